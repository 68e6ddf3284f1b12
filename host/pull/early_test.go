package pull

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
)

// TestReadBeforeHold (issue 24): a decode handed params before the
// prefill's hold was processed reads and notifies at once; the
// notification is kept, and the hold that follows is released "notified"
// without waiting for a lease or the abort timeout. In version 6 and
// version 2, on a fake clock and the in-memory side channel.
func TestReadBeforeHold(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			fk := clock.NewFake(time.Time{})
			tr := memTransport{memtransport.New(fk)}
			ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) {
				c.Transport, c.Clock = tr, fk
				if v6 {
					c.Gen = gen6(t)
				}
			})
			ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) {
				c.Transport, c.Clock = tr, fk
				if v6 {
					c.Gen = gen6(t)
				}
			})
			blocks := []int32{4, 5}
			if err := ps.pools[0].Fill(kvpool.Tokens{Request: 7, Pages: blocks, Count: 8}); err != nil {
				t.Fatal(err)
			}
			params := ps.sender.params("r", blocks) // what Hold will answer, made before it
			if res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: []int32{0, 1}, Params: params})); res.Err != nil {
				t.Fatal(res.Err)
			}
			if err := ds.pools[0].Verify(kvpool.Tokens{Request: 7, Pages: []int32{0, 1}, Count: 8}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the early notification kept", 10*time.Second, func() bool { return ps.sender.Counts().EarlyKept == 1 })
			if _, err := ps.sender.Hold("r", blocks); err != nil {
				t.Fatal(err)
			}
			r := nextRelease(t, ps, 10*time.Second)
			if r.RequestID != "r" || r.Reason != ReleaseNotified || r.Notified != 1 || r.Held != 0 {
				t.Fatalf("release %+v", r)
			}
			if c := ps.sender.Counts(); c.EarlyApplied != 1 || c.EarlyExpired != 0 || c.Held != 0 || c.ReleasedNotified != 1 {
				t.Fatalf("counts %+v", c)
			}
		})
	}
}

// TestEarlyNotificationsCount: kept notifications count as the hold's
// would have, each agent once per rank; a hold whose readers notified
// only in part waits for the rest.
func TestEarlyNotificationsCount(t *testing.T) {
	g := geom{hnd: true, layers: 1, heads: 2, headBytes: 8, tp: 2, blockSize: 4, blocks: 16}
	fk := clock.NewFake(time.Time{})
	ps := newPrefillSide(t, g, "prefill", func(c *SenderConfig) { c.Clock = fk })
	n, n2 := newNotifier(t, ps), newNotifier(t, ps)
	n.send(t, 0, "p:2")
	n.send(t, 0, "p:2") // the same agent again: not kept twice
	n2.send(t, 0, "p:2")
	n.send(t, 1, "p:2")
	eventually(t, "the early notifications", 5*time.Second, func() bool { return ps.sender.Counts().UnknownNotifications == 4 })
	if c := ps.sender.Counts(); c.EarlyKept != 3 {
		t.Fatalf("counts %+v", c)
	}
	if _, err := ps.sender.Hold("p", []int32{1}); err != nil {
		t.Fatal(err)
	}
	noRelease(t, ps, 50*time.Millisecond) // rank 1 has one of its two readers
	n2.send(t, 1, "p:2")
	r := nextRelease(t, ps, 5*time.Second)
	if r.RequestID != "p" || r.Reason != ReleaseNotified || r.Notified != 4 {
		t.Fatalf("release %+v", r)
	}
	if c := ps.sender.Counts(); c.EarlyApplied != 3 || c.UnknownNotifications != 4 || c.Notifications != 5 {
		t.Fatalf("counts %+v", c)
	}
}

// TestEarlyNotificationsExpire: kept notifications last as long as a
// hold would (the abort timeout here); a hold after that is not released
// by them and waits for its own readers.
func TestEarlyNotificationsExpire(t *testing.T) {
	const timeout = 300 * time.Millisecond
	fk := clock.NewFake(time.Time{})
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.AbortTimeout, c.Clock = timeout, fk })
	n := newNotifier(t, ps)
	n.send(t, 0, "late:1")
	eventually(t, "the early notification", 5*time.Second, func() bool { return ps.sender.Counts().EarlyKept == 1 })
	fk.Advance(timeout - time.Millisecond)
	ps.sender.expire(fk.Now())
	if c := ps.sender.Counts(); c.EarlyExpired != 0 {
		t.Fatalf("expired before its time: %+v", c)
	}
	fk.Advance(time.Millisecond)
	eventually(t, "the early notification expired", 5*time.Second, func() bool { return ps.sender.Counts().EarlyExpired == 1 })
	ps.sender.mu.Lock()
	left, bytes := len(ps.sender.early), ps.sender.earlyBytes
	ps.sender.mu.Unlock()
	if left != 0 || bytes != 0 {
		t.Fatalf("%d early requests, %d bytes left", left, bytes)
	}
	if _, err := ps.sender.Hold("late", []int32{1}); err != nil {
		t.Fatal(err)
	}
	noRelease(t, ps, 50*time.Millisecond)
	n.send(t, 0, "late:1")
	if r := nextRelease(t, ps, 5*time.Second); r.RequestID != "late" || r.Reason != ReleaseNotified || r.Notified != 1 {
		t.Fatalf("release %+v", r)
	}
}

// TestEarlyNotificationsBounded: a peer naming requests that never come
// fills the bounds (ids, bytes) and no more; past them notifications are
// dropped as before, and what was kept first still works.
func TestEarlyNotificationsBounded(t *testing.T) {
	fk := clock.NewFake(time.Time{})
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.Clock = fk })
	ps.sender.mu.Lock()
	ps.sender.earlyMax, ps.sender.earlyMaxBytes = 3, 3*(earlyNotifOverhead+64)
	ps.sender.mu.Unlock()
	n := newNotifier(t, ps)
	for i := range 5 {
		n.send(t, 0, fmt.Sprintf("r%d:1", i))
	}
	eventually(t, "the notifications", 5*time.Second, func() bool { return ps.sender.Counts().UnknownNotifications == 5 })
	if c := ps.sender.Counts(); c.EarlyKept != 3 {
		t.Fatalf("kept %d of 5 with room for 3: %+v", c.EarlyKept, c)
	}
	if _, err := ps.sender.Hold("r4", []int32{2}); err != nil { // its notification was dropped
		t.Fatal(err)
	}
	if _, err := ps.sender.Hold("r0", []int32{1}); err != nil {
		t.Fatal(err)
	}
	if r := nextRelease(t, ps, 5*time.Second); r.RequestID != "r0" || r.Reason != ReleaseNotified {
		t.Fatalf("release %+v", r)
	}
	noRelease(t, ps, 50*time.Millisecond)

	// Room for one more id, but not for its bytes.
	long := strings.Repeat("x", 200)
	n.send(t, 0, long+":1")
	eventually(t, "the long notification", 5*time.Second, func() bool { return ps.sender.Counts().UnknownNotifications == 6 })
	ps.sender.mu.Lock()
	_, kept := ps.sender.early[long]
	used := ps.sender.earlyBytes
	ps.sender.mu.Unlock()
	if kept || used > ps.sender.earlyMaxBytes {
		t.Fatalf("kept %v, %d bytes of %d", kept, used, ps.sender.earlyMaxBytes)
	}
	if c := ps.sender.Counts(); c.EarlyKept != 3 {
		t.Fatalf("counts %+v", c)
	}
}
