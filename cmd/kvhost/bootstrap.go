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
)

func init() { register(bootstrapCommand) }

// bootstrapCommand builds `kvhost bootstrap`.
func bootstrapCommand() *cli.Command {
	return &cli.Command{
		Name:      "bootstrap",
		Usage:     "serve SGLang's disaggregation bootstrap server on its own",
		UsageText: "kvhost bootstrap [--host 127.0.0.1] [--port 8998] [--addr-file FILE]",
		Description: "Prefill ranks register where their ZeroMQ sockets listen (PUT /route); decode ranks ask\n" +
			"for the prefill layout and for each rank (GET /route) and check /health as a heartbeat.\n" +
			"`kvhost prefill` (--style sglang) serves this itself by default, as SGLang's prefill server\n" +
			"does, so the heartbeat notices a dead prefill. Run it alone when prefill ranks live in\n" +
			"several processes (each started with --bootstrap-addr); decode's heartbeat then watches\n" +
			"this process, not the prefill ones. Prints the address it serves (host:port) on stdout and\n" +
			"serves until SIGINT or SIGTERM.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "host", Value: "127.0.0.1", EnvVars: env("HOST"), Usage: "address to listen on"},
			&cli.IntFlag{Name: "port", Value: 8998, EnvVars: env("BOOTSTRAP_PORT"), Usage: "port (0 picks a free one)"},
			&cli.StringFlag{Name: "addr-file", EnvVars: env("BOOTSTRAP_ADDR_FILE"), Usage: "write the address served (host:port) to `FILE`"},
		},
		Action: func(c *cli.Context) error {
			srv, err := bootstrap.NewServer(bootstrap.WithLogger(slog.Default())).Start(net.JoinHostPort(c.String("host"), strconv.Itoa(c.Int("port"))))
			if err != nil {
				return fmt.Errorf("bootstrap: %w", err)
			}
			if f := c.String("addr-file"); f != "" {
				if err := os.WriteFile(f, []byte(srv.Addr()+"\n"), 0o644); err != nil {
					return fmt.Errorf("--addr-file: %w", err)
				}
			}
			fmt.Fprintln(c.App.Writer, srv.Addr())
			ctx, cancel := signalContext(c)
			defer cancel()
			<-ctx.Done()
			sctx, scancel := context.WithTimeout(context.Background(), time.Second)
			defer scancel()
			return srv.Close(sctx)
		},
	}
}
