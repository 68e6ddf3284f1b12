package zmq

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// disconnects records what a Router's disconnect handler was called
// with.
type disconnects struct {
	mu    sync.Mutex
	calls map[string]int
	ch    chan string
	// recvd counts messages Recv returned per peer, by the test's Recv
	// loop; atHandler is its value when the handler ran.
	recvd     map[string]int
	atHandler map[string]int
}

func newDisconnects() *disconnects {
	return &disconnects{calls: map[string]int{}, ch: make(chan string, 100), recvd: map[string]int{}, atHandler: map[string]int{}}
}

func (d *disconnects) handler(peer []byte) {
	d.mu.Lock()
	d.calls[string(peer)]++
	d.atHandler[string(peer)] = d.recvd[string(peer)]
	d.mu.Unlock()
	d.ch <- string(peer)
}

// recvLoop receives until the router closes, counting per peer, and
// sends each message on out when it is set.
func (d *disconnects) recvLoop(r *Router, out chan<- RouterMsg) chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := r.Recv(context.Background())
			if err != nil {
				return
			}
			d.mu.Lock()
			d.recvd[string(m.Peer)]++
			d.mu.Unlock()
			if out != nil {
				out <- m
			}
		}
	}()
	return done
}

func (d *disconnects) wait(t *testing.T, within time.Duration) string {
	t.Helper()
	select {
	case id := <-d.ch:
		return id
	case <-time.After(within):
		t.Fatalf("no disconnect reported within %v", within)
	}
	return ""
}

// An engine process that dies (SIGKILL) is reported at once: the handler
// runs within a second of its death, with the id its messages came
// from, whose credentials name that process.
func TestRouterReportsKilledPeer(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	dis := newDisconnects()
	r, err := ListenRouter(IPCEndpoint(ipcPath(t, "r.sock")), quiet(), WithDisconnectHandler(dis.handler))
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan RouterMsg, 10)
	loop := dis.recvLoop(r, msgs)
	peer := zmqtest.Start(t, peerScript, "dealer-hold", r.Endpoint())
	if got := peer.Line(20 * time.Second); got != "SENT" {
		t.Fatalf("peer said %q", got)
	}
	var m RouterMsg
	select {
	case m = <-msgs:
	case <-time.After(10 * time.Second):
		t.Fatal("no hello")
	}
	if string(m.Frames[0]) != "hello" || m.Cred == nil || int(m.Cred.PID) != peer.PID() {
		t.Fatalf("hello %q from %v, want pid %d", m.Frames, m.Cred, peer.PID())
	}
	peer.Kill()
	start := time.Now()
	id := dis.wait(t, time.Second)
	t.Logf("reported %v after the peer was reaped", time.Since(start))
	if id != string(m.Peer) {
		t.Fatalf("reported %x, want %x", id, m.Peer)
	}
	if err := r.Send(context.Background(), m.Peer, []byte("late")); !errors.Is(err, ErrUnknownPeer) {
		t.Fatalf("Send to the reported peer: %v", err)
	}
	r.Close()
	<-loop
	if len(dis.calls) != 1 {
		t.Fatalf("calls %v", dis.calls)
	}
}

// Every connection that completed its handshake is reported exactly
// once, whatever ended it: the peer closing after its messages (reported
// after Recv returned all of them), a protocol error, the idle timeout,
// Router.Disconnect, a connection still open at Close (reported by Close
// before it returns). A connection refused in its handshake is not.
func TestRouterReportsEveryEndOnce(t *testing.T) {
	before := runtime.NumGoroutine()
	dis := newDisconnects()
	// Long enough that the peers meant to end otherwise do not go idle
	// first on a loaded machine (they would still be reported once).
	const idle = time.Second
	r, err := ListenRouter("tcp://127.0.0.1:0", quiet(), WithDisconnectHandler(dis.handler), WithIdleTimeout(idle))
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan RouterMsg, 100)
	loop := dis.recvLoop(r, msgs)
	addr := r.Addr().String()
	// idOf sends one message on c and returns the id it arrived with.
	idOf := func(c interface{ Write([]byte) (int, error) }, body string) string {
		t.Helper()
		c.Write(encodeMessage([][]byte{[]byte(body)}))
		select {
		case m := <-msgs:
			if string(m.Frames[0]) != body {
				t.Fatalf("got %q, want %q", m.Frames[0], body)
			}
			return string(m.Peer)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no message", body)
		}
		return ""
	}
	want := map[string]string{} // id -> how it ended

	// Closes after 20 messages.
	closer, _ := rawPeer(t, addr, typeDealer)
	id := idOf(closer, "closer")
	for range 19 {
		closer.Write(encodeMessage([][]byte{[]byte("more")}))
	}
	for range 19 {
		<-msgs
	}
	closer.Close()
	if got := dis.wait(t, 10*time.Second); got != id {
		t.Fatalf("closer: reported %x, want %x", got, id)
	}
	want[id] = "closed"
	dis.mu.Lock()
	if dis.atHandler[id] != 20 {
		t.Errorf("closer reported after %d of its 20 messages", dis.atHandler[id])
	}
	dis.mu.Unlock()

	// Breaks the protocol (reserved flag bits).
	bad, _ := rawPeer(t, addr, typeDealer)
	id = idOf(bad, "bad")
	bad.Write([]byte{0xf0, 1, 'x'})
	if got := dis.wait(t, 10*time.Second); got != id {
		t.Fatalf("protocol error: reported %x, want %x", got, id)
	}
	want[id] = "protocol"

	// Stays idle past the idle timeout.
	quietPeer, _ := rawPeer(t, addr, typeDealer)
	id = idOf(quietPeer, "idle")
	if got := dis.wait(t, 10*time.Second); got != id {
		t.Fatalf("idle: reported %x, want %x", got, id)
	}
	want[id] = "idle"

	// Disconnected by the router's owner.
	kicked, _ := rawPeer(t, addr, typeDealer)
	id = idOf(kicked, "kicked")
	if err := r.Disconnect([]byte(id)); err != nil {
		t.Fatal(err)
	}
	if got := dis.wait(t, 10*time.Second); got != id {
		t.Fatalf("Disconnect: reported %x, want %x", got, id)
	}
	want[id] = "disconnect"
	if err := r.Disconnect([]byte(id)); !errors.Is(err, ErrUnknownPeer) {
		t.Fatalf("second Disconnect: %v", err)
	}

	// Refused in the handshake (wrong socket type): never a peer.
	refused, err := zmqtest.TryDialRaw(r.Endpoint(), "PUSH", "")
	if err == nil {
		refused.Close()
		t.Fatal("a PUSH peer got through a ROUTER's handshake")
	}

	// Open at Close, with a message Recv already returned; kept busy so
	// the idle timeout does not end it first.
	open, _ := rawPeer(t, addr, typeDealer)
	id = idOf(open, "open")
	want[id] = "close"
	stopPing := make(chan struct{})
	go func() {
		for {
			select {
			case <-stopPing:
				return
			case <-time.After(idle / 4):
				open.Write(encodeCommand("PING", []byte{0, 0}))
			}
		}
	}()
	time.Sleep(idle) // the pings keep it open
	r.Close()
	close(stopPing)
	<-loop
	dis.mu.Lock()
	defer dis.mu.Unlock()
	if len(dis.calls) != len(want) {
		t.Fatalf("reported %d connections, want %d: %v", len(dis.calls), len(want), dis.calls)
	}
	for id, how := range want {
		if dis.calls[id] != 1 {
			t.Errorf("%s (%x): reported %d times", how, id, dis.calls[id])
		}
	}
	goroutinesSettle(t, before)
}

// A DEALER hears at once that its peer process died: Recv returns
// ErrDisconnected within a second, and no goroutine is left after Close.
func TestDealerReportsKilledPeer(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	before := runtime.NumGoroutine()
	ep := IPCEndpoint(ipcPath(t, "r.sock"))
	peer := zmqtest.Start(t, peerScript, "router-dealer", "100", ep)
	portLine(t, peer)
	d, err := DialDealer(ep, quiet())
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t, 20*time.Second)
	if err := d.Send(ctx, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	if m, err := d.Recv(ctx); err != nil || string(m[0]) != "echo" {
		t.Fatalf("reply: %q %v", m, err)
	}
	peer.Kill()
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if _, err := d.Recv(rctx); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("after the peer was killed: %v, want ErrDisconnected", err)
	}
	t.Logf("reported %v after the peer was reaped", time.Since(start))
	d.Close()
	goroutinesSettle(t, before)
}
