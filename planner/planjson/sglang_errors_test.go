package planjson

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/planner"
)

// Every geometry error SGLang's disaggregation/{nixl,mori}/conn.py raises on the SGLang KV paths is an
// *Error naming the field, and SGLang's disaggregation/{nixl,mori}/conn.py (testdata/ref_sglang.py) raises
// on the same input.
func TestSGLangGeometryErrors(t *testing.T) {
	f := false
	base := func(style string) KVRequest {
		return kvReq(style, "mha", 2, sideOf(1, 0, 4, 4, 32, 8), sideOf(1, 0, 4, 4, 32, 8), []int64{1, 2}, []int64{3, 4})
	}
	slice := func(style string) KVRequest {
		return kvReq(style, "mha", 2, sideOf(1, 0, 4, 4, 32, 8), sideOf(2, 1, 2, 4, 16, 8), []int64{1, 2}, []int64{3, 4})
	}
	tests := []struct {
		name  string
		req   KVRequest
		mut   func(*KVRequest)
		want  string // error prefix: field and message start
		noRef bool   // ref_sglang.py does not model this check
	}{
		{"decode fewer regions", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode = withPtrs(sideOf(1, 0, 4, 2, 32, 8), 0x10000)
		}, "decode.kv_ptrs: NIXL PD transfer: decode registered fewer KV regions (2) than prefill (4)", false},
		{"source mixed kinds", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prefill.MemKinds = []string{"VRAM", "DRAM", "VRAM", "VRAM"}
		}, "prefill.mem_kinds: NIXL source mixed KV memory kinds are not implemented safely yet", false},
		{"mixed destination with decode-only draft", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode = withPtrs(sideOf(1, 0, 4, 6, 32, 8), 0x10000)
			r.Decode.MemKinds = []string{"VRAM", "DRAM", "VRAM", "VRAM", "VRAM", "VRAM"}
		}, "decode.mem_kinds: NIXL PD transfer does not support HiSparse combined with decode-only speculative decoding", false},
		{"host destination with decode-only draft", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode = withPtrs(sideOf(1, 0, 4, 6, 32, 8), 0x10000)
			r.Decode.MemKinds = []string{"DRAM", "DRAM", "DRAM", "DRAM", "DRAM", "DRAM"}
		}, "decode.mem_kinds: NIXL PD transfer does not support HiSparse", false},
		{"transfer longer than decode slot", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode = withPtrs(sideOf(1, 0, 4, 4, 16, 8), 0x10000)
		}, "decode.kv_item_lens[0]: NIXL prepared dlist transfer length exceeds item stride: xfer_len=32, item_len=16", false},
		{"slice into host memory", slice(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode.MemKinds = []string{"DRAM", "DRAM", "DRAM", "DRAM"}
		}, "decode.mem_kinds: NIXL heterogeneous-TP direct-to-host KV transfer is not implemented safely yet", false},
		{"slice into mixed memory", slice(StyleSGLangNIXL), func(r *KVRequest) {
			r.Decode.MemKinds = []string{"DRAM", "VRAM", "DRAM", "DRAM"}
		}, "decode.mem_kinds: NIXL destination mixed KV memory kinds", false},
		{"PP stage past the decode layers", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prefill = withPtrs(sideOf(1, 0, 4, 2, 32, 8), 0x1000)
			r.Prefill.StartLayer = 2
			r.Prepped = &f
		}, "decode.kv_ptrs: decode holds 2 MHA layers (4 regions); prefill layers [2, 3) do not fit", false},
		{"runs with unequal page lists", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prepped = &f
			r.DecodePages = []int64{3, 4, 5}
		}, "decode_pages: group_concurrent_contiguous requires equal-length src/dst index arrays, got 2 and 3", false},
		{"prepped with more decode pages", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.DecodePages = []int64{3, 4, 5}
		}, "decode_pages: group_concurrent_contiguous requires equal-length", false},
		{"MORI head slice of zero bytes", slice(StyleSGLangMORI), func(r *KVRequest) {
			r.TotalKVHeads = 64
		}, "decode.kv_item_lens: head slice size evaluates to zero", false},
		// 6 heads, TP 3 -> 2: prefill rank 1 holds heads 2-3, which
		// straddle decode ranks 0 (0-2) and 1 (3-5). SGLang's disaggregation/{nixl,mori}/conn.py writes
		// heads 2-3 at head slots 2-3 of a 3-head decode token, the second
		// one into the next token; kvhost refuses.
		{"slice wider than the decode token", slice(StyleSGLangMORI), func(r *KVRequest) {
			r.Prefill = withPtrs(sideOf(3, 1, 2, 4, 16, 8), 0x1000)
			r.Decode = withPtrs(sideOf(2, 0, 3, 4, 24, 8), 0x10000)
		}, "decode.kv_item_lens: slice size exceeds destination token capacity: heads bytes [8, 16) of a 12-byte decode token", true},
		{"MORI PP stage past the decode layers", base(StyleSGLangMORI), func(r *KVRequest) {
			r.Prefill.StartLayer = 1
		}, "decode.kv_ptrs: decode holds 2 MHA layers (4 regions); prefill layers [1, 3) do not fit", false},
		{"MORI MLA PP stage past the decode layers", base(StyleSGLangMORI), func(r *KVRequest) {
			r.Attention = "mla"
			r.Prefill.StartLayer = 1
		}, "decode.kv_ptrs: decode holds 4 MLA layers; prefill layers [1, 5) do not fit", false},
		{"MORI unequal page lists", base(StyleSGLangMORI), func(r *KVRequest) {
			r.DecodePages = []int64{3}
		}, "decode_pages: group_concurrent_contiguous requires equal-length src/dst index arrays, got 2 and 1", false},
		// Checks beyond SGLang's disaggregation/{nixl,mori}/conn.py, which would hand NIXL descriptors
		// outside the regions or read other tokens' bytes.
		{"page past the prefill pages", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.PrefillPages = []int64{1, 8}
		}, "prefill_pages[1]: page 8 outside [0, 8)", true},
		{"page past the decode pages", base(StyleSGLangMORI), func(r *KVRequest) {
			r.DecodePages = []int64{3, 9}
		}, "decode_pages[1]: page 9 outside [0, 8)", true},
		{"runs stride past a shorter decode region", base(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prepped = &f
			r.Decode = withPtrs(sideOf(1, 0, 4, 4, 16, 8), 0x10000)
			r.DecodePages = []int64{5, 6}
		}, "decode_pages: page 6 at 32 bytes per page ends past region 0 (128 bytes)", true},
		{"head slice past the prefill token", slice(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prefill = withPtrs(sideOf(1, 0, 4, 4, 16, 8), 0x1000)
		}, "prefill.kv_item_lens: head slice [8, 16) lies outside the 8-byte prefill token", true},
		{"slice with uneven item lengths", slice(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prefill.KVItemLens = []uint64{32, 32, 64, 32}
		}, "prefill.kv_item_lens[2]: heterogeneous TP slices every region with kv_item_lens[0] = 32; got 64", true},
		{"non-prepped heterogeneous TP", slice(StyleSGLangNIXL), func(r *KVRequest) {
			r.Prepped = &f
		}, "prepped: the non-prepped path moves whole pages", true},
		{"MORI host memory", base(StyleSGLangMORI), func(r *KVRequest) {
			r.Decode.MemKinds = []string{"VRAM", "DRAM", "VRAM", "VRAM"}
		}, "decode.mem_kinds: MORI registers KV regions as GPU memory; region 1 is DRAM", true},
	}
	var reqs []KVRequest
	for _, tc := range tests {
		tc.mut(&tc.req)
		reqs = append(reqs, tc.req)
	}
	ref := runReference(t, reqs)
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := planKVRequest(reqs[i])
			var pe *planner.Error
			if err == nil || !errors.As(err, &pe) || !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("got %v\nwant *Error %q...", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "\n") {
				t.Errorf("error spans lines: %q", err)
			}
			if !tc.noRef && ref[i].Error == "" {
				t.Errorf("SGLang's disaggregation/{nixl,mori}/conn.py does not raise here")
			}
		})
	}
}

// Bad JSON requests name the offending field in one line.
func TestKVRequestJSONErrors(t *testing.T) {
	good := kvReq(StyleSGLangNIXL, "mha", 2, sideOf(1, 0, 4, 4, 32, 8), sideOf(1, 0, 4, 4, 32, 8), []int64{1}, []int64{3})
	goodRaw, _ := json.Marshal(good)
	if _, _, err := PlanRequest(goodRaw); err != nil {
		t.Fatal(err)
	}
	patch := func(edit func(m map[string]any)) string {
		var m map[string]any
		json.Unmarshal(goodRaw, &m)
		edit(m)
		b, _ := json.Marshal(m)
		return string(b)
	}
	side := func(m map[string]any, name string) map[string]any { return m[name].(map[string]any) }
	tests := []struct {
		raw  string
		want string
	}{
		{``, "request: empty or truncated JSON"},
		{`{`, "request: empty or truncated JSON"},
		{`[]`, "request: want an object, got JSON array"},
		{`{"style":"sglang-nixl","kind":"aux2"}`, `kind: style "sglang-nixl" has no "aux2" plans`},
		{`{"kind":"kv"}`, "style: missing"},
		{`{"style":7}`, "style: want a string, got JSON number"},
		{patch(func(m map[string]any) { m["attention"] = "gqa" }), `attention: unknown attention "gqa"`},
		{patch(func(m map[string]any) { delete(m, "attention") }), "attention: missing"},
		{patch(func(m map[string]any) { m["page_size"] = 0 }), "page_size: must be at least 1"},
		{patch(func(m map[string]any) { m["total_kv_heads"] = -2 }), "total_kv_heads: must not be negative"},
		{patch(func(m map[string]any) { m["extra"] = 1 }), "extra: unknown field"},
		{patch(func(m map[string]any) { side(m, "decode")["extra"] = 1 }), "decode.extra: unknown field"},
		// A key valid at the top level is still unknown inside a side.
		{patch(func(m map[string]any) { side(m, "prefill")["page_size"] = 1 }), "prefill.page_size: unknown field"},
		{patch(func(m map[string]any) { side(m, "prefill")["kv_ptrs"] = "x" }), "prefill.kv_ptrs: want an array, got JSON string"},
		{patch(func(m map[string]any) { side(m, "decode")["kv_ptrs"] = []any{-1, 2, 3, 4} }), "decode.kv_ptrs: want a non-negative integer, got JSON number -1"},
		{patch(func(m map[string]any) { side(m, "decode")["num_pages"] = 1.5 }), "decode.num_pages: want a non-negative integer, got JSON number 1.5"},
		{patch(func(m map[string]any) { side(m, "decode")["mem_kinds"] = []any{"VRAM", "HBM", "VRAM", "VRAM"} }), `decode.mem_kinds[1]: unsupported NIXL KV memory kind "HBM"`},
		{patch(func(m map[string]any) { side(m, "prefill")["draft_layers"] = 1 }), "prefill.draft_layers: only the decode side"},
		{patch(func(m map[string]any) { side(m, "decode")["draft_layers"] = -1 }), "decode.draft_layers: must not be negative"},
		{patch(func(m map[string]any) { side(m, "decode")["block_size"] = 16 }), "decode.block_size: vLLM only"},
		{patch(func(m map[string]any) { side(m, "decode")["start_layer"] = 2 }), "decode.start_layer:"},
		{patch(func(m map[string]any) { side(m, "prefill")["tp_size"] = 0 }), "prefill.tp_size: must be at least 1"},
		{patch(func(m map[string]any) { m["prefill_pages"] = []any{1 << 40} }), "prefill_pages[0]: page 1099511627776 outside [0, 2^31)"},
		{patch(func(m map[string]any) { m["style"] = "sglang-mori"; m["prepped"] = false }), "prepped: only sglang-nixl has a non-prepped path"},
		{patch(func(m map[string]any) {}) + "x", "request: invalid JSON at byte"},
	}
	for _, tc := range tests {
		_, _, err := PlanRequest([]byte(tc.raw))
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%.80s:\n got  %v\n want %q...", tc.raw, err, tc.want)
		}
	}
}
