// Package e2e runs kvhost prefill and decode workers as separate processes
// (this test binary re-executed as a worker) on the fake plugin and checks
// their summaries: every byte verified, failures with their reasons.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
)

// childEnv carries a worker's spec (JSON) to the re-executed test binary.
const childEnv = "KVHOST_E2E_CHILD"

// spec is one worker process.
type spec struct {
	Role        string              `json:"role"` // prefill or decode
	Variant     string              `json:"variant"`
	Completion  string              `json:"completion"`
	Xfer        string              `json:"xfer"`
	Shape       pushworker.Shape    `json:"shape"`
	Workload    pushworker.Workload `json:"workload"`
	TPSize      int                 `json:"tp_size"`
	PPSize      int                 `json:"pp_size"`
	TPRanks     []int               `json:"tp_ranks,omitempty"`
	PPRanks     []int               `json:"pp_ranks,omitempty"`
	Params      []string            `json:"params,omitempty"`
	Concurrency int                 `json:"concurrency"`
	// Prefill: serve the bootstrap server and write its address to
	// AddrFile. Decode: BootstrapAddr.
	AddrFile      string `json:"addr_file,omitempty"`
	BootstrapAddr string `json:"bootstrap_addr,omitempty"`
	Summary       string `json:"summary"`

	BootstrapTimeout  time.Duration `json:"bootstrap_timeout,omitempty"`
	WaitingTimeout    time.Duration `json:"waiting_timeout,omitempty"`
	HeartbeatInterval time.Duration `json:"heartbeat_interval,omitempty"`
	HeartbeatFailures int           `json:"heartbeat_failures,omitempty"`
	TransferTimeout   time.Duration `json:"transfer_timeout,omitempty"`
	InitTimeout       time.Duration `json:"init_timeout,omitempty"`
}

func TestMain(m *testing.M) {
	if s := os.Getenv(childEnv); s != "" {
		os.Exit(runChild(s))
	}
	os.Exit(m.Run())
}

// runChild is the worker process.
func runChild(raw string) int {
	var sp spec
	if err := json.Unmarshal([]byte(raw), &sp); err != nil {
		fmt.Fprintln(os.Stderr, "child spec:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	pl, err := plugin.Load("fake", plugin.SearchDirs(""))
	if err != nil {
		fmt.Fprintln(os.Stderr, "load fake:", err)
		return 2
	}
	params, err := plugin.ParseParams(sp.Params)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	v, _ := push.ParseVariant(sp.Variant)
	c, _ := push.ParseCompletion(sp.Completion)
	common := pushworker.Common{
		Plugin: pl, AgentParams: params, Variant: v, Completion: c, Shape: sp.Shape, Workload: sp.Workload,
		TPSize: sp.TPSize, PPSize: sp.PPSize, TPRanks: sp.TPRanks, PPRanks: sp.PPRanks,
		Concurrency: sp.Concurrency, Logger: log,
		Settings: push.Settings{
			BootstrapTimeout: sp.BootstrapTimeout, WaitingTimeout: sp.WaitingTimeout,
			HeartbeatInterval: sp.HeartbeatInterval, HeartbeatMaxFailures: sp.HeartbeatFailures,
			TransferTimeout: sp.TransferTimeout,
		},
	}
	ctx := context.Background()
	var s *pushworker.Summary
	switch sp.Role {
	case "prefill":
		srv, err := bootstrap.NewServer(bootstrap.WithLogger(log)).Start("127.0.0.1:0")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		err = os.WriteFile(sp.AddrFile+".tmp", []byte(srv.Addr()), 0o644)
		if err == nil {
			err = os.Rename(sp.AddrFile+".tmp", sp.AddrFile)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		x, _ := push.ParseXferMode(sp.Xfer)
		s, err = pushworker.RunPrefill(ctx, pushworker.PrefillOptions{Common: common, XferMode: x, BootstrapAddr: srv.Addr()})
		if err != nil {
			fmt.Fprintln(os.Stderr, "prefill:", err)
		}
		sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		srv.Close(sctx)
		cancel()
	case "decode":
		s, err = pushworker.RunDecode(ctx, pushworker.DecodeOptions{Common: common, BootstrapAddr: sp.BootstrapAddr, InitTimeout: sp.InitTimeout})
		if err != nil {
			fmt.Fprintln(os.Stderr, "decode:", err)
		}
	}
	if s == nil {
		return 2
	}
	var buf bytes.Buffer
	s.WriteJSON(&buf)
	if err := os.WriteFile(sp.Summary, buf.Bytes(), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if !s.OKExit() {
		return 1
	}
	return 0
}

// child is a running worker process.
type child struct {
	t      *testing.T
	sp     spec
	cmd    *exec.Cmd
	stderr *bytes.Buffer
	done   chan error
}

func start(t *testing.T, sp spec) *child {
	t.Helper()
	raw, _ := json.Marshal(sp)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(raw))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{t: t, sp: sp, cmd: cmd, stderr: &stderr, done: make(chan error, 1)}
	go func() { c.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			c.cmd.Process.Kill()
			<-c.done
		}
	})
	return c
}

// wait waits for the worker to exit (within timeout) and returns its
// summary.
func (c *child) wait(timeout time.Duration) *pushworker.Summary {
	c.t.Helper()
	select {
	case <-c.done:
	case <-time.After(timeout):
		c.cmd.Process.Signal(syscall.SIGQUIT)
		<-c.done
		c.t.Fatalf("%s worker did not finish in %v; stderr:\n%s", c.sp.Role, timeout, tail(c.stderr.String()))
	}
	raw, err := os.ReadFile(c.sp.Summary)
	if err != nil {
		c.t.Fatalf("%s worker wrote no summary (%v); stderr:\n%s", c.sp.Role, c.cmd.ProcessState, tail(c.stderr.String()))
	}
	var s pushworker.Summary
	if err := json.Unmarshal(raw, &s); err != nil {
		c.t.Fatal(err)
	}
	return &s
}

func (c *child) kill() {
	c.cmd.Process.Kill()
	<-c.done
}

func tail(s string) string {
	if len(s) > 4000 {
		return "..." + s[len(s)-4000:]
	}
	return s
}

// waitFile returns the content of a file once it exists.
func waitFile(t *testing.T, path string, c *child) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return strings.TrimSpace(string(b))
		}
		select {
		case <-c.done:
			t.Fatalf("prefill exited early (%v); stderr:\n%s", c.cmd.ProcessState, tail(c.stderr.String()))
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatalf("no bootstrap address from prefill; stderr:\n%s", tail(c.stderr.String()))
	return ""
}

// pairSpec is a prefill and a decode worker of one scenario.
type pairSpec struct {
	prefill, decode spec
}

// startPair starts prefill (serving bootstrap) then decode, wired together.
func startPair(t *testing.T, ps pairSpec) (*child, *child) {
	t.Helper()
	dir := t.TempDir()
	ps.prefill.Role, ps.decode.Role = "prefill", "decode"
	ps.prefill.AddrFile = filepath.Join(dir, "bootstrap")
	ps.prefill.Summary = filepath.Join(dir, "prefill.json")
	ps.decode.Summary = filepath.Join(dir, "decode.json")
	p := start(t, ps.prefill)
	ps.decode.BootstrapAddr = waitFile(t, ps.prefill.AddrFile, p)
	d := start(t, ps.decode)
	return p, d
}
