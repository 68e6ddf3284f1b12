package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvhost/kvhost/host/serve/client"
)

func TestServeHelp(t *testing.T) {
	out, err := runKvhost(t, "", "serve", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"docs/engine-api.md", "--control ENDPOINT", "[$KVHOST_CONTROL]", "--metrics-addr", "[$KVHOST_AGENT_PARAMS]",
		"SIGTERM", "disconnected"} {
		if !strings.Contains(out, want) {
			t.Errorf("kvhost serve --help lacks %q:\n%s", want, out)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the app's writes and the test's
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestServeCommand: kvhost serve prints its endpoint, answers hello with
// the backend, serves /health and /metrics, and on cancellation (SIGTERM's path) exits cleanly and
// removes its socket file.
func TestServeCommand(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "k.sock")
	app := newApp()
	var out syncBuffer
	app.Writer, app.ErrWriter = &out, &out
	app.ExitErrHandler = func(*cli.Context, error) {}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	maddr := ln.Addr().String()
	ln.Close()
	go func() {
		done <- app.RunContext(ctx, []string{"kvhost", "serve", "--control", "ipc://" + sock, "--metrics-addr", maddr})
	}()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "ipc://"+sock) {
		if time.Now().After(deadline) {
			t.Fatalf("no endpoint printed: %q", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v", fi, err)
	}
	dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
	defer dcancel()
	c, err := client.Dial(dctx, "ipc://"+sock, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if h := c.Hello(); h.Backend != "fake" || !h.Has("sglang") || !strings.HasPrefix(h.Sidecar, "kvhost") {
		t.Fatalf("hello %+v", h)
	}
	for _, path := range []string{"/health", "/metrics"} {
		resp, err := http.Get("http://" + maddr + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %s\n%s", path, resp.Status, body)
		}
		if path == "/metrics" && !strings.Contains(string(body), `role="sidecar"`) {
			t.Fatalf("/metrics lacks the sidecar's labels:\n%s", body)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("kvhost serve: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("kvhost serve did not stop")
	}
	<-c.Done()
	c.Close()
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket file left: %v", err)
	}
}
