package main

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/push/worker"
)

func init() { register(decodeCommand) }

// decodeCommand builds `kvhost decode`.
func decodeCommand() *cli.Command {
	flags := workerFlags("decode")
	flags = append(flags,
		&cli.StringFlag{Name: "bootstrap-addr", Required: true, EnvVars: []string{"KVHOST_BOOTSTRAP_ADDR"}, Category: "Bootstrap:",
			Usage: "the prefill deployment's bootstrap server, `HOST:PORT`"},
		&cli.DurationFlag{Name: "init-timeout", Value: 60 * time.Second, Category: "Bootstrap:",
			Usage: "how long a request waits for the prefill deployment to be registered"},
		secondsFlag("waiting-timeout", "fail a request whose transfer did not complete this long after its metadata went out (and ABORT it on prefill)",
			push.DefaultWaitingTimeout, push.EnvWaitingTimeout[0], push.EnvWaitingTimeout[1]),
		secondsFlag("heartbeat-interval", "how often the bootstrap server's /health is checked (SGLang never goes below 2 s; kvhost allows it, with a warning)",
			push.DefaultHeartbeatInterval, push.EnvHeartbeatInterval[0], push.EnvHeartbeatInterval[1]),
		&cli.IntFlag{Name: "heartbeat-max-failure", Value: push.DefaultHeartbeatMaxFailures, EnvVars: push.EnvHeartbeatFailures[:], Category: "Runtime (reference defaults):",
			Usage: "failed heartbeats in a row after which every unfinished request of that prefill fails"},
	)
	return &cli.Command{
		Name:  "decode",
		Usage: "run a demo decode worker: synthetic KV pool, push runtime, every byte verified",
		UsageText: "kvhost [--backend fake] decode --bootstrap-addr HOST:PORT [--tp-size 4] [--tp-ranks 0-3]\n" +
			"    [--variant nixl|mori] [--requests N --seed S ...] [--summary FILE]",
		Description: "Runs one or more decode ranks (--tp-ranks x --pp-ranks) in this process. For each request\n" +
			"of the synthetic workload every rank allocates pages at random, fills the prefix its cache\n" +
			"already holds (prefix hits), sends its metadata to the prefill ranks it maps to, waits for\n" +
			"the transfer, and checks every byte it owns (KV and aux) against the formula the prefill\n" +
			"side filled with. The check never uses the transfer planner.\n\n" +
			"Prints a JSON summary (per-request lines with --report); exits 0 only when every request\n" +
			"succeeded or was a planned abort, and every byte was right.",
		Flags:  flags,
		Action: runDecode,
	}
}

func runDecode(c *cli.Context) error {
	common, err := parseCommon(c)
	if err != nil {
		return err
	}
	o := worker.DecodeOptions{Common: common, BootstrapAddr: c.String("bootstrap-addr"), InitTimeout: c.Duration("init-timeout")}
	o.Settings = push.Settings{HeartbeatMaxFailures: c.Int("heartbeat-max-failure")}
	o.Settings.WaitingTimeout = secondsValue(c, "waiting-timeout")
	o.Settings.HeartbeatInterval = secondsValue(c, "heartbeat-interval")
	if o.Settings.HeartbeatInterval < push.MinReferenceHeartbeat {
		slog.Warn("heartbeat interval below SGLang's 2 s floor", "interval", o.Settings.HeartbeatInterval)
	}
	ctx, cancel := signalContext()
	defer cancel()
	rep, closeRep, err := openOutput(c, c.String("report"))
	if err != nil {
		return fmt.Errorf("--report: %w", err)
	}
	defer closeRep()
	o.Report = rep
	slog.Info("decode worker starting", "bootstrap", o.BootstrapAddr, "ranks", len(o.TPRanks)*len(o.PPRanks), "requests", o.Workload.Requests)
	s, runErr := worker.RunDecode(ctx, o)
	if s == nil && runErr == nil {
		runErr = errors.New("decode: no summary")
	}
	return finish(c, s, runErr)
}
