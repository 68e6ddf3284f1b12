package client

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// fakeLink answers every request ok and closes when told.
type fakeLink struct {
	in   chan []byte
	gone chan struct{}
}

func (l *fakeLink) send(_ context.Context, msg []byte) error {
	v, err := msgpack.Decode(msg)
	if err != nil {
		return err
	}
	seq, _ := v.Get("seq")
	n, _ := seq.Uint()
	var e msgpack.Encoder
	e.MapHeader(2)
	e.Str("seq")
	e.Uint(n)
	e.Str("ok")
	e.Bool(true)
	l.in <- e.Bytes()
	return nil
}

func (l *fakeLink) recv() ([]byte, error) {
	select {
	case b := <-l.in:
		return b, nil
	case <-l.gone:
		return nil, errors.New("gone")
	}
}

func (l *fakeLink) close() error { return nil }

// TestVLLMReadsFailWhenConnectionLost: a read in flight when the
// connection drops gets a made-up read event, not ok, every block
// invalid, reason ReasonConnectionLost; a read that finished does not.
func TestVLLMReadsFailWhenConnectionLost(t *testing.T) {
	l := &fakeLink{in: make(chan []byte, 16), gone: make(chan struct{})}
	c := newClient(l)
	ctx := context.Background()
	var params msgpack.Value
	params.Kind = msgpack.Map
	if err := c.Read(ctx, 7, "a", params, []int32{3, 4}); err != nil {
		t.Fatal(err)
	}
	if err := c.Read(ctx, 7, "b", params, []int32{5}); err != nil {
		t.Fatal(err)
	}
	// b finishes.
	var e msgpack.Encoder
	e.MapHeader(4)
	e.Str("event")
	e.Str("read")
	e.Str("rank")
	e.Uint(7)
	e.Str("request_id")
	e.Str("b")
	e.Str("ok")
	e.Bool(true)
	l.in <- e.Bytes()
	next := func() Event {
		select {
		case ev, ok := <-c.Events():
			if !ok {
				t.Fatal("events closed")
			}
			return ev
		case <-time.After(10 * time.Second):
			t.Fatal("no event")
		}
		return Event{}
	}
	if r, ok := next().AsRead(); !ok || !r.OK || r.RequestID != "b" {
		t.Fatalf("%+v", r)
	}
	close(l.gone)
	ev := next()
	r, ok := ev.AsRead()
	if !ok || !ev.Local || r.OK || r.RequestID != "a" || r.Rank != 7 || r.Reason != ReasonConnectionLost || !slices.Equal(r.InvalidBlocks, []int32{3, 4}) {
		t.Fatalf("%+v %+v", ev, r)
	}
	if ev, ok := <-c.Events(); ok {
		t.Fatalf("another event after the lost ones: %+v", ev)
	}
}
