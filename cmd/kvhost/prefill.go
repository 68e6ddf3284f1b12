package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
)

func init() { register(prefillCommand) }

// prefillCommand builds `kvhost prefill`.
func prefillCommand() *cli.Command {
	flags := append(workerFlags("prefill"),
		&cli.StringFlag{Category: catSGLangWire, Name: "xfer", Value: "auto", EnvVars: env("XFER"),
			Usage: "how chunks reach the plugin: auto (batch where the agent has native strides; else prepped where it has native prepped lists and the variant is nixl; else batch), " +
				"batch (strided copies over region pairs imported once per peer; plain descriptors where the agent has no native strides) " +
				"or prepped (SGLang NIXL's prepared lists, built once per peer, indexed per chunk)"},
		&cli.IntFlag{Category: catSGLangWire, Name: "bootstrap-port", Value: 8998, EnvVars: env("BOOTSTRAP_PORT"),
			Usage: "serve the bootstrap server on --host:`PORT` in this process, as SGLang's prefill does (0 picks a free port; see --bootstrap-addr)"},
		&cli.StringFlag{Category: catSGLangWire, Name: "bootstrap-addr", EnvVars: env("BOOTSTRAP_ADDR"),
			Usage: "register with the bootstrap server at `HOST:PORT` (e.g. a kvhost bootstrap process shared by several prefill processes) instead of serving one"},
		&cli.StringFlag{Category: catSGLangWire, Name: "bootstrap-addr-file", EnvVars: env("BOOTSTRAP_ADDR_FILE"),
			Usage: "write the bootstrap address actually served to `FILE` (useful with --bootstrap-port 0)"},
		&cli.DurationFlag{Category: catSGLangWire, Name: "linger", EnvVars: env("LINGER"),
			Usage: "keep serving the bootstrap server this long after the workload ends"},
		secondsFlag(catSGLangRuntime, "bootstrap-timeout", "fail a request still Bootstrapping (no decode metadata) after this long",
			push.DefaultBootstrapTimeout, push.EnvBootstrapTimeout[:]...),
		secondsFlag(catSGLangRuntime, "transfer-timeout", "optional SLA on one chunk's transfers (0: none); $"+push.EnvTransferTimeout[1]+" (milliseconds) is read too",
			0, push.EnvTransferTimeout[0]),
		&cli.IntFlag{Category: catSGLangRuntime, Name: "queue-size", Value: push.DefaultQueueSize, EnvVars: push.EnvQueueSize[:],
			Usage: "transfer worker shards (requests go to shard room % N)"},
		&cli.BoolFlag{Category: catSGLangRuntime, Name: "mori-aux-rdma", EnvVars: push.EnvMORIAuxRDMA[:],
			Usage: "mori variant: write aux by RDMA instead of AUX_DATA messages"},

		&cli.IntFlag{Category: catVLLM, Name: "side-channel-port", Value: 5600, EnvVars: []string{"VLLM_NIXL_SIDE_CHANNEL_PORT"},
			Usage: "handshake side channel (ZMQ ROUTER) port (0 picks a free one)"},
		&cli.StringFlag{Category: catVLLM, Name: "side-channel-host", EnvVars: []string{"VLLM_NIXL_SIDE_CHANNEL_HOST"},
			Usage: "side channel address, bound and told to decodes as remote_host (default: --host)"},
		&cli.IntFlag{Category: catVLLM, Name: "api-port", Value: 8100, EnvVars: env("API_PORT"),
			Usage: "HTTP API port on --host: POST " + pullworker.PrefillPath + " prefills a request and answers its kv_transfer_params (0 picks a free one)"},
		&cli.StringFlag{Category: catVLLM, Name: "api-url-file", EnvVars: env("API_URL_FILE"),
			Usage: "write the API's URL to `FILE` once it serves (useful with --api-port 0)"},
		secondsFlag(catVLLM, "abort-timeout", "free a request's blocks if its decode readers did not all notify within this long",
			pull.DefaultAbortTimeout, pull.EnvAbortTimeout),
	)
	return &cli.Command{
		Name:  "prefill",
		Usage: "run a demo prefill worker (synthetic KV pool): SGLang-style push (default) or, with --style vllm, vLLM-style pull",
		UsageText: "kvhost [--backend fake] prefill [--tp-size 2] [--bootstrap-port 8998] [--variant nixl|mori]\n" +
			"    [--requests N --seed S ...] [--summary FILE]\n" +
			"kvhost [--backend fake] prefill --style vllm [--tp-size 2] [--api-port 8100] [--side-channel-port 5600]\n" +
			"    [--requests N --seed S ...] [--summary FILE]",
		Description: "Runs a prefill worker with a synthetic KV pool per rank in host memory, registered with the\n" +
			"plugin, over a synthetic workload: for each request it fills the tokens decode does not hold\n" +
			"with bytes derived from (request, layer, token, head) and hands them to decode. The workload\n" +
			"(requests, lengths, prefix hits) comes from --seed and the workload flags, which must match\n" +
			"the decode side's. Prints a JSON summary (--summary).\n\n" +
			"--style sglang (default): SGLang's NIXL/MORI connectors. The ranks (--tp-ranks x --pp-ranks)\n" +
			"register with the bootstrap server (served here unless --bootstrap-addr names one) and, once\n" +
			"decode's metadata for a request arrived, WRITE its pages into decode in chunks. Exits 0 only\n" +
			"when every request succeeded or was a planned abort and no room was leaked.\n\n" +
			"--style vllm: vLLM's NIXL connector. One process hosts every TP rank of the engine (--tp-size).\n" +
			"It serves the handshake (ZMQ ROUTER on --side-channel-host:--side-channel-port, msgpack\n" +
			"NixlHandshakePayload with the compatibility hash) and an HTTP API standing in for vLLM's: for\n" +
			"each request a decode (the proxy) posts, it allocates random blocks, fills them on every rank\n" +
			"and answers vLLM's kv_transfer_params. It frees a request's blocks when every decode rank\n" +
			"reading them notified \"{request_id}:{tp_ratio}\", or after --abort-timeout. Exits 0 once every\n" +
			"request of the workload was released (--requests 0: serves until SIGINT/SIGTERM).\n\n" +
			"Flags under \"sglang style\" or \"vllm style\" apply to that style only; the other style refuses them.",
		Flags:  flags,
		Action: dispatch(runPrefillSGLang, runPrefillVLLM),
	}
}

func runPrefillSGLang(c *cli.Context) error {
	common, err := parseSGLang(c)
	if err != nil {
		return err
	}
	o := pushworker.PrefillOptions{Common: common}
	if o.XferMode, err = push.ParseXferMode(c.String("xfer")); err != nil {
		return err
	}
	o.Settings = push.Settings{QueueSize: c.Int("queue-size"), MORIAuxRDMA: c.Bool("mori-aux-rdma"),
		BootstrapTimeout: secondsValue(c, "bootstrap-timeout"), TransferTimeout: secondsValue(c, "transfer-timeout")}
	// SGLang MORI's transfer SLA variable is in milliseconds.
	if v, ok := os.LookupEnv(push.EnvTransferTimeout[1]); ok && !c.IsSet("transfer-timeout") {
		d, err := push.ParseSeconds(v, time.Millisecond)
		if err != nil {
			return fmt.Errorf("%s: %w", push.EnvTransferTimeout[1], err)
		}
		o.Settings.TransferTimeout = d
	}
	run, err := startWorkerRun(c, "prefill", styleSGLang)
	if err != nil {
		return err
	}
	defer run.close()
	run.wirePush(&o.Common)

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
	slog.Info("prefill worker starting", "style", styleSGLang, "bootstrap", o.BootstrapAddr,
		"ranks", len(o.TPRanks)*len(o.PPRanks), "requests", o.Workload.Requests)
	s, runErr := pushworker.RunPrefill(run.ctx, o)
	run.metrics.SetReady(false) // the ranks are closed
	if d := c.Duration("linger"); d > 0 && run.ctx.Err() == nil {
		select {
		case <-time.After(d):
		case <-run.ctx.Done():
		}
	}
	return finishSGLang(c, s, runErr)
}

func runPrefillVLLM(c *cli.Context) error {
	abort := secondsValue(c, "abort-timeout")
	if abort <= 0 {
		return fmt.Errorf("--abort-timeout %v: must be positive", abort)
	}
	o, err := parseVLLM(c, "prefill")
	if err != nil {
		return err
	}
	host := c.String("host")
	sideHost := c.String("side-channel-host")
	if sideHost == "" {
		sideHost = host
	}
	run, err := startWorkerRun(c, "prefill", styleVLLM)
	if err != nil {
		return err
	}
	defer run.close()
	cfg := pullworker.PrefillConfig{
		Plugin: o.plugin, AgentParams: o.params, Model: o.model, Engine: o.engine, EngineID: o.engineID,
		SideChannel:  "tcp://" + net.JoinHostPort(sideHost, strconv.Itoa(c.Int("side-channel-port"))),
		APIAddr:      net.JoinHostPort(host, strconv.Itoa(c.Int("api-port"))),
		AbortTimeout: abort, Workload: o.work, MemKind: o.memKind, Logger: slog.Default(), Report: run.report,
		Observer: run.metrics.PullObserver(), OnReady: run.ready, MeasureCPU: true,
	}
	pf, err := pullworker.StartPrefill(cfg)
	if err != nil {
		return err
	}
	defer pf.Close()
	if f := c.String("api-url-file"); f != "" {
		if err := os.WriteFile(f, []byte("http://"+pf.APIAddr()+"\n"), 0o644); err != nil {
			return fmt.Errorf("--api-url-file: %w", err)
		}
	}
	sum := pf.Wait(run.ctx)
	if err := writeSummary(c, sum); err != nil {
		return err
	}
	if o.work.Requests > 0 && !sum.Done {
		return cli.Exit(fmt.Sprintf("prefill: stopped with %d of %d requests served, %d still held",
			sum.RequestsServed, sum.ExpectedRequests, sum.StillHeld), 1)
	}
	return nil
}
