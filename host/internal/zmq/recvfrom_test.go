package zmq

import (
	"net"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// TestRecvFrom: each message comes with the remote address of the
// connection it arrived on, also when two peers on one machine connect
// from different loopback addresses; Recv still returns the same frames.
func TestRecvFrom(t *testing.T) {
	pull := newPull(t)
	ctx := testCtx(t, 10*time.Second)
	a := zmqtest.DialRawFrom(t, pull.Endpoint(), "PUSH", "127.0.0.1")
	b := zmqtest.DialRawFrom(t, pull.Endpoint(), "PUSH", "127.0.0.2")
	if err := a.Send([]byte("from"), []byte("a")); err != nil {
		t.Fatal(err)
	}
	frames, from, err := pull.RecvFrom(ctx)
	if err != nil || string(frames[1]) != "a" {
		t.Fatalf("%q %v", frames, err)
	}
	if ta, ok := from.(*net.TCPAddr); !ok || !ta.IP.Equal(net.ParseIP("127.0.0.1")) || ta.Port != a.LocalAddr().(*net.TCPAddr).Port {
		t.Fatalf("message from a came from %v, want %v", from, a.LocalAddr())
	}
	if err := b.Send([]byte("from"), []byte("b")); err != nil {
		t.Fatal(err)
	}
	frames, from, err = pull.RecvFrom(ctx)
	if err != nil || string(frames[1]) != "b" {
		t.Fatalf("%q %v", frames, err)
	}
	if ta, ok := from.(*net.TCPAddr); !ok || !ta.IP.Equal(net.ParseIP("127.0.0.2")) {
		t.Fatalf("message from b came from %v, want 127.0.0.2", from)
	}
	if err := a.Send([]byte("plain")); err != nil {
		t.Fatal(err)
	}
	if frames, err := pull.Recv(ctx); err != nil || len(frames) != 1 || string(frames[0]) != "plain" {
		t.Fatalf("Recv: %q %v", frames, err)
	}
	pull.Close()
	if _, _, err := pull.RecvFrom(ctx); err != ErrClosed {
		t.Fatalf("RecvFrom after Close: %v", err)
	}
}
