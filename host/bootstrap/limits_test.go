package bootstrap

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog/ratelogtest"
)

// A first registration whose sizes multiply past any real deployment is
// refused: with 65536 of each, dp × cp × tp × pp wrapped to 0 and the
// server called itself ready after one rank.
func TestLayoutSizeBound(t *testing.T) {
	s, c := start(t)
	r := reg(1, 0, 1, 0)
	r.AttnTPSize, r.AttnCPSize, r.AttnDPSize, r.PPSize = 1<<16, 1<<16, 1<<16, 1<<16
	body, _ := json.Marshal(r)
	code, msg := rawDo(t, "PUT", "http://"+c.Addr+"/route", string(body))
	if code != 400 || !strings.Contains(msg, "exceeds") {
		t.Fatalf("huge layout: %d %q, want 400", code, msg)
	}
	if s.Ready() {
		t.Fatal("ready after a refused registration")
	}
	r.AttnTPSize, r.AttnCPSize, r.AttnDPSize, r.PPSize = 1<<10, 1<<10, 1, 1
	if err := c.Register(context.Background(), r); err != nil {
		t.Fatalf("2^20 ranks: %v", err)
	}
}

// Clients that trickle their headers or body, or send oversized headers,
// are cut off by the listening server's limits while others are served;
// Close ends every connection's goroutine, stalled ones included.
func TestSlowAndOversizedClients(t *testing.T) {
	before := runtime.NumGoroutine()
	limits := httpLimits{readHeader: 200 * time.Millisecond, read: 400 * time.Millisecond,
		write: 400 * time.Millisecond, idle: time.Second, maxHeaderBytes: 4 << 10}
	s := NewServer(WithLogger(quiet), withHTTPLimits(limits))
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dial := func(first string) net.Conn { return rawConn(t, rs.Addr(), first, 10*time.Second) }
	// droppedWithin reads until the server closes c.
	droppedWithin := func(name string, c net.Conn, max time.Duration) {
		t.Helper()
		start := time.Now()
		io.Copy(io.Discard, c)
		if el := time.Since(start); el > max {
			t.Errorf("%s: dropped after %v, want within %v", name, el, max)
		}
	}
	slowHeader := dial("GET /health HTTP/1.1\r\nHost: x\r\n")
	slowBody := dial("PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"attn")

	// Everyone else is served meanwhile.
	if err := NewClient(rs.Addr()).Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	big := dial("GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + strings.Repeat("j", 8<<10) + "\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(big), nil)
	if err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("oversized headers: %v %v, want 431", resp, err)
	}
	droppedWithin("slow headers", slowHeader, 3*time.Second)
	droppedWithin("slow body", slowBody, 3*time.Second)

	// A stalled client is still connected when the server closes.
	stalled := dial("GET /health HTTP/1.1\r\n")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rs.Close(ctx); err != nil {
		t.Fatal(err)
	}
	stalled.Close()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A client sending 20,000 bad registrations over one connection writes a
// bounded number of log lines (it wrote one each, 2.5 MB/s), and what was
// not written is counted in a line of its own.
func TestBadRequestFloodIsRateLimited(t *testing.T) {
	const requests, maxLines = 20000, 200
	var out ratelogtest.LineCounter
	s := NewServer(WithLogger(slog.New(slog.NewTextHandler(&out, nil))))
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + rs.Addr() + "/route"
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	start := time.Now()
	for i := range requests {
		req, _ := http.NewRequest("PUT", url, strings.NewReader(`{"attn_tp_size": "x"}`))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("request %d: status %d, want 400", i, resp.StatusCode)
		}
	}
	elapsed := time.Since(start)
	client.CloseIdleConnections()
	if err := rs.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	lines, last := out.Count()
	t.Logf("%d bad requests in %v: %d log lines", requests, elapsed, lines)
	if lines > maxLines {
		t.Fatalf("%d log lines for %d bad requests, want at most %d", lines, requests, maxLines)
	}
	if !strings.Contains(last, "suppressed") {
		t.Fatalf("the suppressed lines were not reported; last line %q", last)
	}
}
