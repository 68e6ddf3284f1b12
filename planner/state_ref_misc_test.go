package planner

import (
	"encoding/json"
	"fmt"
	"math/rand"
	"reflect"
	"testing"
)

// Reference equivalence of the helpers: Mamba slice blocks, DSA tail
// indices/slicing/remap, CP page filtering, layer-id pairing, KV layer ids,
// rank mapping and DSV4 state indices, each against ref_state.py.

// bRefCheck runs cases through SGLang's disaggregation/{nixl,mori}/conn.py and calls check with each
// result; check compares the Go outcome (err, got) with it.
func bRefCheck(t *testing.T, cases []bRefCase, goFn func(i int) (any, error)) (oks, errs int) {
	t.Helper()
	res := bRunRef(t, cases)
	perFn := map[string][2]int{}
	defer func() { t.Logf("agreeing [results errors] per function: %v", perFn) }()
	for i := range cases {
		got, err := goFn(i)
		name := fmt.Sprintf("%s case %d %s", cases[i].Fn, i, bJSON(cases[i].Args))
		if (err != nil) != (res[i].Err != "") {
			t.Fatalf("%s: Go error %v, reference error %q", name, err, res[i].Err)
		}
		if err != nil {
			errs++
			c := perFn[cases[i].Fn]
			c[1]++
			perFn[cases[i].Fn] = c
			continue
		}
		// Compare through JSON so Go and Python values share one form.
		var want, have any
		if err := json.Unmarshal(res[i].OK, &want); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(bJSON(got)), &have); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(normalizeJSON(have), normalizeJSON(want)) {
			t.Fatalf("%s:\n go: %s\nref: %s", name, bJSON(got), res[i].OK)
		}
		oks++
		c := perFn[cases[i].Fn]
		c[0]++
		perFn[cases[i].Fn] = c
	}
	return oks, errs
}

// normalizeJSON makes null and [] compare equal.
func normalizeJSON(v any) any {
	switch x := v.(type) {
	case nil:
		return []any{}
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normalizeJSON(e)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = normalizeJSON(e)
		}
		return out
	}
	return v
}

func TestMambaSliceMatchesReference(t *testing.T) {
	r := rand.New(rand.NewSource(3))
	var ins []MambaSliceInput
	var cases []bRefCase
	for n := 0; n < 600; n++ {
		src, dst := bPick(r, 1, 2, 4, 8), bPick(r, 1, 2, 4, 8)
		heads := 8 * (1 + r.Intn(4))
		in := MambaSliceInput{
			SrcDim: heads / src, DstDim: heads / dst, SrcTPSize: src, DstTPSize: dst,
			DstTPRank: r.Intn(dst), LocalTPRank: r.Intn(src), OuterCount: 1 + r.Intn(3),
		}
		if r.Intn(2) == 0 {
			q := 8 * r.Intn(heads/8+1)
			in.ConvShardGroups = []int{heads - q, q / 2, q / 2}
			if r.Intn(4) == 0 {
				in.ConvShardGroups = []int{heads, 8} // does not add up: single slice
			}
		}
		if r.Intn(10) == 0 {
			in.SrcDim += 1 // non-divisible geometries still follow the formulas
		}
		b := uint64(bPick(r, 1, 2, 4, 16))
		in.SrcItemLen = uint64(in.SrcDim*in.OuterCount) * b
		in.DstItemLen = uint64(in.DstDim*in.OuterCount) * b
		ins = append(ins, in)
		args := map[string]any{"src_dim": in.SrcDim, "dst_dim": in.DstDim, "src_tp": in.SrcTPSize, "dst_tp": in.DstTPSize,
			"dst_rank": in.DstTPRank, "local_rank": in.LocalTPRank, "groups": in.ConvShardGroups,
			"src_item": in.SrcItemLen, "dst_item": in.DstItemLen, "outer": in.OuterCount}
		cases = append(cases, bRefCase{"mamba_blocks", args}, bRefCase{"mamba_byte_blocks", args})
	}
	oks, _ := bRefCheck(t, cases, func(i int) (any, error) {
		in := ins[i/2]
		if i%2 == 0 {
			bs, err := MambaStateSliceBlocks(in)
			out := make([][3]int, len(bs))
			for k, b := range bs {
				out[k] = [3]int{b.SrcDimStart, b.DstDimStart, b.NumDims}
			}
			return out, err
		}
		bs, err := MambaStateSliceByteBlocks(in)
		out := make([][3]uint64, len(bs))
		for k, b := range bs {
			out[k] = [3]uint64{b.SrcOff, b.DstOff, b.Len}
		}
		return out, err
	})
	if oks < 1000 {
		t.Fatalf("only %d successful comparisons", oks)
	}
}

func TestDSATailMatchesReference(t *testing.T) {
	r := rand.New(rand.NewSource(4))
	var cases []bRefCase
	var fns []func() (any, error)
	for n := 0; n < 600; n++ {
		// Indices on both sides of one request, with different rings.
		pool := bPick(r, 0, 1, 4, 8, 64)
		sp := DSATailPool{KPoolUseCompress: r.Intn(8) != 0, PoolSize: pool, TailExtraSlots: bPick(r, 0, 1, 3)}
		dp := DSATailPool{KPoolUseCompress: sp.KPoolUseCompress, PoolSize: pool, TailExtraSlots: bPick(r, 0, 2, 5)}
		seq, sreq, dreq := r.Intn(300), r.Intn(6), r.Intn(6)
		cases = append(cases, bRefCase{"dsa_tail_indices", map[string]any{"use_compress": sp.KPoolUseCompress, "pool_size": sp.PoolSize, "extra": sp.TailExtraSlots, "seq_len": seq, "req": sreq}})
		fns = append(fns, func() (any, error) { return DSATailStateIndices(sp, sreq, seq) })
		si, err1 := DSATailStateIndices(sp, sreq, seq)
		di, err2 := DSATailStateIndices(dp, dreq, seq)
		if err1 != nil || err2 != nil {
			continue
		}
		if r.Intn(6) == 0 && len(si) == 6 {
			si = append([]int(nil), si...)
			si[bPick(r, 1, 2, 4, 5)] += bPick(r, -1, 1, 50)
		}
		// PP slicing of the decode list, then the remap.
		layers := 1 + r.Intn(4)
		start := r.Intn(3)
		nSrc := 2 * layers
		nDst := bPick(r, nSrc, 2*(start+layers+r.Intn(2)), 2*(start+layers)-2, nSrc+1)
		end, hasEnd := start+layers, r.Intn(2) == 0
		args := map[string]any{"n_src": nSrc, "n_dst": nDst, "start": start}
		if hasEnd {
			args["end"] = end
		}
		cases = append(cases, bRefCase{"dsa_tail_slice", args})
		fns = append(fns, func() (any, error) { return SliceDSATailDstForPP(nSrc, nDst, start, end, hasEnd) })
		sel, err := SliceDSATailDstForPP(nSrc, nDst, start, end, hasEnd)
		if err != nil {
			continue
		}
		var a bAddrs
		var src, dst DSATailBuffers
		ring := func(idx []int) uint64 {
			if len(idx) == 6 && idx[5] > 0 {
				return uint64(idx[5])
			}
			return 6
		}
		slots := make([]uint64, max(nSrc, nDst))
		for k := range slots {
			slots[k] = uint64(bPick(r, 0, 16, 64, 64, 64))
		}
		for k := 0; k < nSrc; k++ {
			src.Ptrs = append(src.Ptrs, a.get())
			extra := uint64(0)
			if r.Intn(15) == 0 {
				extra = 1 // row size not divisible by the ring size
			}
			src.ItemLens = append(src.ItemLens, slots[k]*ring(si)+extra)
		}
		for k := 0; k < nDst; k++ {
			dst.Ptrs = append(dst.Ptrs, a.get())
		}
		withDst := r.Intn(3) != 0
		if withDst {
			for k := 0; k < nDst; k++ {
				// Decode tensor j pairs with prefill tensor k where
				// sel[k] == j; give it the same slot size.
				slot := slots[k]
				for kk, j := range sel {
					if j == k {
						slot = slots[kk]
					}
				}
				if r.Intn(20) == 0 {
					slot *= 2
				}
				dst.ItemLens = append(dst.ItemLens, slot*ring(di))
			}
		}
		refArgs := map[string]any{"src_ptrs": src.Ptrs, "src_item_lens": src.ItemLens, "si": si, "di": di}
		var sdst []uint64
		var sdl []uint64
		for _, j := range sel {
			sdst = append(sdst, dst.Ptrs[j])
			if withDst {
				sdl = append(sdl, dst.ItemLens[j])
			}
		}
		refArgs["dst_ptrs"] = sdst
		if withDst {
			refArgs["dst_item_lens"] = sdl
		}
		cases = append(cases, bRefCase{"dsa_tail_blocks", refArgs})
		fns = append(fns, func() (any, error) {
			p, err := PlanDSATail(src, dst, sel, si, di)
			if err != nil {
				return nil, err
			}
			if err := p.Validate(); err != nil {
				t.Fatalf("invalid DSA tail plan: %v", err)
			}
			// In reference order: blocks are never merged across tensors,
			// and within a tensor Add keeps segment order.
			var out [][3]uint64
			p.ForEachBlock(func(s, d, n uint64) bool {
				out = append(out, [3]uint64{s, d, n})
				return true
			})
			return out, nil
		})
	}
	oks, errs := bRefCheck(t, cases, func(i int) (any, error) { return fns[i]() })
	if oks < 300 || errs < 50 {
		t.Fatalf("weak coverage: %d ok, %d errors", oks, errs)
	}
	t.Logf("%d agreeing results, %d agreeing errors", oks, errs)
}

func TestCPAndLayersMatchReference(t *testing.T) {
	r := rand.New(rand.NewSource(5))
	var cases []bRefCase
	var fns []func() (any, error)
	for n := 0; n < 300; n++ {
		total, size := r.Intn(40), 1+r.Intn(5)
		rank := r.Intn(size)
		cases = append(cases, bRefCase{"cp_bounds", map[string]any{"total": total, "rank": rank, "size": size}})
		fns = append(fns, func() (any, error) {
			s, e, err := CPRankPageBounds(total, rank, size)
			return []int{s, e}, err
		})
		start := r.Intn(total + 1)
		stop := start + r.Intn(total-start+1)
		idx := make([]int32, stop-start)
		for k := range idx {
			idx[k] = int32(r.Intn(1000))
		}
		if r.Intn(8) == 0 && len(idx) > 0 {
			idx = idx[:len(idx)-1] // a chunk shorter than its slice: Python clamps
		}
		size2 := bPick(r, 0, 1, size)
		cases = append(cases, bRefCase{"cp_filter", map[string]any{"indices": idx, "start": start, "stop": stop, "total": total, "rank": rank, "size": size2}})
		fns = append(fns, func() (any, error) {
			out, sl, err := FilterKVIndicesForCPRank(idx, IndexSlice{start, stop}, total, rank, size2)
			return []any{out, sl.Start, sl.Stop}, err
		})

		// Layer-id pairing: a PP stage of a model with repeated groups.
		nl := 1 + r.Intn(6)
		groups := 1 + r.Intn(2)
		var dstIDs []int
		for g := 0; g < groups; g++ {
			for l := 0; l < nl; l++ {
				dstIDs = append(dstIDs, 10+3*l)
			}
		}
		lo := r.Intn(nl)
		hi := lo + 1 + r.Intn(nl-lo)
		var srcIDs []int
		for g := 0; g < groups; g++ {
			for l := lo; l < hi; l++ {
				srcIDs = append(srcIDs, 10+3*l)
			}
		}
		nSrc, nDst := len(srcIDs), len(dstIDs)
		switch r.Intn(6) {
		case 0:
			srcIDs = nil
		case 1:
			srcIDs, dstIDs = nil, nil
		case 2:
			srcIDs = append(srcIDs[:len(srcIDs):len(srcIDs)], 99)
		case 3:
			nSrc++
		}
		fallback := r.Intn(2) == 0
		cases = append(cases, bRefCase{"entry_pairs", map[string]any{"src_ids": srcIDs, "dst_ids": dstIDs, "n_src": nSrc, "n_dst": nDst, "fallback": fallback}})
		fns = append(fns, func() (any, error) {
			ps, err := BuildTransferEntryPairs(srcIDs, dstIDs, nSrc, nDst, fallback)
			out := make([][2]int, len(ps))
			for k, p := range ps {
				out[k] = [2]int{p.Src, p.Dst}
			}
			return out, err
		})

		// KV layer ids with a draft pool.
		in := KVLayerIDsInput{Hybrid: r.Intn(5) != 0, LayerIDs: srcIDs, NumHiddenLayers: 40}
		draft := map[string]any(nil)
		if r.Intn(3) != 0 {
			d := DraftPool{Hybrid: r.Intn(2) == 0, LayerNum: bPick(r, 0, 1, 2, 3)}
			if d.Hybrid {
				d.LayerIDs = []int{0, 0, 1, 2, 2}[:1+r.Intn(5)]
			}
			in.Draft = &d
			in.NumDraftEntries = bPick(r, 0, 2, 3, 4, 5, 6)
			if d.Hybrid && r.Intn(2) == 0 {
				in.NumDraftEntries = len(d.LayerIDs)
			}
			draft = map[string]any{"hybrid": d.Hybrid, "ids": d.LayerIDs, "layer_num": d.LayerNum}
		}
		args := map[string]any{"hybrid": in.Hybrid, "ids": in.LayerIDs, "hidden": in.NumHiddenLayers, "num_draft": in.NumDraftEntries}
		if draft != nil {
			args["draft"] = draft
		}
		cases = append(cases, bRefCase{"kv_layer_ids", args})
		fns = append(fns, func() (any, error) { return BuildKVLayerIDs(in) })
	}
	oks, errs := bRefCheck(t, cases, func(i int) (any, error) { return fns[i]() })
	if oks < 800 || errs < 50 {
		t.Fatalf("weak coverage: %d ok, %d errors", oks, errs)
	}
}

func TestRankMappingMatchesReference(t *testing.T) {
	r := rand.New(rand.NewSource(6))
	var cases []bRefCase
	var fns []func() (any, error)
	for n := 0; n < 400; n++ {
		in := RankMappingInput{
			DecodeTPSize: bPick(r, 1, 2, 4, 8), PrefillTPSize: bPick(r, 1, 2, 4, 8),
			DecodeCPSize: 1, PrefillCPSize: bPick(r, 1, 1, 2, 4),
			PrefillPPSize: bPick(r, 1, 2, 4), MLA: r.Intn(2) == 0,
			AllCPRanks: r.Intn(2) == 0, PrefillDSACacheLayerSplit: r.Intn(4) == 0,
		}
		in.DecodeEngineRank = r.Intn(3 * in.DecodeTPSize)
		in.DecodePPSize = bPick(r, 1, in.PrefillPPSize)
		in.DecodePPRank = r.Intn(in.DecodePPSize)
		cases = append(cases, bRefCase{"rank_map", map[string]any{
			"d_tp": in.DecodeTPSize, "p_tp": in.PrefillTPSize, "rank": in.DecodeEngineRank, "mla": in.MLA,
			"p_cp": in.PrefillCPSize, "all_cp": in.AllCPRanks, "split": in.PrefillDSACacheLayerSplit,
			"p_pp": in.PrefillPPSize, "d_pp": in.DecodePPSize, "pp_rank": in.DecodePPRank,
		}})
		fns = append(fns, func() (any, error) {
			m, err := MapRanks(in)
			if err != nil {
				return nil, err
			}
			var targets [][]any
			for _, tg := range m.Targets(in.MLA) {
				targets = append(targets, []any{tg.CPRank, tg.TPRank, tg.PPRank, tg.Dummy})
			}
			return map[string]any{"tr": m.TargetTPRank, "trs": m.TargetTPRanks, "cps": m.TargetCPRanks, "pps": m.TargetPPRanks,
				"dst_num": m.RequiredDstInfoNum, "resp": m.RequiredPrefillResponseNum, "targets": targets}, nil
		})
	}
	if oks, _ := bRefCheck(t, cases, func(i int) (any, error) { return fns[i]() }); oks != len(cases) {
		t.Fatalf("%d of %d mappings agree", oks, len(cases))
	}
}

func TestDSV4IndicesMatchReference(t *testing.T) {
	r := rand.New(rand.NewSource(7))
	var cases []bRefCase
	var fns []func() (any, error)
	for n := 0; n < 300; n++ {
		req, seq := r.Intn(50), bPick(r, 0, 1, 3, 4, 7, 128, 129, 255, 256, 1000, r.Intn(5000))
		ring := bPick(r, 4, 8, 12, 16, 9)
		cases = append(cases, bRefCase{"dsv4_c4", map[string]any{"req": req, "seq": seq, "ring": ring}})
		fns = append(fns, func() (any, error) { return DSV4C4StateIndices(req, seq, ring) })
		online := r.Intn(3) == 0
		ring2 := bPick(r, 128, 256, 512, 384)
		cases = append(cases, bRefCase{"dsv4_c128", map[string]any{"req": req, "seq": seq, "online": online, "ring": ring2}})
		fns = append(fns, func() (any, error) { return DSV4C128StateIndices(req, seq, online, ring2) })
	}
	bRefCheck(t, cases, func(i int) (any, error) { return fns[i]() })
}
