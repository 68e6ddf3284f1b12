package memtransport

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestMessages: one-way messages arrive in order with their sender's
// address; binding, refusal and Close behave as a socket's would.
func TestMessages(t *testing.T) {
	n := New(nil)
	in, err := n.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if in.Port() == 0 || in.Endpoint() != "tcp://127.0.0.1:"+itoa(in.Port()) {
		t.Fatalf("bound %s port %d", in.Endpoint(), in.Port())
	}
	if _, err := n.Listen(in.Endpoint()); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("second bind: %v", err)
	}
	out := n.Outbox("10.0.0.7")
	ctx := ctxT(t, 10*time.Second)
	frames := [][]byte{[]byte("a"), []byte("bc")}
	for i := range 3 {
		if err := out.Send(ctx, in.Endpoint(), append(frames, []byte{byte(i)})...); err != nil {
			t.Fatal(err)
		}
	}
	frames[0][0] = 'x' // the message is a copy
	for i := range 3 {
		got, from, err := in.RecvFrom(ctx)
		if err != nil || string(got[0]) != "a" || got[2][0] != byte(i) || from.(*net.TCPAddr).IP.String() != "10.0.0.7" {
			t.Fatalf("message %d: %q from %v, %v", i, got, from, err)
		}
	}
	if err := out.Send(ctx, "tcp://127.0.0.1:1", []byte("x")); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("send to nobody: %v", err)
	}
	in.Close()
	if _, _, err := in.RecvFrom(ctx); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("receive after Close: %v", err)
	}
	if err := out.Send(ctx, in.Endpoint(), []byte("x")); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("send to a closed inbox: %v", err)
	}
	out.Close()
	if err := out.Send(ctx, in.Endpoint(), []byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("send on a closed outbox: %v", err)
	}
}

func itoa(i int) string { return (&net.TCPAddr{Port: i}).String()[1:] }

// TestFilter: a dropped message never arrives; a delayed one arrives
// when the fake clock reaches its delay, not before.
func TestFilter(t *testing.T) {
	fk := clock.NewFake(time.Time{})
	n := New(fk)
	in, err := n.Listen("tcp://127.0.0.1:5000")
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	n.SetFilter(func(m Msg) Verdict {
		switch string(m.Frames[0]) {
		case "drop":
			return Verdict{Drop: true}
		case "late":
			return Verdict{Delay: time.Second}
		}
		return Verdict{}
	})
	out := n.Outbox("127.0.0.1")
	ctx := ctxT(t, 10*time.Second)
	for _, m := range []string{"late", "drop", "now"} {
		if err := out.Send(ctx, in.Endpoint(), []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	if got, _, _ := in.RecvFrom(ctx); string(got[0]) != "now" {
		t.Fatalf("first %q", got)
	}
	fk.Advance(999 * time.Millisecond)
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if got, _, err := in.RecvFrom(short); err == nil {
		t.Fatalf("%q arrived before its delay", got)
	}
	fk.Advance(time.Millisecond)
	if got, _, _ := in.RecvFrom(ctx); string(got[0]) != "late" {
		t.Fatalf("second %q", got)
	}
	if sent, dropped := n.Counts(); sent != 3 || dropped != 1 {
		t.Fatalf("%d sent, %d dropped", sent, dropped)
	}
}

// TestRequest: a request gets its handler's reply; a dropped or
// unanswered one fails when the context ends; a delayed reply waits for
// the clock; nobody serving is refused at once.
func TestRequest(t *testing.T) {
	fk := clock.NewFake(time.Time{})
	n := New(fk)
	s, err := n.Serve("tcp://127.0.0.1:0", func(from net.Addr, req [][]byte) ([][]byte, bool) {
		if string(req[0]) == "ignore" {
			return nil, false
		}
		return [][]byte{append([]byte("re:"), req[0]...), []byte(from.(*net.TCPAddr).IP.String())}, true
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t, 10*time.Second)
	rep, err := n.Request(ctx, "10.1.2.3", s.Endpoint(), [][]byte{[]byte("hi")})
	if err != nil || string(rep[0]) != "re:hi" || string(rep[1]) != "10.1.2.3" {
		t.Fatalf("%q %v", rep, err)
	}
	short := func() context.Context { return ctxT(t, 20*time.Millisecond) }
	if _, err := n.Request(short(), "127.0.0.1", s.Endpoint(), [][]byte{[]byte("ignore")}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unanswered: %v", err)
	}
	n.SetFilter(func(m Msg) Verdict {
		if m.Request {
			return Verdict{Drop: string(m.Frames[0]) == "drop"}
		}
		return Verdict{Delay: time.Second} // every reply
	})
	if _, err := n.Request(short(), "127.0.0.1", s.Endpoint(), [][]byte{[]byte("drop")}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("dropped: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		rep, err := n.Request(ctx, "127.0.0.1", s.Endpoint(), [][]byte{[]byte("slow")})
		if err == nil && string(rep[0]) != "re:slow" {
			err = errors.New(string(rep[0]))
		}
		done <- err
	}()
	if err := fk.WaitArmed(ctx, time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		t.Fatalf("a delayed reply came early: %v", err)
	default:
	}
	fk.Advance(time.Second)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, err := n.Request(ctx, "127.0.0.1", s.Endpoint(), [][]byte{[]byte("x")}); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("after Close: %v", err)
	}
}
