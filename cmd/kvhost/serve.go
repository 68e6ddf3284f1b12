package main

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/metrics"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/serve"
)

func init() { register(serveCommand) }

// serveShutdownGrace bounds how long SIGTERM waits for the failure events
// of in-flight rooms to reach the engines.
const serveShutdownGrace = 10 * time.Second

// serveCommand builds `kvhost serve`.
func serveCommand() *cli.Command {
	return &cli.Command{
		Name:      "serve",
		Usage:     "run the sidecar a serving engine (SGLang, vLLM) hands its KV cache and requests to",
		UsageText: "kvhost [--backend nixl] serve [--control ipc:///run/kvhost/engine.sock] [--metrics-addr HOST:PORT] [--agent-param k=v ...]",
		Description: "Serves the engine control API (docs/engine-api.md) on a ZeroMQ ROUTER socket at --control\n" +
			"(ipc://, mode 0600). Engine processes connect one DEALER socket each, say hello, share their\n" +
			"KV memory (host memory by POSIX shared-memory name, GPU memory by CUDA IPC handle), open one\n" +
			"rank per engine rank (each gets its own plugin agent) and drive SGLang push rooms or vLLM pull\n" +
			"requests; the sidecar moves the bytes on the wire of SGLang's and vLLM's own connectors, so\n" +
			"its peers may be other sidecars, kvhost workers or the engines' connectors.\n\n" +
			"An engine connection is its session: when it closes, its rooms fail with \"engine\n" +
			"disconnected\" (peers told), its agents are destroyed and its mappings released. On SIGINT or\n" +
			"SIGTERM the sidecar refuses new requests, fails every unfinished room with \"sidecar shutting\n" +
			"down\" and sends those events, releases everything and removes its socket file.\n\n" +
			"Prints the control endpoint on stdout once it serves. With --metrics-addr it serves\n" +
			"Prometheus /metrics and /health as the workers do.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "control", Value: serve.DefaultControl(), EnvVars: env("CONTROL"),
				Usage: "control `ENDPOINT` engines connect to (ipc://PATH)"},
			&cli.StringSliceFlag{Name: "agent-param", EnvVars: env("AGENT_PARAMS"),
				Usage: "plugin agent parameter `key=value` for every rank's agent (repeatable; env: comma-separated); open_rank's agent_params override it per rank, and ranks that post the transfers (sglang prefill, vllm decode) get num_threads=4 where the plugin takes it (nixl) unless given"},
			&cli.StringFlag{Name: "metrics-addr", EnvVars: env("METRICS_ADDR"),
				Usage: "serve Prometheus /metrics and /health on `HOST:PORT`"},
			&cli.StringFlag{Name: "host", Value: "127.0.0.1", EnvVars: env("HOST"),
				Usage: "IP address ranks bind to and advertise unless their open_rank names one"},
			&cli.StringFlag{Name: "cudart", EnvVars: []string{"KVHOST_CUDART"},
				Usage: "libcudart to open VRAM regions with (`PATH` or name; default libcudart.so, .so.13, .so.12)"},
			&cli.Int64Flag{Name: "max-message", Value: serve.DefaultMaxMessage, EnvVars: env("MAX_MESSAGE"),
				Usage: "largest control message in `BYTES` (larger ones are answered too_large)"},
			&cli.IntFlag{Name: "max-ranks", Value: serve.DefaultMaxRanks, EnvVars: env("MAX_RANKS"), Usage: "ranks per connection"},
			&cli.IntFlag{Name: "max-regions", Value: serve.DefaultMaxRegions, EnvVars: env("MAX_REGIONS"), Usage: "memory regions per connection"},
			&cli.IntFlag{Name: "max-rooms", Value: serve.DefaultMaxRooms, EnvVars: env("MAX_ROOMS"), Usage: "open rooms per connection"},
			secondsFlag("", "bootstrap-timeout", "SGLang: fail a room still Bootstrapping after this long",
				push.DefaultBootstrapTimeout, push.EnvBootstrapTimeout[:]...),
			secondsFlag("", "waiting-timeout", "SGLang decode: fail a room whose transfer did not complete this long after its metadata went out",
				push.DefaultWaitingTimeout, push.EnvWaitingTimeout[:]...),
			&cli.DurationFlag{Name: "handshake-timeout", Value: pull.DefaultHandshakeTimeout, EnvVars: env("HANDSHAKE_TIMEOUT"),
				Usage: "vLLM decode: fail the reads waiting on a prefill's side channel that has not completed the handshake in this long"},
			secondsFlag("", "heartbeat-interval", "SGLang decode: check each prefill bootstrap server's /health this often",
				push.DefaultHeartbeatInterval, push.EnvHeartbeatInterval[:]...),
		},
		Action: runServe,
	}
}

func runServe(c *cli.Context) error {
	params, err := plugin.ParseParams(c.StringSlice("agent-param"))
	if err != nil {
		return fmt.Errorf("--agent-param: %w", err)
	}
	p, err := loadPlugin(c)
	if err != nil {
		return err
	}
	ctx, cancel := signalContext(c)
	defer cancel()
	m, msrv, err := metrics.Start(ctx, c.String("metrics-addr"), map[string]string{"role": "sidecar", "style": "serve"})
	if err != nil {
		return fmt.Errorf("--metrics-addr: %w", err)
	}
	if msrv != nil {
		slog.Info("serving metrics", "addr", msrv.Addr(), "url", "http://"+msrv.Addr()+"/metrics")
	}
	srv, err := serve.New(serve.Config{
		Control: c.String("control"), Plugin: p, Backend: c.String(flagBackend), AgentParams: params,
		Settings: push.Settings{
			BootstrapTimeout:  secondsValue(c, "bootstrap-timeout"),
			WaitingTimeout:    secondsValue(c, "waiting-timeout"),
			HeartbeatInterval: secondsValue(c, "heartbeat-interval"),
		},
		Observer: m.PushObserver(), PullObserver: m.PullObserver(), Host: c.String("host"), CUDALibrary: c.String("cudart"),
		MaxMessage: c.Int64("max-message"), HandshakeTimeout: c.Duration("handshake-timeout"),
		Limits:  serve.Limits{Ranks: c.Int("max-ranks"), Regions: c.Int("max-regions"), Rooms: c.Int("max-rooms")},
		Version: serveVersion(), Logger: slog.Default(),
	})
	if err != nil {
		return err
	}
	m.SetRoomSource(srv.CountRooms)
	m.SetReady(true)
	slog.Info("serving the engine control API", "control", srv.Endpoint(), "backend", c.String(flagBackend), "session", srv.Session())
	fmt.Fprintln(c.App.Writer, srv.Endpoint())
	<-ctx.Done()
	slog.Info("shutting down: failing in-flight rooms")
	m.SetReady(false)
	sctx, scancel := context.WithTimeout(context.Background(), serveShutdownGrace)
	defer scancel()
	return srv.Close(sctx)
}

// serveVersion is hello's sidecar: kvhost and the module version the
// binary was built from, when known.
func serveVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return "kvhost " + bi.Main.Version
	}
	return "kvhost"
}
