package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/demo"
)

var quickDemo = []string{"demo", "--in-process", "--requests", "6", "--layers", "2", "--kv-heads", "4", "--head-dim", "16",
	"--page-size", "4", "--max-tokens", "40", "--min-tokens", "1"}

func TestDemoCommand(t *testing.T) {
	out, err := runKvhost(t, "", quickDemo...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"OK: every byte verified", "6 ok, 0 failed (of 6)", "raw memcpy on this machine", "latency p50", "descriptors"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	out, err = runKvhost(t, "", append(quickDemo, "--json", "--style", "vllm", "--attention", "mla", "--decode-tp", "2", "--mem-kinds", "dram")...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var s demo.Summary
	if err := json.Unmarshal([]byte(out), &s); err != nil || !s.Success() || s.Style != "vllm" || s.DecodeTP != 2 || s.MemKinds != "dram" || s.BytesVerified == 0 {
		t.Fatalf("json %v: %s", err, out)
	}
}

func TestDemoCommandFailures(t *testing.T) {
	// Injected transfer failures: the summary says so and the exit is not 0.
	out, err := runKvhost(t, "", append(quickDemo, "--agent-param", "fail_rate=1")...)
	if err == nil || !strings.Contains(err.Error(), "not verified") || !strings.Contains(out, "FAILED") {
		t.Fatalf("err %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"demo", "--style", "trtllm"}, "style"},
		{[]string{"demo", "--metrics-addr", "127.0.0.1:0"}, "--in-process"},
		{[]string{"demo", "--in-process", "--requests", "0"}, "requests"},
		{[]string{"demo", "extra"}, "unexpected argument"},
		{[]string{"demo", "--in-process", "--mem-kinds", "hbm"}, "memory kinds"},
		{[]string{"demo", "--in-process", "--mem-kinds", "dram"}, "needs VRAM decode pools"},
	} {
		out, err := runKvhost(t, "", c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: err %v (want %q)\n%s", c.args, err, c.want, out)
		}
	}
}
