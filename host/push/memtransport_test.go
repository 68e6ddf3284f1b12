package push_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/push"
)

// memTransport adapts an in-memory network to push.Transport; every
// message a rank sends comes from 127.0.0.1.
type memTransport struct{ n *memtransport.Network }

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
