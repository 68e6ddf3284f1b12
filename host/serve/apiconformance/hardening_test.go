// Checks of the promises the third hardening round (issue 25) made the
// sidecar keep; each failed on the sidecar before that round: a Success
// room turned Failed, start_bootstrap refused its own port, a shrunk shm
// killed the sidecar, unknown ops were answered before hello with replies
// that quoted them whole, a burst of events dropped a reading engine, and
// a dead prefill stayed advertised.

package apiconformance

import (
	"encoding/json"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq"
)

// success runs room to Success on both sides.
func (x *sglSetup) success(room uint64) {
	x.P.t.Helper()
	x.inFlight(room)
	x.P.ok("sender_send", m("rank", x.pRank, "room", room, "pages", i32s(2)))
	x.P.seen("room", roomEvent(x.pRank, room, stSuccess))
	x.D.seen("room", roomEvent(x.dRank, room, stSuccess))
}

// Issue 25 (1): Success is final: abort does not turn it Failed.
func TestSuccessFinalAbort(t *testing.T) {
	x := newSGL(t)
	x.success(1)
	x.P.ok("abort", m("rank", x.pRank, "room", uint64(1)))
	x.D.ok("abort", m("rank", x.dRank, "room", uint64(1)))
	x.P.noEvent("room", roomEvent(x.pRank, 1, stFailed))
	x.D.noEvent("room", roomEvent(x.dRank, 1, stFailed))
	if st, _ := x.P.poll(x.pRank, 1); st[0] != stSuccess {
		t.Fatalf("prefill poll after abort of a Success room: %v", st)
	}
	if st, _ := x.D.poll(x.dRank, 1); st[0] != stSuccess {
		t.Fatalf("decode poll after abort of a Success room: %v", st)
	}
}

// Issue 25 (1): close_rank does not turn a Success room Failed.
func TestSuccessFinalCloseRank(t *testing.T) {
	x := newSGL(t)
	x.success(1)
	x.P.ok("close_rank", m("rank", x.pRank))
	x.D.ok("close_rank", m("rank", x.dRank))
	x.P.noEvent("room", roomEvent(x.pRank, 1, stFailed))
	x.D.noEvent("room", roomEvent(x.dRank, 1, stFailed))
}

// Issue 25 (1): SIGTERM does not turn a Success room Failed (it fails
// the unfinished one).
func TestSuccessFinalSIGTERM(t *testing.T) {
	x := newSGL(t)
	x.success(1)
	x.receiver(2)
	x.side.cmd.Process.Signal(syscall.SIGTERM)
	x.D.event("room", roomEvent(x.dRank, 2, stFailed))
	for _, c := range []*conn{x.P, x.D} {
		c.waitGone()
	}
	x.P.noEvent("room", roomEvent(x.pRank, 1, stFailed))
	x.D.noEvent("room", roomEvent(x.dRank, 1, stFailed))
	if err := x.side.exited(); err != nil {
		t.Fatal(err)
	}
}

// Issue 25 (2): start_bootstrap with port 0, then with the port it
// serves, answers the same addr.
func TestBootstrapServedPort(t *testing.T) {
	side := startSidecar(t)
	c := side.engine(t, "a")
	addr := strOf(c.ok("start_bootstrap", m("host", "127.0.0.1", "port", 0)), "addr")
	_, ps, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	port, _ := strconv.Atoi(ps)
	if got := strOf(c.ok("start_bootstrap", m("host", "127.0.0.1", "port", port)), "addr"); got != addr {
		t.Fatalf("start_bootstrap of the served port: %q, want %q", got, addr)
	}
}

// Issue 25 (3): an engine that shrinks its registered shared memory does
// not take the sidecar down: its rooms fail naming the region, the other
// engines are served on.
func TestShrunkMemory(t *testing.T) {
	x := newSGL(t)
	x.inFlight(1)
	if err := os.Truncate(x.pre.shm.path, 0); err != nil {
		t.Fatal(err)
	}
	x.P.ok("sender_send", m("rank", x.pRank, "room", uint64(1), "pages", i32s(2)))
	r := x.P.failedWith(x.pRank, 1, "region")
	t.Logf("the shrunk engine's room failed with %q", r)
	other := x.side.engine(t, "other")
	other.fail("frobnicate", m(), "unknown_op")
	x.D.ok("poll", m("rank", x.dRank, "rooms", u64s(1)))
	select {
	case <-x.side.done:
		t.Fatalf("the sidecar exited: %v", x.side.err)
	default:
	}
}

// Issue 25 (4): before hello, every op (an unknown one too) is no_hello.
func TestNoHelloFirst(t *testing.T) {
	c := startSidecar(t).dial(t, "e")
	c.fail("frobnicate", m(), "no_hello")
}

// Issue 25 (4): an error reply does not quote a whole (large) op.
func TestShortErrorReplies(t *testing.T) {
	c := startSidecar(t).engine(t, "e")
	v := c.fail(strings.Repeat("x", 60000), m(), "unknown_op")
	if n := len(strOf(v, "message")); n > 1024 {
		t.Fatalf("an unknown_op reply of %d bytes quotes the op", n)
	}
}

// Issue 25 (5): a burst of events larger than the event queue (40000
// rooms failed at once by close_rank) does not drop an engine that reads
// every event, even one that is busy for a second when the burst comes
// (the documented bound is one message not taken within 30 s).
func TestBurstKeepsReader(t *testing.T) {
	side := startSidecar(t, "--max-rooms", "50000")
	// The engine's connection takes one message at a time from its
	// socket: while it is busy, the sidecar holds what it sends.
	c := side.dial(t, "bursty", zmq.WithRecvQueue(1), zmq.WithRecvBudget(1<<16))
	c.ok("hello", m("version", []int{1, 0}))
	boot := strOf(c.ok("start_bootstrap", m("host", "127.0.0.1", "port", 0)), "addr")
	p := newSGLPool(t, 1, 4, 2, 1, 8)
	c.register(p.region())
	rank := must(t, c.ok("open_rank", p.fields("prefill").with("bootstrap_addr", boot)), "rank")
	const rooms = 40000
	for done := 0; done < rooms; done += 500 {
		var seqs []uint64
		for i := done; i < done+500; i++ {
			seqs = append(seqs, c.send("sender_create", m("rank", rank, "room", uint64(i))))
		}
		for _, s := range seqs {
			c.wantOK("sender_create", c.reply(s))
		}
		c.inbox = c.inbox[:0] // the rooms' creation events
	}
	closing := c.send("close_rank", m("rank", rank))
	time.Sleep(time.Second) // busy
	failed := 0
	for failed < rooms || !c.answered[closing] {
		if !c.pump(wait) {
			t.Fatalf("after %d of %d Failed events the connection ended (gone: %v)", failed, rooms, c.gone)
		}
		if v := c.inbox[len(c.inbox)-1]; strOf(v, "event") == "room" {
			if st, _ := uintOf(v, "state"); st == stFailed {
				failed++
			}
		}
		c.inbox = c.inbox[:0]
	}
	c.fail("frobnicate", m(), "unknown_op")
}

// Issue 25 (7): a prefill rank that is gone is no longer advertised by
// the sidecar's bootstrap server.
func TestDeadPrefillNotAdvertised(t *testing.T) {
	x := newSGL(t)
	q := url.Values{"prefill_dp_rank": {"0"}, "prefill_cp_rank": {"0"}, "target_tp_rank": {"0"}, "target_pp_rank": {"0"}}
	route := func() (int, map[string]any) {
		resp, err := http.Get("http://" + x.boot + "/route?" + q.Encode())
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var info map[string]any
		json.NewDecoder(resp.Body).Decode(&info)
		return resp.StatusCode, info
	}
	if code, info := route(); code != http.StatusOK {
		t.Fatalf("the live prefill rank is not advertised: %d %v", code, info)
	}
	x.P.close()
	x.side.waitUnmapped(x.pre.shm.path) // its session is torn down
	deadline := time.Now().Add(wait)
	for {
		code, info := route()
		if code != http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bootstrap server still advertises the closed prefill rank: %v", info)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
