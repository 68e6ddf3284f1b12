// Package demo runs kvhost's end-to-end demonstration: a prefill deployment
// and a decode deployment moving a synthetic workload's KV cache through a
// transfer plugin, with every byte verified on decode by host/demo/kvpool's
// independent check, summarised for a person at a glance.
//
// Two styles, as the workers offer them: "sglang" (the push runtime: a
// bootstrap server, prefill WRITEs into decode, package
// host/demo/pushworker) and "vllm" (the pull runtime: decode READs from
// prefill after a handshake, package host/demo/pullworker). By default
// every part runs as its own process
// (kvhost bootstrap, kvhost prefill hosting every prefill TP rank, one kvhost
// decode per decode TP rank), as a deployment would; InProcess runs the same
// workers as goroutines of this process.
//
// The workers report JSON summaries and one line per request; Run reads
// them and adds this machine's raw memcpy rate, measured in the same run
// with blocks of the average transfer's size, for scale.
//
// host/demo is kvhost's one demo tree: this package, kvpool (the synthetic
// KV pool and its byte check), synth (what both workers share), pushworker
// and pullworker (the demo-grade workers of each style). The runtimes
// (host/push, host/pull) import none of them.
package demo

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/metrics"
)

// Config is one demo run.
type Config struct {
	Style     string // "sglang" (push, default) or "vllm" (pull)
	Attention string // "mha" (default) or "mla"

	PrefillTP, DecodeTP int

	// The model: Layers, KV heads (MHA), elements per head (MLA: the
	// latent row) and bytes per element; tokens per KV page (block).
	Layers, KVHeads, HeadDim, DTypeBytes, PageSize int

	// The workload: Requests with prompt lengths uniform in
	// [MinTokens, MaxTokens] from Seed; sglang sends them in chunks of
	// ChunkPages pages (chunked prefill); Concurrency requests in flight per
	// worker.
	Requests             int
	Seed                 uint64
	MinTokens, MaxTokens int
	ChunkPages           int
	Concurrency          int

	// MemKinds is the memory kind the workers register their KV pools as:
	// "vram", "dram" or (sglang only) "mixed" (K VRAM, V DRAM on decode).
	// The pools are host memory either way; "" picks VRAM when the plugin
	// accepts host memory registered as VRAM (the fake does: it models GPU
	// pools) and DRAM when it refuses it (NIXL's UCX checks the memory's
	// real type, and without CUDA cannot register VRAM at all).
	MemKinds string
	kindsWhy string // why Run chose MemKinds, for kindsErr

	Plugin      string   // plugin name, e.g. "fake"
	PluginPath  string   // plugin search folders (colon-separated), "" for the default
	AgentParams []string // "key=value" agent parameters for every worker

	// InProcess runs every worker in this process.
	InProcess bool
	// Exe is the kvhost binary the processes run (separate processes only).
	Exe string
	// WorkDir holds the workers' summaries, reports and logs (separate
	// processes only); "" makes a temporary one, removed afterwards.
	WorkDir string
	// Timeout bounds the whole run (0: 10 minutes).
	Timeout time.Duration
	// MemcpyTime is how long the raw memcpy measurement after the run
	// takes (0: 300 ms).
	MemcpyTime time.Duration

	// Metrics, when set, sees every worker's runtime events (in-process
	// only: separate processes serve their own with --metrics-addr).
	Metrics *metrics.Metrics
	// Progress, when set, is called as decode ranks finish requests: done
	// of total (Requests x DecodeTP).
	Progress func(done, total int)
	// Log receives the demo's own messages (nil: slog.Default()).
	Log *slog.Logger
	// WorkerLog, when set, receives the workers' logs (processes: their
	// stderr; in-process: their slog output). Otherwise they are kept and
	// shown only when something fails.
	WorkerLog io.Writer
}

// Defaults is the README's demo: a small Llama-like MHA model (16 layers, 8
// KV heads of 128 bf16 elements), prefill TP 2 to decode TP 4, 16-token
// pages, 300 requests of 16 to 512 tokens, chunked by 8 pages, on the fake
// plugin.
func Defaults() Config {
	return Config{
		Style: "sglang", Attention: "mha", PrefillTP: 2, DecodeTP: 4,
		Layers: 16, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, PageSize: 16,
		Requests: 300, Seed: 1, MinTokens: 16, MaxTokens: 512, ChunkPages: 8, Concurrency: 16,
		Plugin: "fake", Timeout: 10 * time.Minute,
	}
}

// Validate reports the first unusable field.
func (c *Config) Validate() error {
	switch {
	case c.Style != "sglang" && c.Style != "vllm":
		return fmt.Errorf("demo: style %q: want sglang or vllm", c.Style)
	case c.Attention != "mha" && c.Attention != "mla":
		return fmt.Errorf("demo: attention %q: want mha or mla", c.Attention)
	case c.PrefillTP < 1 || c.DecodeTP < 1 || c.PrefillTP > 64 || c.DecodeTP > 64:
		return fmt.Errorf("demo: TP sizes must be 1..64 (prefill %d, decode %d)", c.PrefillTP, c.DecodeTP)
	case c.Style == "vllm" && c.DecodeTP < c.PrefillTP:
		// vLLM's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py
		// raises this for every request (it reads from one or more prefill
		// ranks, never merges).
		return fmt.Errorf("demo: vllm style: decode TP %d is smaller than prefill TP %d; vLLM's NIXL connector needs decode TP >= prefill TP", c.DecodeTP, c.PrefillTP)
	case c.MemKinds != "" && c.MemKinds != "vram" && c.MemKinds != "dram" && c.MemKinds != "mixed":
		return fmt.Errorf("demo: memory kinds %q: want vram, dram or mixed", c.MemKinds)
	case c.Style == "vllm" && c.MemKinds == "mixed":
		return errors.New("demo: vllm style: vLLM registers every KV region with one memory type, want vram or dram")
	case c.MemKinds != "" && c.kindsErr() != nil:
		return c.kindsErr()
	case c.Requests < 1:
		return fmt.Errorf("demo: requests must be at least 1, got %d", c.Requests)
	case c.Layers < 1 || c.HeadDim < 1 || c.PageSize < 1 || c.Concurrency < 1:
		return errors.New("demo: layers, head dim, page size and concurrency must be positive")
	case c.Attention == "mha" && c.KVHeads < 1:
		return errors.New("demo: MHA needs at least one KV head")
	case c.DTypeBytes != 1 && c.DTypeBytes != 2 && c.DTypeBytes != 4:
		return fmt.Errorf("demo: dtype bytes %d: want 1, 2 or 4", c.DTypeBytes)
	case c.MinTokens < 1 || c.MaxTokens < c.MinTokens:
		return fmt.Errorf("demo: token range [%d, %d] is empty", c.MinTokens, c.MaxTokens)
	case c.ChunkPages < 0:
		return fmt.Errorf("demo: chunk pages %d must not be negative", c.ChunkPages)
	case c.Plugin == "":
		return errors.New("demo: no plugin")
	case !c.InProcess && c.Exe == "":
		return errors.New("demo: separate processes need the kvhost binary (Exe)")
	case !c.InProcess && c.Metrics != nil:
		return errors.New("demo: Metrics observes in-process workers only")
	}
	// Checked here so that a bad shape stops the demo before any worker
	// starts (each would refuse it on its own, one by one).
	if c.Attention == "mha" {
		for _, side := range []struct {
			name string
			tp   int
		}{{"prefill", c.PrefillTP}, {"decode", c.DecodeTP}} {
			if err := kvpool.CheckHeadSplit(c.KVHeads, side.tp); err != nil {
				return fmt.Errorf("demo: %s: %w (TP must divide the KV heads or be a multiple of them)", side.name, err)
			}
		}
	}
	return nil
}

// kindsErr refuses what SGLang's NIXL connector refuses for every request
// (and the push workers with it): heterogeneous-TP MHA into decode pools
// that are not all VRAM (its head-sliced path writes VRAM only).
func (c *Config) kindsErr() error {
	if c.Style == "sglang" && c.Attention == "mha" && c.PrefillTP != c.DecodeTP && c.MemKinds != "vram" {
		return fmt.Errorf("demo: sglang style, MHA, prefill TP %d -> decode TP %d needs VRAM decode pools "+
			"(SGLang's NIXL connector does not move heterogeneous-TP KV into host memory), and the pools are %s%s; "+
			"use equal TP sizes, --attention mla or --style vllm", c.PrefillTP, c.DecodeTP, c.MemKinds, c.kindsWhy)
	}
	return nil
}

// ranks is the number of decode ranks reporting each request.
func (c *Config) total() int { return c.Requests * c.DecodeTP }
