package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/demo/pullworker"
)

// vllmArgs is a small model every vLLM-style test shares.
var vllmArgs = []string{"--style", "vllm", "--layers", "2", "--kv-heads", "4", "--head-dim", "16", "--requests", "12",
	"--seed", "9", "--min-tokens", "1", "--max-tokens", "100", "--prefix-rate", "0.5", "--full-hit-rate", "0.3",
	"--concurrency", "4"}

// newTestApp returns an app that never exits the process.
func newTestApp(out *bytes.Buffer) *cli.App {
	app := newApp()
	app.Writer, app.ErrWriter = out, out
	app.ExitErrHandler = func(*cli.Context, error) {}
	return app
}

// TestVLLMStyleWorkers runs `kvhost prefill --style vllm` and `kvhost
// decode --style vllm` (in this process) over the whole workload and reads
// their JSON summaries and reports.
func TestVLLMStyleWorkers(t *testing.T) {
	dir := t.TempDir()
	urlFile := filepath.Join(dir, "api.url")
	var pout, dout bytes.Buffer
	papp, dapp := newTestApp(&pout), newTestApp(&dout)
	perr := make(chan error, 1)
	go func() {
		perr <- papp.Run(append([]string{"kvhost", "prefill", "--tp-size", "1", "--page-size", "8", "--api-port", "0",
			"--side-channel-port", "0", "--api-url-file", urlFile, "--abort-timeout", "30",
			"--summary", filepath.Join(dir, "prefill.json"), "--report", filepath.Join(dir, "releases.jsonl")}, vllmArgs...))
	}()
	var url []byte
	for deadline := time.Now().Add(20 * time.Second); len(url) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the prefill did not write its URL: %s", pout.String())
		}
		url, _ = os.ReadFile(urlFile)
	}
	err := dapp.Run(append([]string{"kvhost", "decode", "--tp-size", "2", "--page-size", "16",
		"--prefill-url", strings.TrimSpace(string(url)), "--summary", filepath.Join(dir, "decode.json"),
		"--report", filepath.Join(dir, "requests.jsonl")}, vllmArgs...))
	if err != nil {
		t.Fatalf("decode: %v\n%s", err, dout.String())
	}
	select {
	case err := <-perr:
		if err != nil {
			t.Fatalf("prefill: %v\n%s", err, pout.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the prefill did not finish")
	}
	var ds pullworker.DecodeSummary
	var ps pullworker.PrefillSummary
	readJSON(t, filepath.Join(dir, "decode.json"), &ds)
	readJSON(t, filepath.Join(dir, "prefill.json"), &ps)
	if ds.OK != 12 || ds.Failed != 0 || ds.TPSize != 2 || len(ds.Ranks) != 2 || ds.Reads == 0 || ds.FullHits == 0 {
		t.Fatalf("decode summary %+v", ds)
	}
	if !ps.Done || ps.ReleasedNotified != 12 {
		t.Fatalf("prefill summary %+v", ps)
	}
	// A worker alone in its process reports its threads' CPU time over its
	// requests phase (kvhost demo adds them up).
	if c := ds.CPU; c == nil || c.RunSeconds <= 0 || c.WaitSeconds < 0 || c.Threads == 0 {
		t.Errorf("decode CPU %+v", c)
	}
	if c := ps.CPU; c == nil || c.RunSeconds <= 0 || c.WaitSeconds < 0 || c.Threads == 0 {
		t.Errorf("prefill CPU %+v", c)
	}
	for _, f := range []string{"requests.jsonl", "releases.jsonl"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if len(lines) != 12 {
			t.Fatalf("%s has %d lines", f, len(lines))
		}
		var line map[string]any
		if err := json.Unmarshal([]byte(lines[0]), &line); err != nil || line["request_id"] == nil {
			t.Fatalf("%s: %q %v", f, lines[0], err)
		}
	}
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// TestStyleFlagErrors: flags of the other style (from the command line or
// the environment), bad values and a partial prefill engine are refused
// with a message naming the flag.
func TestStyleFlagErrors(t *testing.T) {
	t.Setenv("KVHOST_STYLE", "") // the default style, whatever the caller's environment says
	for _, c := range []struct {
		args []string
		env  string // NAME=value set for this case
		want string
	}{
		{[]string{"decode", "--style", "vllm", "--chunk-pages", "4"}, "", "--chunk-pages does not apply to --style vllm (it is a --style sglang flag)"},
		{[]string{"prefill", "--style", "vllm", "--bootstrap-port", "1"}, "", "--bootstrap-port does not apply to --style vllm"},
		{[]string{"prefill", "--style", "vllm", "--pp-size", "2"}, "", "--pp-size does not apply to --style vllm"},
		{[]string{"prefill", "--style", "vllm", "--no-bytes"}, "", "--no-bytes does not apply to --style vllm"},
		{[]string{"decode", "--style", "vllm"}, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=5", "--waiting-timeout does not apply to --style vllm (it is a --style sglang flag); $SGLANG_DISAGGREGATION_WAITING_TIMEOUT sets it"},
		{[]string{"decode", "--bootstrap-addr", "127.0.0.1:1", "--prefill-url", "http://x"}, "", "--prefill-url does not apply to --style sglang (it is a --style vllm flag)"},
		{[]string{"prefill", "--side-channel-port", "0"}, "", "--side-channel-port does not apply to --style sglang"},
		{[]string{"prefill"}, "KVHOST_STYLE=vllm KVHOST_XFER=prepped", "--xfer does not apply to --style vllm"},
		{[]string{"prefill", "--style", "vllm", "--tp-size", "2", "--tp-ranks", "1"}, "", "host all 2 ranks"},
		{[]string{"decode", "--style", "vllm", "--kv-layout", "XYZ"}, "", "--kv-layout"},
		{[]string{"decode", "--style", "vllm", "--dtype", "bfloat16", "--dtype-bytes", "4"}, "", "--dtype-bytes says 4"},
		{[]string{"decode", "--style", "vllm", "--dtype-bytes", "3"}, "", "--dtype-bytes: 3-byte elements"},
		{[]string{"decode", "--style", "vllm", "--mem-kinds", "mixed"}, "", "one memory type"},
		{[]string{"prefill", "--style", "vllm", "--abort-timeout", "never"}, "", `"never" is neither a number nor a duration`},
		{[]string{"prefill", "--style", "vllm", "--abort-timeout", "0"}, "", "--abort-timeout 0s: must be positive"},
		{[]string{"decode", "--style", "vllm", "--prefix-rate", "2"}, "", "--prefix-rate"},
		{[]string{"decode", "--style", "mooncake"}, "", "want sglang or vllm"},
		{[]string{"decode"}, "", "--bootstrap-addr is required"},
		{[]string{"decode", "--style", "vllm", "extra"}, "", "unexpected argument \"extra\""},
	} {
		for _, kv := range strings.Fields(c.env) {
			k, v, _ := strings.Cut(kv, "=")
			t.Setenv(k, v)
		}
		var out bytes.Buffer
		err := newTestApp(&out).Run(append([]string{"kvhost", "--backend", "nosuchplugin"}, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v %s: %v, want %q", c.args, c.env, err, c.want)
		}
		for _, kv := range strings.Fields(c.env) {
			k, _, _ := strings.Cut(kv, "=")
			os.Unsetenv(k)
		}
	}
}

// TestWorkerHelp: each worker command's help shows both styles' flags,
// grouped by style, with the variable behind each.
func TestWorkerHelp(t *testing.T) {
	for _, c := range []struct {
		cmd  string
		want []string
	}{
		{"prefill", []string{"--style value", "[$KVHOST_STYLE]", "sglang style, bootstrap and wire:", "--bootstrap-port PORT",
			"sglang style, runtime (SGLang's defaults; its variables are aliases):", "$SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
			"sglang style, layout and workload:", "--chunk-pages", "vllm style:", "--side-channel-port", "$VLLM_NIXL_SIDE_CHANNEL_PORT",
			"$VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "Model shape (same on both sides):", "$KVHOST_PREFILL_TP_SIZE"}},
		{"decode", []string{"--style value", "--bootstrap-addr HOST:PORT", "$SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
			"vllm style:", "--prefill-url", "[$KVHOST_PREFILL_URL]", "$KVHOST_DECODE_TP_SIZE"}},
	} {
		out, err := runKvhost(t, "", c.cmd, "--help")
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range c.want {
			if !strings.Contains(out, w) {
				t.Errorf("%s --help lacks %q", c.cmd, w)
			}
		}
		if strings.Index(out, "sglang style, bootstrap") > strings.Index(out, "vllm style:") {
			t.Errorf("%s --help: the sglang groups should come before the vllm one", c.cmd)
		}
	}
}
