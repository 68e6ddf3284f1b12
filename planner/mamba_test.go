package planner

import (
	"reflect"
	"testing"
)

func TestMambaStateSliceBlocks(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   MambaSliceInput
		want []MambaSliceBlock
	}{
		{
			// 4 prefill ranks -> 2 decode ranks: rank 3 is writer 1 of its
			// decode rank and lands after writer 0's 2 dims.
			name: "aggregate",
			in:   MambaSliceInput{SrcDim: 2, DstDim: 4, SrcTPSize: 4, DstTPSize: 2, LocalTPRank: 3},
			want: []MambaSliceBlock{{0, 2, 2}},
		},
		{
			// 1 prefill rank -> 4 decode ranks: decode rank 3 takes dims 6..7.
			name: "scatter",
			in:   MambaSliceInput{SrcDim: 8, DstDim: 2, SrcTPSize: 1, DstTPSize: 4, DstTPRank: 3},
			want: []MambaSliceBlock{{6, 0, 2}},
		},
		{
			// GDN conv [q|k|v] of 8+4+4 dims, TP 2 -> 4: prefill shard is
			// q4 k2 v2; decode rank 3 takes q[2:4], k[1], v[1].
			name: "scatter groups",
			in:   MambaSliceInput{SrcDim: 8, DstDim: 4, SrcTPSize: 2, DstTPSize: 4, DstTPRank: 3, ConvShardGroups: []int{8, 4, 4}},
			want: []MambaSliceBlock{{2, 0, 2}, {5, 2, 1}, {7, 3, 1}},
		},
		{
			// TP 4 -> 2, writer 1: each sub-block shard goes after writer
			// 0's shard of the same sub-block, keeping q, k, v grouped.
			name: "aggregate groups",
			in:   MambaSliceInput{SrcDim: 4, DstDim: 8, SrcTPSize: 4, DstTPSize: 2, LocalTPRank: 1, ConvShardGroups: []int{8, 4, 4}},
			want: []MambaSliceBlock{{0, 2, 2}, {2, 5, 1}, {3, 7, 1}},
		},
		{
			// Groups that do not add up to the full dim are ignored.
			name: "groups ignored",
			in:   MambaSliceInput{SrcDim: 8, DstDim: 4, SrcTPSize: 2, DstTPSize: 4, DstTPRank: 1, ConvShardGroups: []int{8, 4}},
			want: []MambaSliceBlock{{4, 0, 4}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MambaStateSliceBlocks(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestMambaStateSliceByteBlocks(t *testing.T) {
	// The "scatter groups" geometry with 2 outer rows of 4-byte dims:
	// prefill slot 8 dims x 2 rows x 4 B = 64 B, decode 4 x 2 x 4 = 32 B.
	in := MambaSliceInput{SrcDim: 8, DstDim: 4, SrcTPSize: 2, DstTPSize: 4, DstTPRank: 3,
		ConvShardGroups: []int{8, 4, 4}, SrcItemLen: 64, DstItemLen: 32, OuterCount: 2}
	got, err := MambaStateSliceByteBlocks(in)
	if err != nil {
		t.Fatal(err)
	}
	want := []MambaByteBlock{{8, 0, 8}, {20, 8, 4}, {28, 12, 4}, {40, 16, 8}, {52, 24, 4}, {60, 28, 4}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}

	for _, tc := range []struct {
		name  string
		in    MambaSliceInput
		field string
	}{
		{"zero tp", MambaSliceInput{SrcDim: 1, DstDim: 1, SrcTPSize: 0, DstTPSize: 1, OuterCount: 1}, "tp_size"},
		{"zero outer", MambaSliceInput{SrcDim: 1, DstDim: 1, SrcTPSize: 1, DstTPSize: 1}, "state_slice_outer_counts"},
		{"zero dim", MambaSliceInput{SrcDim: 0, DstDim: 1, SrcTPSize: 1, DstTPSize: 2, OuterCount: 1}, "state_dim_per_tensor"},
		{"negative group", MambaSliceInput{SrcDim: 4, DstDim: 2, SrcTPSize: 1, DstTPSize: 2, OuterCount: 1, ConvShardGroups: []int{-4, 8}}, "state_conv_shard_groups"},
		{"empty group shard", MambaSliceInput{SrcDim: 1, DstDim: 1, SrcTPSize: 4, DstTPSize: 4, OuterCount: 1, ConvShardGroups: []int{2, 2}}, "state_conv_shard_groups"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := MambaStateSliceByteBlocks(tc.in)
			bFieldErr(t, err, tc.field, "")
		})
	}
}

// mambaReq is a one-component Mamba request with two tensors (conv 64 B
// and temporal 128 B per slot on prefill), 8 then 16 dims.
func mambaReq(ptp, dtp int) *StateRequest {
	f := func(tp int) []int { return []int{8 / tp, 16 / tp} }
	sd, dd := f(ptp), f(dtp)
	return &StateRequest{
		Types: []StateType{StateMamba},
		Src: StateBuffers{Ptrs: [][]uint64{{1 << 32, 2 << 32}}, ItemLens: [][]uint64{{uint64(8 * sd[0]), uint64(8 * sd[1])}},
			DimPerTensor: [][]int{sd}},
		Dst: StateBuffers{Ptrs: [][]uint64{{3 << 32, 4 << 32}}, ItemLens: [][]uint64{{uint64(8 * dd[0]), uint64(8 * dd[1])}},
			DimPerTensor: [][]int{dd}},
		SrcIndices: [][]int32{{3}}, DstIndices: [][]int32{{7}},
		Topology: StateTopology{PrefillTPSize: ptp, DecodeTPSize: dtp, DecodeTPRank: 1},
	}
}

func TestMambaStatePlans(t *testing.T) {
	// Equal TP: whole slots, both offsets scaled by the prefill length.
	req := mambaReq(1, 1)
	for _, plan := range []func(*StateRequest) ([]StatePlan, error){PlanStateNIXL, PlanStateMORI} {
		sps, err := plan(req)
		if err != nil {
			t.Fatal(err)
		}
		if len(sps) != 1 || sps[0].Type != StateMamba {
			t.Fatalf("plans %+v", sps)
		}
		want := []Copy{plain(0, 0, 3*64, 7*64, 64), plain(1, 1, 3*128, 7*128, 128)}
		path := PathNIXLMamba
		if sps[0].Plan.Path[:4] == "mori" {
			path = PathMORIMamba
		}
		bCheckPlan(t, &sps[0].Plan, path, want)
	}

	// TP 1 -> 2, decode rank 1: the upper half of each prefill slot, into a
	// whole decode slot (decode offsets scaled by the decode length).
	req = mambaReq(1, 2)
	want := []Copy{plain(0, 0, 3*64+32, 7*32, 32), plain(1, 1, 3*128+64, 7*64, 64)}
	sps, err := PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLMambaSlice, want)
	sps, err = PlanStateMORI(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathMORIMambaSlice, want)

	// TP 2 -> 1, prefill rank 1 writes its shard after rank 0's.
	req = mambaReq(2, 1)
	req.Topology.PrefillTPRank = 1
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLMambaSlice, []Copy{plain(0, 0, 3*32, 7*64+32, 32), plain(1, 1, 3*64, 7*128+64, 64)})

	// Kimi-style outer rows: 2 rows per slot -> one strided copy per tensor.
	req = mambaReq(1, 2)
	req.Src.SliceOuterCounts = [][]int{{2, 1}}
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	// Tensor 0: 64 B = 2 rows x 8 dims x 4 B; decode rank 1 takes dims 4..7
	// of each row: 16 B at 16 and 48, into rows of 4 dims x 4 B.
	bCheckPlan(t, &sps[0].Plan, PathNIXLMambaSlice, []Copy{
		{SrcRegion: 0, DstRegion: 0, SrcOff: 3*64 + 16, DstOff: 7 * 32, Len: 16, SrcStride: 32, DstStride: 16, Count: 2},
		plain(1, 1, 3*128+64, 7*64, 64),
	})

	// Missing dims on one side: whole-slot copies even though TP differs.
	req = mambaReq(1, 2)
	req.Dst.DimPerTensor = nil
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLMamba, []Copy{plain(0, 0, 3*64, 7*64, 64), plain(1, 1, 3*128, 7*128, 128)})

	// NIXL skips tensors with a null pointer (unregistered).
	req = mambaReq(1, 1)
	req.Dst.Ptrs[0][1] = 0
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLMamba, []Copy{plain(0, 0, 3*64, 7*64, 64)})

	// Layer ids pair a PP stage's tensors with a PP-1 decode.
	req = mambaReq(1, 1)
	req.Dst.Ptrs = [][]uint64{{3 << 32, 4 << 32, 5 << 32}}
	req.Src.LayerIDs = [][]int{{5, 9}}
	req.Dst.LayerIDs = [][]int{{1, 5, 9}}
	req.Topology.PrefillPPSize = 2
	sps, err = PlanStateNIXL(req)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, &sps[0].Plan, PathNIXLMamba, []Copy{plain(0, 1, 3*64, 7*64, 64), plain(1, 2, 3*128, 7*128, 128)})
}

func TestMambaStateErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(*StateRequest)
		mori   bool
		field  string
		substr string
	}{
		{"two prefill slots", func(r *StateRequest) { r.SrcIndices = [][]int32{{1, 2}} }, false, "prefill_state_indices[0]", "single state index"},
		{"nixl decode count", func(r *StateRequest) { r.DstIndices = [][]int32{{1, 2}} }, false, "decode_state_indices[0]", "count mismatch"},
		{"mori decode count", func(r *StateRequest) { r.DstIndices = [][]int32{{1, 2}} }, true, "decode_state_indices[0]", "single state index"},
		{"nixl more decode tensors", func(r *StateRequest) {
			r.Dst.Ptrs = [][]uint64{{3 << 32, 4 << 32, 5 << 32}}
		}, false, "prefill.state_item_lens[0]", "no item length for tensor 2"},
		{"mori fewer decode tensors", func(r *StateRequest) { r.Dst.Ptrs = [][]uint64{{3 << 32}} }, true, "decode.state_ptrs[0]", "decode registers 1"},
		{"negative slot", func(r *StateRequest) { r.DstIndices = [][]int32{{-1}} }, false, "decode_state_indices[0]", "negative"},
		{"slot past buffer", func(r *StateRequest) { r.Src.DataLens = [][]uint64{{64, 128}} }, false, "prefill_state_indices[0]", "leaves the prefill buffers"},
		{"one-sided layer ids under PP", func(r *StateRequest) {
			r.Src.LayerIDs = [][]int{{0, 1}}
			r.Topology.PrefillPPSize = 2
		}, false, "layer_ids", "both PD peers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := mambaReq(1, 1)
			tc.mod(req)
			var err error
			if tc.mori {
				_, err = PlanStateMORI(req)
			} else {
				_, err = PlanStateNIXL(req)
			}
			bFieldErr(t, err, tc.field, tc.substr)
		})
	}
}
