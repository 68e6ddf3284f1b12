package main

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/push"
)

func init() { register(decodeCommand) }

// decodeCommand builds `kvhost decode`.
func decodeCommand() *cli.Command {
	flags := append(workerFlags("decode"),
		&cli.StringFlag{Category: catSGLangWire, Name: "bootstrap-addr", EnvVars: env("BOOTSTRAP_ADDR"),
			Usage: "the prefill deployment's bootstrap server, `HOST:PORT` (required)"},
		&cli.DurationFlag{Category: catSGLangWire, Name: "init-timeout", Value: 60 * time.Second, EnvVars: env("INIT_TIMEOUT"),
			Usage: "how long a request waits for the prefill deployment to be registered"},
		secondsFlag(catSGLangRuntime, "waiting-timeout", "fail a request whose transfer did not complete this long after its metadata went out (and ABORT it on prefill)",
			push.DefaultWaitingTimeout, push.EnvWaitingTimeout[:]...),
		secondsFlag(catSGLangRuntime, "heartbeat-interval", "how often the bootstrap server's /health is checked (SGLang never goes below 2 s; kvhost allows it, with a warning)",
			push.DefaultHeartbeatInterval, push.EnvHeartbeatInterval[:]...),
		&cli.IntFlag{Category: catSGLangRuntime, Name: "heartbeat-max-failure", Value: push.DefaultHeartbeatMaxFailures, EnvVars: push.EnvHeartbeatFailures[:],
			Usage: "failed heartbeats in a row after which every unfinished request of that prefill fails"},

		&cli.StringFlag{Category: catVLLM, Name: "prefill-url", Value: "http://127.0.0.1:8100", EnvVars: env("PREFILL_URL"),
			Usage: "the prefill worker's API (its --host and --api-port)"},
		&cli.DurationFlag{Category: catVLLM, Name: "handshake-timeout", Value: 5 * time.Second, EnvVars: env("HANDSHAKE_TIMEOUT"),
			Usage: "give up a handshake after this long (vLLM: 5 s)"},
		&cli.DurationFlag{Category: catVLLM, Name: "read-timeout", Value: time.Minute, EnvVars: env("READ_TIMEOUT"),
			Usage: "fail a READ still running after this long (0: wait forever, as vLLM does)"},
		&cli.BoolFlag{Category: catVLLM, Name: "enforce-compat", Value: true, EnvVars: env("ENFORCE_COMPAT"),
			Usage: "refuse a prefill whose compatibility hash differs (vLLM's enforce_handshake_compat)"},
		&cli.DurationFlag{Category: catVLLM, Name: "connect-timeout", Value: time.Minute, EnvVars: env("CONNECT_TIMEOUT"),
			Usage: "wait this long for the prefill API to come up, and for each prefill call"},
	)
	return &cli.Command{
		Name:  "decode",
		Usage: "run a demo decode worker (synthetic KV pool, every byte verified): SGLang-style push (default) or, with --style vllm, vLLM-style pull",
		UsageText: "kvhost [--backend fake] decode --bootstrap-addr HOST:PORT [--tp-size 4] [--tp-ranks 0-3]\n" +
			"    [--variant nixl|mori] [--requests N --seed S ...] [--summary FILE] [--report FILE]\n" +
			"kvhost [--backend fake] decode --style vllm --prefill-url URL [--tp-size 4] [--tp-ranks 0-3]\n" +
			"    [--requests N --seed S ...] [--summary FILE] [--report FILE]",
		Description: "Runs one or more decode ranks (--tp-ranks) in this process over the synthetic workload. For\n" +
			"each request every rank allocates pages (blocks) at random, fills the prefix its cache already\n" +
			"holds (prefix hits), has the prefill's KV moved in, and checks every byte it owns against the\n" +
			"formula the prefill side filled with. The check never uses the transfer planner. The workload\n" +
			"flags must match the prefill side's. Prints a JSON summary (--summary) and one line per request\n" +
			"as it finishes (--report); exits 0 only when every request succeeded (sglang: or was a planned\n" +
			"abort) and every byte was right.\n\n" +
			"--style sglang (default): SGLang's NIXL/MORI connectors. Each rank learns the prefill layout\n" +
			"from the bootstrap server (--bootstrap-addr), sends its metadata to the prefill ranks it maps\n" +
			"to, and waits for the prefill to WRITE the pages (completion by notification or status\n" +
			"message). --tp-ranks x --pp-ranks ranks run in this process.\n\n" +
			"--style vllm: vLLM's NIXL connector. For each request the worker asks the prefill's API\n" +
			"(--prefill-url) for a prefill, then each rank pulls the blocks it lacks with one READ carrying\n" +
			"the notification \"{request_id}:{tp_ratio}\" (a full prefix hit only notifies), after a handshake\n" +
			"once per prefill engine. Several processes may serve one engine (--engine-id, disjoint\n" +
			"--tp-ranks). --page-size may be a multiple of the prefill's.\n\n" +
			"Flags under \"sglang style\" or \"vllm style\" apply to that style only; the other style refuses them.",
		Flags:  flags,
		Action: dispatch(runDecodeSGLang, runDecodeVLLM),
	}
}

func runDecodeSGLang(c *cli.Context) error {
	if c.String("bootstrap-addr") == "" {
		return errors.New("decode: --bootstrap-addr is required (the prefill deployment's bootstrap server)")
	}
	common, err := parseSGLang(c)
	if err != nil {
		return err
	}
	o := pushworker.DecodeOptions{Common: common, BootstrapAddr: c.String("bootstrap-addr"), InitTimeout: c.Duration("init-timeout")}
	o.Settings = push.Settings{HeartbeatMaxFailures: c.Int("heartbeat-max-failure"),
		WaitingTimeout: secondsValue(c, "waiting-timeout"), HeartbeatInterval: secondsValue(c, "heartbeat-interval")}
	if o.Settings.HeartbeatInterval < push.MinReferenceHeartbeat {
		slog.Warn("heartbeat interval below SGLang's 2 s floor", "interval", o.Settings.HeartbeatInterval)
	}
	run, err := startWorkerRun(c, "decode", styleSGLang)
	if err != nil {
		return err
	}
	defer run.close()
	run.wirePush(&o.Common)
	slog.Info("decode worker starting", "style", styleSGLang, "bootstrap", o.BootstrapAddr,
		"ranks", len(o.TPRanks)*len(o.PPRanks), "requests", o.Workload.Requests)
	s, runErr := pushworker.RunDecode(run.ctx, o)
	return finishSGLang(c, s, runErr)
}

func runDecodeVLLM(c *cli.Context) error {
	o, err := parseVLLM(c, "decode")
	if err != nil {
		return err
	}
	run, err := startWorkerRun(c, "decode", styleVLLM)
	if err != nil {
		return err
	}
	defer run.close()
	slog.Info("decode worker starting", "style", styleVLLM, "prefill", c.String("prefill-url"),
		"ranks", len(o.ranks), "requests", o.work.Requests)
	sum, runErr := pullworker.RunDecode(run.ctx, pullworker.DecodeConfig{
		Plugin: o.plugin, AgentParams: o.params, Model: o.model, Engine: o.engine, Ranks: o.ranks, EngineID: o.engineID,
		PrefillURL: c.String("prefill-url"), Workload: o.work, Concurrency: o.conc,
		HandshakeTimeout: c.Duration("handshake-timeout"), ReadTimeout: c.Duration("read-timeout"),
		ConnectTimeout: c.Duration("connect-timeout"), SkipCompatCheck: !c.Bool("enforce-compat"),
		MemKind: o.memKind, Logger: slog.Default(), Report: run.report,
		Observer: run.metrics.PullObserver(), OnReady: run.ready, MeasureCPU: true,
	})
	if sum != nil {
		if err := writeSummary(c, sum); err != nil {
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
