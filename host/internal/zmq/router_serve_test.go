package zmq

import (
	"bytes"
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// TestRouterDiscardOversize: with WithDiscardOversize an oversized
// message (by bytes or by frames) reaches Recv as a zero-frame marker and
// the connection keeps working; without it the connection is dropped.
func TestRouterDiscardOversize(t *testing.T) {
	r, err := ListenRouter("tcp://127.0.0.1:0", WithMaxMessageSize(1024), WithMaxFrames(4), WithDiscardOversize())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p := zmqtest.DialRaw(t, r.Endpoint(), "DEALER")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	big := bytes.Repeat([]byte{7}, 4096)
	for _, msg := range [][][]byte{{big}, {[]byte("a"), big}, {{1}, {2}, {3}, {4}, {5}}} {
		if err := p.Send(msg...); err != nil {
			t.Fatal(err)
		}
		m, err := r.Recv(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Frames) != 0 {
			t.Fatalf("oversized message delivered as %d frames", len(m.Frames))
		}
		if err := p.Send([]byte("after")); err != nil {
			t.Fatal(err)
		}
		if m, err = r.Recv(ctx); err != nil || len(m.Frames) != 1 || string(m.Frames[0]) != "after" {
			t.Fatalf("after the marker: %v %q", err, m.Frames)
		}
		if err := r.Send(ctx, m.Peer, []byte("reply")); err != nil {
			t.Fatal(err)
		}
		if got, err := p.Recv(); err != nil || string(got[0]) != "reply" {
			t.Fatalf("reply: %v %q", err, got)
		}
	}
}

// TestRouterDisconnect: Disconnect closes one peer's connection only.
func TestRouterDisconnect(t *testing.T) {
	r, err := ListenRouter("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	a := zmqtest.DialRaw(t, r.Endpoint(), "DEALER")
	b := zmqtest.DialRaw(t, r.Endpoint(), "DEALER")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a.Send([]byte("a"))
	ma, err := r.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b.Send([]byte("b"))
	mb, err := r.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r.Disconnect(ma.Peer)
	a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := a.Recv(); err == nil {
		t.Fatal("disconnected peer still reads")
	}
	if err := r.Send(ctx, mb.Peer, []byte("still")); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Recv(); err != nil || string(got[0]) != "still" {
		t.Fatalf("other peer: %v %q", err, got)
	}
	r.Flush(ctx)
}

// TestRouterEnqueueBatches: messages queued faster than they are written
// go out several to a write (drain's batches, bounded by drainBatchBytes,
// a larger message alone) and arrive whole, in order, frame boundaries
// kept.
func TestRouterEnqueueBatches(t *testing.T) {
	r, err := ListenRouter("ipc://"+t.TempDir()+"/r.sock", quiet(), WithSendQueue(1000))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	d, err := DialDealer(r.Endpoint(), quiet(), WithMaxMessageSize(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Send(ctx, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	m, err := r.Recv(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{0, 1, 100, 100 << 10, drainBatchBytes, drainBatchBytes + 1, 3}
	const n = 300
	msg := func(i int) [][]byte {
		body := bytes.Repeat([]byte{byte(i)}, sizes[i%len(sizes)])
		return [][]byte{[]byte(strconv.Itoa(i)), body}
	}
	for i := range n {
		if err := r.Enqueue(m.Peer, msg(i)...); err != nil {
			t.Fatal(i, err)
		}
	}
	for i := range n {
		got, err := d.Recv(ctx)
		if err != nil {
			t.Fatal(i, err)
		}
		want := msg(i)
		if len(got) != 2 || !bytes.Equal(got[0], want[0]) || !bytes.Equal(got[1], want[1]) {
			t.Fatalf("message %d: got %d frames, first %q", i, len(got), got[0])
		}
	}
}
