package main

// What `kvhost prefill` and `kvhost decode` share: the --style switch, the
// flags of both styles and their parsing. prefill.go and decode.go build
// their commands from these and add their own flags.
//
// A flag belongs to a style by its category: flags in a category named
// "sglang style..." only apply to --style sglang, "vllm style..." only to
// --style vllm, every other one to both. dispatch refuses a flag of the
// other style, so nothing given is silently ignored.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/metrics"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
)

// The two styles of pushworker.
const (
	styleSGLang = "sglang"
	styleVLLM   = "vllm"
)

// Flag categories. The style ones start with the style's name (see
// styleOfCategory); the others apply to both styles. urfave/cli lists
// categories in byte order, so the shared ones (capitalised) come first.
const (
	catModel    = "Model shape (same on both sides):"
	catLayout   = "Parallel layout and memory (this side):"
	catNetwork  = "Plugin and network (this side):"
	catWorkload = "Synthetic workload (same on both sides):"
	catOutput   = "Output:"

	catSGLangWire    = "sglang style, bootstrap and wire:"
	catSGLangRuntime = "sglang style, runtime (SGLang's defaults; its variables are aliases):"
	catSGLangWork    = "sglang style, layout and workload:"
	catVLLM          = "vllm style:"
)

// styleOfCategory returns the style a category's flags belong to, "" for
// both.
func styleOfCategory(cat string) string {
	for _, s := range []string{styleSGLang, styleVLLM} {
		if strings.HasPrefix(cat, s+" style") {
			return s
		}
	}
	return ""
}

// roleEnv names a variable per role, e.g. KVHOST_PREFILL_TP_SIZE, for the
// flags a prefill and a decode started from one environment set apart.
func roleEnv(role, name string) []string {
	return env(strings.ToUpper(role) + "_" + name)
}

// secondsFlag is a duration flag that also takes plain seconds ("300",
// "2.5"), as SGLang's and vLLM's variables give them, so those variables
// work as its aliases.
func secondsFlag(cat, name, usage string, def time.Duration, envs ...string) *cli.GenericFlag {
	return &cli.GenericFlag{Name: name, Category: cat, EnvVars: envs, Value: &push.Seconds{D: def},
		Usage: usage + "; plain numbers are seconds, or a duration like 500ms"}
}

// secondsValue reads a secondsFlag.
func secondsValue(c *cli.Context, name string) time.Duration {
	return c.Generic(name).(*push.Seconds).D
}

// styleFlag selects how a worker moves KV.
func styleFlag() cli.Flag {
	return &cli.StringFlag{Name: "style", Value: styleSGLang, EnvVars: env("STYLE"),
		Usage: "sglang: prefill pushes KV into decode (SGLang's NIXL/MORI connectors: bootstrap server, ZMQ control messages); " +
			"vllm: decode pulls KV with READs (vLLM's NIXL connector: handshake side channel, kv_transfer_params). " +
			"Each style refuses the other's flags"}
}

// workerFlags are the flags of both styles: model shape, this side's
// layout, the synthetic workload and the outputs. Both sides must agree on
// the shape and the workload; each chooses its own layout, pages and
// memory kinds.
func workerFlags(role string) []cli.Flag {
	return []cli.Flag{
		styleFlag(),

		&cli.StringFlag{Category: catModel, Name: "attention", Value: "mha", EnvVars: env("ATTENTION"),
			Usage: "mha (K and V, heads split over TP) or mla (one latent per layer, replicated)"},
		&cli.IntFlag{Category: catModel, Name: "layers", Value: 8, EnvVars: env("LAYERS"), Usage: "model layers"},
		&cli.IntFlag{Category: catModel, Name: "kv-heads", Value: 8, EnvVars: env("KV_HEADS"), Usage: "model KV heads in total (mha; with --style vllm mla too: vLLM's compatibility hash counts them)"},
		&cli.IntFlag{Category: catModel, Name: "head-dim", Value: 128, EnvVars: env("HEAD_DIM"), Usage: "elements per head (mla: per latent row)"},
		&cli.IntFlag{Category: catModel, Name: "dtype-bytes", Value: 2, EnvVars: env("DTYPE_BYTES"), Usage: "bytes per element"},
		&cli.IntFlag{Category: catModel, Name: "page-size", Value: 16, EnvVars: env("PAGE_SIZE"),
			Usage: "tokens per KV page (vllm: this side's block size; decode's may be a multiple of prefill's)"},

		&cli.IntFlag{Category: catLayout, Name: "tp-size", Value: 1, EnvVars: roleEnv(role, "TP_SIZE"), Usage: "attention TP size of this side"},
		&cli.StringFlag{Category: catLayout, Name: "tp-ranks", EnvVars: roleEnv(role, "TP_RANKS"),
			Usage: "TP ranks this process hosts, e.g. 0,1 or 0-3 (default all; a vllm prefill hosts all)"},
		&cli.IntFlag{Category: catLayout, Name: "pages", EnvVars: roleEnv(role, "PAGES"),
			Usage: "KV pages (blocks) per rank (0: enough for --concurrency requests of --max-tokens)"},
		&cli.StringFlag{Category: catLayout, Name: "mem-kinds", Value: "vram", EnvVars: roleEnv(role, "MEM_KINDS"),
			Usage: "where KV regions are registered: vram, dram, or (sglang) mixed: K vram, V dram, prefill stays homogeneous. " +
				"The fake plugin treats both as host memory"},

		&cli.StringFlag{Category: catNetwork, Name: "host", Value: "127.0.0.1", EnvVars: env("HOST"),
			Usage: "IP address this worker's sockets and servers bind to and advertise"},
		&cli.StringSliceFlag{Category: catNetwork, Name: "agent-param", EnvVars: roleEnv(role, "AGENT_PARAMS"),
			Usage: "plugin agent parameter `key=value` (repeatable; env: comma-separated), e.g. caps_off=notif or fail_rate=0.05 for the fake plugin (see kvhost plugins); the agents that post the transfers (sglang prefill, vllm decode) get num_threads=4 where the plugin takes it (nixl) unless given"},

		&cli.Uint64Flag{Category: catWorkload, Name: "seed", Value: 1, EnvVars: env("SEED"), Usage: "workload seed: request ids, lengths, prefix hits"},
		&cli.IntFlag{Category: catWorkload, Name: "requests", Value: 64, EnvVars: env("REQUESTS"),
			Usage: "requests (vllm prefill: 0 serves any request until SIGINT/SIGTERM)"},
		&cli.IntFlag{Category: catWorkload, Name: "min-tokens", Value: 16, EnvVars: env("MIN_TOKENS"), Usage: "shortest prompt (tokens)"},
		&cli.IntFlag{Category: catWorkload, Name: "max-tokens", Value: 512, EnvVars: env("MAX_TOKENS"), Usage: "longest prompt (tokens)"},
		&cli.Float64Flag{Category: catWorkload, Name: "prefix-rate", EnvVars: env("PREFIX_RATE"),
			Usage: "fraction of requests whose decode side already holds a prefix"},
		&cli.Float64Flag{Category: catWorkload, Name: "full-hit-rate", EnvVars: env("FULL_HIT_RATE"),
			Usage: "fraction of those holding the whole prompt (sglang: only aux moves; vllm: only the notification)"},
		&cli.IntFlag{Category: catWorkload, Name: "concurrency", Value: 16, EnvVars: env("CONCURRENCY"),
			Usage: "requests in flight (sglang: per rank; vllm decode: per process)"},

		&cli.StringFlag{Category: catOutput, Name: "summary", Value: "-", EnvVars: roleEnv(role, "SUMMARY"),
			Usage: "write the JSON summary to `FILE` (- for stdout, empty for none)"},
		&cli.StringFlag{Category: catOutput, Name: "metrics-addr", EnvVars: append(roleEnv(role, "METRICS_ADDR"), env("METRICS_ADDR")...),
			Usage: "serve Prometheus /metrics and /health (503 until the worker is ready, then 200) on `HOST:PORT` (port 0 picks one, logged; empty: off)"},
		&cli.StringFlag{Category: catOutput, Name: "report", EnvVars: roleEnv(role, "REPORT"),
			Usage: "write one JSON line per request to `FILE` as each finishes: its outcome (a vllm prefill: its release)"},

		&cli.StringFlag{Category: catSGLangWire, Name: "variant", Value: "nixl", EnvVars: env("WIRE_VARIANT"),
			Usage: "SGLang control-message layout: nixl or mori"},
		&cli.StringFlag{Category: catSGLangWire, Name: "completion", Value: "auto", EnvVars: env("COMPLETION"),
			Usage: "how completion reaches decode: auto (notifications on the nixl variant when the plugin has them, else status messages), notif or status"},

		&cli.IntFlag{Category: catSGLangWork, Name: "aux-bytes", Value: 64, EnvVars: env("AUX_BYTES"),
			Usage: "bytes of one request's aux (metadata) slot (same on both sides)"},
		&cli.IntFlag{Category: catSGLangWork, Name: "pp-size", Value: 1, EnvVars: roleEnv(role, "PP_SIZE"),
			Usage: "PP size of this side (decode: equal to prefill's, or 1)"},
		&cli.StringFlag{Category: catSGLangWork, Name: "pp-ranks", EnvVars: roleEnv(role, "PP_RANKS"), Usage: "PP ranks this process hosts (default all)"},
		&cli.Uint64Flag{Category: catSGLangWork, Name: "room-base", EnvVars: env("ROOM_BASE"), Usage: "first room id (0: derived from the seed)"},
		&cli.IntFlag{Category: catSGLangWork, Name: "chunk-pages", Value: 8, EnvVars: env("CHUNK_PAGES"),
			Usage: "chunked-prefill chunk size in pages (0: one chunk per request)"},
		&cli.Float64Flag{Category: catSGLangWork, Name: "abort-rate", EnvVars: env("ABORT_RATE"),
			Usage: "fraction of requests decode aborts after sending its metadata"},
		&cli.BoolFlag{Category: catSGLangWork, Name: "no-bytes", EnvVars: env("NO_BYTES"),
			Usage: "benchmark mode: skip filling (prefill) and checking (decode) the KV bytes; the summary says \"checked\": false"},

		&cli.StringFlag{Category: catVLLM, Name: "engine-id", EnvVars: roleEnv(role, "ENGINE_ID"),
			Usage: "this engine's id (kv_transfer_config.engine_id; default: a random one). Decode processes of one engine share it"},
		&cli.StringFlag{Category: catVLLM, Name: "kv-layout", Value: pull.LayoutHND, EnvVars: env("KV_LAYOUT"),
			Usage: "KV block layout: HND (what vLLM's NIXL connector asks for; needed for heterogeneous TP) or NHD"},
		&cli.BoolFlag{Category: catVLLM, Name: "blocks-first", EnvVars: env("BLOCKS_FIRST"),
			Usage: "FlashInfer's layout: one region per layer, K and V halves in every block"},
		&cli.StringFlag{Category: catVLLM, Name: "model", Value: pullworker.DefaultModelName, EnvVars: env("MODEL"),
			Usage: "model name (a compatibility hash factor)"},
		&cli.StringFlag{Category: catVLLM, Name: "vllm-version", Value: pullworker.DefaultVLLMVersion, EnvVars: env("VLLM_VERSION"),
			Usage: "vLLM version the compatibility hash claims (match the vLLM peers)"},
		&cli.StringFlag{Category: catVLLM, Name: "dtype", EnvVars: env("DTYPE"),
			Usage: "model dtype: bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 (default: from --dtype-bytes)"},
		&cli.StringFlag{Category: catVLLM, Name: "cache-dtype", Value: pullworker.DefaultCacheDType, EnvVars: env("CACHE_DTYPE"),
			Usage: "KV cache dtype (a compatibility hash factor)"},
		&cli.StringFlag{Category: catVLLM, Name: "attn-backend", EnvVars: env("ATTN_BACKEND"),
			Usage: "attention backend name for the hash (default FLASH_ATTN, FLASHINFER with --blocks-first, FLASHMLA with mla)"},
	}
}

// dispatch runs the action of the style --style names, after refusing
// every flag set (on the command line or by its variable) that belongs to
// the other style.
func dispatch(sglang, vllm cli.ActionFunc) cli.ActionFunc {
	return func(c *cli.Context) error {
		if c.NArg() > 0 {
			return fmt.Errorf("%s: unexpected argument %q", c.Command.Name, c.Args().First())
		}
		style := c.String("style")
		if style == "" {
			style = styleSGLang
		}
		var run cli.ActionFunc
		switch style {
		case styleSGLang:
			run = sglang
		case styleVLLM:
			run = vllm
		default:
			return fmt.Errorf("--style: want sglang or vllm, got %q", style)
		}
		for _, f := range c.Command.Flags {
			cf, ok := f.(cli.CategorizableFlag)
			if !ok {
				continue
			}
			name := f.Names()[0]
			own := styleOfCategory(cf.GetCategory())
			if own == "" || own == style || !c.IsSet(name) {
				continue
			}
			msg := fmt.Sprintf("--%s does not apply to --style %s (it is a --style %s flag)", name, style, own)
			if df, ok := f.(cli.DocGenerationFlag); ok {
				for _, v := range df.GetEnvVars() {
					if _, set := os.LookupEnv(v); set {
						msg += "; $" + v + " sets it"
						break
					}
				}
			}
			return errors.New(msg)
		}
		return run(c)
	}
}

// parseAttention reads --attention: true for MLA.
func parseAttention(c *cli.Context) (bool, error) {
	switch a := c.String("attention"); a {
	case "mha":
		return false, nil
	case "mla":
		return true, nil
	default:
		return false, fmt.Errorf("--attention: want mha or mla, got %q", a)
	}
}

// loadPlugin loads the plugin --backend names.
func loadPlugin(c *cli.Context) (*plugin.Plugin, error) {
	p, err := plugin.Load(c.String(flagBackend), plugin.SearchDirs(c.String(flagPluginPath)))
	if err != nil {
		return nil, fmt.Errorf("load plugin %q: %w", c.String(flagBackend), err)
	}
	return p, nil
}

// parseSGLang turns the shared flags into push worker options (plugin
// loaded).
func parseSGLang(c *cli.Context) (pushworker.Common, error) {
	var o pushworker.Common
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
	if o.Shape.MLA, err = parseAttention(c); err != nil {
		return o, err
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
	if o.TPRanks, err = pushworker.ParseRanks(c.String("tp-ranks"), o.TPSize); err != nil {
		return o, fmt.Errorf("--tp-ranks: %w", err)
	}
	if o.PPRanks, err = pushworker.ParseRanks(c.String("pp-ranks"), o.PPSize); err != nil {
		return o, fmt.Errorf("--pp-ranks: %w", err)
	}
	o.Host = c.String("host")
	o.Concurrency = c.Int("concurrency")
	o.NoBytes = c.Bool("no-bytes")
	o.Workload = pushworker.Workload{
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
	o.Plugin, err = loadPlugin(c)
	return o, err
}

// vllmCommon is what both vLLM-style workers read from the shared flags.
type vllmCommon struct {
	plugin   *plugin.Plugin
	params   []plugin.Param
	model    pullworker.Model
	engine   pullworker.Engine
	ranks    []int
	engineID string
	work     pullworker.Workload
	conc     int
	memKind  abi.MemKind
}

// parseVLLM turns the shared flags into the pull workers' settings (plugin
// loaded).
func parseVLLM(c *cli.Context, role string) (*vllmCommon, error) {
	o := &vllmCommon{conc: c.Int("concurrency")}
	var err error
	if o.model, err = vllmModel(c); err != nil {
		return nil, err
	}
	if o.params, err = plugin.ParseParams(c.StringSlice("agent-param")); err != nil {
		return nil, fmt.Errorf("--agent-param: %w", err)
	}
	layout, err := pullworker.ParseLayout(c.String("kv-layout"))
	if err != nil {
		return nil, fmt.Errorf("--kv-layout: %w", err)
	}
	o.engine = pullworker.Engine{TPSize: c.Int("tp-size"), BlockSize: c.Int("page-size"), NumBlocks: c.Int("pages"), Layout: layout}
	if o.engine.TPSize < 1 {
		return nil, fmt.Errorf("--tp-size %d must be positive", o.engine.TPSize)
	}
	if o.ranks, err = pushworker.ParseRanks(c.String("tp-ranks"), o.engine.TPSize); err != nil {
		return nil, fmt.Errorf("--tp-ranks: %w", err)
	}
	if role == "prefill" && len(o.ranks) != o.engine.TPSize {
		return nil, fmt.Errorf("--tp-ranks: a vLLM prefill engine allocates its blocks for all ranks at once: host all %d ranks in this process", o.engine.TPSize)
	}
	// --prefix-rate is the share of requests with any hit, --full-hit-rate
	// the share of those hitting every block.
	prefix, full := c.Float64("prefix-rate"), c.Float64("full-hit-rate")
	if prefix < 0 || prefix > 1 || full < 0 || full > 1 {
		return nil, fmt.Errorf("--prefix-rate %g and --full-hit-rate %g must be in [0, 1]", prefix, full)
	}
	o.work = pullworker.Workload{Seed: c.Uint64("seed"), Requests: c.Int("requests"), MinTokens: c.Int("min-tokens"),
		MaxTokens: c.Int("max-tokens"), PartialHitRate: prefix * (1 - full), FullHitRate: prefix * full}
	if err := o.work.Validate(); err != nil {
		return nil, err
	}
	if o.conc < 1 {
		return nil, fmt.Errorf("--concurrency %d must be positive", o.conc)
	}
	if o.engine.NumBlocks == 0 {
		o.engine.NumBlocks = pullworker.DefaultNumBlocks(o.work.MaxTokens, o.engine.BlockSize, o.conc)
	}
	if err := o.engine.Validate(); err != nil {
		return nil, err
	}
	switch kind := c.String("mem-kinds"); kind {
	case "vram":
		o.memKind = abi.VRAM
	case "dram":
		o.memKind = abi.DRAM
	default:
		return nil, fmt.Errorf("--mem-kinds %q: vLLM registers every KV region with one memory type, want vram or dram", kind)
	}
	o.engineID = c.String("engine-id")
	if o.engineID == "" {
		var b [6]byte
		_, _ = rand.Read(b[:])
		o.engineID = role + "-" + hex.EncodeToString(b[:])
	}
	if o.plugin, err = loadPlugin(c); err != nil {
		return nil, err
	}
	return o, nil
}

// vllmModel reads the model both vLLM-style sides share.
func vllmModel(c *cli.Context) (pullworker.Model, error) {
	m := pullworker.Model{
		Name: c.String("model"), VLLMVersion: c.String("vllm-version"), DType: c.String("dtype"),
		CacheDType: c.String("cache-dtype"), AttnBackend: c.String("attn-backend"), BlocksFirst: c.Bool("blocks-first"),
		Layers: c.Int("layers"), KVHeads: c.Int("kv-heads"), HeadDim: c.Int("head-dim"),
	}
	var err error
	if m.MLA, err = parseAttention(c); err != nil {
		return m, err
	}
	bytes := c.Int("dtype-bytes")
	if m.DType == "" {
		if m.DType, err = pullworker.DTypeOfBytes(bytes); err != nil {
			return m, fmt.Errorf("--dtype-bytes: %w (or name --dtype)", err)
		}
	} else if b, err := pullworker.DTypeBytes(m.DType); err != nil {
		return m, fmt.Errorf("--dtype: %w", err)
	} else if c.IsSet("dtype-bytes") && b != bytes {
		return m, fmt.Errorf("--dtype %s has %d-byte elements, --dtype-bytes says %d", m.DType, b, bytes)
	}
	return m, m.Validate()
}

// workerRun is what every worker command sets up around its runtime.
type workerRun struct {
	// ctx ends on SIGINT or SIGTERM, or when the run is closed.
	ctx context.Context
	// metrics is the worker's metric set, served on --metrics-addr (when
	// given) until the run is closed. The runtime feeds it through its
	// observer and marks it ready.
	metrics *metrics.Metrics
	// report is --report's file (nil when not given).
	report io.Writer
	close  func()
}

// startWorkerRun sets up a run of a role's worker in style.
func startWorkerRun(c *cli.Context, role, style string) (*workerRun, error) {
	ctx, cancel := signalContext(c)
	m, srv, err := metrics.Start(ctx, c.String("metrics-addr"), map[string]string{"role": role, "style": style})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("--metrics-addr: %w", err)
	}
	if srv != nil {
		slog.Info("serving metrics", "addr", srv.Addr(), "url", "http://"+srv.Addr()+"/metrics")
	}
	rep, closeRep, err := openOutput(c, c.String("report"))
	if err != nil {
		cancel()
		return nil, fmt.Errorf("--report: %w", err)
	}
	r := &workerRun{ctx: ctx, metrics: m, report: rep}
	r.close = func() {
		if err := closeRep(); err != nil {
			slog.Error("closing the request report", "file", c.String("report"), "err", err)
		}
		cancel()
	}
	return r, nil
}

// wirePush hands the run's observer, readiness hook and report to a push
// pushworker.
func (r *workerRun) wirePush(o *pushworker.Common) {
	o.Observer = r.metrics.PushObserver()
	o.OnReady = func(rooms pushworker.RoomCounter) {
		r.metrics.SetRoomSource(metrics.RoomSource(rooms))
		r.metrics.SetReady(true)
	}
	o.Report = r.report
	o.MeasureCPU = true // this process runs one worker
}

// ready is the pull workers' readiness hook.
func (r *workerRun) ready() { r.metrics.SetReady(true) }

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

// writeSummary writes a worker's summary as indented JSON where --summary
// says.
func writeSummary(c *cli.Context, sum any) error {
	w, closeFn, err := openOutput(c, c.String("summary"))
	if err != nil {
		return fmt.Errorf("--summary: %w", err)
	}
	if w != nil {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sum); err != nil {
			closeFn()
			return fmt.Errorf("--summary: %w", err)
		}
	}
	return closeFn()
}

// finishSGLang writes a push worker's summary and turns the outcome into
// the exit status.
func finishSGLang(c *cli.Context, s *pushworker.Summary, runErr error) error {
	if s == nil {
		if runErr == nil {
			runErr = fmt.Errorf("%s: no summary", c.Command.Name)
		}
		return runErr
	}
	if err := writeSummary(c, s); err != nil {
		return err
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
