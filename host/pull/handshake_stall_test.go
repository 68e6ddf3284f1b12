package pull

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
)

// stalledAgentMetadata rewrites a fake-plugin agent's metadata (layout in
// plugins/fake/README.md, "Wire formats") into that of an agent named name
// in "another process" (another process token, this pid: the kernel
// vouches for this process's answer) whose notification socket is sock.
// The plugin's load_remote then challenges sock and waits up to 5 s for
// the answer.
func stalledAgentMetadata(t *testing.T, md []byte, name, sock string) []byte {
	t.Helper()
	const hdr = 56
	if len(md) < hdr || string(md[:4]) != "KVFM" {
		t.Fatalf("not fake-plugin metadata: %q", md)
	}
	nameLen, sockLen := int(binary.LittleEndian.Uint16(md[48:])), int(binary.LittleEndian.Uint16(md[50:]))
	regions := md[hdr+nameLen+sockLen:]
	out := append([]byte(nil), md[:hdr]...)
	binary.LittleEndian.PutUint64(out[8:], rand.Uint64()) // another process's token
	binary.LittleEndian.PutUint32(out[24:], uint32(os.Getpid()))
	binary.LittleEndian.PutUint16(out[48:], uint16(len(name)))
	binary.LittleEndian.PutUint16(out[50:], uint16(len(sock)))
	out = append(out, name...)
	out = append(out, sock...)
	return append(out, regions...)
}

// stalledPeer is an engine whose agent metadata load stalls for as long
// as the test wants: the fake plugin's load_remote waits (up to its 5 s)
// for the answer to a challenge sent to a socket of this test.
type stalledPeer struct {
	params     KVTransferParams
	challenged chan struct{} // closed when the challenge arrived
	conn       *net.UnixConn
	challenge  []byte
	from       net.Addr
}

func newStalledPeer(t *testing.T, honest *prefillSide, engineID string) *stalledPeer {
	t.Helper()
	sock := fmt.Sprintf("kvhost-test-stall-%d-%x", os.Getpid(), rand.Uint64())
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: "@" + sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	sp := &stalledPeer{conn: conn, challenged: make(chan struct{})}
	go func() {
		buf := make([]byte, 1024)
		n, from, err := conn.ReadFrom(buf)
		if err == nil && n == 64 && string(buf[:4]) == "KVFC" {
			sp.challenge, sp.from = buf[:n], from
			close(sp.challenged)
		}
	}()
	md := fetchPayload(t, honest.sender.Endpoint(), 0)
	md.EngineID = engineID
	md.AgentMetadata = stalledAgentMetadata(t, md.AgentMetadata, "stalled-"+engineID, sock)
	port := serveHandshake(t, md)
	sp.params = KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{0, 1}, RemoteEngineID: engineID,
		RemoteRequestID: "stalled", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}
	return sp
}

// refuse answers the challenge "no": a load_remote still waiting for it
// fails at once with "does not vouch"; one that gave up waiting has
// already failed with "did not answer the challenge in time".
func (sp *stalledPeer) refuse(t *testing.T) {
	t.Helper()
	ans := make([]byte, 40)
	copy(ans, "KVFA")
	binary.LittleEndian.PutUint16(ans[4:], 1)
	copy(ans[8:32], sp.challenge[8:32]) // agent id, nonce
	binary.LittleEndian.PutUint32(ans[32:], 1)
	if _, err := sp.conn.WriteTo(ans, sp.from); err != nil {
		t.Log("answering the challenge:", err) // the challenger gave up and closed its socket
	}
}

// TestStalledHandshakeDelaysNobody (issue 25.6): a peer whose agent
// metadata load stalls (the fake plugin's load_remote waits for the answer
// to its challenge) does not hold up another engine's handshake on the same
// decode rank: the honest engine's first request completes, every byte
// verified, while the stalled load_remote still waits, which the test
// proves by answering the challenge only then and seeing the answer
// taken. The receiver held one mutex across load_remote: the honest
// handshake waited until the stalled one gave up (5 s), after which the
// answer came too late.
func TestStalledHandshakeDelaysNobody(t *testing.T) {
	baseline := newPrefillSide(t, smallGeom, "prefill-baseline", nil)
	honest := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.HandshakeTimeout = time.Minute })
	rx, pool := ds.rx[0], ds.pools[0]

	load := func(ps *prefillSide, id string, seed uint64) LoadResult {
		params := ps.hold(t, id, seed, []int32{1, 2}, 8)
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{4, 5}, Params: params}))
		if res.Err == nil {
			res.Err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{4, 5}, Count: 8})
		}
		return res
	}
	// The same first request (handshake and READ) with no stalled peer.
	alone := load(baseline, "alone", 11)
	if alone.Err != nil {
		t.Fatal("with no stalled peer:", alone.Err)
	}

	sp := newStalledPeer(t, honest, "stalled")
	stalled := rx.Load(LoadRequest{RequestID: "stalled", LocalBlockIDs: []int32{6, 7}, Params: sp.params})
	select {
	case <-sp.challenged: // the stalled handshake is inside load_remote
	case <-stalled.Done():
		t.Fatalf("the stalled handshake ended before its challenge: %v", stalled.Result().Err)
	case <-time.After(20 * time.Second):
		t.Fatal("the stalled peer was never challenged")
	}
	beside := load(honest, "honest", 12)
	sp.refuse(t)
	res := wait(t, stalled)
	t.Logf("an honest engine's first request (handshake + READ): %v alone, %v beside a stalled handshake; "+
		"the stalled one ended after %v: %v", alone.Latency, beside.Latency, res.Latency, res.Err)
	if beside.Err != nil {
		t.Fatal("beside the stalled peer:", beside.Err)
	}
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "does not vouch") {
		t.Fatalf("the stalled load_remote was not waiting any more when the honest request completed: %v", res.Err)
	}
	if got := load(honest, "after", 13); got.Err != nil {
		t.Fatal("after the stalled handshake:", got.Err)
	}
	if n := rx.agents.count(); n != 2 {
		t.Fatalf("%d remote agents held, want the 2 honest ones", n)
	}
}

// TestStalledHandshakeDelaysNoRelease (issue 25.6): while a peer's agent
// metadata load stalls, releasing another peer (an idle one evicted) does
// not hold up a third engine's handshake either. The release takes the
// agent exclusively (release_dlist, remove_remote), which waited for the
// stalled load, and every call on the agent queued behind it.
func TestStalledHandshakeDelaysNoRelease(t *testing.T) {
	const idle = 150 * time.Millisecond
	fk := clock.NewFake(time.Time{})
	first := newPrefillSide(t, smallGeom, "prefill-first", nil)
	honest := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) {
		c.HandshakeTimeout = time.Hour
		c.PeerIdleTimeout = idle
		c.Clock = fk
	})
	rx, pool := ds.rx[0], ds.pools[0]
	load := func(ps *prefillSide, id string, seed uint64) LoadResult {
		params := ps.hold(t, id, seed, []int32{1, 2}, 8)
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{4, 5}, Params: params}))
		if res.Err == nil {
			res.Err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{4, 5}, Count: 8})
		}
		return res
	}
	if res := load(first, "first", 11); res.Err != nil {
		t.Fatal(res.Err)
	}
	sp := newStalledPeer(t, honest, "stalled")
	stalled := rx.Load(LoadRequest{RequestID: "stalled", LocalBlockIDs: []int32{6, 7}, Params: sp.params})
	select {
	case <-sp.challenged:
	case <-time.After(20 * time.Second):
		t.Fatal("the stalled peer was never challenged")
	}
	// The first peer goes idle and is evicted (its release now runs).
	waitArmed(t, fk, idle/4)
	for range 5 {
		fk.Advance(idle / 4)
	}
	eventually(t, "the idle peer's eviction", 10*time.Second, func() bool {
		rx.mu.Lock()
		defer rx.mu.Unlock()
		return rx.peers["prefill-first"] == nil
	})
	start := time.Now() // latencies are on the fake clock
	beside := load(honest, "honest", 12)
	took := time.Since(start)
	// The eviction's release waits for the stalled load, queued.
	if !rx.agents.queued() {
		t.Fatal("the evicted peer's release did not wait for the stalled load")
	}
	sp.refuse(t)
	res := wait(t, stalled)
	t.Logf("an honest first request beside a stalled handshake and a release: %v (wall clock); the stalled one: %v",
		took, res.Err)
	if beside.Err != nil {
		t.Fatal(beside.Err)
	}
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "does not vouch") {
		t.Fatalf("the stalled load_remote was not waiting any more when the honest request completed: %v", res.Err)
	}
	eventually(t, "the evicted peer's agent to go", 10*time.Second, func() bool { return rx.agents.count() == 1 })
}
