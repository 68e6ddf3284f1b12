package main

import (
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestEveryFlagShowsItsVariable: every visible flag of kvhost and of every
// command can be set by an environment variable, and its help says which.
func TestEveryFlagShowsItsVariable(t *testing.T) {
	app := newApp()
	check := func(where string, flags []cli.Flag) {
		for _, f := range flags {
			if vf, ok := f.(cli.VisibleFlag); ok && !vf.IsVisible() {
				continue
			}
			df, ok := f.(cli.DocGenerationFlag)
			if !ok || len(df.GetEnvVars()) == 0 {
				t.Errorf("%s --%s: no environment variable", where, f.Names()[0])
				continue
			}
			if help := f.String(); !strings.Contains(help, "$"+df.GetEnvVars()[0]) {
				t.Errorf("%s --%s: help %q does not name $%s", where, f.Names()[0], help, df.GetEnvVars()[0])
			}
		}
	}
	check("kvhost", app.Flags)
	if len(app.Commands) != 8 {
		t.Errorf("%d commands", len(app.Commands))
	}
	for _, c := range app.Commands {
		check("kvhost "+c.Name, c.Flags)
		if c.Usage == "" || c.Description == "" || c.UsageText == "" {
			t.Errorf("kvhost %s: usage, description or usage text missing", c.Name)
		}
	}
}

// TestHelp: kvhost --help lists every command and the global flags.
func TestHelp(t *testing.T) {
	out, err := runKvhost(t, "", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kvhost demo", "bench", "bootstrap", "decode", "plan", "plugins", "prefill", "serve",
		"--backend NAME", "[$KVHOST_BACKEND]", "[$KVHOST_PLUGIN_PATH]", "[$KVHOST_LOG_LEVEL]", "[$KVHOST_LOG_FORMAT]"} {
		if !strings.Contains(out, want) {
			t.Errorf("kvhost --help lacks %q:\n%s", want, out)
		}
	}
}
