package zmq

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// routerEcho answers every message [frames...] of a DEALER peer with
// ["echo", frames...] until ctx ends.
func routerEcho(ctx context.Context, t *testing.T, r *Router) {
	for {
		m, err := r.Recv(ctx)
		if err != nil {
			return
		}
		if err := r.Send(ctx, m.Peer, append([][]byte{[]byte("echo")}, m.Frames...)...); err != nil && ctx.Err() == nil && !errors.Is(err, ErrUnknownPeer) {
			t.Errorf("echo: %v", err)
		}
	}
}

// Our DEALER to our ROUTER over tcp and ipc: many requests in flight
// from concurrent senders, every reply comes back, in order per sender.
func TestDealerToRouter(t *testing.T) {
	for _, ep := range []string{"tcp://127.0.0.1:0", IPCEndpoint(ipcPath(t, "r.sock"))} {
		t.Run(ep[:3], func(t *testing.T) {
			r, err := ListenRouter(ep, quiet())
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			ctx := testCtx(t, 20*time.Second)
			go routerEcho(ctx, t, r)
			d, err := DialDealer(r.Endpoint(), quiet())
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			const senders, each = 4, 50
			var wg sync.WaitGroup
			for s := range senders {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range each {
						if err := d.Send(ctx, []byte{byte(s)}, []byte(fmt.Sprint(i)), nil); err != nil {
							t.Error(err)
							return
						}
					}
				}()
			}
			next := make([]int, senders)
			for range senders * each {
				m, err := d.Recv(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if len(m) != 4 || string(m[0]) != "echo" || len(m[1]) != 1 || int(m[1][0]) >= senders || len(m[3]) != 0 {
					t.Fatalf("reply %q", m)
				}
				s := m[1][0]
				if string(m[2]) != fmt.Sprint(next[s]) {
					t.Fatalf("sender %d: reply %s, want %d", s, m[2], next[s])
				}
				next[s]++
			}
			wg.Wait()
		})
	}
}

// our DEALER -> libzmq ROUTER, over tcp and ipc.
func TestInteropGoDealerToPythonRouter(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	const n = 30
	for _, ipc := range []bool{false, true} {
		args := []string{"router-dealer", fmt.Sprint(n)}
		if ipc {
			args = append(args, IPCEndpoint(ipcPath(t, "r.sock")))
		}
		peer := zmqtest.Start(t, peerScript, args...)
		port := portLine(t, peer)
		ep := TCPEndpoint("127.0.0.1", port)
		if ipc {
			ep = args[2]
		}
		d, err := DialDealer(ep, quiet())
		if err != nil {
			t.Fatal(err)
		}
		ctx := testCtx(t, 20*time.Second)
		msgs := standardMessages()[:n]
		for i, m := range msgs {
			if err := d.Send(ctx, m...); err != nil {
				t.Fatalf("%s: send %d: %v\n%s", ep, i, err, peer.Stderr())
			}
		}
		for i, m := range msgs {
			got, err := d.Recv(ctx)
			if err != nil || !equalFrames(got, append([][]byte{[]byte("echo")}, m...)) {
				t.Fatalf("%s: reply %d: %d frames, %v\n%s", ep, i, len(got), err, peer.Stderr())
			}
		}
		if got := peer.Line(20 * time.Second); got != fmt.Sprint("OK ", n) {
			t.Fatalf("%s: peer said %q", ep, got)
		}
		peer.Wait(10 * time.Second)
		// The peer closed its socket: the dealer hears of it.
		if _, err := d.Recv(ctx); !errors.Is(err, ErrDisconnected) {
			t.Fatalf("%s: after the peer left: %v, want ErrDisconnected", ep, err)
		}
		d.Close()
	}
}

// A ROUTER that goes away and comes back: the DEALER's Recv reports the
// lost connection once, after the replies that came before, and the next
// Send connects to the new ROUTER.
func TestDealerReconnects(t *testing.T) {
	ep := IPCEndpoint(ipcPath(t, "r.sock"))
	ctx := testCtx(t, 20*time.Second)
	r1, err := ListenRouter(ep, quiet())
	if err != nil {
		t.Fatal(err)
	}
	d, err := DialDealer(ep, quiet(), WithReconnectInterval(time.Millisecond, 20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Send(ctx, []byte("one")); err != nil {
		t.Fatal(err)
	}
	m, err := r1.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := r1.Send(ctx, m.Peer, []byte("reply one")); err != nil {
		t.Fatal(err)
	}
	r1.Close()
	if got, err := d.Recv(ctx); err != nil || string(got[0]) != "reply one" {
		t.Fatalf("reply before the end: %q %v", got, err)
	}
	if _, err := d.Recv(ctx); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("after the router closed: %v, want ErrDisconnected", err)
	}
	r2, err := ListenRouter(ep, quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	go routerEcho(ctx, t, r2)
	if err := d.Send(ctx, []byte("two")); err != nil {
		t.Fatal(err)
	}
	if got, err := d.Recv(ctx); err != nil || !equalFrames(got, [][]byte{[]byte("echo"), []byte("two")}) {
		t.Fatalf("after reconnecting: %q %v", got, err)
	}
	// Exactly one report per connection: nothing else is waiting.
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if got, err := d.Recv(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("extra item: %q %v", got, err)
	}
}

// With no peer, Send keeps trying until its context or the send timeout
// ends; Close interrupts Send and Recv.
func TestDealerSendTimeoutAndClose(t *testing.T) {
	before := runtime.NumGoroutine()
	d, err := DialDealer(IPCEndpoint(ipcPath(t, "nobody.sock")), quiet(), WithSendTimeout(200*time.Millisecond),
		WithReconnectInterval(time.Millisecond, 10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Send(context.Background(), []byte("x")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("send to nobody: %v", err)
	}
	sendDone, recvDone := make(chan error, 1), make(chan error, 1)
	go func() { sendDone <- d.Send(context.Background(), []byte("x")) }()
	go func() { _, err := d.Recv(context.Background()); recvDone <- err }()
	time.Sleep(20 * time.Millisecond)
	d.Close()
	for _, ch := range []chan error{sendDone, recvDone} {
		if err := <-ch; !errors.Is(err, ErrClosed) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("after Close: %v", err)
		}
	}
	if err := d.Send(context.Background(), []byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
	if _, err := d.Recv(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Recv after Close: %v", err)
	}
	if _, err := DialDealer("udp://x"); err == nil {
		t.Fatal("bad endpoint accepted")
	}
	goroutinesSettle(t, before)
}

// Messages the peer sends are bounded like a bound socket's: one over
// WithMaxMessageSize ends the connection (reported as ErrDisconnected)
// instead of being read.
func TestDealerMessageLimit(t *testing.T) {
	r, err := ListenRouter(IPCEndpoint(ipcPath(t, "r.sock")), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	d, err := DialDealer(r.Endpoint(), quiet(), WithMaxMessageSize(1000))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := testCtx(t, 10*time.Second)
	if err := d.Send(ctx, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	m, err := r.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r.Send(ctx, m.Peer, make([]byte, 1000))
	r.Send(ctx, m.Peer, make([]byte, 1001))
	if got, err := d.Recv(ctx); err != nil || len(got[0]) != 1000 {
		t.Fatalf("message at the limit: %v", err)
	}
	if _, err := d.Recv(ctx); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("message over the limit: %v, want ErrDisconnected", err)
	}
}
