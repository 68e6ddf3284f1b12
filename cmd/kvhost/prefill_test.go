package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/push"
)

var smallWorker = []string{"--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--page-size", "4",
	"--requests", "16", "--max-tokens", "40", "--min-tokens", "1", "--chunk-pages", "2", "--prefix-rate", "0.3"}

func readSummary(t *testing.T, path string) pushworker.Summary {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var s pushworker.Summary
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

func waitAddr(t *testing.T, path string, done chan error) string {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return strings.TrimSpace(string(b))
		}
		select {
		case err := <-done:
			t.Fatalf("prefill ended early: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatal("prefill wrote no bootstrap address")
	return ""
}

// TestPrefillDecodeCLI runs `kvhost prefill` (serving the bootstrap
// server) and `kvhost decode` against each other: TP 2 -> 4, MORI and
// NIXL layouts, every byte verified, summaries written.
func TestPrefillDecodeCLI(t *testing.T) {
	fakeDir(t)
	for _, variant := range []string{"nixl", "mori"} {
		t.Run(variant, func(t *testing.T) {
			dir := t.TempDir()
			addrFile := filepath.Join(dir, "addr")
			ps, ds := filepath.Join(dir, "p.json"), filepath.Join(dir, "d.json")
			done := make(chan error, 1)
			go func() {
				_, err := runKvhost(t, "", append([]string{"--log-level", "warn", "prefill", "--variant", variant, "--tp-size", "2",
					"--bootstrap-port", "0", "--bootstrap-addr-file", addrFile, "--summary", ps}, smallWorker...)...)
				done <- err
			}()
			addr := waitAddr(t, addrFile, done)
			_, err := runKvhost(t, "", append([]string{"--log-level", "warn", "decode", "--variant", variant, "--tp-size", "4",
				"--tp-ranks", "0-3", "--bootstrap-addr", addr, "--summary", ds}, smallWorker...)...)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if err := <-done; err != nil {
				t.Fatalf("prefill: %v", err)
			}
			p, d := readSummary(t, ps), readSummary(t, ds)
			if p.OK != 16 || d.OK != 16 || d.Bytes == 0 || len(d.Ranks) != 4 || len(p.Ranks) != 2 {
				t.Fatalf("prefill %+v\ndecode %+v", p, d)
			}
			// A worker alone in its process reports its threads' CPU time
			// over its requests phase (kvhost demo adds them up).
			for _, s := range []*pushworker.Summary{&p, &d} {
				if s.CPU == nil || s.CPU.RunSeconds <= 0 || s.CPU.WaitSeconds < 0 || s.CPU.Threads == 0 {
					t.Errorf("%s CPU %+v", s.Role, s.CPU)
				}
			}
		})
	}
}

// TestPrefillEnvAlias: SGLang's variables are the env aliases of the
// timeout flags, and their plain-seconds values parse.
func TestPrefillEnvAlias(t *testing.T) {
	want := map[string][]string{
		"prefill/bootstrap-timeout":    {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"},
		"prefill/queue-size":           {"SGLANG_DISAGGREGATION_QUEUE_SIZE"},
		"prefill/mori-aux-rdma":        {"SGLANG_MORI_SEND_AUX_RDMA"},
		"decode/waiting-timeout":       {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT"},
		"decode/heartbeat-interval":    {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"},
		"decode/heartbeat-max-failure": {"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"},
	}
	found := 0
	for _, cmd := range newApp().Commands {
		for _, f := range cmd.Flags {
			df, ok := f.(cli.DocGenerationFlag)
			if !ok {
				continue
			}
			for _, name := range f.Names() {
				for _, env := range want[cmd.Name+"/"+name] {
					if !slices.Contains(df.GetEnvVars(), env) {
						t.Errorf("%s --%s: env vars %v lack %s", cmd.Name, name, df.GetEnvVars(), env)
					}
					found++
				}
			}
		}
	}
	if found != len(want) {
		t.Fatalf("found %d of %d aliased flags", found, len(want))
	}
	// A short bootstrap timeout given as SGLang writes it (plain seconds, in
	// its variable): no decode comes, every request fails in Bootstrapping,
	// exit non-zero.
	dir := t.TempDir()
	ps := filepath.Join(dir, "p.json")
	t.Setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "0.2")
	start := time.Now()
	_, err := runKvhost(t, "", append([]string{"--log-level", "error", "prefill", "--bootstrap-port", "0", "--summary", ps}, smallWorker...)...)
	if err == nil || time.Since(start) > 10*time.Second {
		t.Fatalf("err %v after %v", err, time.Since(start))
	}
	p := readSummary(t, ps)
	if p.Failed != 16 || !strings.Contains(p.Failures[0].Reason, "in KVPoll.Bootstrapping") {
		t.Fatalf("%+v", p)
	}
}

// TestRunsDoNotShareFlags: a value one run of the app took from the command
// line or the environment does not reach the next run in the same process.
func TestRunsDoNotShareFlags(t *testing.T) {
	type seen struct {
		backend string
		timeout time.Duration
	}
	capture := func(args ...string) seen {
		t.Helper()
		app := newApp()
		var got seen
		for _, cmd := range app.Commands {
			if cmd.Name == "prefill" {
				cmd.Action = func(c *cli.Context) error {
					got = seen{c.String(flagBackend), secondsValue(c, "bootstrap-timeout")}
					return nil
				}
			}
		}
		if err := app.Run(append([]string{"kvhost"}, args...)); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := capture("--backend", "nixl", "prefill", "--bootstrap-timeout", "7"); got != (seen{"nixl", 7 * time.Second}) {
		t.Fatalf("first run saw %+v", got)
	}
	t.Setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "9")
	if got := capture("prefill"); got != (seen{"fake", 9 * time.Second}) {
		t.Fatalf("second run saw %+v, want the defaults and the env's 9 s", got)
	}
	os.Unsetenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
	if got := capture("prefill"); got != (seen{"fake", push.DefaultBootstrapTimeout}) {
		t.Fatalf("third run saw %+v, want the defaults", got)
	}
}

func TestWorkerFlagErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"prefill", "--variant", "ucx"}, "unknown wire variant"},
		{[]string{"prefill", "--tp-size", "2", "--tp-ranks", "0,2"}, "--tp-ranks"},
		{[]string{"prefill", "--attention", "gqa"}, "--attention"},
		{[]string{"prefill", "--xfer", "rdma"}, "unknown transfer mode"},
		{[]string{"prefill", "--min-tokens", "10", "--max-tokens", "5"}, "token range"},
		{[]string{"prefill", "--bootstrap-timeout", "soon"}, "neither a number nor a duration"},
		{[]string{"decode"}, "bootstrap-addr"},
		{[]string{"--backend", "nosuch", "decode", "--bootstrap-addr", "127.0.0.1:1"}, "nosuch"},
	} {
		_, err := runKvhost(t, "", c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v (want %q)", c.args, err, c.want)
		}
	}
}
