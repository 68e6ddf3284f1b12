package planner

import (
	"math/rand/v2"
	"testing"
	"time"
)

// Realistic hybrid-state shapes. Each benchmark plans one request's state
// with a warm StatePlanner and warm plans (what the runtime does on a last
// chunk) and reports ns per descriptor, allocations per plan, descriptor
// counts, and the speed relative to a baseline measured in the same run:
// building SGLang's disaggregation/{nixl,mori}/conn.py's descriptor list for the same request as plain
// (src, dst, len) triples into a preallocated slice (the least the
// reference does before its backend sees a descriptor).

type stateBenchCase struct {
	name   string
	nixl   bool
	types  []StateType
	src    StateBuffers
	dst    StateBuffers
	topo   StateTopology
	si, di [][]int32
}

func stateBenchCases() []stateBenchCase {
	r := rand.New(rand.NewPCG(7, 7))
	var cases []stateBenchCase

	// Qwen3-Next-like: 36 linear-attention layers, each with a GDN
	// conv_state ([q|k|v] = 2048+2048+4096 channels x 3 rows, bf16) and a
	// temporal state (32 heads x 128 x 128 fp32), TP 2 -> 4.
	{
		const layers = 36
		var c stateBenchCase
		c.name, c.nixl, c.types = "Mamba-36-layers-GDN-TP2-to-4", true, []StateType{StateMamba}
		c.topo = StateTopology{PrefillTPSize: 2, DecodeTPSize: 4, DecodeTPRank: 3, PrefillTPRank: 1}
		groups := []int{2048, 2048, 4096}
		var sp, dp, sl, dl, sd, dd []uint64
		var sdim, ddim, outer []int
		var conv [][]int
		for l := 0; l < 2*layers; l++ {
			sp = append(sp, uint64(l+1)<<36)
			dp = append(dp, uint64(l+100)<<36)
			if l < layers { // conv: channels x 3 rows x 2 B
				sdim, ddim = append(sdim, 8192/2), append(ddim, 8192/4)
				sl, dl = append(sl, 8192/2*3*2), append(dl, 8192/4*3*2)
				conv, outer = append(conv, groups), append(outer, 3)
			} else { // temporal: heads x 128 x 128 x 4 B
				sdim, ddim = append(sdim, 32/2), append(ddim, 32/4)
				sl, dl = append(sl, 32/2*128*128*4), append(dl, 32/4*128*128*4)
				conv, outer = append(conv, nil), append(outer, 1)
			}
			sd, dd = append(sd, sl[l]*512), append(dd, dl[l]*512)
		}
		c.src = StateBuffers{Ptrs: [][]uint64{sp}, ItemLens: [][]uint64{sl}, DataLens: [][]uint64{sd}, DimPerTensor: [][]int{sdim},
			ConvShardGroups: [][][]int{conv}, SliceOuterCounts: [][]int{outer}}
		c.dst = StateBuffers{Ptrs: [][]uint64{dp}, ItemLens: [][]uint64{dl}, DataLens: [][]uint64{dd}, DimPerTensor: [][]int{ddim}}
		c.si, c.di = [][]int32{{137}}, [][]int32{{411}}
		cases = append(cases, c)
	}

	// DeepSeek-V3.2-like DSA index cache: 61 MLA layers, 64-token pages of
	// 132-byte entries, 1024 scattered pages (every page its own run).
	{
		var c stateBenchCase
		c.name, c.nixl, c.types = "DSA-61-layers-1024-scattered-pages", true, []StateType{StateDSA}
		c.topo = StateTopology{PrefillTPSize: 8, DecodeTPSize: 8, MLA: true}
		const pool, item = 20000, 64 * 132
		var sp, dp, lens, data []uint64
		for l := 0; l < 61; l++ {
			sp, dp = append(sp, uint64(l+1)<<36), append(dp, uint64(l+100)<<36)
			lens, data = append(lens, item), append(data, item*pool)
		}
		c.src = StateBuffers{Ptrs: [][]uint64{sp}, ItemLens: [][]uint64{lens}, DataLens: [][]uint64{data}}
		c.dst = StateBuffers{Ptrs: [][]uint64{dp}, DataLens: [][]uint64{data}}
		c.si, c.di = [][]int32{scattered(r, 1024, pool)}, [][]int32{scattered(r, 1024, pool)}
		cases = append(cases, c)
	}

	// gpt-oss-like SWA: 24 sliding-window layers, MHA K and V (8 heads x
	// 64 x bf16, 16-token pages), a 128-token window = 9 pages in 2 runs,
	// plus one Mamba-free request slot. MORI.
	{
		var c stateBenchCase
		c.name, c.nixl, c.types = "SWA-MHA-24-layers-9-pages-MORI", false, []StateType{StateSWA}
		c.topo = StateTopology{PrefillTPSize: 1, DecodeTPSize: 1}
		const pool, item = 4096, 16 * 8 * 64 * 2
		var sp, dp, lens, data []uint64
		for l := 0; l < 48; l++ {
			sp, dp = append(sp, uint64(l+1)<<36), append(dp, uint64(l+100)<<36)
			lens, data = append(lens, item), append(data, item*pool)
		}
		c.src = StateBuffers{Ptrs: [][]uint64{sp}, ItemLens: [][]uint64{lens}, DataLens: [][]uint64{data}}
		c.dst = StateBuffers{Ptrs: [][]uint64{dp}, DataLens: [][]uint64{data}}
		c.si = [][]int32{{100, 101, 102, 103, 104, 900, 901, 902, 903}}
		c.di = [][]int32{{7, 8, 9, 10, 11, 12, 13, 14, 15}}
		cases = append(cases, c)
	}
	return cases
}

func (c *stateBenchCase) planner(tb testing.TB) *StatePlanner {
	var sp *StatePlanner
	var err error
	if c.nixl {
		sp, err = NewStatePlannerNIXL(c.types, c.src, c.dst, c.topo)
	} else {
		sp, err = NewStatePlannerMORI(c.types, c.src, c.dst, c.topo)
	}
	if err != nil {
		tb.Fatal(err)
	}
	return sp
}

// referenceTriples builds SGLang's disaggregation/{nixl,mori}/conn.py's descriptor list of the plans:
// every block as a plain triple (what SGLang's disaggregation/{nixl,mori}/conn.py hands its backend,
// zero-length descriptors aside).
func referenceTriples(out [][3]uint64, plans []StatePlan) [][3]uint64 {
	out = out[:0]
	for k := range plans {
		plans[k].Plan.ForEachBlock(func(s, d, n uint64) bool {
			out = append(out, [3]uint64{s, d, n})
			return true
		})
	}
	return out
}

func BenchmarkStatePlan(b *testing.B) {
	for _, c := range stateBenchCases() {
		b.Run(c.name, func(b *testing.B) {
			sp := c.planner(b)
			var plans []StatePlan
			if err := sp.Plan(&plans, c.si, c.di); err != nil {
				b.Fatal(err)
			}
			// Baseline, same run: SGLang's disaggregation/{nixl,mori}/conn.py's plain descriptor list.
			triples := referenceTriples(nil, plans)
			start, runs := time.Now(), 0
			for time.Since(start) < 200*time.Millisecond {
				triples = referenceTriples(triples, plans)
				runs++
			}
			baseNs := float64(time.Since(start).Nanoseconds()) / float64(runs)

			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := sp.Plan(&plans, c.si, c.di); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			var descs int
			var ref uint64
			for k := range plans {
				descs += plans[k].Plan.Descriptors()
				ref += plans[k].Plan.ReferenceDescriptors
			}
			perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(perOp/float64(descs), "ns/descriptor")
			b.ReportMetric(float64(descs), "descriptors")
			b.ReportMetric(float64(ref), "reference-descriptors")
			b.ReportMetric(baseNs/perOp, "x-vs-reference-list")
		})
	}
}

func BenchmarkAuxPlan(b *testing.B) {
	// SGLang's 10 metadata buffers (first token, logprobs, hidden states of
	// 7168 bf16, bootstrap room), 512 slots.
	items := []uint64{64, 64, 64, 64, 512, 512, 64, 128, 7168 * 2, 64}
	var src, dst AuxBuffers
	for i, it := range items {
		src.Ptrs, dst.Ptrs = append(src.Ptrs, uint64(i+1)<<32), append(dst.Ptrs, uint64(i+50)<<32)
		src.ItemLens, src.DataLens = append(src.ItemLens, it), append(src.DataLens, it*512)
	}
	a, err := NewAuxPlannerNIXL(src, dst)
	if err != nil {
		b.Fatal(err)
	}
	p := new(Plan)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if err := a.Plan(p, int64(i%512), int64((i*7)%512)); err != nil {
			b.Fatal(err)
		}
	}
}

// TestStateBenchShapes pins what the benchmarks measure: the plans match
// SGLang's disaggregation/{nixl,mori}/conn.py's bytes (descriptor lists expand to the same blocks), need
// no more descriptors than SGLang's disaggregation/{nixl,mori}/conn.py, and a warm plan allocates
// nothing.
func TestStateBenchShapes(t *testing.T) {
	for _, c := range stateBenchCases() {
		sp := c.planner(t)
		var plans []StatePlan
		if err := sp.Plan(&plans, c.si, c.di); err != nil {
			t.Fatal(err)
		}
		var descs int
		var ref, expanded, bytes uint64
		for k := range plans {
			p := &plans[k].Plan
			if err := p.Validate(); err != nil {
				t.Fatal(err)
			}
			descs += p.Descriptors()
			ref += p.ReferenceDescriptors
			expanded += p.ExpandedDescriptors()
			bytes += p.Bytes()
		}
		if uint64(descs) > ref || expanded > ref {
			t.Errorf("%s: %d descriptors (%d expanded), reference %d", c.name, descs, expanded, ref)
		}
		allocs := testing.AllocsPerRun(5, func() {
			if err := sp.Plan(&plans, c.si, c.di); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocations per warm plan", c.name, allocs)
		}
		t.Logf("%s: %d descriptors (%d expanded), reference %d, %d bytes", c.name, descs, expanded, ref, bytes)
	}
	a, err := NewAuxPlannerMORI(AuxBuffers{Ptrs: []uint64{1, 2}, ItemLens: []uint64{8, 8}}, AuxBuffers{Ptrs: []uint64{3, 4}})
	if err != nil {
		t.Fatal(err)
	}
	p := new(Plan)
	if allocs := testing.AllocsPerRun(5, func() { _ = a.Plan(p, 3, 4) }); allocs != 0 {
		t.Errorf("aux: %v allocations per warm plan", allocs)
	}
}
