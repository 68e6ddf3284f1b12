// Command kvhost moves KV cache between prefill and decode workers of a
// disaggregated LLM serving cluster through runtime-loaded transfer plugins.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
)

// commands holds a constructor per subcommand. Each command lives in its
// own file and registers its constructor from an init function, so adding
// a command touches no other file. newApp calls every constructor: urfave/cli
// keeps parsed values (from the command line and the environment) inside
// the flag structs, so an app must never share a flag with another run.
var commands []func() *cli.Command

func register(newCommand func() *cli.Command) { commands = append(commands, newCommand) }

// Names of the global flags, read by commands with c.String.
const (
	flagBackend    = "backend"
	flagPluginPath = "plugin-path"
	flagLogLevel   = "log-level"
	flagLogFormat  = "log-format"
)

// env names a flag's variable: KVHOST_ and the name.
func env(name string) []string { return []string{"KVHOST_" + name} }

// globalFlags are the flags every command shares (given before it).
func globalFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{
			Name:    flagBackend,
			Usage:   "transfer plugin `NAME` (fake, nixl, mori, or any libkvhost_NAME.so in the plugin path)",
			Value:   "fake",
			EnvVars: env("BACKEND"),
		},
		&cli.StringFlag{
			Name: flagPluginPath,
			Usage: "colon-separated `DIRS` searched for plugins before the binary's own folder, ../lib/kvhost beside it " +
				"and lib/kvhost of the kvhost checkout holding the working directory (see kvhost plugins)",
			EnvVars: env("PLUGIN_PATH"),
		},
		&cli.StringFlag{
			Name:    flagLogLevel,
			Usage:   "debug, info, warn or error",
			Value:   "info",
			EnvVars: env("LOG_LEVEL"),
		},
		&cli.StringFlag{
			Name:    flagLogFormat,
			Usage:   "text or json (logs go to stderr)",
			Value:   "text",
			EnvVars: env("LOG_FORMAT"),
		},
	}
}

// newApp builds the whole command tree afresh: every command and flag is
// new, so one process may run several apps (tests) without one run's
// values leaking into the next.
func newApp() *cli.App {
	cmds := make([]*cli.Command, 0, len(commands))
	for _, newCommand := range commands {
		cmds = append(cmds, newCommand())
	}
	sort.Slice(cmds, func(i, j int) bool { return cmds[i].Name < cmds[j].Name })
	return &cli.App{
		Name:  "kvhost",
		Usage: "KV-cache transfer host for disaggregated LLM serving",
		Description: "kvhost moves KV cache between the prefill and decode workers of a disaggregated LLM\n" +
			"deployment through a transfer plugin loaded at run time (fake, nixl, mori: --backend), on\n" +
			"the wire of SGLang's NIXL/MORI connectors (push) or vLLM's NIXL connector (pull).\n\n" +
			"Start with `kvhost demo`: a prefill and a decode deployment on this machine, every byte\n" +
			"verified. `kvhost plugins` lists the plugins found and why one is rejected; `kvhost bench`\n" +
			"measures one. `kvhost COMMAND --help` describes each command; every flag that an\n" +
			"environment variable can set shows it in brackets.",
		Flags:                globalFlags(),
		Commands:             cmds,
		Before:               setupLogging,
		EnableBashCompletion: true,
	}
}

// setupLogging installs the default slog logger from --log-level and
// --log-format. Logs go to stderr so stdout stays machine-readable.
func setupLogging(c *cli.Context) error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String(flagLogLevel))); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch strings.ToLower(c.String(flagLogFormat)) {
	case "text":
		h = slog.NewTextHandler(os.Stderr, opts)
	case "json":
		h = slog.NewJSONHandler(os.Stderr, opts)
	default:
		return fmt.Errorf("--log-format: want text or json, got %q", c.String(flagLogFormat))
	}
	slog.SetDefault(slog.New(h))
	return nil
}

// signalContext is the command's context, also cancelled by SIGINT or
// SIGTERM.
func signalContext(c *cli.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
}

func main() {
	if err := newApp().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "kvhost:", err)
		os.Exit(1)
	}
}
