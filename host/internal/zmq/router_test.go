package zmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func newRouter(t *testing.T, opts ...Option) *Router {
	t.Helper()
	r, err := ListenRouter("tcp://127.0.0.1:0", append([]Option{quiet()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// echoServer answers every REQ-shaped request with "echo" + the body and
// counts failed replies; it runs until ctx ends.
func echoServer(ctx context.Context, r *Router, failed *atomic.Int64) {
	for {
		m, err := r.Recv(ctx)
		if err != nil {
			return
		}
		if len(m.Frames) < 2 || len(m.Frames[0]) != 0 {
			failed.Add(1)
			continue
		}
		reply := append([][]byte{nil, []byte("echo")}, m.Frames[1:]...)
		// Generous: a client that left fails the send at once, and 1 s
		// was cut short (the connection closed, the client read EOF)
		// when the loaded machine stalled.
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := r.Send(sctx, m.Peer, reply...); err != nil {
			failed.Add(1)
		}
		cancel()
	}
}

// Many concurrent short-lived REQ clients (each connects once, as vLLM's
// handshake does), with hostile clients mixed in: every well-behaved
// client gets its own reply, nothing deadlocks, and the router keeps
// serving.
func TestRouterManyShortLivedClients(t *testing.T) {
	// The default handshake timeout: the hostile clients leave on their
	// own, and a shorter one (500 ms) cut well-behaved clients' handshakes
	// when the loaded machine stalled (broken pipe).
	r := newRouter(t)
	ctx := testCtx(t, 30*time.Second)
	var failed atomic.Int64
	go echoServer(ctx, r, &failed)
	start := time.Now()

	// Hostile clients, concurrently with the real ones.
	var hostile sync.WaitGroup
	for i := range 40 {
		hostile.Add(1)
		go func() {
			defer hostile.Done()
			c, err := net.Dial("tcp", r.Addr().String())
			if err != nil {
				return
			}
			defer c.Close()
			switch i % 4 {
			case 0: // silent
				time.Sleep(100 * time.Millisecond)
			case 1: // garbage
				c.Write([]byte(strings.Repeat("\xff\x00garbage", 50)))
			case 2: // asks, then leaves before the reply
				c.Write(greeting())
				c.Write(encodeCommand("READY", readyMetadata(typeReq)))
				c.Write(encodeMessage([][]byte{{}, []byte("bye")}))
			case 3: // huge declared frame after a valid handshake
				c.Write(greeting())
				c.Write(encodeCommand("READY", readyMetadata(typeReq)))
				c.Write([]byte{flagLong, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
				time.Sleep(50 * time.Millisecond)
			}
		}()
	}

	const workers, perWorker = 32, 40
	var wg sync.WaitGroup
	errc := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				body := []byte(fmt.Sprintf("w%d-r%d", w, i))
				rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				rep, err := Request(rctx, r.Endpoint(), [][]byte{body}, quiet())
				cancel()
				if err != nil {
					errc <- fmt.Errorf("worker %d request %d: %w", w, i, err)
					return
				}
				if len(rep) != 2 || string(rep[0]) != "echo" || string(rep[1]) != string(body) {
					errc <- fmt.Errorf("worker %d request %d: reply %q", w, i, rep)
					return
				}
			}
		}()
	}
	wg.Wait()
	hostile.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	t.Logf("%d requests on fresh connections in %v (%d replies could not be written)",
		workers*perWorker, time.Since(start), failed.Load())
	// Still serving.
	rep, err := Request(testCtx(t, 5*time.Second), r.Endpoint(), [][]byte{[]byte("still")}, quiet())
	if err != nil || string(rep[1]) != "still" {
		t.Fatalf("after the storm: %q %v", rep, err)
	}
}

func TestRouterSendUnknownPeer(t *testing.T) {
	r := newRouter(t)
	err := r.Send(testCtx(t, time.Second), []byte{0, 0, 0, 0, 99}, []byte("x"))
	if !errors.Is(err, ErrUnknownPeer) {
		t.Fatalf("Send: %v, want ErrUnknownPeer", err)
	}
	r.Close()
	if err := r.Send(testCtx(t, time.Second), []byte{0, 0, 0, 0, 1}, []byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
	if _, err := r.Recv(testCtx(t, time.Second)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Recv after Close: %v", err)
	}
}

// A REQ against a dead port fails at once; against a peer that never
// answers it fails when its context ends, not later.
func TestRequestTimeouts(t *testing.T) {
	dead := deadEndpoint(t)
	start := time.Now()
	if _, err := Request(testCtx(t, 5*time.Second), dead, [][]byte{[]byte("x")}, quiet()); err == nil {
		t.Fatal("request to a dead port succeeded")
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("dead port took %v", el)
	}

	// A ROUTER that receives but never replies.
	r := newRouter(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start = time.Now()
	_, err := Request(ctx, r.Endpoint(), [][]byte{[]byte("x")}, quiet())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("silent router: %v, want deadline exceeded", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("silent router took %v", el)
	}

	// A plain TCP server that accepts and says nothing (handshake never
	// completes).
	ln2, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln2.Close()
	go func() {
		for {
			c, err := ln2.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel2()
	if _, err := Request(ctx2, endpointOf(ln2.Addr()), [][]byte{[]byte("x")}, quiet()); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("mute TCP server: %v, want deadline exceeded", err)
	}
}

// A reply without the REQ delimiter is a protocol error, not a hang.
func TestRequestBadReply(t *testing.T) {
	r := newRouter(t)
	ctx := testCtx(t, 5*time.Second)
	go func() {
		m, err := r.Recv(ctx)
		if err == nil {
			r.Send(ctx, m.Peer, []byte("no-delimiter"))
		}
	}()
	if _, err := Request(ctx, r.Endpoint(), [][]byte{[]byte("x")}, quiet()); !errors.Is(err, ErrProtocol) {
		t.Fatalf("Request: %v, want ErrProtocol", err)
	}
}

// A peer that never reads cannot hold Router.Send forever: a context
// without a deadline is bounded by the send timeout, the peer's connection
// is closed, and the router keeps serving others.
func TestRouterSendTimeoutOnStuckPeer(t *testing.T) {
	const timeout = 300 * time.Millisecond
	r := newRouter(t, WithSendTimeout(timeout))
	stuck, _ := rawPeer(t, r.Addr().String(), typeReq) // never reads
	stuck.Write(encodeMessage([][]byte{{}, []byte("hello")}))
	m, err := r.Recv(testCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 4<<20)
	errc := make(chan error, 1)
	start := time.Now()
	go func() {
		for {
			// Fills the kernel's buffers, then blocks on the stuck peer.
			if err := r.Send(context.Background(), m.Peer, nil, big); err != nil {
				errc <- err
				return
			}
		}
	}()
	select {
	case err := <-errc:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Send to a stuck peer: %v, want deadline exceeded", err)
		}
		if el := time.Since(start); el > 20*timeout {
			t.Fatalf("Send gave up after %v", el)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Send to a peer that never reads did not return")
	}
	if err := r.Send(context.Background(), m.Peer, nil, []byte("x")); !errors.Is(err, ErrUnknownPeer) && !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after the timeout: %v, want the peer's connection gone", err)
	}
	var failed atomic.Int64
	ctx := testCtx(t, 10*time.Second)
	go echoServer(ctx, r, &failed)
	if rep, err := Request(ctx, r.Endpoint(), [][]byte{[]byte("other")}, quiet()); err != nil || string(rep[1]) != "other" {
		t.Fatalf("another client after the stuck one: %q %v", rep, err)
	}
	if DefaultSendTimeout != 30*time.Second {
		t.Fatalf("DefaultSendTimeout = %v", DefaultSendTimeout)
	}
}

// A peer that pipelines requests and never reads its replies does not
// hold up anyone else when the server answers with Enqueue from one loop:
// its queue fills (ErrPeerBusy), its connection is closed once a write
// runs out of the send timeout, and honest clients are answered at once
// meanwhile.
func TestRouterEnqueueIsolatesStuckPeer(t *testing.T) {
	const sendTimeout = 2 * time.Second
	var logs logBuffer
	r := newRouter(t, WithLogger(logs.logger()), WithSendTimeout(sendTimeout), WithSendQueue(4))
	ctx := testCtx(t, 30*time.Second)
	reply := make([]byte, 1<<20) // a few fill the stuck peer's socket buffers
	var busy, gone atomic.Int64
	serverDone := make(chan struct{})
	go func() {
		defer close(serverDone)
		for {
			m, err := r.Recv(ctx)
			if err != nil {
				return
			}
			body := reply
			if len(m.Frames) == 2 && string(m.Frames[1]) != "stuck" {
				body = append([]byte("echo "), m.Frames[1]...)
			}
			switch err := r.Enqueue(m.Peer, nil, body); {
			case errors.Is(err, ErrPeerBusy):
				busy.Add(1)
			case errors.Is(err, ErrUnknownPeer):
				gone.Add(1)
			case err != nil:
				t.Errorf("Enqueue: %v", err)
			}
		}
	}()

	stuck, _ := rawPeer(t, r.Addr().String(), typeReq) // never reads
	stuck.SetDeadline(time.Time{})
	stop := make(chan struct{})
	pipelined := make(chan struct{})
	go func() {
		defer close(pipelined)
		req := encodeMessage([][]byte{{}, []byte("stuck")})
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := stuck.Write(req); err != nil {
				return // closed by the router
			}
			time.Sleep(time.Millisecond)
		}
	}()
	waitFor(t, "the stuck peer's queue to fill", func() bool { return busy.Load() > 0 })

	// Honest clients, while the stuck peer is stuck: each answered fast.
	var slowest time.Duration
	for i := range 20 {
		start := time.Now()
		body := []byte(fmt.Sprint("client ", i))
		rep, err := Request(ctx, r.Endpoint(), [][]byte{body}, quiet())
		if err != nil || string(rep[0]) != "echo "+string(body) {
			t.Fatalf("client %d: %q %v", i, rep, err)
		}
		slowest = max(slowest, time.Since(start))
	}
	if slowest > sendTimeout/2 {
		t.Fatalf("an honest client waited %v with a stuck peer connected (send timeout %v)", slowest, sendTimeout)
	}
	// The stuck peer is dropped once a write runs out of time.
	select {
	case <-pipelined:
	case <-time.After(10 * sendTimeout):
		t.Fatal("the stuck peer was never disconnected")
	}
	close(stop)
	waitFor(t, "the drop to be logged", func() bool { return strings.Contains(logs.String(), "queued message not written") })
	t.Logf("slowest honest client %v; %d replies refused as busy, %d to a gone peer", slowest, busy.Load(), gone.Load())
}

func TestRouterEnqueueErrors(t *testing.T) {
	r := newRouter(t)
	if err := r.Enqueue([]byte{0, 0, 0, 0, 9}, []byte("x")); !errors.Is(err, ErrUnknownPeer) {
		t.Fatalf("unknown peer: %v", err)
	}
	if err := r.Enqueue([]byte{0, 0, 0, 0, 9}); err == nil {
		t.Fatal("a message without frames was accepted")
	}
	// Queued replies reach a REQ client in order.
	ctx := testCtx(t, 10*time.Second)
	go func() {
		m, err := r.Recv(ctx)
		if err == nil {
			r.Enqueue(m.Peer, nil, []byte("one"))
		}
	}()
	if rep, err := Request(ctx, r.Endpoint(), [][]byte{[]byte("q")}, quiet()); err != nil || string(rep[0]) != "one" {
		t.Fatalf("queued reply: %q %v", rep, err)
	}
	r.Close()
	if err := r.Enqueue([]byte{0, 0, 0, 0, 1}, []byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

// A peer that does not read is refused (ErrPeerBusy) once the bytes
// queued for it would pass WithSendQueueBytes, long before the count
// bound; the queue never holds more than the bound; a message larger than
// the bound still goes into an empty queue.
func TestRouterEnqueueBytesBound(t *testing.T) {
	const bound = 1 << 20
	r := newRouter(t, WithSendQueue(1<<20), WithSendQueueBytes(bound))
	ctx := testCtx(t, 20*time.Second)
	stuck, _ := rawPeer(t, r.Addr().String(), typeDealer) // never reads
	stuck.SetDeadline(time.Time{})
	if _, err := stuck.Write(encodeMessage([][]byte{[]byte("hi")})); err != nil {
		t.Fatal(err)
	}
	m, err := r.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 4*bound)
	if err := r.Enqueue(m.Peer, big); err != nil {
		t.Fatalf("a message over the bound into an empty queue: %v", err)
	}
	// The writer takes it off the queue and blocks writing it (the peer
	// never reads); until it has, a message more is refused at once (the
	// oversized one alone is over the bound), which is right but not what
	// the rest of this test measures.
	for n, _ := r.Queued(m.Peer); n > 0; n, _ = r.Queued(m.Peer) {
		if ctx.Err() != nil {
			t.Fatal("the writer never took the oversized message")
		}
		time.Sleep(time.Millisecond)
	}
	msg := make([]byte, 64<<10)
	sent := 0
	for {
		err := r.Enqueue(m.Peer, msg)
		if errors.Is(err, ErrPeerBusy) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		sent++
		if n, b := r.Queued(m.Peer); b > bound && n > 1 {
			t.Fatalf("%d messages, %d bytes queued: over the bound of %d", n, b, bound)
		}
		if sent > 1<<16 {
			t.Fatal("a peer that does not read was never refused")
		}
	}
	n, b := r.Queued(m.Peer)
	if b > bound || b+int64(len(msg)) <= bound {
		t.Fatalf("refused with %d bytes (%d messages) queued; the bound is %d", b, n, bound)
	}
	t.Logf("refused after %d messages; %d bytes in %d messages queued", sent, b, n)
}
