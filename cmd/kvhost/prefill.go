package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/push/worker"
)

// Flags shared by `kvhost prefill` and `kvhost decode` (and reusable by
// commands that start them): the wire, the model shape, the parallel layout
// and the synthetic workload. Both sides must agree on the shape and the
// workload; each chooses its own TP/PP layout, pages and memory kinds.
func workerFlags(role string) []cli.Flag {
	cat := func(f cli.Flag, c string) cli.Flag {
		switch v := f.(type) {
		case *cli.StringFlag:
			v.Category = c
		case *cli.IntFlag:
			v.Category = c
		case *cli.Uint64Flag:
			v.Category = c
		case *cli.Float64Flag:
			v.Category = c
		case *cli.BoolFlag:
			v.Category = c
		case *cli.StringSliceFlag:
			v.Category = c
		case *cli.GenericFlag:
			v.Category = c
		}
		return f
	}
	env := func(name string) []string { return []string{"KVHOST_" + name} }
	wire := "Wire and plugin:"
	model := "Model shape (same on both sides):"
	par := "Parallel layout (this side):"
	wl := "Synthetic workload (same on both sides):"
	out := "Output:"
	return []cli.Flag{
		cat(&cli.StringFlag{Name: "variant", Value: "nixl", EnvVars: env("WIRE_VARIANT"), Usage: "SGLang control-message layout: nixl or mori"}, wire),
		cat(&cli.StringFlag{Name: "completion", Value: "auto", EnvVars: env("COMPLETION"), Usage: "how completion reaches decode: auto (notifications on the nixl variant when the plugin has them, else status messages), notif or status"}, wire),
		cat(&cli.StringSliceFlag{Name: "agent-param", EnvVars: env(upper(role) + "_AGENT_PARAMS"), Usage: "plugin agent parameter `key=value` (repeatable; env: comma-separated), e.g. caps_off=notif or fail_rate=0.05 for the fake plugin (see kvhost plugins)"}, wire),
		cat(&cli.StringFlag{Name: "host", Value: "127.0.0.1", EnvVars: env("HOST"), Usage: "IP address this worker's sockets bind to and advertise"}, wire),

		cat(&cli.StringFlag{Name: "attention", Value: "mha", EnvVars: env("ATTENTION"), Usage: "mha (K and V, heads split over TP) or mla (one latent per layer, replicated)"}, model),
		cat(&cli.IntFlag{Name: "layers", Value: 8, EnvVars: env("LAYERS"), Usage: "model layers"}, model),
		cat(&cli.IntFlag{Name: "kv-heads", Value: 8, EnvVars: env("KV_HEADS"), Usage: "model KV heads (mha)"}, model),
		cat(&cli.IntFlag{Name: "head-dim", Value: 128, EnvVars: env("HEAD_DIM"), Usage: "elements per head (mla: per latent row)"}, model),
		cat(&cli.IntFlag{Name: "dtype-bytes", Value: 2, EnvVars: env("DTYPE_BYTES"), Usage: "bytes per element"}, model),
		cat(&cli.IntFlag{Name: "page-size", Value: 16, EnvVars: env("PAGE_SIZE"), Usage: "tokens per KV page"}, model),
		cat(&cli.IntFlag{Name: "aux-bytes", Value: 64, EnvVars: env("AUX_BYTES"), Usage: "bytes of one request's aux (metadata) slot"}, model),
		cat(&cli.IntFlag{Name: "pages", EnvVars: env(upper(role) + "_PAGES"), Usage: "KV pages per rank (0: enough for --concurrency requests of --max-tokens)"}, par),
		cat(&cli.StringFlag{Name: "mem-kinds", Value: "vram", EnvVars: env(upper(role) + "_MEM_KINDS"), Usage: "where KV regions are registered: vram, dram or mixed (K vram, V dram; prefill stays homogeneous). The fake plugin treats both as host memory"}, par),
		cat(&cli.IntFlag{Name: "tp-size", Value: 1, EnvVars: env(upper(role) + "_TP_SIZE"), Usage: "attention TP size of this side"}, par),
		cat(&cli.StringFlag{Name: "tp-ranks", EnvVars: env(upper(role) + "_TP_RANKS"), Usage: "TP ranks this process hosts, e.g. 0,1 or 0-3 (default all)"}, par),
		cat(&cli.IntFlag{Name: "pp-size", Value: 1, EnvVars: env(upper(role) + "_PP_SIZE"), Usage: "PP size of this side (decode: equal to prefill's, or 1)"}, par),
		cat(&cli.StringFlag{Name: "pp-ranks", EnvVars: env(upper(role) + "_PP_RANKS"), Usage: "PP ranks this process hosts (default all)"}, par),

		cat(&cli.Uint64Flag{Name: "seed", Value: 1, EnvVars: env("SEED"), Usage: "workload seed: room ids, lengths, prefix hits"}, wl),
		cat(&cli.IntFlag{Name: "requests", Value: 64, EnvVars: env("REQUESTS"), Usage: "requests"}, wl),
		cat(&cli.Uint64Flag{Name: "room-base", EnvVars: env("ROOM_BASE"), Usage: "first room id (0: derived from the seed)"}, wl),
		cat(&cli.IntFlag{Name: "min-tokens", Value: 16, EnvVars: env("MIN_TOKENS"), Usage: "shortest prompt (tokens)"}, wl),
		cat(&cli.IntFlag{Name: "max-tokens", Value: 512, EnvVars: env("MAX_TOKENS"), Usage: "longest prompt (tokens)"}, wl),
		cat(&cli.IntFlag{Name: "chunk-pages", Value: 8, EnvVars: env("CHUNK_PAGES"), Usage: "chunked-prefill chunk size in pages (0: one chunk per request)"}, wl),
		cat(&cli.Float64Flag{Name: "prefix-rate", EnvVars: env("PREFIX_RATE"), Usage: "fraction of requests whose decode side already holds a prefix"}, wl),
		cat(&cli.Float64Flag{Name: "full-hit-rate", EnvVars: env("FULL_HIT_RATE"), Usage: "fraction of those holding the whole prompt (only aux moves)"}, wl),
		cat(&cli.Float64Flag{Name: "abort-rate", EnvVars: env("ABORT_RATE"), Usage: "fraction of requests decode aborts after sending its metadata"}, wl),
		cat(&cli.IntFlag{Name: "concurrency", Value: 16, EnvVars: env("CONCURRENCY"), Usage: "requests in flight per rank"}, wl),

		cat(&cli.StringFlag{Name: "summary", Value: "-", EnvVars: env(upper(role) + "_SUMMARY"), Usage: "write the JSON summary to `FILE` (- for stdout, empty for none)"}, out),
		cat(&cli.StringFlag{Name: "report", EnvVars: env(upper(role) + "_REPORT"), Usage: "write one JSON line per request (room, ok, reason) to `FILE`"}, out),
		cat(&cli.BoolFlag{Name: "no-bytes", EnvVars: env("NO_BYTES"), Usage: "benchmark mode: skip filling (prefill) and checking (decode) the KV bytes; the summary says \"checked\": false"}, out),
	}
}

func upper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'a' && c <= 'z' {
			b[i] = c - 32
		}
	}
	return string(b)
}

// secondsFlag is a duration flag that also takes SGLang's plain seconds
// ("300", "2.5"), so the reference env vars work as its aliases.
func secondsFlag(name, usage string, def time.Duration, envs ...string) *cli.GenericFlag {
	return &cli.GenericFlag{Name: name, Usage: usage + "; plain numbers are seconds, or a duration like 500ms",
		EnvVars: envs, Category: "Runtime (reference defaults):", Value: &push.Seconds{D: def}}
}

// secondsValue reads a secondsFlag.
func secondsValue(c *cli.Context, name string) time.Duration {
	return c.Generic(name).(*push.Seconds).D
}

// parseCommon turns the shared flags into worker options (plugin loaded).
func parseCommon(c *cli.Context) (worker.Common, error) {
	var o worker.Common
	var err error
	if o.Variant, err = push.ParseVariant(c.String("variant")); err != nil {
		return o, err
	}
	if o.Completion, err = push.ParseCompletion(c.String("completion")); err != nil {
		return o, err
	}
	if o.AgentParams, err = plugin.ParseParams(c.StringSlice("agent-param")); err != nil {
		return o, fmt.Errorf("--agent-param: %w", err)
	}
	switch c.String("attention") {
	case "mha":
	case "mla":
		o.Shape.MLA = true
	default:
		return o, fmt.Errorf("--attention: want mha or mla, got %q", c.String("attention"))
	}
	o.Shape.Layers = c.Int("layers")
	o.Shape.KVHeads = c.Int("kv-heads")
	o.Shape.HeadBytes = c.Int("head-dim") * c.Int("dtype-bytes")
	o.Shape.PageSize = c.Int("page-size")
	o.Shape.AuxItemLen = c.Int("aux-bytes")
	o.Shape.Pages = c.Int("pages")
	o.Shape.MemKinds = c.String("mem-kinds")
	o.TPSize, o.PPSize = c.Int("tp-size"), c.Int("pp-size")
	if o.TPSize < 1 || o.PPSize < 1 {
		return o, fmt.Errorf("--tp-size %d, --pp-size %d: must be positive", o.TPSize, o.PPSize)
	}
	if o.TPRanks, err = worker.ParseRanks(c.String("tp-ranks"), o.TPSize); err != nil {
		return o, fmt.Errorf("--tp-ranks: %w", err)
	}
	if o.PPRanks, err = worker.ParseRanks(c.String("pp-ranks"), o.PPSize); err != nil {
		return o, fmt.Errorf("--pp-ranks: %w", err)
	}
	o.Host = c.String("host")
	o.Concurrency = c.Int("concurrency")
	o.NoBytes = c.Bool("no-bytes")
	o.Workload = worker.Workload{
		Seed: c.Uint64("seed"), Requests: c.Int("requests"), RoomBase: c.Uint64("room-base"),
		MinTokens: c.Int("min-tokens"), MaxTokens: c.Int("max-tokens"), ChunkPages: c.Int("chunk-pages"),
		PrefixRate: c.Float64("prefix-rate"), FullHitRate: c.Float64("full-hit-rate"), AbortRate: c.Float64("abort-rate"),
	}
	if err := o.Shape.Check(); err != nil {
		return o, err
	}
	if err := o.Workload.Check(o.Shape.PageSize); err != nil {
		return o, err
	}
	o.Logger = slog.Default()
	o.Plugin, err = plugin.Load(c.String(flagBackend), plugin.SearchDirs(c.String(flagPluginPath)))
	if err != nil {
		return o, fmt.Errorf("load plugin %q: %w", c.String(flagBackend), err)
	}
	return o, nil
}

// signalContext is cancelled by SIGINT or SIGTERM.
func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

// openOutput opens name for writing ("-" is stdout, "" nothing).
func openOutput(c *cli.Context, name string) (io.Writer, func() error, error) {
	switch name {
	case "":
		return nil, func() error { return nil }, nil
	case "-":
		return c.App.Writer, func() error { return nil }, nil
	}
	f, err := os.Create(name)
	if err != nil {
		return nil, nil, err
	}
	return f, f.Close, nil
}

// finish writes the summary and turns the outcome into the exit status.
func finish(c *cli.Context, s *worker.Summary, runErr error) error {
	if s != nil {
		w, closeFn, err := openOutput(c, c.String("summary"))
		if err != nil {
			return fmt.Errorf("--summary: %w", err)
		}
		if w != nil {
			if err := s.WriteJSON(w); err != nil {
				return err
			}
		}
		if err := closeFn(); err != nil {
			return err
		}
	}
	switch {
	case runErr != nil:
		return runErr
	case !s.OKExit():
		return cli.Exit(fmt.Sprintf("%s: %d of %d requests failed unexpectedly, %d with wrong bytes, %d rooms leaked",
			s.Role, s.Unexpected, s.Requests, s.VerifyErrors, s.Leaked), 1)
	}
	return nil
}

func init() { register(prefillCommand) }

// prefillCommand builds `kvhost prefill`.
func prefillCommand() *cli.Command {
	flags := workerFlags("prefill")
	flags = append(flags,
		&cli.StringFlag{Name: "xfer", Value: "batch", EnvVars: []string{"KVHOST_XFER"}, Category: "Wire and plugin:",
			Usage: "how chunks reach the plugin: batch (strided copies over region pairs imported once per peer) or prepped (SGLang NIXL's prepared lists, built once per peer, indexed per chunk)"},
		&cli.IntFlag{Name: "bootstrap-port", Value: 8998, EnvVars: []string{"KVHOST_BOOTSTRAP_PORT"}, Category: "Bootstrap:",
			Usage: "serve the bootstrap server on --host:`PORT` in this process, as SGLang's prefill does (0 picks a free port; see --bootstrap-addr)"},
		&cli.StringFlag{Name: "bootstrap-addr", EnvVars: []string{"KVHOST_BOOTSTRAP_ADDR"}, Category: "Bootstrap:",
			Usage: "register with the bootstrap server at `HOST:PORT` (e.g. a kvhost bootstrap process shared by several prefill processes) instead of serving one"},
		&cli.StringFlag{Name: "bootstrap-addr-file", Category: "Bootstrap:", Usage: "write the bootstrap address actually served to `FILE` (useful with --bootstrap-port 0)"},
		secondsFlag("bootstrap-timeout", "fail a request still Bootstrapping (no decode metadata) after this long",
			push.DefaultBootstrapTimeout, push.EnvBootstrapTimeout[0], push.EnvBootstrapTimeout[1]),
		secondsFlag("transfer-timeout", "optional SLA on one chunk's transfers (0: none); SGLANG_MORI_TRANSFER_TIMEOUT_MS (milliseconds) is read too",
			0, push.EnvTransferTimeout[0]),
		&cli.IntFlag{Name: "queue-size", Value: push.DefaultQueueSize, EnvVars: push.EnvQueueSize[:], Category: "Runtime (reference defaults):",
			Usage: "transfer worker shards (requests go to shard room % N)"},
		&cli.BoolFlag{Name: "mori-aux-rdma", EnvVars: push.EnvMoriAuxRDMA[:], Category: "Runtime (reference defaults):",
			Usage: "mori variant: write aux by RDMA instead of AUX_DATA messages"},
		&cli.DurationFlag{Name: "linger", Category: "Bootstrap:", Usage: "keep serving the bootstrap server this long after the workload ends"},
	)
	return &cli.Command{
		Name:  "prefill",
		Usage: "run a demo prefill worker: synthetic KV pool, push runtime, SGLang-compatible wire",
		UsageText: "kvhost [--backend fake] prefill [--tp-size 2] [--tp-ranks 0,1] [--bootstrap-port 8998]\n" +
			"    [--variant nixl|mori] [--requests N --seed S ...] [--summary FILE]",
		Description: "Runs one or more prefill ranks (--tp-ranks x --pp-ranks) in this process, each with a\n" +
			"synthetic KV pool in host memory registered with the plugin. Every rank registers with the\n" +
			"bootstrap server (served here unless --bootstrap-addr names one) and serves the synthetic\n" +
			"workload: for each request it waits for decode's metadata, fills the tokens decode does not\n" +
			"hold with bytes derived from (request, layer, token, head), and sends them in chunks.\n\n" +
			"The workload (rooms, lengths, chunks, prefix hits, aborts) comes from --seed and must match\n" +
			"the decode side's. Prints a JSON summary; exits 0 only when every request succeeded or was\n" +
			"a planned abort and no room was leaked.",
		Flags:  flags,
		Action: runPrefill,
	}
}

func runPrefill(c *cli.Context) error {
	common, err := parseCommon(c)
	if err != nil {
		return err
	}
	o := worker.PrefillOptions{Common: common}
	if o.XferMode, err = push.ParseXferMode(c.String("xfer")); err != nil {
		return err
	}
	o.Settings = push.Settings{QueueSize: c.Int("queue-size"), MoriAuxRDMA: c.Bool("mori-aux-rdma")}
	o.Settings.BootstrapTimeout = secondsValue(c, "bootstrap-timeout")
	o.Settings.TransferTimeout = secondsValue(c, "transfer-timeout")
	// The SGLang transfer SLA variable is in milliseconds.
	if v, ok := os.LookupEnv(push.EnvTransferTimeout[1]); ok && !c.IsSet("transfer-timeout") {
		d, err := push.ParseSeconds(v, time.Millisecond)
		if err != nil {
			return fmt.Errorf("%s: %w", push.EnvTransferTimeout[1], err)
		}
		o.Settings.TransferTimeout = d
	}
	ctx, cancel := signalContext()
	defer cancel()

	o.BootstrapAddr = c.String("bootstrap-addr")
	if o.BootstrapAddr == "" {
		srv, err := bootstrap.NewServer(bootstrap.WithLogger(slog.Default())).Start(net.JoinHostPort(o.Host, strconv.Itoa(c.Int("bootstrap-port"))))
		if err != nil {
			return fmt.Errorf("serve bootstrap: %w", err)
		}
		defer func() {
			// Decode's heartbeat keeps connections open; do not wait on them.
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			srv.Close(ctx)
		}()
		o.BootstrapAddr = srv.Addr()
	}
	if f := c.String("bootstrap-addr-file"); f != "" {
		if err := os.WriteFile(f, []byte(o.BootstrapAddr+"\n"), 0o644); err != nil {
			return fmt.Errorf("--bootstrap-addr-file: %w", err)
		}
	}
	rep, closeRep, err := openOutput(c, c.String("report"))
	if err != nil {
		return fmt.Errorf("--report: %w", err)
	}
	defer closeRep()
	o.Report = rep
	slog.Info("prefill worker starting", "bootstrap", o.BootstrapAddr, "ranks", len(o.TPRanks)*len(o.PPRanks), "requests", o.Workload.Requests)
	s, runErr := worker.RunPrefill(ctx, o)
	if d := c.Duration("linger"); d > 0 && ctx.Err() == nil {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}
	if s == nil && runErr == nil {
		runErr = errors.New("prefill: no summary")
	}
	return finish(c, s, runErr)
}
