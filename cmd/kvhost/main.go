// Command kvhost moves KV cache between prefill and decode workers of a
// disaggregated LLM serving cluster through runtime-loaded transfer plugins.
package main

import (
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"

	"github.com/urfave/cli/v2"
)

// commands holds every subcommand. Each lives in its own file and adds
// itself with register from an init function, so adding a command touches
// no other file.
var commands []*cli.Command

func register(c *cli.Command) { commands = append(commands, c) }

// Global flags shared by every command.
var (
	flagBackend = &cli.StringFlag{
		Name:    "backend",
		Usage:   "transfer plugin to use (fake, nixl, mori, or any plugin found in the plugin path)",
		Value:   "fake",
		EnvVars: []string{"KVHOST_BACKEND"},
	}
	flagPluginPath = &cli.StringFlag{
		Name:    "plugin-path",
		Usage:   "colon-separated folders searched for plugins before the binary's own folder, ../lib/kvhost beside it and the build tree",
		EnvVars: []string{"KVHOST_PLUGIN_PATH"},
	}
	flagLogLevel = &cli.StringFlag{
		Name:    "log-level",
		Usage:   "debug, info, warn or error",
		Value:   "info",
		EnvVars: []string{"KVHOST_LOG_LEVEL"},
	}
	flagLogFormat = &cli.StringFlag{
		Name:    "log-format",
		Usage:   "text or json",
		Value:   "text",
		EnvVars: []string{"KVHOST_LOG_FORMAT"},
	}
)

func newApp() *cli.App {
	sort.Slice(commands, func(i, j int) bool { return commands[i].Name < commands[j].Name })
	return &cli.App{
		Name:                 "kvhost",
		Usage:                "KV-cache transfer host for disaggregated LLM serving",
		Flags:                []cli.Flag{flagBackend, flagPluginPath, flagLogLevel, flagLogFormat},
		Commands:             commands,
		Before:               setupLogging,
		EnableBashCompletion: true,
	}
}

// setupLogging installs the default slog logger from --log-level and
// --log-format. Logs go to stderr so stdout stays machine-readable.
func setupLogging(c *cli.Context) error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String(flagLogLevel.Name))); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch strings.ToLower(c.String(flagLogFormat.Name)) {
	case "text":
		h = slog.NewTextHandler(os.Stderr, opts)
	case "json":
		h = slog.NewJSONHandler(os.Stderr, opts)
	default:
		return fmt.Errorf("--log-format: want text or json, got %q", c.String(flagLogFormat.Name))
	}
	slog.SetDefault(slog.New(h))
	return nil
}

func main() {
	if err := newApp().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "kvhost:", err)
		os.Exit(1)
	}
}
