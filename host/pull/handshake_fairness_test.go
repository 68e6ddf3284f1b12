package pull

import (
	"context"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog/ratelogtest"

	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// Clients that pipeline requests and never read the replies (here four of
// them, with 1 MiB replies that soon fill their socket buffers) do not
// hold up anyone else's handshake: honest clients are served at once
// meanwhile, and the stuck clients lose their connections.
func TestHandshakeStuckClientsDelayNobody(t *testing.T) {
	md := sampleMetadata()
	md.AgentMetadata = make([]byte, 1<<20)
	s, err := ListenHandshake("tcp://127.0.0.1:0", HandshakeService{Payloads: map[int][]byte{0: vllm.NewHandshakePayload("H", md).Encode()}}, quietLog)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	const stuckClients = 4
	var wg sync.WaitGroup
	disconnected := make(chan struct{}, stuckClients)
	for range stuckClients {
		c := zmqtest.DialRaw(t, s.Endpoint(), "REQ")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for { // never reads
				if err := c.Send(nil, vllm.EncodeMetaRequest(0)); err != nil {
					disconnected <- struct{}{}
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond) // their replies pile up meanwhile

	var slowest time.Duration
	for i := range 10 {
		start := time.Now()
		got, err := FetchHandshake(context.Background(), s.Endpoint(), 0, expect("H"))
		if err != nil {
			t.Fatalf("honest client %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, md) {
			t.Fatalf("honest client %d: wrong metadata", i)
		}
		slowest = max(slowest, time.Since(start))
	}
	// Before replies were queued per client, each stuck client held the
	// server for replyTimeout (1 s).
	if slowest > replyTimeout/2 {
		t.Fatalf("an honest handshake took %v with %d stuck clients connected", slowest, stuckClients)
	}
	for i := range stuckClients {
		select {
		case <-disconnected:
		case <-time.After(10 * replyTimeout):
			t.Fatalf("only %d of %d stuck clients were disconnected", i, stuckClients)
		}
	}
	wg.Wait()
	t.Logf("slowest honest handshake %v", slowest)
}

// A REQ request with no frame or more than one after the delimiter is
// refused with an empty reply at once (it used to get no reply, so the
// client waited out its whole timeout); the server keeps serving.
func TestHandshakeRefusesWrongFrameCounts(t *testing.T) {
	s, mds := startServer(t, "H")
	for _, frames := range [][][]byte{
		{vllm.EncodeMetaRequest(0), []byte("extra")},
		{vllm.EncodeMetaRequest(0), {}, {}},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), DefaultHandshakeTimeout)
		start := time.Now()
		rep, err := zmq.Request(ctx, s.Endpoint(), frames, quietZMQ()...)
		cancel()
		if err != nil || len(rep) != 1 || len(rep[0]) != 0 {
			t.Fatalf("%d frames: reply %q, %v; want one empty frame", len(frames), rep, err)
		}
		if el := time.Since(start); el > time.Second {
			t.Fatalf("%d frames: refused after %v", len(frames), el)
		}
	}
	// The delimiter alone, from a raw REQ peer (a REQ socket always sends
	// a body frame).
	c := zmqtest.DialRaw(t, s.Endpoint(), "REQ")
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Send(nil); err != nil {
		t.Fatal(err)
	}
	if rep, err := c.Recv(); err != nil || len(rep) != 2 || len(rep[0]) != 0 || len(rep[1]) != 0 {
		t.Fatalf("delimiter only: reply %q, %v; want the delimiter and an empty frame", rep, err)
	}
	got, err := FetchHandshake(context.Background(), s.Endpoint(), 1, expect("H"))
	if err != nil || !reflect.DeepEqual(got, mds[1]) {
		t.Fatalf("after refusals: %v", err)
	}
}

// A client sending 20,000 bad handshake requests writes a bounded number
// of log lines (it wrote one each), and what was not written is counted
// in a line of its own.
func TestBadRequestFloodIsRateLimited(t *testing.T) {
	const requests, maxLines = 20000, 200
	var out ratelogtest.LineCounter
	s, err := ListenHandshake("tcp://127.0.0.1:0", HandshakeService{Payloads: map[int][]byte{0: vllm.NewHandshakePayload("H", sampleMetadata()).Encode()}},
		slog.New(slog.NewTextHandler(&out, nil)))
	if err != nil {
		t.Fatal(err)
	}
	c := zmqtest.DialRaw(t, s.Endpoint(), "REQ")
	c.SetDeadline(time.Now().Add(time.Minute))
	start := time.Now()
	for i := range requests {
		if err := c.Send(nil, []byte("not msgpack")); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if rep, err := c.Recv(); err != nil || len(rep) != 2 || len(rep[1]) != 0 {
			t.Fatalf("request %d: reply %q, %v; want an empty one", i, rep, err)
		}
	}
	elapsed := time.Since(start)
	if err := s.Close(); err != nil {
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

// 1100 clients that finish the ZMTP handshake and then say nothing, more
// than the connection limit, do not lock an honest client out, whether
// they come from its own host or another: it is served on its first
// attempt or, with everyone on one host, on a retry a moment later (as
// vLLM retries a failed handshake). They locked the server for good.
func TestIdleClientsDoNotLockOutHandshakes(t *testing.T) {
	const idle = 1100
	s, mds := startServer(t, "H")
	for _, attacker := range []string{"127.0.0.2", "127.0.0.1"} {
		var held []*zmqtest.Raw
		var mu sync.Mutex
		var wg sync.WaitGroup
		work := make(chan struct{})
		for range 16 {
			wg.Go(func() {
				for range work {
					if c, err := zmqtest.TryDialRaw(s.Endpoint(), "REQ", attacker); err == nil {
						mu.Lock()
						held = append(held, c)
						mu.Unlock()
					}
				}
			})
		}
		for range idle {
			work <- struct{}{}
		}
		close(work)
		wg.Wait()
		start := time.Now()
		var err error
		for time.Since(start) < 20*time.Second {
			var got *vllm.AgentMetadata
			if got, err = FetchHandshake(context.Background(), s.Endpoint(), 1, expect("H")); err == nil {
				if !reflect.DeepEqual(got, mds[1]) {
					t.Fatal("wrong metadata")
				}
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("idle clients from %s (%d of %d handshakes done): honest client: %v", attacker, len(held), idle, err)
		}
		t.Logf("idle clients from %s (%d of %d handshakes done): honest client served after %v", attacker, len(held), idle, time.Since(start))
		for _, c := range held {
			c.Close()
		}
	}
}
