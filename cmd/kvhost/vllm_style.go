package main

// `kvhost prefill --style vllm` and `kvhost decode --style vllm`: the demo
// workers of the pull runtime (host/pull, host/pull/demo), vLLM's NIXL
// connector model. They reuse the shared worker flags of prefill.go
// (model shape, TP layout, workload, --agent-param, --summary, --report)
// and add the vLLM ones below.
//
// Hook: prefill.go and decode.go call runPrefillVLLM / runDecodeVLLM when
// --style is vllm and list vllmFlags(role) among their flags. Until they
// do, installVLLMStyle (called from this file's init, which runs after
// theirs) adds --style and these flags to the registered commands and wraps
// their actions; it does nothing to a command that already has --style.

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/pull/demo"
	"github.com/kvhost/kvhost/host/push/worker"
)

const vllmCategory = "vLLM style (--style vllm):"

// styleFlag selects the runtime and wire of prefill and decode. Each
// command gets its own flag value (urfave/cli flags hold parse state).
func styleFlag() *cli.StringFlag {
	return &cli.StringFlag{Name: "style", Value: "sglang", EnvVars: []string{"KVHOST_STYLE"},
		Usage: "sglang (prefill pushes: bootstrap server, ZMQ messages) or vllm (decode pulls with READs: NIXL connector handshake, kv_transfer_params)"}
}

// vllmFlags are the flags only --style vllm reads.
func vllmFlags(role string) []cli.Flag {
	f := []cli.Flag{
		&cli.StringFlag{Name: "engine-id", EnvVars: []string{"KVHOST_ENGINE_ID"}, Category: vllmCategory,
			Usage: "this engine's id (kv_transfer_config.engine_id; default: a random one)"},
		&cli.StringFlag{Name: "kv-layout", Value: pull.LayoutHND, EnvVars: []string{"KVHOST_KV_LAYOUT"}, Category: vllmCategory,
			Usage: "KV block layout: HND (what vLLM's NIXL connector asks for; needed for heterogeneous TP) or NHD"},
		&cli.BoolFlag{Name: "blocks-first", EnvVars: []string{"KVHOST_BLOCKS_FIRST"}, Category: vllmCategory,
			Usage: "FlashInfer's layout: one region per layer, K and V halves in every block"},
		&cli.StringFlag{Name: "model", Value: "kvhost/synthetic-llama", EnvVars: []string{"KVHOST_MODEL"}, Category: vllmCategory,
			Usage: "model name (a compatibility hash factor)"},
		&cli.StringFlag{Name: "vllm-version", Value: "0.13.0", EnvVars: []string{"KVHOST_VLLM_VERSION"}, Category: vllmCategory,
			Usage: "vLLM version the compatibility hash claims (match the vLLM peers)"},
		&cli.StringFlag{Name: "dtype", EnvVars: []string{"KVHOST_DTYPE"}, Category: vllmCategory,
			Usage: "model dtype: bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 (default: from --dtype-bytes)"},
		&cli.StringFlag{Name: "cache-dtype", Value: "auto", EnvVars: []string{"KVHOST_CACHE_DTYPE"}, Category: vllmCategory,
			Usage: "KV cache dtype (a compatibility hash factor)"},
		&cli.StringFlag{Name: "attn-backend", EnvVars: []string{"KVHOST_ATTN_BACKEND"}, Category: vllmCategory,
			Usage: "attention backend name for the hash (default FLASH_ATTN, FLASHINFER with --blocks-first, FLASHMLA with mla)"},
	}
	if role == "prefill" {
		return append(f,
			&cli.IntFlag{Name: "side-channel-port", Value: 5600, EnvVars: []string{"VLLM_NIXL_SIDE_CHANNEL_PORT"}, Category: vllmCategory,
				Usage: "handshake side channel (ZMQ ROUTER) port (0 picks a free one)"},
			&cli.StringFlag{Name: "side-channel-host", EnvVars: []string{"VLLM_NIXL_SIDE_CHANNEL_HOST"}, Category: vllmCategory,
				Usage: "side channel address, bound and told to decodes as remote_host (default: --host)"},
			&cli.IntFlag{Name: "api-port", Value: 8100, EnvVars: []string{"KVHOST_API_PORT"}, Category: vllmCategory,
				Usage: "HTTP API port on --host: POST " + demo.PrefillPath + " prefills a request and answers its kv_transfer_params (0 picks a free one)"},
			&cli.StringFlag{Name: "api-url-file", Category: vllmCategory,
				Usage: "write the API's URL to `FILE` once it serves (useful with --api-port 0)"},
			&cli.StringFlag{Name: "abort-timeout", Value: "480", EnvVars: []string{pull.EnvAbortTimeout}, Category: vllmCategory,
				Usage: "free a request's blocks if its decode readers did not all notify within this long: seconds, or a duration like 500ms"},
		)
	}
	return append(f,
		&cli.StringFlag{Name: "prefill-url", Value: "http://127.0.0.1:8100", EnvVars: []string{"KVHOST_PREFILL_URL"}, Category: vllmCategory,
			Usage: "the prefill worker's API (its --host and --api-port)"},
		&cli.DurationFlag{Name: "handshake-timeout", Value: 5 * time.Second, EnvVars: []string{"KVHOST_HANDSHAKE_TIMEOUT"}, Category: vllmCategory,
			Usage: "give up a handshake after this long (vLLM: 5 s)"},
		&cli.DurationFlag{Name: "read-timeout", Value: time.Minute, EnvVars: []string{"KVHOST_READ_TIMEOUT"}, Category: vllmCategory,
			Usage: "fail a READ still running after this long (0: wait forever, as vLLM does)"},
		&cli.BoolFlag{Name: "enforce-compat", Value: true, EnvVars: []string{"KVHOST_ENFORCE_COMPAT"}, Category: vllmCategory,
			Usage: "refuse a prefill whose compatibility hash differs (vLLM's enforce_handshake_compat)"},
		&cli.DurationFlag{Name: "connect-timeout", Value: time.Minute, EnvVars: []string{"KVHOST_CONNECT_TIMEOUT"}, Category: vllmCategory,
			Usage: "wait this long for the prefill API to come up, and for each prefill call"},
	)
}

// sglangOnlyFlags are shared worker flags --style vllm does not use: set
// explicitly with it, they are an error rather than silently ignored.
var sglangOnlyFlags = []string{"variant", "completion", "aux-bytes", "room-base", "chunk-pages", "abort-rate", "pp-ranks",
	"xfer", "bootstrap-port", "bootstrap-addr", "bootstrap-addr-file", "bootstrap-timeout", "transfer-timeout", "queue-size",
	"mori-aux-rdma", "linger", "init-timeout", "waiting-timeout", "heartbeat-interval", "heartbeat-max-failure"}

func init() {
	for i, newCommand := range commands {
		commands[i] = func() *cli.Command {
			cmd := newCommand()
			installVLLMStyle(cmd)
			return cmd
		}
	}
}

// installVLLMStyle adds --style vllm to a prefill or decode command that
// does not dispatch on --style itself.
func installVLLMStyle(cmd *cli.Command) {
	var run cli.ActionFunc
	switch cmd.Name {
	case "prefill":
		run = runPrefillVLLM
	case "decode":
		run = runDecodeVLLM
	default:
		return
	}
	if hasFlag(cmd, "style") {
		return
	}
	for _, f := range cmd.Flags {
		// --bootstrap-addr is required by the sglang decode only.
		if sf, ok := f.(*cli.StringFlag); ok && sf.Name == "bootstrap-addr" && sf.Required {
			sf.Required = false
			sf.Usage += " (required with --style sglang)"
		}
	}
	cmd.Flags = append(append(cmd.Flags, styleFlag()), vllmFlags(cmd.Name)...)
	cmd.Usage += "; --style vllm: vLLM NIXL connector model, decode pulls"
	cmd.Description += "\n\nWith --style vllm the worker follows vLLM's NIXL connector instead: see the \"" + vllmCategory + "\" flags.\n" +
		vllmDescription(cmd.Name)
	sglang := cmd.Action
	name := cmd.Name
	cmd.Action = func(c *cli.Context) error {
		switch c.String("style") {
		case "vllm":
			return run(c)
		case "sglang", "":
			if name == "decode" && c.String("bootstrap-addr") == "" {
				return fmt.Errorf("decode --style sglang needs --bootstrap-addr")
			}
			return sglang(c)
		}
		return fmt.Errorf("--style: want sglang or vllm, got %q", c.String("style"))
	}
}

func hasFlag(cmd *cli.Command, name string) bool {
	for _, f := range cmd.Flags {
		for _, n := range f.Names() {
			if n == name {
				return true
			}
		}
	}
	return false
}

func vllmDescription(role string) string {
	if role == "prefill" {
		return "The vLLM prefill hosts every TP rank of one engine (--tp-size). It serves the NIXL handshake\n" +
			"(ZMQ ROUTER on --side-channel-host:--side-channel-port, msgpack NixlHandshakePayload with the\n" +
			"compatibility hash) and an HTTP API standing in for vLLM's: for each request of the workload a\n" +
			"decode (the proxy) posts, it allocates random blocks, fills them with bytes derived from\n" +
			"(request, layer, token, head) on every rank and answers vLLM's kv_transfer_params. It frees a\n" +
			"request's blocks when every decode rank reading them notified \"{request_id}:{tp_ratio}\", or\n" +
			"after --abort-timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT). It exits 0 once every request of the\n" +
			"workload was released (--requests 0: serves until SIGINT/SIGTERM). --page-size is this side's\n" +
			"block size; --tp-ranks must cover all ranks."
	}
	return "The vLLM decode hosts --tp-ranks of a decode engine (several processes may share one engine).\n" +
		"For each request of the workload it asks the prefill's API (--prefill-url) for a prefill, fills\n" +
		"its prefix-hit blocks locally, and on each rank pulls the rest with one NIXL READ carrying the\n" +
		"notification (a full prefix hit only notifies), after a handshake once per prefill engine. Every\n" +
		"byte of every token is then checked on every rank. --page-size is this side's block size (it may\n" +
		"be a multiple of the prefill's). It exits 0 only when every request verified."
}

// vllmModel reads the model shape shared by both sides.
func vllmModel(c *cli.Context) (demo.Model, error) {
	m := demo.Model{
		Name: c.String("model"), VLLMVersion: c.String("vllm-version"), DType: c.String("dtype"),
		CacheDType: c.String("cache-dtype"), AttnBackend: c.String("attn-backend"), BlocksFirst: c.Bool("blocks-first"),
		Layers: c.Int("layers"), KVHeads: c.Int("kv-heads"), HeadDim: c.Int("head-dim"),
	}
	switch c.String("attention") {
	case "mha":
	case "mla":
		m.MLA = true
	default:
		return m, fmt.Errorf("--attention: want mha or mla, got %q", c.String("attention"))
	}
	bytes := c.Int("dtype-bytes")
	if m.DType == "" {
		switch bytes {
		case 1:
			m.DType = "float8_e4m3fn"
		case 2:
			m.DType = "bfloat16"
		case 4:
			m.DType = "float32"
		default:
			return m, fmt.Errorf("--dtype-bytes %d: want 1, 2 or 4 (or name --dtype)", bytes)
		}
	} else if b, err := demo.DTypeBytes(m.DType); err != nil {
		return m, fmt.Errorf("--dtype: %w", err)
	} else if c.IsSet("dtype-bytes") && b != bytes {
		return m, fmt.Errorf("--dtype %s has %d-byte elements, --dtype-bytes says %d", m.DType, b, bytes)
	}
	return m, m.Validate()
}

// vllmCommon holds what both vLLM workers read from the shared flags.
type vllmCommon struct {
	plugin   *plugin.Plugin
	params   []plugin.Param
	model    demo.Model
	engine   demo.Engine
	ranks    []int
	engineID string
	work     demo.Workload
	conc     int
}

func parseVLLMCommon(c *cli.Context, role string) (*vllmCommon, error) {
	for _, name := range sglangOnlyFlags {
		if hasFlag(c.Command, name) && c.IsSet(name) {
			return nil, fmt.Errorf("--%s does not apply to --style vllm", name)
		}
	}
	if c.Int("pp-size") != 1 {
		return nil, errors.New("--style vllm: vLLM's NIXL connector pairs TP ranks only; --pp-size must be 1")
	}
	o := &vllmCommon{conc: c.Int("concurrency")}
	var err error
	if o.model, err = vllmModel(c); err != nil {
		return nil, err
	}
	if o.params, err = plugin.ParseParams(c.StringSlice("agent-param")); err != nil {
		return nil, fmt.Errorf("--agent-param: %w", err)
	}
	layout, err := demo.ParseLayout(c.String("kv-layout"))
	if err != nil {
		return nil, fmt.Errorf("--kv-layout: %w", err)
	}
	o.engine = demo.Engine{TPSize: c.Int("tp-size"), BlockSize: c.Int("page-size"), NumBlocks: c.Int("pages"), Layout: layout}
	if o.engine.TPSize < 1 {
		return nil, fmt.Errorf("--tp-size %d must be positive", o.engine.TPSize)
	}
	if o.ranks, err = worker.ParseRanks(c.String("tp-ranks"), o.engine.TPSize); err != nil {
		return nil, fmt.Errorf("--tp-ranks: %w", err)
	}
	// --prefix-rate is the share of requests with any hit, --full-hit-rate
	// the share of those hitting every block.
	prefix, full := c.Float64("prefix-rate"), c.Float64("full-hit-rate")
	if prefix < 0 || prefix > 1 || full < 0 || full > 1 {
		return nil, fmt.Errorf("--prefix-rate %g and --full-hit-rate %g must be in [0, 1]", prefix, full)
	}
	o.work = demo.Workload{Seed: c.Uint64("seed"), Requests: c.Int("requests"), MinTokens: c.Int("min-tokens"),
		MaxTokens: c.Int("max-tokens"), PartialHitRate: prefix * (1 - full), FullHitRate: prefix * full}
	if err := o.work.Validate(); err != nil {
		return nil, err
	}
	if o.conc < 1 {
		return nil, fmt.Errorf("--concurrency %d must be positive", o.conc)
	}
	if o.engine.NumBlocks == 0 {
		// Room for twice the requests in flight at the longest prompt.
		per := (o.work.MaxTokens + o.engine.BlockSize - 1) / max(o.engine.BlockSize, 1)
		o.engine.NumBlocks = max(64, 2*o.conc*per)
	}
	if err := o.engine.Validate(); err != nil {
		return nil, err
	}
	if kind := c.String("mem-kinds"); kind != "vram" && kind != "dram" {
		return nil, fmt.Errorf("--mem-kinds %q: vLLM registers every KV region with one memory type, want vram or dram", kind)
	}
	o.engineID = c.String("engine-id")
	if o.engineID == "" {
		var b [6]byte
		_, _ = rand.Read(b[:])
		o.engineID = role + "-" + hex.EncodeToString(b[:])
	}
	o.plugin, err = plugin.Load(c.String(flagBackend), plugin.SearchDirs(c.String(flagPluginPath)))
	if err != nil {
		return nil, fmt.Errorf("load plugin %q: %w", c.String(flagBackend), err)
	}
	return o, nil
}

// memKind is the memory kind the pools register as (the fake plugin
// treats both as host memory).
func memKind(c *cli.Context) abi.MemKind {
	if c.String("mem-kinds") == "dram" {
		return abi.DRAM
	}
	return abi.VRAM
}

// parseDurationOrSeconds accepts plain seconds ("480", "1.5") as vLLM's
// variables are given, or a Go duration ("500ms").
func parseDurationOrSeconds(name, v string) (time.Duration, error) {
	if d, err := time.ParseDuration(strings.TrimSpace(v)); err == nil && d > 0 {
		return d, nil
	}
	return pull.ParseSeconds(name, v)
}

func runPrefillVLLM(c *cli.Context) error {
	o, err := parseVLLMCommon(c, "prefill")
	if err != nil {
		return err
	}
	if len(o.ranks) != o.engine.TPSize {
		return fmt.Errorf("--tp-ranks: a vLLM prefill engine allocates its blocks for all ranks at once: host all %d ranks in this process", o.engine.TPSize)
	}
	abort, err := parseDurationOrSeconds("--abort-timeout", c.String("abort-timeout"))
	if err != nil {
		return err
	}
	host := c.String("host")
	sideHost := c.String("side-channel-host")
	if sideHost == "" {
		sideHost = host
	}
	rep, closeRep, err := openOutput(c, c.String("report"))
	if err != nil {
		return fmt.Errorf("--report: %w", err)
	}
	defer closeRep()
	cfg := demo.PrefillConfig{
		Plugin: o.plugin, AgentParams: o.params, Model: o.model, Engine: o.engine, EngineID: o.engineID,
		SideChannel:  "tcp://" + net.JoinHostPort(sideHost, strconv.Itoa(c.Int("side-channel-port"))),
		APIAddr:      net.JoinHostPort(host, strconv.Itoa(c.Int("api-port"))),
		AbortTimeout: abort, Workload: o.work, MemKind: memKind(c), Logger: slog.Default(), Report: rep,
	}
	ctx, cancel := signalContext()
	defer cancel()
	pf, err := demo.StartPrefill(cfg)
	if err != nil {
		return err
	}
	defer pf.Close()
	if f := c.String("api-url-file"); f != "" {
		if err := os.WriteFile(f, []byte("http://"+pf.APIAddr()+"\n"), 0o644); err != nil {
			return fmt.Errorf("--api-url-file: %w", err)
		}
	}
	sum := pf.Wait(ctx)
	if err := writeVLLMSummary(c, sum); err != nil {
		return err
	}
	if o.work.Requests > 0 && !sum.Done {
		return cli.Exit(fmt.Sprintf("prefill: stopped with %d of %d requests served, %d still held",
			sum.RequestsServed, sum.ExpectedRequests, sum.StillHeld), 1)
	}
	return nil
}

func runDecodeVLLM(c *cli.Context) error {
	o, err := parseVLLMCommon(c, "decode")
	if err != nil {
		return err
	}
	rep, closeRep, err := openOutput(c, c.String("report"))
	if err != nil {
		return fmt.Errorf("--report: %w", err)
	}
	defer closeRep()
	ctx, cancel := signalContext()
	defer cancel()
	sum, runErr := demo.RunDecode(ctx, demo.DecodeConfig{
		Plugin: o.plugin, AgentParams: o.params, Model: o.model, Engine: o.engine, Ranks: o.ranks, EngineID: o.engineID,
		PrefillURL: c.String("prefill-url"), Workload: o.work, Concurrency: o.conc,
		HandshakeTimeout: c.Duration("handshake-timeout"), ReadTimeout: c.Duration("read-timeout"),
		ConnectTimeout: c.Duration("connect-timeout"), SkipCompatCheck: !c.Bool("enforce-compat"),
		MemKind: memKind(c), Logger: slog.Default(), Report: rep,
	})
	if sum != nil {
		if err := writeVLLMSummary(c, sum); err != nil {
			return err
		}
	}
	switch {
	case runErr != nil:
		return runErr
	case sum.Failed > 0:
		return cli.Exit(fmt.Sprintf("decode: %d of %d requests failed (see failed_requests in the summary)", sum.Failed, sum.Requests), 1)
	}
	return nil
}

// writeVLLMSummary writes the JSON summary where --summary says.
func writeVLLMSummary(c *cli.Context, sum any) error {
	w, closeFn, err := openOutput(c, c.String("summary"))
	if err != nil {
		return fmt.Errorf("--summary: %w", err)
	}
	if w != nil {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sum); err != nil {
			return err
		}
	}
	return closeFn()
}
