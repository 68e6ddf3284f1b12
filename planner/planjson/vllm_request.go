package planjson

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"

	"github.com/kvhost/kvhost/planner"
)

// The JSON handler of style "vllm", kind "kv" (`kvhost plan`): one decode
// rank's READ from the prefill rank it pulls from.

func init() { registerHandler(StyleVLLM, KindKV, planVLLMKVRequest) }

// vllmKVRequest is the KV request plus vLLM's extras. Its prefill
// and decode fields shadow KVRequest's to add per-side vLLM fields.
type vllmKVRequest struct {
	KVRequest
	Prefill vllmSideJSON `json:"prefill"`
	Decode  vllmSideJSON `json:"decode"`
	// BlockWindowPerLayer is block_window_per_layer: per layer, null (or 0)
	// for global attention or the number of last blocks a local-attention
	// layer reads.
	BlockWindowPerLayer []*int `json:"block_window_per_layer,omitempty"`
	// EnablePermuteLocalKV is kv_transfer_config.enable_permute_local_kv.
	EnablePermuteLocalKV bool `json:"enable_permute_local_kv,omitempty"`
	// PhysicalBlocksPerLogical: kernel blocks per scheduler block (default
	// 1); prefill_pages and decode_pages are then logical blocks.
	PhysicalBlocksPerLogical int `json:"physical_blocks_per_logical,omitempty"`
}

// vllmSideJSON is one side: the fields plus NixlAgentMetadata's
// kv_cache_layout and device_id.
type vllmSideJSON struct {
	KVSideJSON
	KVCacheLayout string `json:"kv_cache_layout,omitempty"` // default "HND"
	DeviceID      uint64 `json:"device_id,omitempty"`
}

func planVLLMKVRequest(raw json.RawMessage) (*planner.Plan, error) {
	r, local, remote, err := vllmFromJSON(raw)
	if err != nil {
		return nil, err
	}
	// What the pull runtime reads: with decode blocks larger than
	// prefill's, a partial prefix hit is aligned to the decode blocks.
	remote = r.AlignRemote(len(local), remote)
	p, err := planNew(r, remote, local)
	if err != nil {
		return nil, vllmJSONError(err)
	}
	return p, nil
}

// vllmFromJSON decodes and checks a request and performs the handshake
// step; it returns the reader and the request's decode and prefill blocks.
func vllmFromJSON(raw json.RawMessage) (*planner.VLLMReader, []int32, []int32, error) {
	var req vllmKVRequest
	if err := DecodeStrict(raw, &req); err != nil {
		return nil, nil, nil, err
	}
	mla, err := req.MLA()
	if err != nil {
		return nil, nil, nil, err
	}
	if req.PageSize < 1 {
		return nil, nil, nil, errorf("page_size", "must be at least 1, got %d", req.PageSize)
	}
	if req.Prepped != nil {
		return nil, nil, nil, errorf("prepped", "only %s has a non-prepped path; vLLM always reads with prepped lists", StyleSGLangNIXL)
	}
	if req.Prefill.BlocksFirst != req.Decode.BlocksFirst {
		return nil, nil, nil, errorf("prefill.blocks_first", "%v differs from decode's %v: both sides run the same attention backend (the compatibility hash covers it)", req.Prefill.BlocksFirst, req.Decode.BlocksFirst)
	}
	if req.PhysicalBlocksPerLogical < 0 {
		return nil, nil, nil, errorf("physical_blocks_per_logical", "must not be negative, got %d", req.PhysicalBlocksPerLogical)
	}
	dec, err := req.Decode.agent("decode", req.PageSize)
	if err != nil {
		return nil, nil, nil, err
	}
	pre, err := req.Prefill.agent("prefill", req.PageSize)
	if err != nil {
		return nil, nil, nil, err
	}
	heads := req.TotalKVHeads
	if heads < 0 {
		return nil, nil, nil, errorf("total_kv_heads", "must not be negative, got %d", heads)
	}
	if heads == 0 {
		heads = req.Prefill.KVHeadNum * req.Prefill.TPSize
	}
	if heads == 0 && !mla {
		return nil, nil, nil, errorf("total_kv_heads", "missing: give total_kv_heads or prefill.kv_head_num")
	}
	local := planner.VLLMDecode{
		Agent:                    dec,
		TPRank:                   req.Decode.TPRank,
		TPSize:                   req.Decode.TPSize,
		MLA:                      mla,
		BlocksFirst:              req.Decode.BlocksFirst,
		TotalKVHeads:             heads,
		EnablePermuteLocalKV:     req.EnablePermuteLocalKV,
		PhysicalBlocksPerLogical: req.PhysicalBlocksPerLogical,
	}
	if req.BlockWindowPerLayer != nil {
		local.BlockWindows = make([]int, len(req.BlockWindowPerLayer))
		for i, w := range req.BlockWindowPerLayer {
			if w != nil {
				local.BlockWindows[i] = *w
			}
		}
	}
	r, err := planner.NewVLLMReader(local, pre, req.Prefill.TPSize)
	if err != nil {
		return nil, nil, nil, vllmJSONError(err)
	}
	if req.Prefill.TPRank != r.RemoteRank() {
		return nil, nil, nil, errorf("prefill.tp_rank", "%d, but decode rank %d reads prefill rank %d (tp_ratio %d)", req.Prefill.TPRank, req.Decode.TPRank, r.RemoteRank(), r.TPRatio())
	}
	remote, err := Pages("prefill_pages", req.PrefillPages)
	if err != nil {
		return nil, nil, nil, err
	}
	localPages, err := Pages("decode_pages", req.DecodePages)
	if err != nil {
		return nil, nil, nil, err
	}
	// Two reads into one decode block would race; vLLM's scheduler never
	// asks for it, so a request that does is a mistake worth naming.
	seen := make(map[int32]int, len(localPages))
	for i, b := range localPages {
		if j, dup := seen[b]; dup {
			return nil, nil, nil, errorf(fmt.Sprintf("decode_pages[%d]", i), "block %d already listed at decode_pages[%d]", b, j)
		}
		seen[b] = i
	}
	return r, localPages, remote, nil
}

// agent converts one side into vLLM agent metadata.
func (s *vllmSideJSON) agent(name string, pageSize int) (planner.VLLMAgent, error) {
	side, err := s.Side(name)
	if err != nil {
		return planner.VLLMAgent{}, err
	}
	if side.StartLayer != 0 {
		return planner.VLLMAgent{}, errorf(name+".start_layer", "vLLM pull plans have no pipeline-parallel layer offset")
	}
	if side.DraftLayersKnown {
		return planner.VLLMAgent{}, errorf(name+".draft_layers", "SGLang only: vLLM registers no decode-only draft layers")
	}
	if side.NumPages > math.MaxInt32 {
		return planner.VLLMAgent{}, errorf(name+".num_pages", "%d blocks exceed the int32 descriptor ids", side.NumPages)
	}
	a := planner.VLLMAgent{
		BaseAddrs:     side.Ptrs,
		BlockLens:     side.ItemLens,
		NumBlocks:     int(side.NumPages),
		BlockSize:     s.BlockSize,
		KVCacheLayout: s.KVCacheLayout,
		DeviceID:      s.DeviceID,
	}
	if a.BlockSize == 0 {
		a.BlockSize = pageSize
	}
	if a.BlockSize < 0 {
		return planner.VLLMAgent{}, errorf(name+".block_size", "must be positive, got %d", a.BlockSize)
	}
	if a.KVCacheLayout == "" {
		a.KVCacheLayout = "HND"
	}
	for i, k := range side.Kinds {
		if k != side.Kinds[0] {
			return planner.VLLMAgent{}, errorf(fmt.Sprintf("%s.mem_kinds[%d]", name, i), "%v differs from %v: vLLM registers every KV region with one memory type", k, side.Kinds[0])
		}
	}
	a.Kind = planner.VRAM // mem_kinds' default
	if len(side.Kinds) > 0 {
		a.Kind = side.Kinds[0]
	}
	return a, nil
}

// vllmJSONFields maps the Go API's field names (vLLM's) onto the request's.
var vllmJSONFields = strings.NewReplacer(
	"kv_caches_base_addr", "kv_ptrs",
	"block_lens", "kv_item_lens",
	"num_blocks", "num_pages",
	"mem_kind", "mem_kinds",
	"total_num_kv_heads", "total_kv_heads",
	"local_block_ids", "decode_pages",
	"remote_block_ids", "prefill_pages",
)

// vllmJSONError renames the field of a planner error to the JSON request's
// name for it.
func vllmJSONError(err error) error {
	if pe, ok := err.(*planner.Error); ok {
		return &planner.Error{Field: vllmJSONFields.Replace(pe.Field), Msg: pe.Msg}
	}
	return err
}
