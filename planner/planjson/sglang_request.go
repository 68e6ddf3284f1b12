package planjson

import (
	"encoding/json"

	"github.com/kvhost/kvhost/planner"
)

func init() {
	registerHandler(StyleSGLangNIXL, KindKV, planSGLangNIXLKV)
	registerHandler(StyleSGLangMORI, KindKV, planSGLangMORIKV)
}

// sglangKVRequest decodes a KV request of an SGLang style into geometry
// and chunk pages.
func sglangKVRequest(raw json.RawMessage, style string) (planner.SGLangKV, []int32, []int32, *KVRequest, error) {
	var req KVRequest
	var g planner.SGLangKV
	if err := DecodeStrict(raw, &req); err != nil {
		return g, nil, nil, nil, err
	}
	mla, err := req.MLA()
	if err != nil {
		return g, nil, nil, nil, err
	}
	if req.PageSize < 1 {
		return g, nil, nil, nil, errorf("page_size", "must be at least 1, got %d", req.PageSize)
	}
	if req.TotalKVHeads < 0 {
		return g, nil, nil, nil, errorf("total_kv_heads", "must not be negative, got %d", req.TotalKVHeads)
	}
	if req.Prepped != nil && style != StyleSGLangNIXL {
		return g, nil, nil, nil, errorf("prepped", "only %s has a non-prepped path", StyleSGLangNIXL)
	}
	for _, s := range []struct {
		name string
		side *KVSideJSON
	}{{"prefill", &req.Prefill}, {"decode", &req.Decode}} {
		if s.side.BlockSize != 0 {
			return g, nil, nil, nil, errorf(s.name+".block_size", "vLLM only (SGLang pages are page_size tokens)")
		}
		if s.side.BlocksFirst {
			return g, nil, nil, nil, errorf(s.name+".blocks_first", "vLLM only")
		}
	}
	if req.Decode.StartLayer != 0 {
		return g, nil, nil, nil, errorf("decode.start_layer", "SGLang pairs layers with the prefill stage's start_layer; decode holds its stage from layer 0 of its list")
	}
	g = planner.SGLangKV{MLA: mla, PageSize: req.PageSize, TotalKVHeads: req.TotalKVHeads}
	if g.Prefill, err = req.Prefill.Side("prefill"); err != nil {
		return g, nil, nil, nil, err
	}
	if g.Decode, err = req.Decode.Side("decode"); err != nil {
		return g, nil, nil, nil, err
	}
	src, err := Pages("prefill_pages", req.PrefillPages)
	if err != nil {
		return g, nil, nil, nil, err
	}
	dst, err := Pages("decode_pages", req.DecodePages)
	if err != nil {
		return g, nil, nil, nil, err
	}
	return g, src, dst, &req, nil
}

func planSGLangNIXLKV(raw json.RawMessage) (*planner.Plan, error) {
	g, src, dst, req, err := sglangKVRequest(raw, StyleSGLangNIXL)
	if err != nil {
		return nil, err
	}
	prepped := req.Prepped == nil || *req.Prepped
	n, err := planner.NewNIXLKV(g, prepped)
	if err != nil {
		return nil, err
	}
	return planNew(n, src, dst)
}

func planSGLangMORIKV(raw json.RawMessage) (*planner.Plan, error) {
	g, src, dst, _, err := sglangKVRequest(raw, StyleSGLangMORI)
	if err != nil {
		return nil, err
	}
	m, err := planner.NewMORIKV(g)
	if err != nil {
		return nil, err
	}
	return planNew(m, src, dst)
}

// planNew plans one request into a new Plan, with any planner of the
// index-list shape (NIXLKV, MORIKV, VLLMReader).
func planNew(pl interface {
	Plan(p *planner.Plan, prefill, decode []int32) error
}, prefill, decode []int32) (*planner.Plan, error) {
	p := new(planner.Plan)
	if err := pl.Plan(p, prefill, decode); err != nil {
		return nil, err
	}
	return p, nil
}
