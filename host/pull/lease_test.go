package pull

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

func gen6(t *testing.T) *vllm.Generation {
	g, err := vllm.Lookup(6)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// expireNow runs the Sender's expiry at the fake clock's time and returns
// its counts (the expiry goroutine would get there on its own, later).
func expireNow(ps *prefillSide, fk *clock.Fake) SenderCounts {
	ps.sender.expire(fk.Now())
	return ps.sender.Counts()
}

// TestLeaseKeptAliveByHeartbeats: a version-6 (and -12, the newest)
// decode whose READ is still running sends a heartbeat every lease//6 (5 s
// of a 30 s lease) to the prefill, which extends the hold to now + 20 s
// each time: the hold outlives its first lease. Once the decode stops (its
// READ aborted, no notification), the lease lapses 20 s after the last
// heartbeat. All on a fake clock: ticked, not slept.
func TestLeaseKeptAliveByHeartbeats(t *testing.T) {
	for _, v := range []int{6, 12} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			g, err := vllm.Lookup(v)
			if err != nil {
				t.Fatal(err)
			}
			leaseKeptAlive(t, g)
		})
	}
}

func leaseKeptAlive(t *testing.T, g *vllm.Generation) {
	fk := clock.NewFake(time.Time{})
	tr := memTransport{memtransport.New(fk)}
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.Gen, c.Transport, c.Clock = g, tr, fk })
	// The decode agent's transfers wait a minute: the READ stays in flight.
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Gen, c.Transport, c.Clock = g, tr, fk },
		plugin.Param{Key: "delay_us", Value: "60000000"})
	params := ps.hold(t, "r", 1, []int32{2, 3}, 8)
	l := ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: []int32{0, 1}, Params: params})
	eventually(t, "the handshake", 10*time.Second, func() bool { return len(ds.rx[0].Peers()) == 1 })
	if off := ds.rx[0].Peers()[0].ClockOffset; off != 0 {
		t.Fatalf("both sides on one fake clock, started together: clock offset %v", off)
	}
	for i := 1; i <= 7; i++ { // to 35 s, past the first lease
		fk.Advance(5 * time.Second)
		eventually(t, "a heartbeat", 10*time.Second, func() bool { return ps.sender.Counts().Heartbeats >= i })
		if c := expireNow(ps, fk); c.Held != 1 || c.ReleasedExpired != 0 {
			t.Fatalf("at %v: %+v", fk.Since(time.Time{}), c)
		}
	}
	// A heartbeat extends to max(deadline, now + 20 s): the ones at 5 and
	// 10 s do not move the first lease's 30 s, those from 15 s on do.
	if c := ps.sender.Counts(); c.Renewed != 5 {
		t.Fatalf("%+v", c)
	}
	select {
	case <-l.Done():
		t.Fatalf("the READ ended: %+v", l.Result())
	default:
	}
	// The decode goes: no more heartbeats. The hold lapses at 35 + 20 s.
	ds.rx[0].Close()
	if res := l.Result(); res.Err == nil {
		t.Fatal("the closed decode's READ succeeded")
	}
	fk.Advance(19 * time.Second)
	if c := expireNow(ps, fk); c.Held != 1 {
		t.Fatalf("expired before its extended lease: %+v", c)
	}
	fk.Advance(time.Second)
	expireNow(ps, fk)
	select {
	case rel := <-ps.releases:
		if rel.Reason != ReleaseExpired || rel.Held != 55*time.Second || rel.Notified != 0 {
			t.Fatalf("release %+v", rel)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("not released")
	}
}

// TestLeaseLapses: a version-6 hold nobody reads lapses at its lease;
// heartbeats for other requests, unknown ids or malformed ones do not
// extend it. A version-2 hold waits for the abort timeout instead.
func TestLeaseLapses(t *testing.T) {
	g := gen6(t)
	fk := clock.NewFake(time.Time{})
	tr := memTransport{memtransport.New(fk)}
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) {
		c.Gen, c.Transport, c.Clock, c.Lease = g, tr, fk, 12*time.Second
	})
	ps2 := newPrefillSide(t, smallGeom, "prefill2", func(c *SenderConfig) { c.Transport, c.Clock = tr, fk })
	ps.hold(t, "a", 1, []int32{1}, 4)
	ps.hold(t, "b", 2, []int32{2}, 4)
	ps2.hold(t, "a", 1, []int32{1}, 4)
	// A peer's heartbeats: it loaded the prefill's agent metadata.
	peer := newAgent(t, "hb")
	blob, err := ps.agents[0].LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	name, err := peer.LoadRemote(blob)
	if err != nil {
		t.Fatal(err)
	}
	fk.Advance(6 * time.Second)
	for _, m := range []string{"HB:b,unknown", "HB:\xff", "HB:"} {
		if err := peer.SendNotif(name, []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the heartbeats", 10*time.Second, func() bool {
		c := ps.sender.Counts()
		return c.Heartbeats == 2 && c.MalformedNotifications == 1
	})
	// b: extended to 6 + 12*2//3 = 14 s; a: still 12 s.
	fk.Advance(6*time.Second - time.Nanosecond)
	if c := expireNow(ps, fk); c.Held != 2 {
		t.Fatalf("%+v", c)
	}
	fk.Advance(time.Nanosecond)
	if c := expireNow(ps, fk); c.Held != 1 || c.ReleasedExpired != 1 || c.Renewed != 1 {
		t.Fatalf("at 12 s: %+v", c)
	}
	fk.Advance(2 * time.Second)
	if c := expireNow(ps, fk); c.Held != 0 || c.ReleasedExpired != 2 {
		t.Fatalf("at 14 s: %+v", c)
	}
	got := map[string]time.Duration{}
	for range 2 {
		rel := <-ps.releases
		got[rel.RequestID] = rel.Held
	}
	if got["a"] != 12*time.Second || got["b"] != 14*time.Second {
		t.Fatalf("held %v", got)
	}
	// Version 2 holds for the abort timeout (a minute here).
	if c := expireNow(ps2, fk); c.Held != 1 {
		t.Fatalf("version 2 at 14 s: %+v", c)
	}
	fk.Advance(46 * time.Second)
	if c := expireNow(ps2, fk); c.Held != 0 || c.ReleasedExpired != 1 {
		t.Fatalf("version 2 at 60 s: %+v", c)
	}
}

// TestLeaseWatchedBeforeLoad: a version-6 decode renews the lease of a
// request it was told it will load (Watch; vLLM's on_new_request) while
// the request waits for its load: the first heartbeat round finds no
// handshake with the prefill engine and starts one, the next ones renew.
// The load finishing, or Unwatch, stops it, and an unwatched lease lapses.
// Version 2 has no leases to renew.
func TestLeaseWatchedBeforeLoad(t *testing.T) {
	g := gen6(t)
	fk := clock.NewFake(time.Time{})
	tr := memTransport{memtransport.New(fk)}
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.Gen, c.Transport, c.Clock = g, tr, fk })
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Gen, c.Transport, c.Clock = g, tr, fk })
	queued := ps.hold(t, "queued", 2, []int32{3, 4}, 8)
	if err := ds.rx[0].Watch("d2", queued); err != nil {
		t.Fatal(err)
	}
	fk.Advance(5 * time.Second)
	eventually(t, "the handshake the heartbeat started", 10*time.Second, func() bool { return len(ds.rx[0].Peers()) == 1 })
	if c := ps.sender.Counts(); c.Heartbeats != 0 {
		t.Fatalf("a heartbeat before the handshake: %+v", c)
	}
	for i := 1; i <= 7; i++ { // to 40 s, past the first lease
		fk.Advance(5 * time.Second)
		eventually(t, "a heartbeat", 10*time.Second, func() bool { return ps.sender.Counts().Heartbeats >= i })
		if c := expireNow(ps, fk); c.Held != 1 {
			t.Fatalf("at %v: %+v", fk.Since(time.Time{}), c)
		}
	}
	// Its load comes: read, notified, released; the watch ends with it.
	if res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d2", LocalBlockIDs: []int32{5, 6}, Params: queued})); res.Err != nil {
		t.Fatal(res.Err)
	}
	select {
	case rel := <-ps.releases:
		if rel.Reason != ReleaseNotified || rel.RequestID != "queued" || rel.Held != 40*time.Second {
			t.Fatalf("%+v", rel)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("not released")
	}
	if err := ds.pools[0].Verify(kvpool.Tokens{Request: 2, Pages: []int32{5, 6}, Count: 8}); err != nil {
		t.Fatal(err)
	}
	// Unwatched before its load: the lease lapses.
	dropped := ps.hold(t, "dropped", 3, []int32{7}, 4)
	if err := ds.rx[0].Watch("d3", dropped); err != nil {
		t.Fatal(err)
	}
	fk.Advance(5 * time.Second)
	eventually(t, "a heartbeat", 10*time.Second, func() bool { return ps.sender.Counts().Heartbeats >= 8 })
	ds.rx[0].Unwatch("d3")
	hb := ds.rx[0].Heartbeats()
	fk.Advance(25 * time.Second)
	eventually(t, "a heartbeat round", 10*time.Second, func() bool { return ds.rx[0].Heartbeats() > hb })
	if c := expireNow(ps, fk); c.Held != 0 || c.ReleasedExpired != 1 || c.Heartbeats != 8 {
		t.Fatalf("%+v", c)
	}
	if err := newDecodeSide(t, smallGeom, nil).rx[0].Watch("x", queued); !errors.Is(err, ErrNoLease) {
		t.Fatalf("version 2: %v", err)
	}
}
