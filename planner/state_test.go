package planner

import (
	"testing"
)

// pagedReq is a one-component paged request with nSrc prefill and nDst
// decode tensors; tensor k has item length lens[k].
func pagedReq(st StateType, nSrc, nDst int, lens []uint64, si, di []int32, topo StateTopology) *StateRequest {
	r := &StateRequest{Types: []StateType{st}, SrcIndices: [][]int32{si}, DstIndices: [][]int32{di}, Topology: topo}
	src, dst := make([]uint64, nSrc), make([]uint64, nDst)
	for k := range src {
		src[k] = uint64(k+1) << 32
	}
	for k := range dst {
		dst[k] = uint64(k+100) << 32
	}
	r.Src.Ptrs, r.Dst.Ptrs = [][]uint64{src}, [][]uint64{dst}
	r.Src.ItemLens = [][]uint64{lens}
	return r
}

var tp1 = StateTopology{PrefillTPSize: 1, DecodeTPSize: 1}

func TestPagedStateNIXL(t *testing.T) {
	// MHA SWA, 2 layers (K0 K1 V0 V1) with distinct item lengths. Pages
	// 1,2,3,7 -> 4,5,6,9 form runs (1->4 x3) and (7->9 x1). The V half
	// uses the K layer's item length, as SGLang's disaggregation/{nixl,mori}/conn.py does.
	req := pagedReq(StateSWA, 4, 4, []uint64{10, 20, 30, 40}, []int32{1, 2, 3, 7}, []int32{4, 5, 6, 9}, tp1)
	sps, err := PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLPaged, []Copy{
		plain(0, 0, 10, 40, 30), plain(0, 0, 70, 90, 10),
		plain(1, 1, 20, 80, 60), plain(1, 1, 140, 180, 20),
		plain(2, 2, 10, 40, 30), plain(2, 2, 70, 90, 10),
		plain(3, 3, 20, 80, 60), plain(3, 3, 140, 180, 20),
	})

	// Equally spaced runs become one strided copy: pages 0,2,4 -> 1,3,5.
	req = pagedReq(StateDSA, 1, 1, []uint64{64}, []int32{0, 2, 4}, []int32{1, 3, 5}, StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, MLA: true})
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLPaged, []Copy{{SrcRegion: 0, DstRegion: 0, SrcOff: 0, DstOff: 64, Len: 64, SrcStride: 128, DstStride: 128, Count: 3}})

	// MLA PP: a 2-layer stage starting at layer 2 of a 5-layer decode; MLA
	// also allows different TP sizes.
	topo := StateTopology{PrefillTPSize: 2, DecodeTPSize: 4, MLA: true, PrefillPPSize: 2, PP: PPLayout{StartLayer: 2}}
	req = pagedReq(StateSWA, 2, 5, []uint64{8, 8}, []int32{3}, []int32{6}, topo)
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLPaged, []Copy{plain(0, 2, 24, 48, 8), plain(1, 3, 24, 48, 8)})

	// MHA PP: stage layers [1, 3) of 4 decode layers: K -> 1,2; V -> 5,6.
	topo = StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, PrefillPPSize: 2, PP: PPLayout{StartLayer: 1}}
	req = pagedReq(StateSWA, 4, 8, []uint64{8, 8, 8, 8}, []int32{0}, []int32{0}, topo)
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLPaged, []Copy{plain(0, 1, 0, 0, 8), plain(1, 2, 0, 0, 8), plain(2, 5, 0, 0, 8), plain(3, 6, 0, 0, 8)})
}

func TestCompressedMLAPairing(t *testing.T) {
	// 4 model layers with ratios 0,4,128,4; the stage holds layers [2, 4).
	pp := PPLayout{StartLayer: 2, EndLayer: 4, HasEnd: true, CompressionRatios: []int{0, 4, 128, 4}}
	for _, tc := range []struct {
		name       string
		st         StateType
		nSrc, nDst int
		want       []int32
	}{
		// C128 state: one per c128 layer; the stage's c128 layer is #0.
		{"c128", StateC128State, 1, 1, []int32{0}},
		// SWA ring: per model layer.
		{"swa ring", StateSWARing, 2, 4, []int32{2, 3}},
		// SWA state data [swa0..3, c4 compress 0..1, c4 indexer 0..1]:
		// stage swa 2,3, compress c4 #1 (index 5), indexer c4 #1 (index 7).
		{"swa state", StateSWA, 4, 8, []int32{2, 3, 5, 7}},
		// KV-data layout [c4 0..1, c4 indexer 0..1, c128 0]: c4 #1 (1),
		// indexer #1 (3), c128 #0 (4).
		{"kv layout", StateDSA, 3, 5, []int32{1, 3, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := PairCompressedMLARegions(nil, tc.nSrc, tc.nDst, pp, tc.st)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for k := range got {
				if got[k] != tc.want[k] {
					t.Fatalf("got %v, want %v", got, tc.want)
				}
			}
		})
	}
	_, err := PairCompressedMLARegions(nil, 2, 4, PPLayout{StartLayer: 2, CompressionRatios: []int{0, 4, 128, 4}}, StateSWARing)
	bFieldErr(t, err, "prefill.end_layer", "must be set")
	_, err = PairCompressedMLARegions(nil, 3, 9, pp, StateSWA) // swa_L 5 > 4 layers
	bFieldErr(t, err, "prefill.mla_compression_ratios", "unexpected")
	_, err = PairCompressedMLARegions(nil, 3, 4, pp, StateSWARing) // stage slice has 2
	bFieldErr(t, err, "decode.state_ptrs", "has 2 entries for 3")

	// Through the state planner: a C128 component on a PP stage.
	topo := StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, MLA: true, PrefillPPSize: 2, PP: pp}
	req := pagedReq(StateSWARing, 2, 4, []uint64{16, 16}, []int32{5}, []int32{9}, topo)
	sps, err := PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLPaged, []Copy{plain(0, 2, 80, 144, 16), plain(1, 3, 80, 144, 16)})
}

func TestPagedStateRules(t *testing.T) {
	si, di := []int32{1, 2, 3}, []int32{5, 6}
	mla := StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, MLA: true}
	mha := tp1
	hetero := StateTopology{PrefillTPSize: 2, DecodeTPSize: 4}
	for _, tc := range []struct {
		name   string
		req    *StateRequest
		mori   bool
		field  string // "" means success
		substr string
		want   []Copy
	}{
		// NIXL: unequal index lists are an error for every paged type.
		{name: "nixl swa mismatch", req: pagedReq(StateSWA, 1, 1, []uint64{8}, si, di, mla), field: "decode_state_indices[0]", substr: "length mismatch"},
		// MORI: paged SWA/DSA truncate to the common prefix...
		{name: "mori swa truncates", req: pagedReq(StateSWA, 1, 1, []uint64{8}, si, di, mla), mori: true, want: []Copy{plain(0, 0, 8, 40, 16)}},
		{name: "mori dsa truncates", req: pagedReq(StateDSA, 1, 1, []uint64{8}, si, di, mla), mori: true, want: []Copy{plain(0, 0, 8, 40, 16)}},
		{name: "mori minimax truncates", req: pagedReq(StateMiniMaxIndexK, 1, 1, []uint64{8}, si, di, mla), mori: true, want: []Copy{plain(0, 0, 8, 40, 16)}},
		// ...but position-indexed SWA_RING and C128 must match.
		{name: "mori ring mismatch", req: pagedReq(StateSWARing, 1, 1, []uint64{8}, si, di, mla), mori: true, field: "decode_state_indices[0]", substr: "swa_ring state index length mismatch"},
		{name: "mori c128 mismatch", req: pagedReq(StateC128State, 1, 1, []uint64{8}, si, di, mla), mori: true, field: "decode_state_indices[0]", substr: "c128_state state index length mismatch"},
		// TP rules: NIXL rejects every non-MLA paged type across TP sizes;
		// MORI only SWA.
		{name: "nixl dsa hetero", req: pagedReq(StateDSA, 2, 2, []uint64{8, 8}, si, si, hetero), field: "decode.tp_size", substr: "non-MLA dsa"},
		{name: "mori swa hetero", req: pagedReq(StateSWA, 2, 2, []uint64{8, 8}, si, si, hetero), mori: true, field: "decode.tp_size", substr: "TP-mismatched non-MLA SWA"},
		{name: "mori dsa hetero", req: pagedReq(StateDSA, 1, 1, []uint64{8}, si, si, hetero), mori: true, want: []Copy{plain(0, 0, 8, 8, 24)}},
		{name: "nixl minimax pp", req: pagedReq(StateMiniMaxIndexK, 1, 1, []uint64{8}, si, si, StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, PrefillPPSize: 2}), field: "prefill.pp_size", substr: "MiniMax"},
		{name: "nixl minimax hetero", req: pagedReq(StateMiniMaxIndexK, 1, 1, []uint64{8}, si, si, StateTopology{PrefillTPSize: 1, DecodeTPSize: 2, MLA: true}), field: "decode.tp_size", substr: "MiniMax"},
		// MiniMax index K is flat even on an MHA backend: one tensor per layer.
		{name: "nixl minimax flat", req: pagedReq(StateMiniMaxIndexK, 3, 3, []uint64{8, 8, 8}, si, si, mha), want: []Copy{plain(0, 0, 8, 8, 24), plain(1, 1, 8, 8, 24), plain(2, 2, 8, 8, 24)}},
		{name: "nixl unknown type", req: pagedReq("dsa_tail", 1, 1, []uint64{8}, si, si, mla), field: "state_types[0]", substr: "does not support"},
		{name: "mori unknown type", req: pagedReq("block_scale", 1, 1, []uint64{8}, si, si, mla), mori: true, field: "state_types[0]", substr: "unknown state_type"},
		{name: "negative page", req: pagedReq(StateSWA, 1, 1, []uint64{8}, []int32{-1}, []int32{0}, mla), field: "prefill_state_indices[0]", substr: "negative"},
		// SGLang's disaggregation/{nixl,mori}/conn.py would silently drop the third tensor; kvhost
		// refuses a K/V list that is not K and V of whole layers.
		{name: "mha odd tensors", req: pagedReq(StateSWA, 3, 3, []uint64{8, 8, 8}, si, si, mha), field: "prefill.state_ptrs[0]", substr: "odd count"},
		{name: "mha pp does not fit", req: pagedReq(StateSWA, 4, 2, []uint64{8, 8}, si, si, mha), field: "decode.state_ptrs[0]", substr: "do not fit"},
		{name: "short item lens", req: pagedReq(StateSWA, 2, 2, []uint64{8}, si, si, mla), field: "prefill.state_item_lens[0]", substr: "no item length for tensor 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var sps []StatePlan
			var err error
			if tc.mori {
				sps, err = PlanStateMORI(tc.req)
			} else {
				sps, err = PlanStateNIXL(tc.req)
			}
			if tc.field != "" {
				bFieldErr(t, err, tc.field, tc.substr)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			path := PathNIXLPaged
			if tc.mori {
				path = PathMORIPaged
			}
			bCheckPlan(t, &sps[0].Plan, path, tc.want)
		})
	}
}

func TestStateComponentSkipping(t *testing.T) {
	// Components without prefill indices are skipped (NIXL), or without
	// indices on either side (MORI); MORI without local state is a no-op.
	req := &StateRequest{
		Types:      []StateType{StateMamba, StateSWA, StateSWA},
		Src:        StateBuffers{Ptrs: [][]uint64{{1 << 32}, {2 << 32}, {3 << 32}}, ItemLens: [][]uint64{{64}, {8}, {8}}},
		Dst:        StateBuffers{Ptrs: [][]uint64{{4 << 32}, {5 << 32}, {6 << 32}}},
		SrcIndices: [][]int32{nil, {1}, {2}},
		DstIndices: [][]int32{{1}, {3}},
		Topology:   StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, MLA: true},
	}
	if _, err := PlanStateNIXL(req); err == nil {
		t.Fatal("NIXL: component 2 has prefill indices but no decode indices: want a length mismatch")
	}
	sps, err := PlanStateMORI(req)
	if err != nil {
		t.Fatal(err)
	}
	if len(sps) != 1 || sps[0].Component != 1 {
		t.Fatalf("MORI plans %+v", sps)
	}
	bCheckPlan(t, &sps[0].Plan, PathMORIPaged, []Copy{plain(0, 0, 8, 24, 8)})

	req.DstIndices = append(req.DstIndices, []int32{4})
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	if len(sps) != 2 || sps[0].Component != 1 || sps[1].Component != 2 {
		t.Fatalf("NIXL plans %+v", sps)
	}

	if sps, err := PlanStateMORI(&StateRequest{Topology: tp1}); err != nil || sps != nil {
		t.Fatalf("MORI without state: %v %v", sps, err)
	}
	_, err = PlanStateMORI(&StateRequest{Src: req.Src, Dst: req.Dst, Topology: tp1})
	bFieldErr(t, err, "state_types", "empty")
	_, err = PlanStateMORI(&StateRequest{Types: req.Types, Src: req.Src, Dst: StateBuffers{Ptrs: req.Dst.Ptrs[:2]}, Topology: tp1})
	bFieldErr(t, err, "decode.state_ptrs", "component count mismatch")
	_, err = PlanStateNIXL(&StateRequest{Topology: StateTopology{PrefillTPSize: 0, DecodeTPSize: 1}})
	bFieldErr(t, err, "prefill.tp_size", "positive")
}

func TestJoinStatePlans(t *testing.T) {
	req := mambaReq(1, 1)
	req.Types = append(req.Types, StateSWA)
	req.Src.Ptrs = append(req.Src.Ptrs, []uint64{9 << 32})
	req.Dst.Ptrs = append(req.Dst.Ptrs, []uint64{10 << 32})
	req.Src.ItemLens = append(req.Src.ItemLens, []uint64{32})
	req.SrcIndices = append(req.SrcIndices, []int32{1, 2})
	req.DstIndices = append(req.DstIndices, []int32{4, 5})
	req.Topology.MLA = true
	sps, err := PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	p := JoinStatePlans(sps, true)
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	if p.Path != "state:mamba[0]=nixl-state-mamba,swa[1]=nixl-state-paged" {
		t.Fatalf("path %q", p.Path)
	}
	if len(p.Parts) != 2 || p.Parts[0].NotifSuffix != "_0" || p.Parts[1].NotifSuffix != "_1" || p.Parts[1].Start != 2 || p.Parts[1].End != 3 {
		t.Fatalf("parts %+v", p.Parts)
	}
	// The SWA copy now addresses the third region of the joined tables.
	if c := p.Copies[2]; c.SrcRegion != 2 || c.DstRegion != 2 || c.SrcOff != 32 || c.DstOff != 128 || c.Len != 64 {
		t.Fatalf("joined copy %+v", c)
	}
	if p.Bytes() != 64+128+64 {
		t.Fatalf("bytes %d", p.Bytes())
	}
	if q := JoinStatePlans(sps, false); len(q.Parts) != 0 || q.Bytes() != p.Bytes() {
		t.Fatal("MORI join has no parts")
	}
}
