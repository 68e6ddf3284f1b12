package zmq

import (
	"context"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// goroutinesSettle waits until no more goroutines run than before, and
// fails with every goroutine's stack if that does not happen: a socket
// that was closed must leave nothing behind.
func goroutinesSettle(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Every socket type, used and abused (peers silent in the handshake,
// stalled mid-message, a Send waiting for a peer that never comes, a REQ
// waiting for a reply), then closed: no goroutine survives.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	pull, err := ListenPull("tcp://127.0.0.1:0", quiet(), withMessageTimeout(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	router, err := ListenRouter("tcp://127.0.0.1:0", quiet())
	if err != nil {
		t.Fatal(err)
	}
	var failed atomic.Int64
	echoDone := make(chan struct{})
	go func() { defer close(echoDone); echoServer(ctx, router, &failed) }()

	push, _ := DialPush(pull.Endpoint(), quiet())
	for i := range 20 {
		if err := push.Send(ctx, []byte("m"), []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		if _, err := pull.Recv(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range 5 {
		if rep, err := Request(ctx, router.Endpoint(), [][]byte{[]byte("x")}, quiet()); err != nil || string(rep[0]) != "echo" {
			t.Fatalf("request: %q %v", rep, err)
		}
	}
	// A DEALER talking to an ipc ROUTER that reports disconnects.
	reported := make(chan []byte, 4)
	irouter, err := ListenRouter(IPCEndpoint(ipcPath(t, "r.sock")), quiet(), WithDisconnectHandler(func(p []byte) { reported <- p }))
	if err != nil {
		t.Fatal(err)
	}
	dealer, _ := DialDealer(irouter.Endpoint(), quiet())
	if err := dealer.Send(ctx, []byte("d")); err != nil {
		t.Fatal(err)
	}
	im, err := irouter.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := irouter.Send(ctx, im.Peer, []byte("r")); err != nil {
		t.Fatal(err)
	}
	if _, err := dealer.Recv(ctx); err != nil {
		t.Fatal(err)
	}
	ps := NewPushers(quiet())
	if err := ps.Send(ctx, pull.Endpoint(), []byte("via pushers")); err != nil {
		t.Fatal(err)
	}
	if _, err := pull.Recv(ctx); err != nil {
		t.Fatal(err)
	}

	// Abuse: silent TCP clients in the handshake, a peer stalled inside a
	// message, a Send to nobody, a REQ to a peer that never answers.
	var conns []net.Conn
	for range 5 {
		c, err := net.Dial("tcp", pull.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	stalled, _ := rawPeer(t, pull.Addr().String(), typePush)
	stalled.Write([]byte{0, 200, 1, 2, 3})
	nobody := deadEndpoint(t)
	lonely, _ := DialPush(nobody, quiet(), WithReconnectInterval(time.Millisecond, 10*time.Millisecond))
	sendDone := make(chan error, 1)
	go func() { sendDone <- lonely.Send(context.Background(), []byte("never")) }()
	mute, err := ListenPull("tcp://127.0.0.1:0", quiet()) // a REQ to a PULL is refused...
	if err != nil {
		t.Fatal(err)
	}
	mrouter, err := ListenRouter("tcp://127.0.0.1:0", quiet()) // ...a REQ to a silent ROUTER waits
	if err != nil {
		t.Fatal(err)
	}
	reqDone := make(chan error, 2)
	for _, ep := range []string{mute.Endpoint(), mrouter.Endpoint()} {
		go func() {
			rctx, rcancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer rcancel()
			_, err := Request(rctx, ep, [][]byte{[]byte("?")}, quiet())
			reqDone <- err
		}()
	}
	time.Sleep(100 * time.Millisecond)

	lonely.Close()
	if err := <-sendDone; err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("Send interrupted by Close: %v", err)
	}
	for range 2 {
		if err := <-reqDone; err == nil {
			t.Fatal("request to a peer that never answers succeeded")
		}
	}
	cancel()
	<-echoDone
	for _, c := range []interface{ Close() error }{push, ps, pull, router, mute, mrouter, dealer, irouter} {
		c.Close()
	}
	if len(reported) != 1 {
		t.Fatalf("%d disconnects reported for the DEALER's one connection", len(reported))
	}
	// The hostile clients are still connected: closing the sockets must
	// have ended the goroutines serving them.
	goroutinesSettle(t, before)
	for _, c := range conns {
		c.Close()
	}
	stalled.Close()
}

// A router closed while Enqueue's writers are blocked on a peer that never
// reads (no send timeout) ends them: Close returns and no goroutine
// survives.
func TestRouterCloseEndsQueuedWriters(t *testing.T) {
	before := runtime.NumGoroutine()
	r, err := ListenRouter("tcp://127.0.0.1:0", quiet(), WithSendTimeout(0))
	if err != nil {
		t.Fatal(err)
	}
	stuck, _ := rawPeer(t, r.Addr().String(), typeReq)
	stuck.Write(encodeMessage([][]byte{{}, []byte("q")}))
	m, err := r.Recv(testCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 8<<20)
	for range 4 {
		if err := r.Enqueue(m.Peer, nil, big); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond) // the writer is blocked now
	done := make(chan error, 1)
	go func() { done <- r.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end a blocked writer")
	}
	stuck.Close()
	goroutinesSettle(t, before)
}
