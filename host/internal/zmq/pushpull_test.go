package zmq

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func newPull(t *testing.T, opts ...Option) *Pull {
	t.Helper()
	p, err := ListenPull("tcp://127.0.0.1:0", append([]Option{quiet()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func newPush(t *testing.T, endpoint string, opts ...Option) *Push {
	t.Helper()
	p, err := DialPush(endpoint, append([]Option{quiet()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func TestPushPullRoundTrip(t *testing.T) {
	pull := newPull(t)
	push := newPush(t, pull.Endpoint())
	ctx := testCtx(t, 10*time.Second)
	for _, m := range standardMessages() {
		if err := push.Send(ctx, m...); err != nil {
			t.Fatal(err)
		}
	}
	for i, want := range standardMessages() {
		got, err := pull.Recv(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !equalFrames(got, want) {
			t.Fatalf("message %d differs", i)
		}
	}
}

func TestEndpoints(t *testing.T) {
	if got := TCPEndpoint("::1", 5); got != "tcp://[::1]:5" {
		t.Fatalf("TCPEndpoint = %q", got)
	}
	for _, bad := range []string{"ipc://", "inproc://x", "tcp://host", "tcp://h:99999", "tcp://*:5", "tcp://h:0", "127.0.0.1:5"} {
		if _, err := DialPush(bad); err == nil {
			t.Errorf("DialPush(%q) accepted", bad)
		}
	}
	p, err := ListenPull("tcp://*:0", quiet())
	if err != nil {
		t.Fatalf("wildcard bind: %v", err)
	}
	p.Close()
	if _, err := ListenPull("tcp://127.0.0.1:x"); err == nil {
		t.Fatal("bad port accepted")
	}
}

func TestRecvHonoursContextAndClose(t *testing.T) {
	pull := newPull(t)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := pull.Recv(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv: %v, want deadline exceeded", err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := pull.Recv(context.Background())
		errc <- err
	}()
	time.Sleep(20 * time.Millisecond)
	pull.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Recv after Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not unblock Recv")
	}
	if err := pull.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// A peer that is not up yet is waited for, within the context.
func TestPushWaitsForLatePeer(t *testing.T) {
	// Nobody listens there yet, and no other test's listener can take the
	// port meanwhile (a Send would then succeed to that stranger).
	ep, release := reserveEndpoint(t)
	push := newPush(t, ep, WithReconnectInterval(10*time.Millisecond, 50*time.Millisecond))
	ctx := testCtx(t, 10*time.Second)
	done := make(chan error, 1)
	go func() { done <- push.Send(ctx, []byte("early")) }()
	time.Sleep(200 * time.Millisecond)
	release()
	pull := relisten(t, ep)
	defer pull.Close()
	if err := <-done; err != nil {
		t.Fatalf("Send: %v", err)
	}
	m, err := pull.Recv(ctx)
	if err != nil || string(m[0]) != "early" {
		t.Fatalf("Recv: %q %v", m, err)
	}
}

// No peer at all: Send fails when its context ends, and says why; it never
// reports success for a message it could not deliver.
func TestPushNoPeerFails(t *testing.T) {
	ep := deadEndpoint(t)
	push := newPush(t, ep, WithReconnectInterval(5*time.Millisecond, 20*time.Millisecond))
	// Long enough for a dial to be refused even on a loaded machine (with
	// 300 ms the only dial sometimes ran out of time instead).
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	err := push.Send(ctx, []byte("x"))
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("Send: %v, want deadline exceeded mentioning the refused connection", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("Send took %v", el)
	}
	// The socket's own send timeout applies to contexts without a deadline.
	push2 := newPush(t, ep, WithSendTimeout(100*time.Millisecond))
	if err := push2.Send(context.Background(), []byte("x")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Send with send timeout: %v", err)
	}
}

func TestPushCloseInterruptsSend(t *testing.T) {
	ep := deadEndpoint(t)
	push := newPush(t, ep)
	errc := make(chan error, 1)
	go func() { errc <- push.Send(context.Background(), []byte("x")) }()
	time.Sleep(50 * time.Millisecond)
	push.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Send: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not interrupt Send")
	}
	if err := push.Send(context.Background(), []byte("y")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
}

// The receiving side restarts on the same port: the sender notices the
// old connection is gone and delivers to the new listener.
func TestPushReconnectsAfterPeerRestart(t *testing.T) {
	pull := newPull(t)
	ep := pull.Endpoint()
	push := newPush(t, ep, WithReconnectInterval(10*time.Millisecond, 50*time.Millisecond))
	ctx := testCtx(t, 10*time.Second)
	if err := push.Send(ctx, []byte("one")); err != nil {
		t.Fatal(err)
	}
	if m, err := pull.Recv(ctx); err != nil || string(m[0]) != "one" {
		t.Fatalf("first: %q %v", m, err)
	}
	pull.Close()
	time.Sleep(50 * time.Millisecond)
	pull2 := relisten(t, ep)
	defer pull2.Close()
	for i := range 5 {
		if err := push.Send(ctx, []byte(fmt.Sprint("after-", i))); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		m, err := pull2.Recv(ctx)
		if err != nil || string(m[0]) != fmt.Sprint("after-", i) {
			t.Fatalf("after restart %d: %q %v", i, m, err)
		}
	}
}

// Hostile and broken peers: a silent TCP client, garbage bytes, a frame
// header declaring an absurd size, a wrong socket type. Each is dropped
// with a log line; a well-behaved peer keeps working throughout.
func TestPullSurvivesHostilePeers(t *testing.T) {
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()), WithHandshakeTimeout(300*time.Millisecond), WithMaxMessageSize(1<<20))
	addr := pull.Addr().String()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// 1. Silent clients hold connections open without greeting.
	for range 20 {
		dial()
	}
	// 2. Garbage instead of a greeting.
	dial().Write([]byte(strings.Repeat("GET / HTTP/1.1\r\n", 8)))
	// 3. A valid handshake, then a frame declaring 2^44 bytes.
	huge := dial()
	huge.Write(greeting())
	huge.Write(encodeCommand("READY", readyMetadata(typePush)))
	huge.Write([]byte{flagLong, 0, 0, 0x10, 0, 0, 0, 0, 0})
	// 4. A REQ socket, which may not talk to PULL.
	wrong := dial()
	wrong.Write(greeting())
	wrong.Write(encodeCommand("READY", readyMetadata(typeReq)))

	push := newPush(t, pull.Endpoint())
	ctx := testCtx(t, 10*time.Second)
	for i := range 10 {
		if err := push.Send(ctx, []byte(fmt.Sprint(i))); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		m, err := pull.Recv(ctx)
		if err != nil || string(m[0]) != fmt.Sprint(i) {
			t.Fatalf("recv %d: %q %v", i, m, err)
		}
	}
	waitFor(t, "hostile peers to be logged", func() bool {
		l := logs.String()
		return strings.Contains(l, "message larger than") &&
			strings.Contains(l, "cannot talk to PULL") &&
			strings.Contains(l, "not a ZMTP peer") &&
			strings.Contains(l, "i/o timeout")
	})
}

func TestPushers(t *testing.T) {
	pullA, pullB := newPull(t), newPull(t)
	ps := NewPushers(quiet())
	defer ps.Close()
	ctx := testCtx(t, 10*time.Second)
	for _, p := range []*Pull{pullA, pullB} {
		if err := ps.Send(ctx, p.Endpoint(), []byte(p.Endpoint())); err != nil {
			t.Fatal(err)
		}
		m, err := p.Recv(ctx)
		if err != nil || string(m[0]) != p.Endpoint() {
			t.Fatalf("%q %v", m, err)
		}
	}
	a1, _ := ps.Get(pullA.Endpoint())
	a2, _ := ps.Get(pullA.Endpoint())
	if a1 != a2 {
		t.Fatal("Get did not reuse the socket")
	}
	ps.Forget(pullA.Endpoint())
	if a3, _ := ps.Get(pullA.Endpoint()); a3 == a1 {
		t.Fatal("Forget did not drop the socket")
	}
	ps.Close()
	if err := ps.Send(ctx, pullA.Endpoint(), []byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
}

// A libzmq peer with heartbeats on (ZMQ_HEARTBEAT_IVL) sends PING; we
// answer PONG with its context, and a peer's ERROR ends the connection.
func TestPingPongAndError(t *testing.T) {
	pull := newPull(t)
	c, err := net.Dial("tcp", pull.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write(greeting())
	c.Write(encodeCommand("READY", readyMetadata(typePush)))
	r := bufio.NewReader(c)
	g := make([]byte, greetingSize)
	if _, err := io.ReadFull(r, g); err != nil {
		t.Fatal(err)
	}
	lim := limits{maxMessageSize: 1 << 20, maxFrames: 8}
	if _, cmd, err := readMessage(r, lim); err != nil || cmd == nil || cmd.name != "READY" {
		t.Fatalf("READY: %v %v", cmd, err)
	}
	c.Write(encodeCommand("PING", []byte{0, 10, 'c', 't', 'x'}))
	_, cmd, err := readMessage(r, lim)
	if err != nil || cmd == nil || cmd.name != "PONG" || string(cmd.body) != "ctx" {
		t.Fatalf("PONG: %+v %v", cmd, err)
	}
	// Data still flows after the PING.
	c.Write(encodeMessage([][]byte{[]byte("after ping")}))
	if m, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil || string(m[0]) != "after ping" {
		t.Fatalf("recv: %q %v", m, err)
	}
	c.Write(encodeCommand("ERROR", errorBody("going away")))
	if _, err := r.ReadByte(); err != io.EOF {
		t.Fatalf("after ERROR the connection should be closed, read: %v", err)
	}
}
