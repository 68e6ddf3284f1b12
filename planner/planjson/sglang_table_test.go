package planjson

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/planner"
)

// Hand-checked plans for every SGLang KV layout. Region addresses are
// round so the expected offsets can be read off: prefill region i starts at
// 0x1000*(i+1), decode region j at 0x10000*(j+1).

func sideOf(tp, rank, heads, regions int, item, pages uint64) KVSideJSON {
	s := KVSideJSON{TPSize: tp, TPRank: rank, KVHeadNum: heads, NumPages: pages}
	for i := 0; i < regions; i++ {
		s.KVItemLens = append(s.KVItemLens, item)
	}
	return s
}

func withPtrs(s KVSideJSON, step uint64) KVSideJSON {
	s.KVPtrs = nil
	for i := range s.KVItemLens {
		s.KVPtrs = append(s.KVPtrs, step*uint64(i+1))
	}
	return s
}

func kvReq(style, attention string, pageSize int, prefill, decode KVSideJSON, src, dst []int64) KVRequest {
	return KVRequest{
		Style: style, Attention: attention, PageSize: pageSize,
		Prefill: withPtrs(prefill, 0x1000), Decode: withPtrs(decode, 0x10000),
		PrefillPages: src, DecodePages: dst,
	}
}

func TestSGLangLayoutTable(t *testing.T) {
	f := false
	tests := []struct {
		name     string
		req      KVRequest
		mutate   func(*KVRequest)
		path     string
		want     []copyRow
		refDescs uint64
		parts    []partRow
	}{
		{
			// 2 layers (K0 K1 V0 V1), 64-byte pages. Runs (1..3 -> 4..6)
			// and (6 -> 0): one block per region per run.
			name: "equal TP", path: planner.PathNIXLPreppedEqualTP,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(2, 0, 4, 4, 64, 8), sideOf(2, 0, 4, 4, 64, 8),
				[]int64{1, 2, 3, 6}, []int64{4, 5, 6, 0}),
			want: []copyRow{
				{0, 0, 64, 256, 192, 0, 0, 1}, {0, 0, 384, 0, 64, 0, 0, 1},
				{1, 1, 64, 256, 192, 0, 0, 1}, {1, 1, 384, 0, 64, 0, 0, 1},
				{2, 2, 64, 256, 192, 0, 0, 1}, {2, 2, 384, 0, 64, 0, 0, 1},
				{3, 3, 64, 256, 192, 0, 0, 1}, {3, 3, 384, 0, 64, 0, 0, 1},
			},
			refDescs: 16,
		},
		{
			// Decode (HiSparse) slots are 128 bytes apart; 64 move per page.
			name: "equal TP, wider decode slots", path: planner.PathNIXLPreppedEqualTP,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 2, 64, 8), sideOf(1, 0, 4, 2, 128, 8),
				[]int64{1, 2, 3}, []int64{4, 5, 6}),
			want: []copyRow{
				{0, 0, 64, 512, 64, 64, 128, 3},
				{1, 1, 64, 512, 64, 64, 128, 3},
			},
			refDescs: 6,
		},
		{
			// Decode runs speculative decoding: 2 draft layers after the
			// main K and V; only the first 4 regions receive.
			name: "equal TP, decode-only draft layers", path: planner.PathNIXLPreppedEqualTP,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 4, 64, 8), sideOf(1, 0, 4, 6, 64, 8),
				[]int64{0}, []int64{7}),
			want: []copyRow{
				{0, 0, 0, 448, 64, 0, 0, 1}, {1, 1, 0, 448, 64, 0, 0, 1},
				{2, 2, 0, 448, 64, 0, 0, 1}, {3, 3, 0, 448, 64, 0, 0, 1},
			},
			refDescs: 4,
		},
		{
			// MLA ignores TP. Pages 0, 2, 4 -> 1, 3, 5: equal gaps become
			// one strided copy per layer.
			name: "MLA", path: planner.PathNIXLPreppedMLA,
			req: kvReq(StyleSGLangNIXL, "mla", 64, sideOf(2, 1, 1, 3, 32, 8), sideOf(4, 3, 1, 3, 32, 8),
				[]int64{0, 2, 4}, []int64{1, 3, 5}),
			want: []copyRow{
				{0, 0, 0, 32, 32, 64, 64, 3}, {1, 1, 0, 32, 32, 64, 64, 3}, {2, 2, 0, 32, 32, 64, 64, 3},
			},
			refDescs: 9,
		},
		{
			// TP 1 -> 2, 4 heads of 4 bytes, 2 tokens per page: prefill
			// tokens are 16 bytes (4 heads), decode tokens 8 (2 heads).
			// Decode rank 1 owns heads 2-3: offset 8 of every prefill
			// token. Pages 3, 4 -> 0, 1 are one run: 4 tokens.
			name: "slice, prefill TP < decode TP", path: planner.PathNIXLPreppedSlice,
			req: kvReq(StyleSGLangNIXL, "mha", 2, sideOf(1, 0, 4, 4, 32, 8), sideOf(2, 1, 2, 4, 16, 8),
				[]int64{3, 4}, []int64{0, 1}),
			want: []copyRow{
				{0, 0, 104, 0, 8, 16, 8, 4}, {1, 1, 104, 0, 8, 16, 8, 4},
				{2, 2, 104, 0, 8, 16, 8, 4}, {3, 3, 104, 0, 8, 16, 8, 4},
			},
			refDescs: 16,
		},
		{
			// TP 4 -> 2, 4 heads of 4 bytes: prefill rank 3 holds head 3,
			// decode rank 1 holds heads 2-3: rank 3 writes the second head
			// slot (offset 4) of every 8-byte decode token.
			name: "slice, prefill TP > decode TP", path: planner.PathNIXLPreppedSlice,
			req: kvReq(StyleSGLangNIXL, "mha", 2, sideOf(4, 3, 1, 2, 8, 8), sideOf(2, 1, 2, 2, 16, 8),
				[]int64{0, 1, 2, 5}, []int64{5, 6, 7, 0}),
			want: []copyRow{
				{0, 0, 0, 84, 4, 4, 8, 6}, {0, 0, 40, 4, 4, 4, 8, 2},
				{1, 1, 0, 84, 4, 4, 8, 6}, {1, 1, 40, 4, 4, 4, 8, 2},
			},
			refDescs: 16,
		},
		{
			// TP 4 -> 2 with 2 KV heads: prefill ranks 2 and 3 both hold
			// (replicated) head 1; decode rank 1 holds head 1 alone, so
			// rank 3 writes the whole decode token.
			name: "slice, prefill TP > KV heads (replicated)", path: planner.PathNIXLPreppedSlice,
			req: kvReq(StyleSGLangNIXL, "mha", 2, sideOf(4, 3, 1, 2, 8, 8), sideOf(2, 1, 1, 2, 8, 8),
				[]int64{2}, []int64{3}),
			mutate:   func(r *KVRequest) { r.TotalKVHeads = 2 },
			want:     []copyRow{{0, 0, 16, 24, 8, 0, 0, 1}, {1, 1, 16, 24, 8, 0, 0, 1}},
			refDescs: 4,
		},
		{
			// TP 2 -> 8 with 2 KV heads: decode ranks hold one replicated
			// head; rank 5 takes prefill rank 1's only head, whole tokens.
			name: "slice, decode TP > KV heads (replicated)", path: planner.PathNIXLPreppedSlice,
			req: kvReq(StyleSGLangNIXL, "mha", 2, sideOf(2, 1, 1, 2, 8, 8), sideOf(8, 5, 1, 2, 8, 8),
				[]int64{4, 5}, []int64{1, 2}),
			want:     []copyRow{{0, 0, 32, 8, 16, 0, 0, 1}, {1, 1, 32, 8, 16, 0, 0, 1}},
			refDescs: 8,
		},
		{
			// TP 1 -> 4 with 2 KV heads of 4 bytes: decode ranks 0-1 hold
			// head 0, ranks 2-3 head 1. Rank 1 takes head 0 (offset 0 of
			// the 8-byte prefill token); SGLang's disaggregation/{nixl,mori}/conn.py would send it head
			// 1 (offset 4), see referenceView.
			name: "slice, decode TP > KV heads, rank holding a replica", path: planner.PathNIXLPreppedSlice,
			req: kvReq(StyleSGLangNIXL, "mha", 2, sideOf(1, 0, 2, 2, 16, 8), sideOf(4, 1, 1, 2, 8, 8),
				[]int64{1}, []int64{2}),
			want:     []copyRow{{0, 0, 16, 16, 4, 8, 4, 2}, {1, 1, 16, 16, 4, 8, 4, 2}},
			refDescs: 4,
		},
		{
			// Decode mixes memory kinds: (VRAM,VRAM) (VRAM,DRAM)x2
			// (VRAM,VRAM): three parts, posted and notified apart.
			name: "mixed memory kinds", path: planner.PathNIXLPreppedMixed,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 4, 64, 8), sideOf(1, 0, 4, 4, 64, 8),
				[]int64{1}, []int64{2}),
			mutate: func(r *KVRequest) { r.Decode.MemKinds = []string{"VRAM", "DRAM", "DRAM", "VRAM"} },
			want: []copyRow{
				{0, 0, 64, 128, 64, 0, 0, 1}, {1, 1, 64, 128, 64, 0, 0, 1},
				{2, 2, 64, 128, 64, 0, 0, 1}, {3, 3, 64, 128, 64, 0, 0, 1},
			},
			parts:    []partRow{{0, 1, planner.VRAM, planner.VRAM, ""}, {1, 3, planner.VRAM, planner.DRAM, ""}, {3, 4, planner.VRAM, planner.VRAM, ""}},
			refDescs: 4,
		},
		{
			// Non-prepped, prefill PP stage holding layer 1 of 3, decode
			// PP 1: K1 -> decode region 1, V1 -> decode region 4.
			name: "non-prepped runs with PP", path: planner.PathNIXLRuns,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 2, 64, 8), sideOf(1, 0, 4, 6, 64, 8),
				[]int64{2, 3}, []int64{0, 1}),
			mutate:   func(r *KVRequest) { r.Prefill.StartLayer = 1; r.Prepped = &f },
			want:     []copyRow{{0, 1, 128, 0, 128, 0, 0, 1}, {1, 4, 128, 0, 128, 0, 0, 1}},
			refDescs: 2,
		},
		{
			name: "non-prepped MLA runs with PP", path: planner.PathNIXLRunsMLA,
			req: kvReq(StyleSGLangNIXL, "mla", 16, sideOf(1, 0, 1, 2, 32, 8), sideOf(1, 0, 1, 4, 32, 8),
				[]int64{0, 1, 5}, []int64{6, 7, 2}),
			mutate: func(r *KVRequest) { r.Prefill.StartLayer = 2; r.Prepped = &f },
			want: []copyRow{
				{0, 2, 0, 192, 64, 0, 0, 1}, {0, 2, 160, 64, 32, 0, 0, 1},
				{1, 3, 0, 192, 64, 0, 0, 1}, {1, 3, 160, 64, 32, 0, 0, 1},
			},
			refDescs: 4,
		},
		{
			// Uneven PP (2 of 3 layers): SGLang's disaggregation/{nixl,mori}/conn.py heuristic would pair
			// V with K2/V0; draft_layers 0 makes the pairing exact.
			name: "runs with uneven PP and known draft layers", path: planner.PathNIXLRuns,
			req: kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 4, 64, 8), sideOf(1, 0, 4, 6, 64, 8),
				[]int64{0}, []int64{1}),
			mutate: func(r *KVRequest) { zero := 0; r.Decode.DraftLayers = &zero; r.Prepped = &f },
			want: []copyRow{
				{0, 0, 0, 64, 64, 0, 0, 1}, {1, 1, 0, 64, 64, 0, 0, 1},
				{2, 3, 0, 64, 64, 0, 0, 1}, {3, 4, 0, 64, 64, 0, 0, 1},
			},
			refDescs: 4,
		},
		{
			name: "MORI equal TP", path: planner.PathMORIRuns,
			req: kvReq(StyleSGLangMORI, "mha", 16, sideOf(2, 0, 4, 2, 64, 8), sideOf(2, 0, 4, 2, 64, 8),
				[]int64{3, 4, 7}, []int64{0, 1, 5}),
			want: []copyRow{
				{0, 0, 192, 0, 128, 0, 0, 1}, {0, 0, 448, 320, 64, 0, 0, 1},
				{1, 1, 192, 0, 128, 0, 0, 1}, {1, 1, 448, 320, 64, 0, 0, 1},
			},
			refDescs: 4,
		},
		{
			// MORI MLA with PP: prefill layers 1-2 of decode's 3.
			name: "MORI MLA with PP", path: planner.PathMORIRunsMLA,
			req: kvReq(StyleSGLangMORI, "mla", 16, sideOf(1, 0, 1, 2, 32, 8), sideOf(1, 0, 1, 3, 32, 8),
				[]int64{1}, []int64{2}),
			mutate:   func(r *KVRequest) { r.Prefill.StartLayer = 1 },
			want:     []copyRow{{0, 1, 32, 64, 32, 0, 0, 1}, {1, 2, 32, 64, 32, 0, 0, 1}},
			refDescs: 2,
		},
		{
			// MORI TP 1 -> 2 (as the NIXL slice case); only min(len)
			// pages move: page 3 -> 0.
			name: "MORI TP slice truncates to the shorter list", path: planner.PathMORITPSlice,
			req: kvReq(StyleSGLangMORI, "mha", 2, sideOf(1, 0, 4, 2, 32, 8), sideOf(2, 1, 2, 2, 16, 8),
				[]int64{3, 4, 5}, []int64{0}),
			want:     []copyRow{{0, 0, 104, 0, 8, 16, 8, 2}, {1, 1, 104, 0, 8, 16, 8, 2}},
			refDescs: 4,
		},
	}
	var refReqs []KVRequest
	for _, tc := range tests {
		if tc.mutate != nil {
			tc.mutate(&tc.req)
		}
		refReqs = append(refReqs, tc.req)
	}
	ref := runReference(t, referenceView(refReqs))
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := refReqs[i]
			p, err := planKVRequest(req)
			if err != nil {
				t.Fatal(err)
			}
			if p.Path != tc.path {
				t.Errorf("path %s, want %s", p.Path, tc.path)
			}
			if !slices.Equal(copyRows(p.Copies), tc.want) {
				t.Errorf("copies\n got  %v\n want %v", p.Copies, tc.want)
			}
			if !slices.Equal(partRows(p.Parts), tc.parts) {
				t.Errorf("parts %v, want %v", p.Parts, tc.parts)
			}
			if p.ReferenceDescriptors != tc.refDescs {
				t.Errorf("reference descriptors %d, want %d", p.ReferenceDescriptors, tc.refDescs)
			}
			if err := p.Validate(); err != nil {
				t.Error(err)
			}
			// The hand-checked copies are also SGLang's disaggregation/{nixl,mori}/conn.py's bytes,
			// except where kvhost pairs layers exactly on purpose.
			if ref[i].Error != "" {
				t.Fatalf("reference: %s", ref[i].Error)
			}
			if req.Decode.DraftLayers == nil {
				var want []block
				for _, part := range ref[i].Parts {
					for _, d := range part {
						want = append(want, block{Src: d[0], Dst: d[1], Len: d[2]})
					}
				}
				if got := canonical(planBlocks(p, -1)); !slices.Equal(got, canonical(want)) {
					t.Errorf("reference moves other bytes:\n got  %v\n want %v", got, canonical(want))
				}
			}
		})
	}
}

func TestMixedPartsResponse(t *testing.T) {
	req := kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 4, 64, 8), sideOf(1, 0, 4, 4, 64, 8), []int64{1}, []int64{2})
	req.Decode.MemKinds = []string{"DRAM", "DRAM", "VRAM", "VRAM"}
	raw, _ := json.Marshal(req)
	p, env, err := PlanRequest(raw)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := WriteResponse(&buf, env, p, true); err != nil {
		t.Fatal(err)
	}
	want := `{"style":"sglang-nixl","kind":"kv","path":"nixl-prepped-mixed","descriptors":4,"expanded_descriptors":4,"bytes":256,"reference_descriptors":4,` +
		`"parts":[{"descriptors":2,"bytes":128,"src_mem_kind":"VRAM","dst_mem_kind":"DRAM","notif_suffix":"_part_0_2"},` +
		`{"descriptors":2,"bytes":128,"src_mem_kind":"VRAM","dst_mem_kind":"VRAM","notif_suffix":"_part_1_2"}]}` + "\n"
	if buf.String() != want {
		t.Errorf("got  %s\nwant %s", buf.String(), want)
	}
}

func TestWriteResponseCopies(t *testing.T) {
	p := &planner.Plan{
		Path: "x",
		Src:  []planner.Region{{Addr: 100, Len: 100}},
		Dst:  []planner.Region{{Addr: 1000, Len: 100}},
		Copies: []planner.Copy{
			{Len: 4, SrcStride: 4, DstStride: 8, Count: 3}, // 100->1000, 104->1008, 108->1016
			{SrcOff: 12, DstOff: 20, Len: 4, Count: 1},     // continues 108->1016 on both sides
		},
	}
	var buf bytes.Buffer
	if err := WriteResponse(&buf, Envelope{Style: "s", Kind: "kv"}, p, false); err != nil {
		t.Fatal(err)
	}
	want := `{"style":"s","kind":"kv","path":"x","descriptors":2,"expanded_descriptors":4,"bytes":16,"copies":[[100,1000,4],[104,1008,4],[108,1016,8]]}` + "\n"
	if buf.String() != want {
		t.Errorf("got  %s\nwant %s", buf.String(), want)
	}
	var v map[string]any
	if err := json.Unmarshal(buf.Bytes(), &v); err != nil {
		t.Errorf("not JSON: %v", err)
	}
	empty := &planner.Plan{Path: "y"}
	buf.Reset()
	WriteResponse(&buf, Envelope{Style: "s", Kind: "kv"}, empty, false)
	if !strings.Contains(buf.String(), `"copies":[]}`) {
		t.Errorf("empty plan: %s", buf.String())
	}
}

// copyRow and partRow are planner.Copy and planner.Part as the table spells
// them: positionally, which vet allows only for this package's own types.
type (
	copyRow planner.Copy
	partRow planner.Part
)

// copyRows and partRows convert a plan's copies or parts to the table's
// row types.
func copyRows(in []planner.Copy) []copyRow {
	if in == nil {
		return nil
	}
	out := make([]copyRow, len(in))
	for i, v := range in {
		out[i] = copyRow(v)
	}
	return out
}

func partRows(in []planner.Part) []partRow {
	if in == nil {
		return nil
	}
	out := make([]partRow, len(in))
	for i, v := range in {
		out[i] = partRow(v)
	}
	return out
}
