// Package pullworker runs vLLM-style prefill and decode workers over
// synthetic KV caches (host/demo/kvpool), moving KV with the pull runtime
// (host/pull). It is what `kvhost prefill --style vllm` and `kvhost decode
// --style vllm` run, and what the two-process end-to-end tests drive.
//
// The flow is vLLM's disaggregated serving with a toy proxy folded into the
// decode worker:
//
//  1. The decode worker generates the workload from a seed (request ids,
//     prompt lengths, prefix hits; Workload) and, for each request, asks
//     the prefill worker's HTTP API to prefill it (POST /kvhost/v1/prefill
//     with {"request_id", "num_tokens", "kv_transfer_params":
//     {"do_remote_decode": true}}).
//  2. The prefill allocates random blocks, fills them on every TP rank with
//     bytes derived from (request, layer, K/V, token, head) (kvpool.Fill),
//     holds them (pull.Sender.Hold) and answers with vLLM's
//     kv_transfer_params.
//  3. The decode allocates its own blocks, fills the prefix-hit ones
//     locally, pulls the rest on each of its TP ranks (pull.Receiver.Load),
//     and checks every byte of every token on every rank (kvpool.Verify),
//     which knows nothing of transfer plans.
//  4. The prefill frees the blocks once every decode reader notified, or
//     when the abort timeout expires.
//
// Both print a JSON summary the demo command aggregates.
package pullworker

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// What a synthetic worker's model claims in the compatibility hash unless
// told otherwise: a vLLM peer must claim the same to pair with it.
const (
	DefaultModelName   = "kvhost/synthetic-llama"
	DefaultVLLMVersion = "0.13.0"
	DefaultCacheDType  = "auto"
)

// Model is what both engines share: the facts of the compatibility hash and
// the KV cache shape per layer.
type Model struct {
	// Name is the model name (a compatibility hash factor).
	Name string
	// VLLMVersion is the vLLM version the hash claims (a factor).
	VLLMVersion string
	// DType is the model dtype: bfloat16, float16, float32 or float8_e4m3fn.
	DType string
	// CacheDType is the KV cache dtype (a factor), "auto" for the model's.
	CacheDType string
	// AttnBackend is the attention backend name (a factor); empty picks
	// FLASH_ATTN, FLASHINFER for blocks-first, FLASHMLA for MLA.
	AttnBackend string
	MLA         bool
	// BlocksFirst is FlashInfer's layout: K and V of a block together.
	BlocksFirst bool
	Layers      int
	// KVHeads is the model's total KV head count (vLLM's
	// model_config.get_total_num_kv_heads()), MLA included: vLLM hashes it
	// (DeepSeek-V3: 128) although an MLA cache holds one latent head per
	// rank, and the cache geometry ignores it for MLA.
	KVHeads int
	// HeadDim is elements per head (MLA: the latent width, e.g. 576).
	HeadDim int
}

// DTypeBytes returns the bytes of one element of dtype.
func DTypeBytes(dtype string) (int, error) {
	switch dtype {
	case "bfloat16", "float16":
		return 2, nil
	case "float32":
		return 4, nil
	case "float8_e4m3fn", "float8_e5m2":
		return 1, nil
	}
	return 0, fmt.Errorf("dtype %q: want bfloat16, float16, float32, float8_e4m3fn or float8_e5m2", dtype)
}

// DTypeOfBytes names the usual model dtype with elements of n bytes:
// float8_e4m3fn, bfloat16 or float32.
func DTypeOfBytes(n int) (string, error) {
	switch n {
	case 1:
		return "float8_e4m3fn", nil
	case 2:
		return "bfloat16", nil
	case 4:
		return "float32", nil
	}
	return "", fmt.Errorf("%d-byte elements: want 1, 2 or 4", n)
}

// Validate reports the first unusable field.
func (m Model) Validate() error {
	if _, err := DTypeBytes(m.DType); err != nil {
		return err
	}
	switch {
	case m.Name == "":
		return errors.New("model name is empty")
	case m.Layers <= 0:
		return fmt.Errorf("layers %d must be positive", m.Layers)
	case m.HeadDim <= 0:
		return fmt.Errorf("head dim %d must be positive", m.HeadDim)
	case m.KVHeads <= 0:
		return fmt.Errorf("KV heads %d must be positive", m.KVHeads)
	case m.MLA && m.BlocksFirst:
		return errors.New("MLA has no K/V halves: blocks-first does not apply")
	}
	return nil
}

// HeadBytes is the bytes of one head of one token.
func (m Model) HeadBytes() int {
	b, _ := DTypeBytes(m.DType)
	return b * m.HeadDim
}

// Backend is the attention backend name used in the hash.
func (m Model) Backend() string {
	switch {
	case m.AttnBackend != "":
		return m.AttnBackend
	case m.MLA:
		return "FLASHMLA"
	case m.BlocksFirst:
		return "FLASHINFER"
	}
	return "FLASH_ATTN"
}

// CompatHash is vLLM's compatibility hash of the model. Its KV heads are
// the model's total for MLA too: vLLM's compute_nixl_compatibility_hash
// (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py) takes
// model_config.get_total_num_kv_heads(), which has no MLA case (only the
// per-rank get_num_kv_heads returns 1 for MLA).
func (m Model) CompatHash() string {
	return vllm.CompatibilityHash(vllm.CompatFactors{
		VLLMVersion:      m.VLLMVersion,
		ConnectorVersion: vllm.ConnectorVersion,
		Model:            m.Name,
		DType:            "torch." + m.DType,
		NumKVHeads:       m.KVHeads,
		HeadSize:         m.HeadDim,
		NumHiddenLayers:  m.Layers,
		AttnBackendName:  m.Backend(),
		CacheDType:       m.CacheDType,
	})
}

// Engine is one engine's parallelism and cache: what may differ between
// prefill and decode.
type Engine struct {
	TPSize    int
	BlockSize int // tokens per block
	NumBlocks int // blocks per rank
	Layout    string
}

// DefaultNumBlocks sizes a synthetic cache when none is given: room for
// twice concurrency requests of maxTokens, and at least 64 blocks.
func DefaultNumBlocks(maxTokens, blockSize, concurrency int) int {
	per := (maxTokens + blockSize - 1) / max(blockSize, 1)
	return max(64, 2*concurrency*per)
}

// Validate reports the first unusable field.
func (e Engine) Validate() error {
	switch {
	case e.TPSize <= 0:
		return fmt.Errorf("TP size %d must be positive", e.TPSize)
	case e.BlockSize <= 0:
		return fmt.Errorf("block size %d must be positive", e.BlockSize)
	case e.NumBlocks <= 0:
		return fmt.Errorf("num blocks %d must be positive", e.NumBlocks)
	case e.Layout != pull.LayoutHND && e.Layout != pull.LayoutNHD:
		return fmt.Errorf("KV layout %q: want HND or NHD", e.Layout)
	}
	return nil
}

// ParseLayout accepts hnd/nhd in any case.
func ParseLayout(s string) (string, error) {
	switch l := strings.ToUpper(s); l {
	case pull.LayoutHND, pull.LayoutNHD:
		return l, nil
	}
	return "", fmt.Errorf("KV layout %q: want HND or NHD", s)
}

// geometry is rank's synthetic pool geometry.
func geometry(m Model, e Engine, rank int) kvpool.Geometry {
	g := kvpool.Geometry{
		Attention:  kvpool.MHA,
		Order:      kvpool.Interleaved,
		HeadMajor:  e.Layout == pull.LayoutHND,
		Layers:     m.Layers,
		Pages:      e.NumBlocks,
		PageSize:   e.BlockSize,
		TotalHeads: m.KVHeads,
		TPSize:     e.TPSize,
		TPRank:     rank,
		HeadBytes:  m.HeadBytes(),
	}
	if m.MLA {
		g.Attention = kvpool.MLA
	}
	if m.BlocksFirst {
		g.Order = kvpool.BlocksFirst
	}
	return g
}

// cacheOf describes a pool's memory as the pull runtime registers it.
func cacheOf(p *kvpool.Pool, e Engine, kind abi.MemKind) pull.Cache {
	mem := p.Bytes()
	base := p.Regions()[0].Addr
	c := pull.Cache{NumBlocks: e.NumBlocks, BlockSize: e.BlockSize, Layout: e.Layout, Kind: kind}
	for _, r := range p.Regions() {
		c.Regions = append(c.Regions, pull.Region{Addr: r.Addr, Len: r.Len})
		off := r.Addr - base
		c.Host = append(c.Host, mem[off:off+r.Len:off+r.Len])
	}
	return c
}
