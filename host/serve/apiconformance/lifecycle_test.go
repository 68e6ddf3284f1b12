package apiconformance

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/internal/zmq"
)

// inFlight brings room to WaitingForInput on both sides: the decode's
// metadata reached the prefill, nothing was sent.
func (x *sglSetup) inFlight(room uint64) {
	x.P.t.Helper()
	x.receiver(room)
	x.sender(room)
	x.D.ok("receiver_init", m("rank", x.dRank, "room", room, "pages", i32s(1), "aux_index", 0))
	x.P.ok("sender_init", m("rank", x.pRank, "room", room, "num_pages", 1, "aux_index", 0))
	x.P.seen("room", roomEvent(x.pRank, room, stWaiting))
}

// failedWith takes the room's events up to its final one and wants
// Failed with a reason holding sub; it returns the reason.
func (c *conn) failedWith(rank, room uint64, sub string) string {
	c.t.Helper()
	st := c.states(rank, room)
	if st[len(st)-1] != stFailed {
		c.t.Fatalf("%s: room %d states %v, want Failed", c.name, room, st)
	}
	// states consumed the events: find the reason through poll.
	_, reasons := c.poll(rank, room)
	r := strOf(reasons, strconv.FormatUint(room, 10))
	if !strings.Contains(r, sub) {
		c.t.Fatalf("%s: room %d failed with %q, want it to say %q", c.name, room, r, sub)
	}
	return r
}

// TestCloseRankFailsRooms: close_rank fails the rank's unfinished rooms
// with "rank closed"; the peer's room fails too, with a reason that
// names the prefill's failure; the rank and its rooms are gone.
func TestCloseRankFailsRooms(t *testing.T) {
	x := newSGL(t)
	x.inFlight(3)
	x.P.ok("close_rank", m("rank", x.pRank))
	st := x.P.states(x.pRank, 3)
	if st[len(st)-1] != stFailed {
		t.Fatalf("prefill room after close_rank: %v", st)
	}
	x.P.fail("poll", m("rank", x.pRank, "rooms", u64s(3)), "unknown")
	r := x.D.failedWith(x.dRank, 3, "")
	t.Logf("the decode's room failed with %q", r)
	if r == "" {
		t.Fatal("the peer's room failed without a reason")
	}
	// The decode's other rooms and its connection are untouched.
	x.D.ok("poll", m("rank", x.dRank, "rooms", u64s(3)))
}

// TestCloseRankReason: the closing side's own rooms say "rank closed".
func TestCloseRankReason(t *testing.T) {
	x := newSGL(t)
	x.receiver(4)
	x.D.ok("close_rank", m("rank", x.dRank))
	v := x.D.event("room", roomEvent(x.dRank, 4, stFailed))
	if strOf(v, "reason") != "rank closed" {
		t.Fatalf("room of a closed rank: %s, want reason \"rank closed\"", show(v))
	}
}

// TestConnectionClose: an engine closing its connection fails its
// rooms (the peer's room fails, "engine disconnected" in its reason),
// its mappings are released, and other connections go on.
func TestConnectionClose(t *testing.T) {
	x := newSGL(t)
	x.inFlight(5)
	x.P.close()
	r := x.D.failedWith(x.dRank, 5, "engine disconnected")
	t.Logf("the decode's room failed with %q", r)
	x.side.waitUnmapped(x.pre.shm.path)
	x.receiver(6) // the decode engine goes on (the bootstrap server too)
	if !strings.Contains(x.side.maps(), x.dec.shm.path) {
		t.Fatal("the decode engine's region was unmapped with the prefill's")
	}
}

// TestEngineKilled: an engine process killed with SIGKILL, with a room
// in flight: its connection's end tears its session down like a close.
func TestEngineKilled(t *testing.T) {
	x := newSGLOn(t, startSidecar(t), false)
	// The prefill engine is a child process (this test binary, see
	// TestMain) with its own pool.
	pool := newSGLPool(t, 2, 16, 4, 2, 8)
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), "KVAC_CHILD_ENGINE="+x.side.endpoint, "KVAC_CHILD_SHM="+pool.shm.name,
		"KVAC_CHILD_BASE="+strconv.FormatUint(pool.base, 10), "KVAC_CHILD_BOOT="+x.boot)
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	x.D.ok("receiver_create", m("rank", x.dRank, "room", uint64(9), "bootstrap_addr", x.boot))
	x.D.seen("room", roomEvent(x.dRank, 9, stWaiting))
	x.D.ok("receiver_init", m("rank", x.dRank, "room", uint64(9), "pages", i32s(1), "aux_index", 0))
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "READY") {
		t.Fatalf("child engine: %q %v", line, err)
	}
	if !strings.Contains(x.side.maps(), pool.shm.path) {
		t.Fatal("the sidecar does not map the child engine's pool")
	}
	child.Process.Kill()
	r := x.D.failedWith(x.dRank, 9, "engine disconnected")
	t.Logf("the decode's room failed with %q", r)
	x.side.waitUnmapped(pool.shm.path)
}

// TestMain runs the child engine of TestEngineKilled when asked to.
func TestMain(mm *testing.M) {
	if ep := os.Getenv("KVAC_CHILD_ENGINE"); ep != "" {
		childEngine(ep)
		return
	}
	os.Exit(mm.Run())
}

// childEngine is a prefill engine process: it opens a rank on the pool
// it is given (the SGLang geometry of newSGLPool(2, 16, 4, 2, 8)),
// creates room 9, prints READY once the room is WaitingForInput, and
// waits to be killed.
func childEngine(ep string) {
	fail := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "child engine: "+format+"\n", args...)
		os.Exit(2)
	}
	d, err := zmq.DialDealer(ep)
	if err != nil {
		fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	base, _ := strconv.ParseUint(os.Getenv("KVAC_CHILD_BASE"), 10, 64)
	p := &sglPool{shm: &shm{name: os.Getenv("KVAC_CHILD_SHM")}, base: base, layers: 2, pages: 16, pageSize: 4, heads: 2, hb: 8, auxSlots: 8, auxItem: 64}
	seq := uint64(0)
	// The room's WaitingForInput event may come before sender_create's
	// reply (the decode's receiver_init can reach the rank first, and
	// the contract orders events among themselves, not against replies):
	// every message read is checked for it.
	var rank uint64
	haveRank, waiting := false, false
	watch := func(v msgpack.Value) {
		if haveRank && roomEvent(rank, 9, stWaiting)(v) {
			waiting = true
		}
	}
	call := func(op string, f M) msgpack.Value {
		seq++
		if err := d.Send(ctx, encode(append(M{{"op", op}, {"seq", seq}}, f...))); err != nil {
			fail("send %s: %v", op, err)
		}
		for {
			fs, err := d.Recv(ctx)
			if err != nil {
				fail("recv: %v", err)
			}
			v, _ := msgpack.Decode(fs[0])
			watch(v)
			if n, ok := uintOf(v, "seq"); ok && n == seq {
				if ok, _ := boolOf(v, "ok"); !ok {
					fail("%s: %s", op, show(v))
				}
				return v
			}
		}
	}
	call("hello", m("version", []int{1, 0}))
	call("register_memory", m("regions", []any{p.region()}))
	rank, haveRank = uintOf(call("open_rank", p.fields("prefill").with("bootstrap_addr", os.Getenv("KVAC_CHILD_BOOT"))), "rank")
	call("sender_create", m("rank", rank, "room", uint64(9)))
	for !waiting {
		fs, err := d.Recv(ctx)
		if err != nil {
			fail("recv: %v", err)
		}
		v, _ := msgpack.Decode(fs[0])
		watch(v)
	}
	fmt.Println("READY")
	time.Sleep(time.Hour)
}

// TestSIGTERM: SIGTERM fails every unfinished room with "sidecar
// shutting down" (the events reach the engines), releases every held
// request ("closed"), closes the connections, removes the socket file
// and exits 0.
func TestSIGTERM(t *testing.T) {
	x := newSGL(t)
	x.inFlight(2)
	v := newVLLMOn(t, x.side)
	v.hold(v.P, "h1", 1)
	x.side.cmd.Process.Signal(syscall.SIGTERM)
	for _, c := range []struct {
		c    *conn
		rank uint64
	}{{x.P, x.pRank}, {x.D, x.dRank}} {
		ev := c.c.event("room", roomEvent(c.rank, 2, stFailed))
		if strOf(ev, "reason") != "sidecar shutting down" {
			t.Fatalf("%s: room at SIGTERM: %s, want reason \"sidecar shutting down\"", c.c.name, show(ev))
		}
	}
	v.P.event("released", released("P", "h1", "closed"))
	if err := x.side.exited(); err != nil {
		t.Fatalf("the sidecar's exit after SIGTERM: %v\n%s", err, x.side.logText())
	}
	for _, c := range []*conn{x.P, x.D, v.P, v.D} {
		c.waitGone()
	}
	if _, err := os.Stat(x.side.sock); !os.IsNotExist(err) {
		t.Fatalf("the socket file after SIGTERM: %v", err)
	}
}

// newVLLMOn is newVLLM on an existing sidecar.
func newVLLMOn(t *testing.T, side *sidecar) *vllmSetup {
	t.Helper()
	x := &vllmSetup{side: side}
	x.P = side.engine(t, "prefill worker")
	x.D = side.engine(t, "decode worker")
	x.pre = newVLLMPool(t, 2, 8, 4, 2, 8)
	x.dec = newVLLMPool(t, 2, 8, 4, 2, 8)
	x.P.register(x.pre.region())
	x.D.register(x.dec.region())
	x.pRank = must(t, x.P.ok("open_rank", x.pre.fields("prefill", "P", 1, 0)), "rank")
	x.P.event("engine_ready", nil)
	x.dRank = must(t, x.D.ok("open_rank", x.dec.fields("decode", "D", 1, 0)), "rank")
	return x
}

// TestVLLMLifecycle: a prefill rank's close releases every request the
// engine held ("closed") to the holder and the engine's other ranks;
// its connection's end likewise; a read in flight on a closed decode
// rank ends with "rank closed", every block invalid.
func TestVLLMLifecycle(t *testing.T) {
	side := startSidecar(t)
	x := newVLLMOn(t, side)
	sched := side.engine(t, "scheduler")
	x.hold(sched, "a", 1)
	x.hold(x.P, "b", 2)
	x.P.ok("close_rank", m("rank", x.pRank))
	sched.event("released", released("P", "a", "closed"))
	x.P.event("released", released("P", "a", "closed"))
	x.P.event("released", released("P", "b", "closed"))
	sched.fail("hold", m("engine_id", "P", "request_id", "c", "block_ids", i32s(1)), "unknown")
	// Opening the missing rank again opens the engine again.
	x.pRank = must(t, x.P.ok("open_rank", x.pre.fields("prefill", "P", 1, 0)), "rank")
	x.P.event("engine_ready", nil)
	x.hold(sched, "d", 1)
	x.P.close()
	sched.event("released", released("P", "d", "closed"))

	// A read whose side channel never answers stays in flight until its
	// rank closes.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	params := m("do_remote_prefill", true, "do_remote_decode", false, "remote_block_ids", []int{1, 2},
		"remote_engine_id", "P", "remote_request_id", "s", "remote_host", "127.0.0.1", "remote_port", port, "tp_size", 1)
	x.D.ok("read", m("rank", x.dRank, "request_id", "s", "kv_transfer_params", params, "block_ids", i32s(4, 5)))
	x.D.fail("read", m("rank", x.dRank, "request_id", "s", "kv_transfer_params", params, "block_ids", i32s(4, 5)), "exists")
	x.D.noEvent("read", readOf(x.dRank, "s"))
	x.D.ok("close_rank", m("rank", x.dRank))
	ev := x.D.event("read", readOf(x.dRank, "s"))
	if mustBool(ev, "ok") || strOf(ev, "reason") != "rank closed" || string(binOf(ev, "invalid_blocks")) != string(i32s(4, 5)) {
		t.Fatalf("read in flight on a closed rank: %s, want failed, \"rank closed\", blocks 4, 5 invalid", show(ev))
	}
}

// TestDecodeGoneTellsPrefill: the decode's side closing (close_rank, or
// its connection) fails the prefill's room of the same request, "Aborted
// by decode HOST:PORT" as SGLang's connectors say it.
func TestDecodeGoneTellsPrefill(t *testing.T) {
	x := newSGL(t)
	x.inFlight(1)
	x.D.ok("close_rank", m("rank", x.dRank))
	x.P.failedWith(x.pRank, 1, "Aborted by decode 127.0.0.1:")
	x.dRank = must(t, x.D.ok("open_rank", x.dec.fields("decode")), "rank")
	x.inFlight(3)
	x.D.close()
	x.P.failedWith(x.pRank, 3, "Aborted by decode 127.0.0.1:")
}

// TestAbortTellsPeer: an abort fails the peer's room too: the decode's
// abort reaches the prefill as "Aborted by decode HOST:PORT", the
// prefill's reaches the decode with its own reason.
func TestAbortTellsPeer(t *testing.T) {
	x := newSGL(t)
	x.inFlight(1)
	x.D.ok("abort", m("rank", x.dRank, "room", uint64(1)))
	x.P.failedWith(x.pRank, 1, "Aborted by decode 127.0.0.1:")
	x.inFlight(2)
	x.P.ok("abort", m("rank", x.pRank, "room", uint64(2)))
	x.D.failedWith(x.dRank, 2, "Aborted by AbortReq.")
}
