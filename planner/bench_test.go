package planner

import (
	"math/rand/v2"
	"testing"
	"time"
)

// Realistic shapes from issue 3. Each benchmark plans one chunk with a warm
// Plan (what the runtime does per chunk) and reports ns per descriptor
// handed to the backend, allocations per plan, the descriptor counts, and
// the speedup over a baseline measured in the same run: building the
// reference's per-chunk index arrays for its prepped dlists (what SGLang
// does per chunk before NIXL even sees a descriptor), on the same pages.

type benchCase struct {
	name   string
	g      SGLangKV
	src    []int32
	dst    []int32
	layers int
}

// scattered draws n distinct pages of a pool, in random order, so nearly
// every page is its own run (the worst case for coalescing).
func scattered(r *rand.Rand, n, pool int) []int32 {
	perm := r.Perm(pool)[:n]
	out := make([]int32, n)
	for i, p := range perm {
		out[i] = int32(p)
	}
	return out
}

func mhaSide(tp, heads, layers, pageSize, headBytes int, pages uint64, base uint64, kinds func(i int) MemKind) KVSide {
	item := uint64(pageSize * heads * headBytes)
	s := KVSide{TPSize: tp, KVHeadNum: heads, NumPages: pages}
	for i := 0; i < 2*layers; i++ {
		s.Ptrs = append(s.Ptrs, base+uint64(i)*item*pages)
		s.ItemLens = append(s.ItemLens, item)
		if kinds != nil {
			s.Kinds = append(s.Kinds, kinds(i))
		}
	}
	return s
}

func benchCases() []benchCase {
	r := rand.New(rand.NewPCG(42, 42))
	const pool = 20000
	// 61-layer MLA (DeepSeek-V3: 576 bf16 values per token), page size 64.
	mla := SGLangKV{MLA: true, PageSize: 64}
	for _, side := range []*KVSide{&mla.Prefill, &mla.Decode} {
		side.TPSize, side.NumPages = 8, pool
		for i := 0; i < 61; i++ {
			side.Ptrs = append(side.Ptrs, uint64(1+i)<<36)
			side.ItemLens = append(side.ItemLens, 64*576*2)
		}
	}
	mla.Decode.Ptrs = nil
	for i := 0; i < 61; i++ {
		mla.Decode.Ptrs = append(mla.Decode.Ptrs, uint64(100+i)<<36)
	}
	// 80-layer MHA (Llama-70B: 8 KV heads of 128 bf16), TP 2 -> 8, page 16.
	hetero := SGLangKV{PageSize: 16, TotalKVHeads: 8,
		Prefill: mhaSide(2, 4, 80, 16, 256, pool, 1<<40, nil),
		Decode:  mhaSide(8, 1, 80, 16, 256, pool, 2<<40, nil)}
	hetero.Decode.TPRank = 5
	// 32-layer MHA, equal TP, decode keeps layers 16-31 in host memory
	// (HiSparse): K and V of each half form a run of kinds.
	kinds := func(i int) MemKind {
		if i%32 >= 16 {
			return DRAM
		}
		return VRAM
	}
	mixed := SGLangKV{PageSize: 16,
		Prefill: mhaSide(4, 2, 32, 16, 256, pool, 1<<40, nil),
		Decode:  mhaSide(4, 2, 32, 16, 256, pool, 2<<40, kinds)}
	return []benchCase{
		{"MLA-61-layers-4096-pages", mla, scattered(r, 4096, pool), scattered(r, 4096, pool), 61},
		{"MHA-80-layers-TP2-to-8-1024-pages", hetero, scattered(r, 1024, pool), scattered(r, 1024, pool), 80},
		{"MHA-32-layers-mixed-VRAM-DRAM-1024-pages", mixed, scattered(r, 1024, pool), scattered(r, 1024, pool), 32},
	}
}

func BenchmarkNIXLKVPlan(b *testing.B) {
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			n, err := NewNIXLKV(bc.g, true)
			if err != nil {
				b.Fatal(err)
			}
			pk, err := n.Prepped()
			if err != nil {
				b.Fatal(err)
			}
			// Baseline, same run: SGLang's disaggregation/{nixl,mori}/conn.py's per-chunk index arrays.
			var si, di []int32
			baseline := func() {
				for part := range pk.Parts {
					si, di, _ = n.Indices(pk, part, si[:0], di[:0], bc.src, bc.dst)
				}
			}
			baseline()
			start, runs := time.Now(), 0
			for time.Since(start) < 200*time.Millisecond {
				baseline()
				runs++
			}
			baseNs := float64(time.Since(start).Nanoseconds()) / float64(runs)
			benchPlan(b, n, bc.src, bc.dst, baseNs, "x-vs-reference-indices")
		})
	}
}

func BenchmarkMORIKVPlan(b *testing.B) {
	for _, bc := range benchCases()[:2] {
		b.Run(bc.name, func(b *testing.B) {
			m, err := NewMORIKV(bc.g)
			if err != nil {
				b.Fatal(err)
			}
			benchPlan(b, m, bc.src, bc.dst, 0, "")
		})
	}
}

// benchPlan times a warm pl.Plan of one chunk and reports ns per
// descriptor, the plan's and SGLang's disaggregation/{nixl,mori}/conn.py's descriptor counts and, when
// baseNs (the baseline measured in the same run) is set, the speed ratio
// against it as ratioUnit. It returns the plan.
func benchPlan(b *testing.B, pl interface {
	Plan(p *Plan, prefill, decode []int32) error
}, prefill, decode []int32, baseNs float64, ratioUnit string) *Plan {
	p := new(Plan)
	if err := pl.Plan(p, prefill, decode); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := pl.Plan(p, prefill, decode); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(perOp/float64(p.Descriptors()), "ns/descriptor")
	b.ReportMetric(float64(p.Descriptors()), "descriptors")
	b.ReportMetric(float64(p.ReferenceDescriptors), "reference-descriptors")
	if baseNs > 0 {
		b.ReportMetric(baseNs/perOp, ratioUnit)
	}
	return p
}

// TestRealisticShapes pins what the benchmarks measure: descriptor counts
// against SGLang's disaggregation/{nixl,mori}/conn.py's, and no allocation per plan once warm.
func TestRealisticShapes(t *testing.T) {
	cases := benchCases()
	wantRef := []uint64{61 * 4096, 160 * 1024 * 16, 64 * 1024}
	for i, bc := range cases {
		n, err := NewNIXLKV(bc.g, true)
		if err != nil {
			t.Fatal(err)
		}
		p := new(Plan)
		if err := n.Plan(p, bc.src, bc.dst); err != nil {
			t.Fatal(err)
		}
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		runs := CountRuns(bc.src, bc.dst)
		regions := len(bc.g.Prefill.Ptrs)
		if p.Descriptors() > regions*runs {
			t.Errorf("%s: %d descriptors, more than one per region (%d) per page run (%d)", bc.name, p.Descriptors(), regions, runs)
		}
		if p.ReferenceDescriptors != wantRef[i] {
			t.Errorf("%s: reference descriptors %d, want %d", bc.name, p.ReferenceDescriptors, wantRef[i])
		}
		allocRuns := 5
		if raceEnabled {
			allocRuns = 1
		}
		allocs := testing.AllocsPerRun(allocRuns, func() {
			if err := n.Plan(p, bc.src, bc.dst); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocations per warm plan", bc.name, allocs)
		}
		t.Logf("%s: %s, %d descriptors (%d expanded), reference %d, %d bytes, %d parts",
			bc.name, p.Path, p.Descriptors(), p.ExpandedDescriptors(), p.ReferenceDescriptors, p.Bytes(), len(p.Parts))
	}
}
