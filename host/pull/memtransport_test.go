package pull

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
)

// memTransport adapts an in-memory network to Transport: the handshake
// server answers with HandshakeService.Reply.
type memTransport struct{ n *memtransport.Network }

func (m memTransport) ListenHandshake(endpoint string, svc HandshakeService, _ *slog.Logger) (HandshakeListener, error) {
	s, err := m.n.Serve(endpoint, func(_ net.Addr, req [][]byte) ([][]byte, bool) {
		reply, _, _, _ := svc.Reply(req)
		return reply, true
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

func (m memTransport) Request(ctx context.Context, endpoint string, request [][]byte) ([][]byte, error) {
	return m.n.Request(ctx, "127.0.0.1", endpoint, request)
}

// waitArmed waits (at most 10 s) until the code under test armed a timer
// of d on fk.
func waitArmed(t *testing.T, fk *clock.Fake, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := fk.WaitArmed(ctx, d); err != nil {
		t.Fatalf("no %v timer armed: %v", d, err)
	}
}

// TestMemTransportHandshake: a Receiver and a Sender on the in-memory
// transport handshake and pull as over ZMQ, and a dropped handshake
// request fails at the handshake timeout on the fake clock.
func TestMemTransportHandshake(t *testing.T) {
	fk := clock.NewFake(time.Time{})
	mem := memtransport.New(fk)
	tr := memTransport{mem}
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.Transport, c.Clock = tr, fk })
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Transport, c.Clock = tr, fk })
	params := ps.hold(t, "r", 1, []int32{2, 3}, 8)
	if res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: params})); res.Err != nil {
		t.Fatal(res.Err)
	}

	const timeout = time.Second
	ds2 := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Transport, c.Clock, c.HandshakeTimeout = tr, fk, timeout })
	mem.SetFilter(func(m memtransport.Msg) memtransport.Verdict { return memtransport.Verdict{Drop: m.Request} })
	params = ps.hold(t, "dropped", 2, []int32{4}, 4)
	l := ds2.rx[0].Load(LoadRequest{RequestID: "dropped", LocalBlockIDs: []int32{1}, Params: params})
	eventually(t, "the dropped request", 10*time.Second, func() bool { _, dropped := mem.Counts(); return dropped == 1 })
	waitArmed(t, fk, timeout)
	start := fk.Now()
	fk.Advance(timeout)
	res := wait(t, l)
	if !errors.Is(res.Err, ErrHandshake) || !errors.Is(res.Err, context.DeadlineExceeded) || fk.Since(start) != timeout {
		t.Fatalf("%v after %v", res.Err, fk.Since(start))
	}
	if sent, dropped := mem.Counts(); dropped != 1 || sent < 3 {
		t.Fatalf("%d messages, %d dropped", sent, dropped)
	}
}
