package planner

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// addPairsRunsSlow and appendDlistIndicesSlow are the planners' first
// forms: every copy through Add, every index appended. The fast forms must
// give exactly what they gave.
func addPairsRunsSlow(p *Plan, pairs []pagePair, runs []pageRun) {
	for _, pp := range pairs {
		addPageRuns(p, pp, runs)
	}
}

func appendDlistIndicesSlow(out []int32, d *Dlist, pages []int32, g uint64) []int32 {
	var base uint64
	for _, b := range d.Blocks {
		per := b.Tokens * b.Groups
		for _, q := range pages {
			first := base + uint64(q)*per + g
			for t := uint64(0); t < b.Tokens; t++ {
				out = append(out, int32(first+t*b.Groups))
			}
		}
		base += b.Entries()
	}
	return out
}

// TestRepeatEqualsAdd: pairs of varying strides (a new template wherever
// one changes), repeated pairs of one region (repeat must refuse to merge
// across them as Add would) and parts closed between segments.
func TestRepeatEqualsAdd(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	for iter := range 300 {
		nPages := 1 + r.IntN(40)
		src := scattered(r, nPages, 64)
		dst := scattered(r, nPages, 64)
		if r.IntN(3) == 0 { // long runs
			for i := 1; i < nPages; i++ {
				if r.IntN(4) > 0 {
					src[i], dst[i] = src[i-1]+1, dst[i-1]+1
				}
			}
		}
		var pairs []pagePair
		strides := []uint64{64, 128, 96}
		for i := range 1 + r.IntN(12) {
			s := strides[r.IntN(len(strides))]
			d := strides[r.IntN(len(strides))]
			pp := pagePair{src: int32(i), dst: int32(r.IntN(4)), srcStride: s, dstStride: d, xfer: min(s, d) - uint64(r.IntN(2))*32}
			if r.IntN(5) == 0 && i > 0 {
				pp.src = pairs[i-1].src // same regions as the pair before
				pp.dst = pairs[i-1].dst
			}
			pairs = append(pairs, pp)
		}
		var fast, slow Plan
		var runs []pageRun
		cut := r.IntN(len(pairs) + 1)
		for _, part := range [][]pagePair{pairs[:cut], pairs[cut:]} {
			runs = fast.pageRuns(src, dst, r.IntN(4) == 0)
			addPairsRuns(&fast, part, runs)
			fast.ClosePart(VRAM, VRAM)
			addPairsRunsSlow(&slow, part, runs)
			slow.ClosePart(VRAM, VRAM)
		}
		if !slices.Equal(fast.Copies, slow.Copies) || !slices.Equal(fast.Parts, slow.Parts) {
			t.Fatalf("iter %d: repeat differs from Add\npairs %+v\nruns %+v\nfast %+v\nslow %+v", iter, pairs, runs, fast.Copies, slow.Copies)
		}
	}
}

// TestDlistIndicesEqualAppend: every prepped list shape the planner builds
// (whole pages, head slices with groups, mixed segments) on random chunks.
func TestDlistIndicesEqualAppend(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	for iter := range 300 {
		slots := uint64(1 + r.IntN(64))
		var d Dlist
		tokens, groups := uint64(1+r.IntN(17)), uint64(1+r.IntN(4))
		for i := range 1 + r.IntN(9) {
			b := DlistBlock{Region: int32(i), Slots: slots, Tokens: tokens, Groups: groups}
			if r.IntN(6) == 0 { // a block of another shape
				b.Tokens, b.Groups = uint64(1+r.IntN(3)), 1
			}
			d.Blocks = append(d.Blocks, b)
		}
		pages := make([]int32, r.IntN(50))
		for i := range pages {
			pages[i] = int32(r.IntN(int(slots)))
		}
		g := uint64(r.IntN(int(groups)))
		prefix := []int32{7, 8, 9}[:r.IntN(4)]
		got := appendDlistIndices(slices.Clone(prefix), &d, pages, g)
		want := appendDlistIndicesSlow(slices.Clone(prefix), &d, pages, g)
		if !slices.Equal(got, want) {
			t.Fatalf("iter %d: blocks %+v pages %v group %d:\ngot  %v\nwant %v", iter, d.Blocks, pages, g, got, want)
		}
	}
}

// TestPlanningBeatsReference pins issue 17's bar on three of
// BenchmarkKVPlan's rows, measured like the benchmark (alternating rounds,
// each side's fastest request): the prepped indices of a 61-layer MLA
// chunk and of a TP 2 -> 8 head-slice chunk no slower than the reference's
// numpy, and MORI's grouped plan of runs of 8 pages, which the reference
// builds with Python loops, well ahead of it. The bounds leave a margin
// under the benchmark's figures (about 3x, 3x and 15x on a loaded 2-core
// machine). Timing under the race detector says nothing, so the race
// build only plans the rows.
func TestPlanningBeatsReference(t *testing.T) {
	want := map[string]float64{
		"sglang-nixl-prepped-indices/MLA-61-layers-4096-pages":          1,
		"sglang-nixl-prepped-indices/MHA-80-layers-TP2-to-8-1024-pages": 1,
		"sglang-mori/MHA-80-layers-equal-TP-1024-pages-runs-of-8":       5,
	}
	found := 0
	for _, c := range kvPlanCases(t) {
		bound, ok := want[c.name]
		if !ok {
			continue
		}
		found++
		if err := c.plan(); err != nil {
			t.Fatal(err)
		}
		if raceEnabled {
			continue
		}
		r := kvPlanMeasure(t, c)
		t.Logf("%s: kvhost %.0f ns, reference %.0f ns, %.2fx", c.name, r.bestNs, r.refNs, r.ratio)
		if r.ratio < bound {
			t.Errorf("%s: %.2fx the reference's speed, want at least %gx", c.name, r.ratio, bound)
		}
	}
	if found != len(want) {
		t.Fatalf("found %d of the %d rows", found, len(want))
	}
}
