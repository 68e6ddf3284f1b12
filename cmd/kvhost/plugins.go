package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/conformance"
	"github.com/kvhost/kvhost/host/plugin"
)

func init() { register(pluginsCommand) }

// pluginsCommand builds `kvhost plugins`.
func pluginsCommand() *cli.Command {
	return &cli.Command{
		Name:  "plugins",
		Usage: "list the transfer plugins in the plugin path, or prove one with the conformance suite",
		UsageText: "kvhost plugins [--json]\n" +
			"kvhost plugins --check NAME [--param key=value ...] [--mode both|in-process|two-process]",
		Description: "Without --check, lists every libkvhost_<name>.so in the plugin path (see --plugin-path)\n" +
			"with its version, ABI version, capabilities, memory kinds and agent parameters, or the\n" +
			"reason it cannot be loaded. A file shadowed by an earlier one of the same name is listed\n" +
			"but not used.\n\n" +
			"With --check NAME, runs the plugin conformance suite against the plugin, with peers in\n" +
			"this process and in a helper process, and exits non-zero if any case fails. Cases the\n" +
			"plugin's capabilities rule out are skipped with the reason.",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "json", EnvVars: env("PLUGINS_JSON"), Usage: "print the list as JSON"},
			&cli.StringFlag{Name: "check", EnvVars: env("PLUGINS_CHECK"), Usage: "run the conformance suite against plugin `NAME`"},
			&cli.StringSliceFlag{Name: "param", EnvVars: env("PLUGINS_PARAMS"), Usage: "agent parameter `key=value` for --check (repeatable), e.g. backend=UCX"},
			&cli.StringFlag{Name: "mode", EnvVars: env("PLUGINS_MODE"), Value: "both", Usage: "where --check's peer agents live: in-process, two-process or both"},
			&cli.StringSliceFlag{Name: "abi-variant", EnvVars: env("PLUGINS_ABI_VARIANTS"), Usage: "for --check: a build of the plugin for another ABI major (`FILE`), which must be refused"},
			&cli.BoolFlag{Name: "conformance-helper", Hidden: true, Usage: "serve as the helper process of --check"},
		},
		Action: runPlugins,
	}
}

func runPlugins(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("plugins: unexpected argument %q (to check a plugin: --check NAME)", c.Args().First())
	}
	if c.Bool("conformance-helper") {
		if os.Getenv(conformance.HelperEnv) == "" {
			return errors.New("plugins: --conformance-helper is started by --check, not by hand")
		}
		return conformance.ServeHelperStdio()
	}
	dirs := plugin.SearchDirs(c.String(flagPluginPath))
	if name := c.String("check"); name != "" {
		return checkPlugin(c, name, dirs)
	}
	if c.IsSet("param") || c.IsSet("abi-variant") || c.IsSet("mode") {
		return errors.New("plugins: --param, --mode and --abi-variant go with --check NAME")
	}
	list := discover(dirs)
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(list)
	}
	writePluginList(c.App.Writer, list)
	return nil
}

// pluginList is the output of `kvhost plugins` (the JSON form as is).
type pluginList struct {
	SearchPath []string      `json:"search_path"`
	Plugins    []pluginEntry `json:"plugins"`
}

type pluginEntry struct {
	Name       string            `json:"name"`
	File       string            `json:"file"`
	Used       bool              `json:"used"`                  // false when shadowed or rejected
	ShadowedBy string            `json:"shadowed_by,omitempty"` // the file used instead
	Error      string            `json:"error,omitempty"`       // why the file was rejected
	Version    string            `json:"version,omitempty"`
	ABI        string            `json:"abi,omitempty"` // "major.minor"
	Caps       []string          `json:"capabilities,omitempty"`
	MemKinds   []string          `json:"memory_kinds,omitempty"`
	Params     []plugin.ParamDoc `json:"params,omitempty"`
	InfoName   string            `json:"plugin_name,omitempty"` // what the plugin calls itself, if not Name
}

func discover(dirs []string) pluginList {
	list := pluginList{SearchPath: dirs, Plugins: []pluginEntry{}}
	for _, c := range plugin.Discover(dirs) {
		e := pluginEntry{Name: c.Name, File: c.Path, ShadowedBy: c.ShadowedBy}
		if c.Err != nil {
			e.Error = c.Err.Error()
		} else {
			info := c.Info
			e.Used = c.ShadowedBy == ""
			e.Version = info.Version
			e.ABI = fmt.Sprintf("%d.%d", info.ABIMajor, info.ABIMinor)
			e.Caps = info.Caps.Names()
			for _, k := range info.MemKinds {
				e.MemKinds = append(e.MemKinds, k.String())
			}
			e.Params = info.ParamsDoc
			if info.Name != c.Name {
				e.InfoName = info.Name
			}
		}
		list.Plugins = append(list.Plugins, e)
	}
	return list
}

func writePluginList(w io.Writer, list pluginList) {
	fmt.Fprintf(w, "plugin path: %s\n", strings.Join(list.SearchPath, ":"))
	if len(list.Plugins) == 0 {
		fmt.Fprintf(w, "no libkvhost_*.so found (build the fake plugin with `make plugin-fake`, or set --plugin-path)\n")
		return
	}
	for _, p := range list.Plugins {
		fmt.Fprintf(w, "\n%s  %s\n", p.Name, p.File)
		switch {
		case p.Error != "":
			fmt.Fprintf(w, "  REJECTED: %s\n", strings.TrimPrefix(p.Error, p.File+": "))
			continue
		case p.ShadowedBy != "":
			fmt.Fprintf(w, "  not used: shadowed by %s\n", p.ShadowedBy)
		}
		if p.InfoName != "" {
			fmt.Fprintf(w, "  calls itself %q\n", p.InfoName)
		}
		fmt.Fprintf(w, "  version %s, ABI %s\n", p.Version, p.ABI)
		fmt.Fprintf(w, "  capabilities: %s\n", strings.Join(p.Caps, " "))
		fmt.Fprintf(w, "  memory kinds: %s\n", strings.Join(p.MemKinds, " "))
		if len(p.Params) > 0 {
			fmt.Fprintf(w, "  agent parameters:\n")
			for _, d := range p.Params {
				fmt.Fprintf(w, "    %s=%s\n      %s\n", d.Key, d.Default, d.Description)
			}
		}
	}
}

// checkPlugin runs the conformance suite against plugin name.
func checkPlugin(c *cli.Context, name string, dirs []string) error {
	params, err := plugin.ParseParams(c.StringSlice("param"))
	if err != nil {
		return fmt.Errorf("plugins --check: --param: %w", err)
	}
	modes, err := conformance.ParseModes(c.String("mode"))
	if err != nil {
		return fmt.Errorf("plugins --check: --mode: %w", err)
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("plugins --check: locating this binary for the helper process: %w", err)
	}
	w := c.App.Writer
	counts := map[conformance.Status]int{}
	for _, mode := range modes {
		cfg := conformance.Config{
			Plugin: name, Dirs: dirs, Params: params, Mode: mode, ABIVariants: c.StringSlice("abi-variant"),
			Helper: func() *exec.Cmd { return exec.Command(exe, "plugins", "--conformance-helper") },
		}
		results, err := conformance.Run(cfg, w)
		for _, r := range results {
			counts[r.Status]++
		}
		if err != nil {
			return fmt.Errorf("plugins --check %s (%s): %w", name, mode, err)
		}
	}
	fmt.Fprintf(w, "\n%s: %d passed, %d failed, %d skipped\n", name, counts[conformance.Pass], counts[conformance.Fail], counts[conformance.Skip])
	if counts[conformance.Fail] > 0 {
		return fmt.Errorf("plugins --check %s: %d cases failed", name, counts[conformance.Fail])
	}
	return nil
}
