package pull

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// serveHandshake serves one crafted TP-rank-0 handshake for md, as a
// hostile prefill would, and returns its endpoint's port.
func serveHandshake(t *testing.T, md *vllm.AgentMetadata) int {
	t.Helper()
	srv, err := ListenHandshake("tcp://127.0.0.1:0", HandshakeService{Payloads: map[int][]byte{0: vllm.NewHandshakePayload(testHash, md).Encode()}}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv.Port()
}

// honestLoads runs n requests against the honest prefill, one after the
// other, and returns how many verified.
func honestLoads(t *testing.T, ps *prefillSide, rx *Receiver, pool *kvpool.Pool, tag string, n int) (ok int, firstErr error) {
	t.Helper()
	for i := range n {
		id := fmt.Sprintf("%s-%d", tag, i)
		seed := uint64(1000 + i)
		params := ps.hold(t, id, seed, []int32{int32(2 * (i % 8)), int32(2*(i%8) + 1)}, 8)
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{4, 5}, Params: params}))
		err := res.Err
		if err == nil {
			err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{4, 5}, Count: 8})
		}
		if err == nil {
			ok++
		} else if firstErr == nil {
			firstErr = err
		}
		ps.sender.Abort(id)
	}
	return ok, firstErr
}

// TestRefusedHandshakeSparesOtherEngines (issue 19.1): a handshake for
// another engine id that carries the honest prefill's own agent metadata
// with lying geometry is refused, and the refusal leaves the honest
// engine's peer (its remote agent and lists) as it was.
func TestRefusedHandshakeSparesOtherEngines(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, nil)
	rx, pool := ds.rx[0], ds.pools[0]
	if ok, err := honestLoads(t, ps, rx, pool, "before", 10); ok != 10 {
		t.Fatalf("before the attack: %d/10 honest requests ok (%v)", ok, err)
	}
	lies := map[string]func(*vllm.AgentMetadata){
		"doubled num_blocks": func(m *vllm.AgentMetadata) { m.NumBlocks *= 2 },
		"shifted base":       func(m *vllm.AgentMetadata) { m.KVCachesBaseAddr[0] += 1 << 20 },
		"other device":       func(m *vllm.AgentMetadata) { m.DeviceID++ },
	}
	for what, lie := range lies {
		md := fetchPayload(t, ps.sender.Endpoint(), 0)
		md.EngineID = "evil"
		lie(md)
		port := serveHandshake(t, md)
		evil := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{0, 1}, RemoteEngineID: "evil",
			RemoteRequestID: "evil", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}
		res := wait(t, rx.Load(LoadRequest{RequestID: "evil", LocalBlockIDs: []int32{6, 7}, Params: evil}))
		if !errors.Is(res.Err, ErrHandshake) {
			t.Fatalf("%s: the lying handshake was not refused: %v", what, res.Err)
		}
		ok, err := honestLoads(t, ps, rx, pool, "after-"+what, 29)
		t.Logf("%s: honest requests after the refused handshake: %d/29 ok", what, ok)
		if ok != 29 {
			t.Fatalf("%s: %d/29 honest requests ok after the refused handshake (first error: %v)", what, ok, err)
		}
	}
	if got := rx.Peers(); len(got) != 1 || got[0].EngineID != "prefill" {
		t.Fatalf("peers %+v", got)
	}
}

// notifRun is one side of TestHostileNotifications: how many of the
// legitimate decode's requests verified and were released as notified,
// and each one's time from Load to release.
type notifRun struct {
	verified int
	took     []time.Duration
	firstErr error
}

// median is the middle duration: scheduling hiccups on a loaded machine
// (which hit a few requests of either kind) are not the attack, which
// would slow every attacked request.
func median(d []time.Duration) time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// TestHostileNotifications (issue 19.4): a hostile decode that loaded the
// prefill's metadata sends early and surplus notifications, with other
// tp_ratio claims, for the legitimate decode's requests. Every request
// still verifies (the prefill did not free blocks still being read: a
// released block is overwritten at once here, as an engine reusing it
// would) and is released on its reader's notification, within 1.5x the
// unattacked time measured in the same run.
func TestHostileNotifications(t *testing.T) {
	const abort = 2 * time.Second
	var ps *prefillSide
	ps = newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) {
		c.AbortTimeout = abort
		c.OnRelease = func(r Release) {
			// The engine reuses freed blocks at once: overwrite them.
			for _, p := range ps.pools {
				p.Fill(kvpool.Tokens{Request: 0xdead, Pages: r.BlockIDs, Count: len(r.BlockIDs) * smallGeom.blockSize})
			}
			ps.releases <- r
		}
	})
	ds := newDecodeSide(t, smallGeom, nil)
	rx, pool := ds.rx[0], ds.pools[0]
	hostile := newNotifier(t, ps)

	// Unattacked and attacked requests alternate, so that both see the
	// same machine load.
	const n = 40
	var base, att notifRun
	for j := range 2*n + 4 {
		out, attack := &base, j%2 == 1
		if attack {
			out = &att
		}
		i := j / 2
		id := fmt.Sprintf("r-%d", j)
		seed := uint64(j + 1)
		blocks := []int32{int32(2 * (j % 16)), int32(2*(j%16) + 1)}
		params := ps.hold(t, id, seed, blocks, 8)
		// The hostile decode's notifications go out before the reader's
		// on both sides, so both wait alike: for another id when
		// unattacked, for this one when attacked. Early and surplus: three
		// claiming tp_ratio 2 (two of them freed the blocks before the
		// fix), or two claiming 3 (the reader's own notification was then
		// surplus, and the blocks held until the abort timeout).
		before := ps.sender.Counts().Notifications
		claim, sends := 2, 3
		if i%2 == 1 {
			claim, sends = 3, 2
		}
		target := id
		if !attack {
			target = "someone-else-" + id
		}
		for range sends {
			hostile.send(t, 0, vllm.ReadNotif(target, claim))
		}
		eventually(t, "the hostile notifications", 5*time.Second, func() bool {
			return ps.sender.Counts().Notifications >= before+sends
		})
		start := time.Now()
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{4, 5}, Params: params}))
		err := res.Err
		if err == nil {
			err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{4, 5}, Count: 8})
		}
		select {
		case r := <-ps.releases:
			if err == nil && (r.RequestID != id || r.Reason != ReleaseNotified) {
				err = fmt.Errorf("release %+v", r)
			}
		case <-time.After(abort + time.Second):
			if err == nil {
				err = errors.New("not released")
			}
		}
		if j < 4 {
			continue // warm-up
		}
		out.took = append(out.took, time.Since(start))
		if err == nil {
			out.verified++
		} else if out.firstErr == nil {
			out.firstErr = fmt.Errorf("%s: %w", id, err)
		}
	}
	bt, at := median(base.took), median(att.took)
	t.Logf("unattacked: %d/%d ok, median %v; attacked: %d/%d ok (verified and released on the reader's notification), median %v (%.2fx)",
		base.verified, n, bt, att.verified, n, at, float64(at)/float64(bt))
	if base.verified != n {
		t.Fatalf("unattacked: %d/%d ok (first error: %v)", base.verified, n, base.firstErr)
	}
	if att.verified != n {
		t.Fatalf("attacked: %d/%d ok (first error: %v)", att.verified, n, att.firstErr)
	}
	if at > bt*3/2 {
		t.Fatalf("attacked requests took %v (median), unattacked %v: more than 1.5x", at, bt)
	}
}

// peakRSS resets the process's peak resident set (VmHWM) when reset, and
// returns it in bytes.
func peakRSS(t *testing.T, reset bool) int64 {
	t.Helper()
	if reset {
		if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
			t.Fatalf("cannot reset the peak RSS: %v", err)
		}
	}
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/self/status")
	return 0
}

// TestHugeGeometryRefusedUpFront (issue 19.3): a handshake declaring
// 2^26 descriptors (the prefill's real agent, num_blocks inflated) is
// refused on its declared geometry, before a descriptor is built: the
// decode's peak RSS grows by at most 256 MB and the request fails within
// the handshake timeout; honest requests go on.
func TestHugeGeometryRefusedUpFront(t *testing.T) {
	const timeout = 2 * time.Second
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.HandshakeTimeout = timeout })
	rx, pool := ds.rx[0], ds.pools[0]
	if ok, err := honestLoads(t, ps, rx, pool, "before", 2); ok != 2 {
		t.Fatalf("honest requests: %d/2 ok (%v)", ok, err)
	}
	runtime.GC()
	before := peakRSS(t, true)
	for _, engine := range []string{"huge-1", "huge-2"} {
		md := fetchPayload(t, ps.sender.Endpoint(), 0)
		md.EngineID = engine
		md.NumBlocks = (1 << 26) / len(md.KVCachesBaseAddr)
		port := serveHandshake(t, md)
		p := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{0, 1}, RemoteEngineID: engine,
			RemoteRequestID: "huge", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}
		res := wait(t, rx.Load(LoadRequest{RequestID: "huge", LocalBlockIDs: []int32{6, 7}, Params: p}))
		grew := peakRSS(t, false) - before
		t.Logf("%s: refused after %v, peak RSS grew %d MB: %v", engine, res.Latency.Round(time.Millisecond), grew>>20, res.Err)
		if !errors.Is(res.Err, ErrHandshake) {
			t.Fatalf("%s: a 2^26-descriptor peer was not refused: %v", engine, res.Err)
		}
		if grew > 256<<20 {
			t.Fatalf("%s: peak RSS grew %d MB (bound 256 MB)", engine, grew>>20)
		}
		if res.Latency > timeout {
			t.Fatalf("%s: refused after %v, handshake timeout %v", engine, res.Latency, timeout)
		}
	}
	if ok, err := honestLoads(t, ps, rx, pool, "after", 5); ok != 5 {
		t.Fatalf("honest requests after: %d/5 ok (%v)", ok, err)
	}
}

// TestHandshakeBoundedInTime (issue 19.3): HandshakeTimeout bounds the
// whole handshake, not only the exchange: a handshake whose later steps
// are slow fails its requests at the timeout, requests meanwhile fail at
// once, what it built is released when it returns, and the next request
// handshakes again.
func TestHandshakeBoundedInTime(t *testing.T) {
	const timeout = 300 * time.Millisecond
	fk := clock.NewFake(time.Time{}) // the handshake timeout passes when advanced
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.HandshakeTimeout, c.Clock = timeout, fk })
	rx, pool := ds.rx[0], ds.pools[0]
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	fetched := make(chan struct{}, 1) // the exchange is done, the rest is slow
	hook := func() {
		select {
		case fetched <- struct{}{}:
		default:
		}
		<-release
	}
	testHookAfterFetch.Store(&hook)
	t.Cleanup(func() { testHookAfterFetch.Store(nil); unblock() }) // before the receiver's Close

	params := ps.hold(t, "slow", 7, []int32{1, 2}, 8)
	l := rx.Load(LoadRequest{RequestID: "slow", LocalBlockIDs: []int32{4, 5}, Params: params})
	select {
	case <-fetched:
	case <-time.After(10 * time.Second):
		t.Fatal("no handshake exchange")
	}
	waitArmed(t, fk, timeout)
	fk.Advance(timeout)
	res := wait(t, l)
	if !errors.Is(res.Err, ErrHandshake) || res.Latency > timeout+time.Second {
		t.Fatalf("a handshake stuck past its timeout: after %v: %v", res.Latency, res.Err)
	}
	if res := wait(t, rx.Load(LoadRequest{RequestID: "slow", LocalBlockIDs: []int32{4, 5}, Params: params})); !errors.Is(res.Err, ErrHandshake) {
		t.Fatalf("a request during the abandoned handshake: %v", res.Err)
	}
	testHookAfterFetch.Store(nil)
	unblock()
	eventually(t, "the abandoned handshake to go", 5*time.Second, func() bool {
		rx.mu.Lock()
		defer rx.mu.Unlock()
		return len(rx.peers) == 0 && rx.remoteDescs == 0
	})
	refs := rx.agents.count()
	if refs != 0 {
		t.Fatalf("the abandoned handshake left %d remote agents", refs)
	}
	ps.sender.Abort("slow")
	if ok, err := honestLoads(t, ps, rx, pool, "after", 3); ok != 3 {
		t.Fatalf("after: %d/3 ok (%v)", ok, err)
	}
}

// TestPeerEviction (issue 19.3): peers no request uses are released after
// PeerIdleTimeout (never one with a READ in flight), remote descriptors
// are bounded in total, and an evicted engine handshakes again.
func TestPeerEviction(t *testing.T) {
	const idle = 150 * time.Millisecond
	// Idle time passes on a fake clock, advanced by hand.
	fk := clock.NewFake(time.Time{})
	obs := &countingObserver{}
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ps2 := newPrefillSide(t, smallGeom, "prefill-2", nil)
	// 128 remote descriptors per peer (4 regions × 32 blocks): one fits.
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) {
		c.PeerIdleTimeout = idle
		c.MaxTotalDescriptors = 200
		c.Observer = obs
		c.Clock = fk
	}, plugin.Param{Key: "delay_us", Value: "600000"})
	rx, pool := ds.rx[0], ds.pools[0]
	// No peer left, nor a remote agent (released just after the peer
	// leaves the map).
	peers := func() int {
		n := rx.agents.count()
		rx.mu.Lock()
		defer rx.mu.Unlock()
		return n + len(rx.peers)
	}

	// idlePast advances the clock past the idle timeout, tick by tick of
	// the eviction ticker (a quarter of it).
	waitArmed(t, fk, idle/4)
	idlePast := func() {
		for range 5 {
			fk.Advance(idle / 4)
		}
	}
	// A READ slower than the idle timeout keeps its peer.
	params := ps.hold(t, "slow", 3, []int32{1, 2}, 8)
	slow := rx.Load(LoadRequest{RequestID: "slow", LocalBlockIDs: []int32{4, 5}, Params: params})
	eventually(t, "the handshake", 5*time.Second, func() bool { return len(rx.Peers()) == 1 })
	idlePast() // while the READ (600 ms on the plugin) is in flight
	if res := wait(t, slow); res.Err != nil {
		t.Fatal(res.Err)
	}
	if err := pool.Verify(kvpool.Tokens{Request: 3, Pages: []int32{4, 5}, Count: 8}); err != nil {
		t.Fatal(err)
	}
	// The budget is taken: another engine is refused.
	p2 := ps2.hold(t, "other", 4, []int32{1, 2}, 8)
	res := wait(t, rx.Load(LoadRequest{RequestID: "other", LocalBlockIDs: []int32{6, 7}, Params: p2}))
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "MaxTotalDescriptors") {
		t.Fatalf("a peer past the total descriptor bound: %v", res.Err)
	}
	start := fk.Now()
	idlePast()
	eventually(t, "the idle peer's eviction", 5*time.Second, func() bool { return peers() == 0 })
	t.Logf("idle peer evicted %v after its last request", fk.Since(start).Round(time.Millisecond))
	// With the budget back, the other engine is served, then the first
	// again after a new handshake.
	if res := wait(t, rx.Load(LoadRequest{RequestID: "other", LocalBlockIDs: []int32{6, 7}, Params: p2})); res.Err != nil {
		t.Fatal(res.Err)
	}
	idlePast()
	eventually(t, "the second idle peer's eviction", 5*time.Second, func() bool { return peers() == 0 })
	params = ps.hold(t, "again", 5, []int32{3}, 4)
	if res := wait(t, rx.Load(LoadRequest{RequestID: "again", LocalBlockIDs: []int32{8}, Params: params})); res.Err != nil {
		t.Fatal(res.Err)
	}
	if err := pool.Verify(kvpool.Tokens{Request: 5, Pages: []int32{8}, Count: 4}); err != nil {
		t.Fatal(err)
	}
	if n := obs.handshakes.Load(); n != 4 {
		t.Fatalf("%d handshakes, want 4", n)
	}
}
