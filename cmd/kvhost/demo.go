package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/kvhost/kvhost/host/demo"
	"github.com/kvhost/kvhost/host/metrics"
)

func init() { register(demoCommand) }

// demoCommand builds `kvhost demo`.
func demoCommand() *cli.Command {
	d := demo.Defaults()
	return &cli.Command{
		Name:  "demo",
		Usage: "run prefill and decode workers on a realistic synthetic workload and verify every byte",
		UsageText: "kvhost [--backend fake] demo [--style sglang|vllm] [--attention mha|mla] [--prefill-tp 2]\n" +
			"    [--decode-tp 4] [--requests 300] [--in-process [--metrics-addr HOST:PORT]] [--json]",
		Description: "Runs a disaggregated deployment on this machine and moves a synthetic workload's KV cache\n" +
			"through the transfer plugin chosen with --backend: a prefill worker hosting every prefill TP\n" +
			"rank and one decode worker per decode TP rank, each a separate kvhost process (plus a kvhost\n" +
			"bootstrap process with --style sglang), or goroutines of this process with --in-process. Every\n" +
			"decode rank checks every byte it received against a formula that knows nothing of transfer\n" +
			"plans. A progress bar (stderr, on a terminal) counts requests verified; at the end a summary\n" +
			"says: requests ok and failed, bytes moved and verified, GB/s, transfer latency p50/p99,\n" +
			"descriptors per request, this machine's raw memcpy rate measured in the same run, and how long\n" +
			"the workers' threads ran and waited, runnable, for a core over the requests phase (the kernel's\n" +
			"per-thread schedstat; summed over the worker processes) (--json: the same as JSON, with every\n" +
			"worker's own summary).\n\n" +
			"The default is a small Llama-like MHA model (16 layers, 8 KV heads of 128 bf16 elements),\n" +
			"prefill TP 2 -> decode TP 4, 16-token pages, 300 requests of 16..512 tokens with random page\n" +
			"allocations, chunked prefill of 8 pages, on the fake plugin. --style sglang moves KV the SGLang\n" +
			"way (prefill WRITEs into decode; bootstrap server, ZMQ control messages); --style vllm the vLLM\n" +
			"NIXL connector's way (decode READs after a handshake; the prefill's HTTP API stands in for the\n" +
			"proxy). The workers' logs, summaries and per-request reports stay in --work-dir if given; a\n" +
			"failing worker's last log lines are in the summary.\n\n" +
			"The KV pools are host memory, registered as VRAM when the plugin accepts that (the fake does)\n" +
			"and as DRAM otherwise (nixl: UCX checks the memory's real type); --mem-kinds chooses. SGLang's\n" +
			"NIXL connector moves heterogeneous-TP MHA KV only into VRAM, so on DRAM pools the sglang style\n" +
			"needs equal TP sizes or --attention mla (the vllm style takes any decode TP >= prefill TP).\n\n" +
			"Exits 0 only when every request was verified on every decode rank.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "style", Value: d.Style, EnvVars: env("STYLE"), Usage: "sglang (push) or vllm (pull)"},
			&cli.StringFlag{Name: "attention", Value: d.Attention, EnvVars: env("ATTENTION"), Usage: "mha (K and V, heads split over TP) or mla (one latent per layer, replicated)"},
			&cli.IntFlag{Name: "prefill-tp", EnvVars: env("PREFILL_TP_SIZE"), Value: d.PrefillTP, Usage: "prefill TP size (one process hosts every prefill rank)"},
			&cli.IntFlag{Name: "decode-tp", EnvVars: env("DECODE_TP_SIZE"), Value: d.DecodeTP, Usage: "decode TP size (one process per decode rank)"},
			&cli.IntFlag{Name: "requests", Value: d.Requests, EnvVars: env("REQUESTS"), Usage: "requests in the workload"},
			&cli.Uint64Flag{Name: "seed", Value: d.Seed, EnvVars: env("SEED"), Usage: "workload seed: request ids, lengths, page allocations"},
			&cli.IntFlag{Name: "layers", Value: d.Layers, EnvVars: env("LAYERS"), Usage: "model layers"},
			&cli.IntFlag{Name: "kv-heads", Value: d.KVHeads, EnvVars: env("KV_HEADS"), Usage: "model KV heads in total (mha; with --style vllm mla too: vLLM's compatibility hash counts them)"},
			&cli.IntFlag{Name: "head-dim", Value: d.HeadDim, EnvVars: env("HEAD_DIM"), Usage: "elements per head (mla: per latent row)"},
			&cli.IntFlag{Name: "dtype-bytes", Value: d.DTypeBytes, EnvVars: env("DTYPE_BYTES"), Usage: "bytes per element: 1, 2 or 4"},
			&cli.IntFlag{Name: "page-size", Value: d.PageSize, EnvVars: env("PAGE_SIZE"), Usage: "tokens per KV page"},
			&cli.IntFlag{Name: "min-tokens", Value: d.MinTokens, EnvVars: env("MIN_TOKENS"), Usage: "shortest prompt (tokens)"},
			&cli.IntFlag{Name: "max-tokens", Value: d.MaxTokens, EnvVars: env("MAX_TOKENS"), Usage: "longest prompt (tokens)"},
			&cli.IntFlag{Name: "chunk-pages", Value: d.ChunkPages, EnvVars: env("CHUNK_PAGES"), Usage: "chunked-prefill chunk size in pages (sglang style; 0: one chunk per request)"},
			&cli.IntFlag{Name: "concurrency", Value: d.Concurrency, EnvVars: env("CONCURRENCY"), Usage: "requests in flight per worker rank"},
			&cli.StringFlag{Name: "mem-kinds", EnvVars: env("DEMO_MEM_KINDS"), Usage: "register the KV pools as vram, dram or (sglang) mixed: K vram, V dram on decode " +
				"(default: vram when the plugin accepts host memory as VRAM, as the fake does; dram otherwise, e.g. NIXL over UCX)"},
			&cli.StringSliceFlag{Name: "agent-param", EnvVars: env("AGENT_PARAMS"), Usage: "plugin agent parameter `key=value` for every worker (repeatable), e.g. caps_off=notif; the workers that post the transfers get num_threads=4 where the plugin takes it (nixl) unless given"},
			&cli.BoolFlag{Name: "in-process", EnvVars: env("DEMO_IN_PROCESS"), Usage: "run every worker in this process instead of separate processes"},
			&cli.StringFlag{Name: "metrics-addr", EnvVars: env("METRICS_ADDR"), Usage: "with --in-process: serve the workers' Prometheus /metrics and /health on `HOST:PORT` " +
				"(separate workers: run kvhost prefill/decode --metrics-addr yourself)"},
			&cli.StringFlag{Name: "work-dir", EnvVars: env("DEMO_WORK_DIR"), Usage: "keep the workers' summaries, request reports and logs in `DIR` (default: a temporary folder, removed)"},
			&cli.DurationFlag{Name: "timeout", EnvVars: env("DEMO_TIMEOUT"), Value: d.Timeout, Usage: "give up after this long"},
			&cli.BoolFlag{Name: "verbose", EnvVars: env("DEMO_VERBOSE"), Usage: "show the workers' logs (stderr) as they run"},
			&cli.BoolFlag{Name: "json", EnvVars: env("DEMO_JSON"), Usage: "print the summary as JSON (no progress bar)"},
		},
		Action: runDemo,
	}
}

func runDemo(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("demo: unexpected argument %q", c.Args().First())
	}
	cfg := demo.Config{
		Style: c.String("style"), Attention: c.String("attention"),
		PrefillTP: c.Int("prefill-tp"), DecodeTP: c.Int("decode-tp"),
		Layers: c.Int("layers"), KVHeads: c.Int("kv-heads"), HeadDim: c.Int("head-dim"), DTypeBytes: c.Int("dtype-bytes"),
		PageSize: c.Int("page-size"), Requests: c.Int("requests"), Seed: c.Uint64("seed"),
		MinTokens: c.Int("min-tokens"), MaxTokens: c.Int("max-tokens"), ChunkPages: c.Int("chunk-pages"),
		Concurrency: c.Int("concurrency"), MemKinds: c.String("mem-kinds"), Plugin: c.String(flagBackend), PluginPath: c.String(flagPluginPath),
		AgentParams: c.StringSlice("agent-param"), InProcess: c.Bool("in-process"), WorkDir: c.String("work-dir"),
		Timeout: c.Duration("timeout"), Log: slog.Default(),
	}
	if c.Bool("verbose") {
		cfg.WorkerLog = os.Stderr
	}
	ctx, stop := signalContext(c)
	defer stop()
	if addr := c.String("metrics-addr"); addr != "" {
		if !cfg.InProcess {
			return errors.New("demo: --metrics-addr needs --in-process (separate workers serve their own)")
		}
		m, srv, err := metrics.Start(ctx, addr, map[string]string{"role": "demo"})
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		defer srv.Close()
		m.SetReady(true)
		cfg.Metrics = m
		slog.Info("demo metrics", "url", "http://"+srv.Addr()+"/metrics")
	}
	if !cfg.InProcess {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("demo: locating this binary for the worker processes: %w", err)
		}
		cfg.Exe = exe
	}
	var bar *progressbar.ProgressBar
	if !c.Bool("json") && !c.Bool("verbose") && term.IsTerminal(int(os.Stderr.Fd())) {
		bar = progressbar.NewOptions(cfg.Requests*cfg.DecodeTP,
			progressbar.OptionSetWriter(os.Stderr),
			progressbar.OptionSetDescription("requests verified (all decode ranks)"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionClearOnFinish(),
			progressbar.OptionSetWidth(30),
		)
		cfg.Progress = func(done, total int) {
			if total != bar.GetMax() {
				bar.ChangeMax(total)
			}
			bar.Set(done)
		}
	}
	s, err := demo.Run(ctx, cfg)
	if bar != nil {
		bar.Finish()
	}
	if err != nil {
		return err
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		if err := enc.Encode(s); err != nil {
			return err
		}
	} else if err := s.WriteText(c.App.Writer); err != nil {
		return err
	}
	if !s.Success() {
		return fmt.Errorf("demo: %d of %d requests not verified on every decode rank", s.Requests-s.OK, s.Requests)
	}
	return nil
}
