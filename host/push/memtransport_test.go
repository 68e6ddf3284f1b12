package push_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// memTransport adapts an in-memory network to push.Transport; every
// message a rank sends comes from 127.0.0.1. The bootstrap server is the
// real one (HTTP), unless boot replaces its client.
type memTransport struct {
	n    *memtransport.Network
	boot func(addr string) push.BootstrapClient
}

func (m memTransport) Bootstrap(addr string) push.BootstrapClient {
	if m.boot != nil {
		return m.boot(addr)
	}
	return bootstrap.NewClient(addr)
}

func (m memTransport) Listen(endpoint string, _ *slog.Logger) (push.Inbox, error) {
	in, err := m.n.Listen(endpoint)
	if err != nil {
		return nil, err
	}
	return in, nil
}

func (m memTransport) Outbox(*slog.Logger, time.Duration) push.Outbox { return m.n.Outbox("127.0.0.1") }

// waitArmed waits (at most 10 s) until the code under test armed a timer
// or ticker of d on fk.
func waitArmed(t testing.TB, fk *clock.Fake, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := fk.WaitArmed(ctx, d); err != nil {
		t.Fatalf("no %v timer armed: %v", d, err)
	}
}

// flakyBootstrap is a bootstrap client whose server can be made
// unreachable.
type flakyBootstrap struct {
	push.BootstrapClient
	down *atomic.Bool
}

var errBootstrapDown = errors.New("test: bootstrap server unreachable")

func (f flakyBootstrap) Health(ctx context.Context) error {
	if f.down.Load() {
		return errBootstrapDown
	}
	return f.BootstrapClient.Health(ctx)
}

// heartbeats reports the decode's heartbeat checks.
type heartbeats struct {
	push.NopObserver
	c chan error
}

func (h heartbeats) Handshake(e push.HandshakeEvent) {
	if e.Kind == push.HandshakeHeartbeat {
		h.c <- e.Err
	}
}

// TestHeartbeatFailsRooms: when the bootstrap server stops answering,
// HeartbeatMaxFailures failed checks in a row fail the decode's
// unfinished rooms with SGLang's reason; one failed check does not. The
// checks run on a fake clock over the in-memory transport, one per
// Advance of HeartbeatInterval.
func TestHeartbeatFailsRooms(t *testing.T) {
	const interval = 5 * time.Second
	fk := clock.NewFake(time.Time{})
	var down atomic.Bool
	beats := heartbeats{c: make(chan error, 16)}
	r := newRig(t, rigOpts{dset: push.Settings{HeartbeatInterval: interval, HeartbeatMaxFailures: 2}, dobs: beats,
		clock: fk, mem: memtransport.New(fk),
		boot: func(addr string) push.BootstrapClient { return flakyBootstrap{bootstrap.NewClient(addr), &down} }})
	ctx := ctxT(t, 20*time.Second)
	q := r.prepare(21, 8, 0)
	defer q.close()
	if err := q.rcv.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := q.rcv.SendMetadata(ctx, q.dpages, q.daux, nil, 0); err != nil {
		t.Fatal(err)
	}
	beat := func() error {
		t.Helper()
		fk.Advance(interval)
		select {
		case err := <-beats.c:
			return err
		case <-ctx.Done():
			t.Fatal("no heartbeat")
			return nil
		}
	}
	waitArmed(t, fk, interval)
	if err := beat(); err != nil {
		t.Fatal("heartbeat of a live server:", err)
	}
	down.Store(true)
	if err := beat(); !errors.Is(err, errBootstrapDown) {
		t.Fatal(err)
	}
	if st := q.rcv.Poll(); st == sglang.KVPollFailed {
		t.Fatalf("one failed heartbeat failed the room: %v", q.rcv.Failure())
	}
	if err := beat(); !errors.Is(err, errBootstrapDown) {
		t.Fatal(err)
	}
	if st, _ := q.rcv.Wait(ctx); st != sglang.KVPollFailed || !strings.Contains(q.rcv.Failure().Error(), "Lost connection with prefill instance") {
		t.Fatalf("decode %v: %v", st, q.rcv.Failure())
	}
}
