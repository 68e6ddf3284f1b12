package bootstrap

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Close returns promptly, under the default limits, whatever the clients
// are doing: idle keep-alive connections (a decode's heartbeat client), a
// connection opened and never used (what a client's dial race leaves),
// a client stalled in its headers, one stalled in its body, and one that
// sent a request and never reads the answer. Every connection is closed
// and no goroutine is left.
func TestCloseIsPromptWithClientsConnected(t *testing.T) {
	before := runtime.NumGoroutine()
	s := NewServer(WithLogger(quiet))
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 8}
	defer tr.CloseIdleConnections()
	keepAlive := &Client{Addr: rs.Addr(), HTTP: &http.Client{Transport: tr}}
	for range 3 {
		if err := keepAlive.Health(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	dial := func(first string) net.Conn { return rawConn(t, rs.Addr(), first, 20*time.Second) }
	clients := map[string]net.Conn{
		"unused":        dial(""),
		"stalled head":  dial("GET /health HTTP/1.1\r\nHost: x\r\n"),
		"stalled body":  dial("PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"attn"),
		"never reads":   dial(strings.Repeat("GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 2000)),
		"second unused": dial(""),
	}
	time.Sleep(200 * time.Millisecond) // every connection is known to the server

	start := time.Now()
	if err := rs.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("Close took %v, want under 1 s", el)
	}
	for name, c := range clients {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil && !isReset(err) {
			t.Errorf("%s: still open after Close: %v", name, err)
		}
	}
	if err := keepAlive.Health(context.Background()); err == nil {
		t.Fatal("health after Close succeeded")
	}
	tr.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func isReset(err error) bool {
	return strings.Contains(err.Error(), "connection reset")
}

// With no request in flight (idle keep-alive and never-used connections)
// Close does not wait for the grace at all; a request in flight that
// completes within the grace is answered.
func TestCloseWaitsOnlyForRequestsInFlight(t *testing.T) {
	s := NewServer(WithLogger(quiet))
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	if err := (&Client{Addr: rs.Addr(), HTTP: &http.Client{Transport: tr}}).Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	unused, err := net.Dial("tcp", rs.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer unused.Close()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	if err := rs.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el >= defaultHTTPLimits.closeGrace {
		t.Fatalf("Close with nothing in flight took %v, as long as the grace (%v)", el, defaultHTTPLimits.closeGrace)
	}

	// A request in flight: its headers and half its body arrived before
	// Close, the rest arrives during the grace.
	rs2, err := NewServer(WithLogger(quiet)).Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", rs2.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	body := `{"bootstrap_room": 7, "dp_rank": 1}`
	io.WriteString(c, "POST /register_dp_rank HTTP/1.1\r\nHost: x\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body[:10])
	time.Sleep(100 * time.Millisecond) // the handler is reading the body
	closed := make(chan error, 1)
	go func() { closed <- rs2.Close(context.Background()) }()
	time.Sleep(50 * time.Millisecond)
	io.WriteString(c, body[10:])
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("request in flight during Close: %v", err)
	}
	if resp.StatusCode != http.StatusOK || !resp.Close {
		t.Fatalf("request in flight during Close: %s (close %v), want 200 and Connection: close", resp.Status, resp.Close)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}

// The case the push tests hit: decode-side clients (the default HTTP
// client) made concurrent requests, which leaves connections that were
// dialled but never used; Close took over 5 s (http.Server.Shutdown
// waits for a new connection until it is 5 s old). Now nothing is in
// flight, so Close does not even wait for the grace.
func TestCloseAfterConcurrentClients(t *testing.T) {
	rs, err := NewServer(WithLogger(quiet)).Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(rs.Addr())
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 5 {
				if err := c.Health(context.Background()); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	start := time.Now()
	if err := rs.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el >= defaultHTTPLimits.closeGrace {
		t.Fatalf("Close took %v", el)
	}
}
