package planner

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

func TestPlanAddCoalesces(t *testing.T) {
	plain := func(s, d, l uint64) Copy { return Copy{SrcOff: s, DstOff: d, Len: l, Count: 1} }
	tests := []struct {
		name string
		in   []Copy
		want []Copy
	}{
		{"adjacent blocks merge", []Copy{plain(0, 100, 8), plain(8, 108, 8), plain(16, 116, 4)},
			[]Copy{plain(0, 100, 20)}},
		{"adjacent on one side only stay apart", []Copy{plain(0, 100, 8), plain(8, 200, 8), plain(16, 300, 8)},
			[]Copy{{SrcOff: 0, DstOff: 100, Len: 8, SrcStride: 8, DstStride: 100, Count: 3}}},
		{"equal gaps become a strided copy", []Copy{plain(0, 0, 4), plain(16, 32, 4), plain(32, 64, 4), plain(48, 96, 4)},
			[]Copy{{Len: 4, SrcStride: 16, DstStride: 32, Count: 4}}},
		{"a broken stride starts a new copy", []Copy{plain(0, 0, 4), plain(16, 32, 4), plain(40, 64, 4)},
			[]Copy{{Len: 4, SrcStride: 16, DstStride: 32, Count: 2}, plain(40, 64, 4)}},
		{"backwards never merges", []Copy{plain(32, 32, 4), plain(0, 0, 4)},
			[]Copy{plain(32, 32, 4), plain(0, 0, 4)}},
		{"overlapping stride never merges", []Copy{plain(0, 0, 8), plain(4, 16, 8)},
			[]Copy{plain(0, 0, 8), plain(4, 16, 8)}},
		{"different lengths never stride", []Copy{plain(0, 0, 4), plain(16, 16, 8)},
			[]Copy{plain(0, 0, 4), plain(16, 16, 8)}},
		{"strided runs continue", []Copy{
			{Len: 2, SrcOff: 0, DstOff: 0, SrcStride: 8, DstStride: 4, Count: 4},
			{Len: 2, SrcOff: 32, DstOff: 16, SrcStride: 8, DstStride: 4, Count: 4},
		}, []Copy{{Len: 2, SrcStride: 8, DstStride: 4, Count: 8}}},
		{"strided run with other strides stays apart", []Copy{
			{Len: 2, SrcStride: 8, DstStride: 4, Count: 4},
			{Len: 2, SrcOff: 32, DstOff: 16, SrcStride: 16, DstStride: 4, Count: 2},
		}, []Copy{{Len: 2, SrcStride: 8, DstStride: 4, Count: 4}, {Len: 2, SrcOff: 32, DstOff: 16, SrcStride: 16, DstStride: 4, Count: 2}}},
		{"run of adjacent blocks is one block", []Copy{{Len: 4, SrcStride: 4, DstStride: 4, Count: 5}},
			[]Copy{plain(0, 0, 20)}},
		{"other region never merges", []Copy{plain(0, 0, 4), {SrcRegion: 1, SrcOff: 4, DstOff: 4, Len: 4, Count: 1}},
			[]Copy{plain(0, 0, 4), {SrcRegion: 1, SrcOff: 4, DstOff: 4, Len: 4, Count: 1}}},
		{"plain block then its strided continuation", []Copy{plain(0, 0, 2), {SrcOff: 8, DstOff: 4, Len: 2, SrcStride: 8, DstStride: 4, Count: 3}},
			[]Copy{{Len: 2, SrcStride: 8, DstStride: 4, Count: 4}}},
		{"overflowing strides never merge", []Copy{
			{SrcOff: 0, DstOff: 0, Len: 1, SrcStride: math.MaxUint64 / 2, DstStride: 1, Count: 3},
			plain(math.MaxUint64-1, 3, 1),
		}, []Copy{{SrcOff: 0, DstOff: 0, Len: 1, SrcStride: math.MaxUint64 / 2, DstStride: 1, Count: 3}, plain(math.MaxUint64-1, 3, 1)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var p Plan
			var before []block
			for _, c := range tc.in {
				p.Add(c)
				two := []Region{{Len: math.MaxUint64}, {Len: math.MaxUint64}}
				q := Plan{Copies: []Copy{c}, Src: two, Dst: two}
				if c.Count < 1<<10 {
					before = append(before, planBlocks(&q, -1)...)
				}
			}
			if !slices.Equal(p.Copies, tc.want) {
				t.Fatalf("got  %+v\nwant %+v", p.Copies, tc.want)
			}
			p.Src = []Region{{Len: math.MaxUint64}, {Len: math.MaxUint64}}
			p.Dst = p.Src
			if tc.name != "overflowing strides never merge" {
				if got := canonical(planBlocks(&p, -1)); !slices.Equal(got, canonical(before)) {
					t.Errorf("merging changed the bytes moved:\n got  %v\n want %v", got, canonical(before))
				}
			}
		})
	}
}

func TestPlanPartsNeverMergeAcross(t *testing.T) {
	var p Plan
	p.Src = []Region{{Len: 64, Kind: VRAM}, {Len: 64, Kind: DRAM}}
	p.Dst = []Region{{Len: 64, Kind: VRAM}, {Len: 64, Kind: DRAM}}
	p.Add(Copy{Len: 8, Count: 1})
	p.ClosePart(VRAM, VRAM)
	p.Add(Copy{SrcOff: 8, DstOff: 8, Len: 8, Count: 1}) // would continue the first
	p.ClosePart(VRAM, VRAM)
	if len(p.Copies) != 2 || len(p.Parts) != 2 {
		t.Fatalf("copies %v parts %v", p.Copies, p.Parts)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	p.Parts[1].SrcKind = DRAM
	if err := p.Validate(); err == nil || !strings.Contains(err.Error(), "reads VRAM") {
		t.Errorf("kind mismatch: %v", err)
	}
	p.Parts = p.Parts[:1]
	if err := p.Validate(); err == nil || !strings.Contains(err.Error(), "parts end at copy 1 of 2") {
		t.Errorf("uncovered copy: %v", err)
	}
	p.Reset()
	if len(p.Copies) != 0 || len(p.Parts) != 0 || p.mergeFloor != 0 {
		t.Errorf("Reset left %+v", p)
	}
}

func TestPlanValidate(t *testing.T) {
	regions := []Region{{Addr: 1000, Len: 100}}
	tests := []struct {
		c    Copy
		want string
	}{
		{Copy{Len: 100, Count: 1}, ""},
		{Copy{SrcOff: 90, Len: 10, Count: 1}, ""},
		{Copy{SrcOff: 91, Len: 10, Count: 1}, "source: bytes [91, 91+10) outside region 0"},
		{Copy{Len: 10, SrcStride: 30, DstStride: 10, Count: 4}, ""},
		{Copy{Len: 11, SrcStride: 30, DstStride: 10, Count: 4}, "source: bytes [90, 90+11)"},
		{Copy{Len: 1, SrcStride: math.MaxUint64, Count: 3}, "overflows"},
		{Copy{SrcOff: math.MaxUint64, Len: 2, Count: 1}, "outside region"},
		{Copy{Len: 0, Count: 1}, "empty"},
		{Copy{Len: 1, Count: 0}, "empty"},
		{Copy{DstRegion: 1, Len: 1, Count: 1}, "destination: region 1 out of range"},
		{Copy{SrcRegion: -1, Len: 1, Count: 1}, "source: region -1 out of range"},
	}
	for _, tc := range tests {
		p := Plan{Src: regions, Dst: regions, Copies: []Copy{tc.c}}
		err := p.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: %v", tc.c, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: got %v, want %q", tc.c, err, tc.want)
		}
	}
}

func TestPairKVRegions(t *testing.T) {
	tests := []struct {
		name                     string
		how                      KVPairing
		mla                      bool
		nSrc, nDst, start, draft int
		want                     []int32
		wantErr                  string
	}{
		{"MHA same stage", PairCommon, false, 4, 4, 3, DraftUnknown, []int32{0, 1, 2, 3}, ""},
		{"MHA decode PP 1", PairCommon, false, 4, 8, 1, DraftUnknown, []int32{1, 2, 5, 6}, ""},
		{"MHA decode draft", PairCommon, false, 4, 6, 0, DraftUnknown, []int32{0, 1, 2, 3}, ""},
		// SGLang's disaggregation/{nixl,mori}/conn.py's heuristic reads 3 total layers over a 2-layer
		// stage as a draft: V goes to 2, 3 (K of layer 2 and V of layer 0).
		{"MHA uneven PP, reference heuristic", PairCommon, false, 4, 6, 0, DraftUnknown, []int32{0, 1, 2, 3}, ""},
		{"MHA uneven PP, exact", PairCommon, false, 4, 6, 0, 0, []int32{0, 1, 3, 4}, ""},
		{"MHA uneven PP stage 2, exact", PairCommon, false, 2, 6, 2, 0, []int32{2, 5}, ""},
		{"MHA draft exact", PairCommon, false, 4, 6, 0, 1, []int32{0, 1, 2, 3}, ""},
		{"MHA PP plus draft exact", PairCommon, false, 2, 8, 1, 1, []int32{1, 4}, ""},
		{"MHA stage past decode", PairCommon, false, 4, 6, 2, DraftUnknown, nil, "do not fit"},
		{"MHA fewer decode layers", PairCommon, false, 6, 4, 0, DraftUnknown, nil, "do not fit"},
		{"MHA odd prefill", PairCommon, false, 3, 4, 0, DraftUnknown, nil, "odd count"},
		{"MHA one decode region", PairCommon, false, 2, 1, 0, DraftUnknown, nil, "got 1 region"},
		{"MORI decode PP 1", PairMORI, false, 4, 6, 1, DraftUnknown, []int32{1, 2, 4, 5}, ""},
		{"MORI same stage start>0 raises", PairMORI, false, 4, 4, 2, DraftUnknown, nil, "do not fit"},
		{"MORI same stage exact", PairMORI, false, 4, 4, 2, 0, []int32{0, 1, 2, 3}, ""},
		{"MLA equal", PairCommon, true, 3, 3, 5, DraftUnknown, []int32{0, 1, 2}, ""},
		{"MLA PP", PairCommon, true, 2, 5, 3, DraftUnknown, []int32{3, 4}, ""},
		{"MLA PP past end", PairCommon, true, 2, 5, 4, DraftUnknown, nil, "do not fit"},
		{"MORI MLA equal start>0 raises", PairMORI, true, 3, 3, 1, DraftUnknown, nil, "do not fit"},
		{"MLA draft exact", PairMORI, true, 3, 4, 0, 1, []int32{0, 1, 2}, ""},
		{"draft leaves nothing", PairCommon, false, 2, 4, 0, 2, nil, "no main layers"},
		{"negative draft", PairCommon, false, 2, 4, 0, -2, nil, "draft_layers"},
		{"negative start", PairCommon, false, 2, 4, -1, DraftUnknown, nil, "start_layer"},
		{"no prefill", PairCommon, false, 0, 4, 0, DraftUnknown, nil, "prefill.kv_ptrs"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := PairKVRegions(nil, tc.how, tc.mla, tc.nSrc, tc.nDst, tc.start, tc.draft)
			if tc.wantErr != "" {
				var pe *Error
				if err == nil || !errors.As(err, &pe) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want *Error containing %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestRuns(t *testing.T) {
	src := []int32{3, 4, 5, 9, 10, 2, 3, 7}
	dst := []int32{0, 1, 2, 5, 7, 8, 9, 10}
	var runs [][3]int32
	for i, n := 0, 0; i < len(src); i += n {
		n = NextRun(src, dst, i)
		runs = append(runs, [3]int32{src[i], dst[i], int32(n)})
	}
	want := [][3]int32{{3, 0, 3}, {9, 5, 1}, {10, 7, 1}, {2, 8, 2}, {7, 10, 1}}
	if !slices.Equal(runs, want) || CountRuns(src, dst) != len(want) {
		t.Errorf("runs %v, want %v", runs, want)
	}
	if CountRuns(nil, nil) != 0 {
		t.Error("empty input has runs")
	}
	if err := CheckPagePairs(src, 11, dst[:3], 11); err == nil || !strings.Contains(err.Error(), "equal-length") {
		t.Errorf("unequal lengths: %v", err)
	}
	if err := CheckPagePairs(src, 10, dst, 11); err == nil || err.Error() != "prefill_pages[4]: page 10 outside [0, 10)" {
		t.Errorf("page range: %v", err)
	}
	if err := CheckPages("decode_pages", []int32{0, -1}, 4); err == nil || !strings.HasPrefix(err.Error(), "decode_pages[1]:") {
		t.Errorf("negative page: %v", err)
	}
}

func TestKVSideCheck(t *testing.T) {
	good := KVSide{TPSize: 1, Ptrs: []uint64{0x1000, 0x2000}, ItemLens: []uint64{16, 16}, NumPages: 4}
	if err := good.Check("prefill"); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		mut  func(*KVSide)
		want string
	}{
		{func(s *KVSide) { s.TPSize = 0 }, "prefill.tp_size:"},
		{func(s *KVSide) { s.TPRank = -1 }, "prefill.tp_rank:"},
		{func(s *KVSide) { s.KVHeadNum = -1 }, "prefill.kv_head_num:"},
		{func(s *KVSide) { s.StartLayer = -1 }, "prefill.start_layer:"},
		{func(s *KVSide) { s.Ptrs = nil; s.ItemLens = nil }, "prefill.kv_ptrs: no KV regions"},
		{func(s *KVSide) { s.ItemLens = s.ItemLens[:1] }, "prefill.kv_item_lens: length mismatch"},
		{func(s *KVSide) { s.Kinds = []MemKind{VRAM} }, "prefill.mem_kinds: kv_data_mem_kinds length mismatch"},
		{func(s *KVSide) { s.NumPages = 0 }, "prefill.num_pages:"},
		{func(s *KVSide) { s.ItemLens = []uint64{16, 0} }, "prefill.kv_item_lens[1]: must be at least 1"},
		{func(s *KVSide) { s.ItemLens = []uint64{16, math.MaxUint64} }, "prefill.kv_item_lens[1]:"},
		{func(s *KVSide) { s.Ptrs = []uint64{0x1000, math.MaxUint64 - 8} }, "prefill.kv_ptrs[1]: region"},
	}
	for _, tc := range tests {
		s := good
		s.Ptrs, s.ItemLens = slices.Clone(good.Ptrs), slices.Clone(good.ItemLens)
		tc.mut(&s)
		err := s.Check("prefill")
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("got %v, want prefix %q", err, tc.want)
		}
	}
}

// MemKind is numbered as NIXL's nixl_mem_t (DRAM_SEG 0, VRAM_SEG 1), so a
// runtime converts it with a plain conversion; DRAM is therefore the zero
// value, and every VRAM default is explicit: nil Kinds are VRAM regions,
// VRAM parts and VRAM prepped lists.
func TestMemKindNumberingAndDefaults(t *testing.T) {
	if DRAM != MemKind(abi.DRAM) || VRAM != MemKind(abi.VRAM) {
		t.Fatalf("DRAM %d VRAM %d, abi (NIXL) DRAM %d VRAM %d: the runtimes convert kinds as they are", DRAM, VRAM, abi.DRAM, abi.VRAM)
	}
	for _, k := range []MemKind{DRAM, VRAM} {
		if got, err := ParseMemKind(k.String()); err != nil || got != k {
			t.Errorf("%v does not round-trip: %v %v", k, got, err)
		}
	}
	if MemKind(7).String() != "MemKind(7)" {
		t.Errorf("unknown kind prints %q", MemKind(7))
	}
	g := SGLangKV{PageSize: 4, Prefill: mhaSide(2, 2, 3, 4, 8, 16, 1<<30, nil), Decode: mhaSide(2, 2, 3, 4, 8, 16, 1<<40, nil)}
	n, err := NewNIXLKV(g, true)
	if err != nil {
		t.Fatal(err)
	}
	src, dst := n.Regions()
	for _, r := range append(src, dst...) {
		if r.Kind != VRAM {
			t.Fatalf("region %+v: nil Kinds must mean VRAM", r)
		}
	}
	pk, err := n.Prepped()
	if err != nil {
		t.Fatal(err)
	}
	for i, part := range pk.Parts {
		if part.Src.Kind != VRAM || part.Dst.Kind != VRAM {
			t.Errorf("prepped part %d: lists %v -> %v, want VRAM", i, part.Src.Kind, part.Dst.Kind)
		}
	}
	for i, part := range n.Parts() {
		if part.SrcKind != VRAM || part.DstKind != VRAM {
			t.Errorf("part %d: %v -> %v, want VRAM", i, part.SrcKind, part.DstKind)
		}
	}
	if _, err := NewMORIKV(g); err != nil {
		t.Errorf("MORI with default (VRAM) kinds: %v", err)
	}
	g.Decode.Kinds = make([]MemKind, len(g.Decode.Ptrs)) // all zero: DRAM
	if _, err := NewMORIKV(g); err == nil {
		t.Error("MORI accepted DRAM regions")
	}
}
