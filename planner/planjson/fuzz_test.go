package planjson

import (
	"bytes"
	"encoding/json"
	"testing"
)

// seedRequests are valid requests of every SGLang path plus a few broken
// ones, to start the fuzzers somewhere interesting.
func seedRequests() [][]byte {
	f := false
	reqs := []KVRequest{
		kvReq(StyleSGLangNIXL, "mha", 16, sideOf(2, 0, 4, 4, 64, 8), sideOf(2, 0, 4, 4, 64, 8), []int64{1, 2, 3, 6}, []int64{4, 5, 6, 0}),
		kvReq(StyleSGLangNIXL, "mla", 64, sideOf(2, 1, 1, 3, 32, 8), sideOf(4, 3, 1, 3, 32, 8), []int64{0, 2, 4}, []int64{1, 3, 5}),
		kvReq(StyleSGLangNIXL, "mha", 2, sideOf(1, 0, 4, 4, 32, 8), sideOf(2, 1, 2, 4, 16, 8), []int64{3, 4}, []int64{0, 1}),
		kvReq(StyleSGLangNIXL, "mha", 2, sideOf(4, 3, 1, 2, 8, 8), sideOf(2, 1, 2, 2, 16, 8), []int64{0, 1, 2, 5}, []int64{5, 6, 7, 0}),
		kvReq(StyleSGLangMORI, "mha", 2, sideOf(1, 0, 4, 2, 32, 8), sideOf(2, 1, 2, 2, 16, 8), []int64{3, 4, 5}, []int64{0}),
		kvReq(StyleSGLangMORI, "mla", 16, sideOf(1, 0, 1, 2, 32, 8), sideOf(1, 0, 1, 3, 32, 8), []int64{1}, []int64{2}),
	}
	mixed := kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 4, 64, 8), sideOf(1, 0, 4, 4, 64, 8), []int64{1}, []int64{2})
	mixed.Decode.MemKinds = []string{"VRAM", "DRAM", "DRAM", "VRAM"}
	runs := kvReq(StyleSGLangNIXL, "mha", 16, sideOf(1, 0, 4, 2, 64, 8), sideOf(1, 0, 4, 6, 64, 8), []int64{2, 3}, []int64{0, 1})
	runs.Prefill.StartLayer, runs.Prepped = 1, &f
	reqs = append(reqs, mixed, runs)
	var out [][]byte
	for _, r := range reqs {
		b, _ := json.Marshal(r)
		out = append(out, b)
	}
	return append(out, []byte(`{"style":"sglang-nixl"}`), []byte(`{"style":"vllm","kind":"kv"}`),
		[]byte(`{"style":"sglang-mori","kind":"aux"}`), []byte(`{"style":"sglang-nixl","kind":"state"}`), []byte(`[1,2]`))
}

// FuzzPlanRequest: whatever the request, planning never panics, a plan it
// returns stays inside its regions, and its response is valid JSON.
func FuzzPlanRequest(f *testing.F) {
	for _, s := range seedRequests() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, env, err := PlanRequest(raw)
		if err != nil {
			if bytes.ContainsRune([]byte(err.Error()), '\n') {
				t.Fatalf("multi-line error %q", err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("plan outside its regions: %v", err)
		}
		var buf bytes.Buffer
		summary := p.ExpandedDescriptors() > 1<<16
		if err := WriteResponse(&buf, env, p, summary); err != nil {
			t.Fatal(err)
		}
		if !json.Valid(buf.Bytes()) {
			t.Fatalf("response is not JSON: %.200s", buf.String())
		}
	})
}
