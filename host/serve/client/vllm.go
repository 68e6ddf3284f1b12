package client

import (
	"context"
	"encoding/binary"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// VLLMCompat are vLLM's compatibility hash factors
// (compute_nixl_compatibility_hash in vLLM's
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py).
type VLLMCompat struct {
	VLLMVersion          string
	NixlConnectorVersion int
	Model                string
	DType                string // e.g. "torch.bfloat16"
	NumKVHeads           int
	HeadSize             int
	NumHiddenLayers      int
	AttnBackendName      string
	CacheDType           string
	// Extra are the factors later generations hash, by vLLM's names
	// (version 6: cross_layers_blocks bool, is_hma_enabled bool,
	// speculative_config map or nil).
	Extra Fields
}

// VLLMRank is open_rank's vLLM fields (NixlConnectorWorker's
// register_kv_caches and the engine's config).
type VLLMRank struct {
	Role             string // prefill or decode
	EngineID         string
	TPSize, TPRank   int
	KVCachesBaseAddr []uint64
	RegionLen        uint64
	NumBlocks        int
	BlockSize        int
	KVCacheLayout    string // HND (default) or NHD
	BlocksFirst      bool
	IsMLA            bool
	TotalKVHeads     int
	BlockWindows     []int
	// RegionNames, optional, are the layer of each region of
	// KVCachesBaseAddr (vLLM's kv_caches keys), advertised from version 11.
	RegionNames []string
	Compat      VLLMCompat
	// Prefill: the handshake side channel (host "" : the sidecar's
	// default host; port 0 picks one) and the hold timeout (0: the
	// sidecar's, VLLM_NIXL_ABORT_REQUEST_TIMEOUT or 480 s).
	SideChannelHost string
	SideChannelPort int
	AbortTimeout    time.Duration
	// KVLeaseDuration is the prefill's lease in generations with leases
	// (vLLM's kv_lease_duration; 0: 30 s).
	KVLeaseDuration time.Duration
	// AgentParams override the sidecar's --agent-param for this rank's
	// agent (e.g. num_threads).
	AgentParams map[string]string
}

// OpenVLLM opens a vLLM rank. A prefill rank's Endpoint is the engine's
// side channel once all its TP ranks are open, else "" (an engine_ready
// event follows).
func (c *Client) OpenVLLM(ctx context.Context, r VLLMRank) (Rank, error) {
	f := Fields{
		{"style", "vllm"}, {"role", r.Role}, {"engine_id", r.EngineID},
		{"tp_size", r.TPSize}, {"tp_rank", r.TPRank},
		{"kv_caches_base_addr", r.KVCachesBaseAddr}, {"region_len", r.RegionLen},
		{"num_blocks", r.NumBlocks}, {"block_size", r.BlockSize},
		{"blocks_first", r.BlocksFirst}, {"is_mla", r.IsMLA}, {"total_kv_heads", r.TotalKVHeads},
		{"compat", append(Fields{
			{"vllm_version", r.Compat.VLLMVersion}, {"nixl_connector_version", r.Compat.NixlConnectorVersion},
			{"model", r.Compat.Model}, {"dtype", r.Compat.DType}, {"num_kv_heads", r.Compat.NumKVHeads},
			{"head_size", r.Compat.HeadSize}, {"num_hidden_layers", r.Compat.NumHiddenLayers},
			{"attn_backend_name", r.Compat.AttnBackendName}, {"cache_dtype", r.Compat.CacheDType},
		}, r.Compat.Extra...)},
	}
	if r.KVLeaseDuration > 0 {
		f = append(f, Field{"kv_lease_duration", r.KVLeaseDuration.Seconds()})
	}
	if r.KVCacheLayout != "" {
		f = append(f, Field{"kv_cache_layout", r.KVCacheLayout})
	}
	if r.BlockWindows != nil {
		f = append(f, Field{"block_windows", r.BlockWindows})
	}
	if r.RegionNames != nil {
		f = append(f, Field{"region_names", r.RegionNames})
	}
	if r.SideChannelHost != "" {
		f = append(f, Field{"side_channel_host", r.SideChannelHost})
	}
	if r.SideChannelPort != 0 {
		f = append(f, Field{"side_channel_port", r.SideChannelPort})
	}
	if r.AbortTimeout > 0 {
		f = append(f, Field{"abort_timeout", r.AbortTimeout.Seconds()})
	}
	return c.openRank(ctx, withAgentParams(f, r.AgentParams))
}

// Hold holds a finished request's blocks on the prefill engine (vLLM's
// request_finished) and returns the kv_transfer_params map vLLM puts in
// the response; pass it to the decode's Read as it is.
func (c *Client) Hold(ctx context.Context, engineID, requestID string, blockIDs []int32) (msgpack.Value, error) {
	return c.HoldTokens(ctx, engineID, requestID, blockIDs, -1)
}

// HoldTokens is Hold that also says the request's num_computed_tokens
// (version 6's remote_num_tokens); numTokens < 0 says nothing.
func (c *Client) HoldTokens(ctx context.Context, engineID, requestID string, blockIDs []int32, numTokens int) (msgpack.Value, error) {
	f := Fields{{"engine_id", engineID}, {"request_id", requestID}, {"block_ids", Pages(blockIDs)}}
	if numTokens >= 0 {
		f = append(f, Field{"num_tokens", numTokens})
	}
	v, err := c.call(ctx, "hold", f)
	if err != nil {
		return msgpack.Value{}, err
	}
	p, _ := v.Get("kv_transfer_params")
	return p, nil
}

// Release frees a held request at once (the engine aborted it).
func (c *Client) Release(ctx context.Context, engineID, requestID string) error {
	_, err := c.call(ctx, "release", Fields{{"engine_id", engineID}, {"request_id", requestID}})
	return err
}

// Read starts pulling a request's KV into blockIDs of a decode rank
// (vLLM's start_load_kv); a read event reports how it ended. params is
// the kv_transfer_params map (from Hold, or any msgpack map).
func (c *Client) Read(ctx context.Context, rank uint64, requestID string, params msgpack.Value, blockIDs []int32) error {
	c.vllm.track(rank, requestID, blockIDs)
	_, err := c.call(ctx, "read", Fields{{"rank", rank}, {"request_id", requestID}, {"kv_transfer_params", params},
		{"block_ids", Pages(blockIDs)}})
	if err != nil {
		c.vllm.untrack(rank, requestID)
	}
	return err
}

// ReadEvent is a read event: how one decode read ended.
type ReadEvent struct {
	Rank      uint64
	RequestID string
	OK        bool
	// InvalidBlocks are the local blocks that did not load (vLLM's
	// get_block_ids_with_load_errors).
	InvalidBlocks []int32
	Reason        string
	Bytes         uint64
	Seconds       float64
}

// AsRead decodes a read event.
func (e Event) AsRead() (ReadEvent, bool) {
	if e.Name != "read" {
		return ReadEvent{}, false
	}
	r := ReadEvent{Rank: e.Rank, RequestID: str(e.Raw, "request_id"), Reason: e.Reason}
	if x, ok := e.Raw.Get("ok"); ok {
		r.OK, _ = x.Bool()
	}
	if x, ok := e.Raw.Get("invalid_blocks"); ok {
		b, _ := x.Bin()
		for i := 0; i+4 <= len(b); i += 4 {
			r.InvalidBlocks = append(r.InvalidBlocks, int32(binary.LittleEndian.Uint32(b[i:])))
		}
	}
	r.Bytes, _ = u64(e.Raw, "bytes")
	if x, ok := e.Raw.Get("seconds"); ok {
		r.Seconds, _ = x.Float()
	}
	return r, true
}

// ReleasedEvent is a released event: the prefill stopped holding a
// request ("notified", "timeout", "aborted" or "closed").
type ReleasedEvent struct {
	EngineID, RequestID, Reason string
}

// AsReleased decodes a released event.
func (e Event) AsReleased() (ReleasedEvent, bool) {
	if e.Name != "released" {
		return ReleasedEvent{}, false
	}
	return ReleasedEvent{EngineID: str(e.Raw, "engine_id"), RequestID: str(e.Raw, "request_id"), Reason: e.Reason}, true
}

// AsEngineReady decodes an engine_ready event: the engine's side channel.
func (e Event) AsEngineReady() (engineID, endpoint string, ok bool) {
	if e.Name != "engine_ready" {
		return "", "", false
	}
	return str(e.Raw, "engine_id"), str(e.Raw, "endpoint"), true
}

// vllmTrack remembers the reads in flight, so that a connection lost
// fails them (read events not ok, reason ReasonConnectionLost, Local).
type vllmTrack struct {
	mu    sync.Mutex
	reads map[vllmRead][]int32 // the local blocks
	lost  bool
}

type vllmRead struct {
	rank uint64
	id   string
}

func (t *vllmTrack) track(rank uint64, id string, blocks []int32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lost {
		return
	}
	if t.reads == nil {
		t.reads = make(map[vllmRead][]int32)
	}
	t.reads[vllmRead{rank, id}] = append([]int32(nil), blocks...)
}

func (t *vllmTrack) untrack(rank uint64, id string) {
	t.mu.Lock()
	delete(t.reads, vllmRead{rank, id})
	t.mu.Unlock()
}

// vllmEvent untracks the read a read event finishes.
func (c *Client) vllmEvent(e Event) {
	if e.Name == "read" {
		c.vllm.untrack(e.Rank, str(e.Raw, "request_id"))
	}
}

// vllmLost makes up the failed read events of the reads in flight when
// the connection dropped (before the event queue closes).
func (c *Client) vllmLost() {
	c.vllm.mu.Lock()
	reads := c.vllm.reads
	c.vllm.reads = nil
	c.vllm.lost = true
	c.vllm.mu.Unlock()
	for r, blocks := range reads {
		var e msgpack.Encoder
		e.MapHeader(6)
		e.Str("event")
		e.Str("read")
		e.Str("rank")
		e.Uint(r.rank)
		e.Str("request_id")
		e.Str(r.id)
		e.Str("ok")
		e.Bool(false)
		e.Str("invalid_blocks")
		e.Bin(Pages(blocks))
		e.Str("reason")
		e.Str(ReasonConnectionLost)
		raw, _ := msgpack.Decode(e.Bytes())
		c.events.push(Event{Name: "read", Rank: r.rank, Reason: ReasonConnectionLost, Raw: raw, Local: true})
	}
}

// Watch asks a decode rank to renew the prefill's lease of a request
// queued for a later Read (versions with leases; vLLM's on_new_request).
func (c *Client) Watch(ctx context.Context, rank uint64, requestID string, params msgpack.Value) error {
	_, err := c.call(ctx, "watch", Fields{{"rank", rank}, {"request_id", requestID}, {"kv_transfer_params", params}})
	return err
}

// Unwatch stops renewing it (the request finished or was aborted).
func (c *Client) Unwatch(ctx context.Context, rank uint64, requestID string) error {
	_, err := c.call(ctx, "unwatch", Fields{{"rank", rank}, {"request_id", requestID}})
	return err
}
