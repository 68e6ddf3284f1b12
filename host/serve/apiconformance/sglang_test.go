package apiconformance

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// KVPoll states (docs/engine-api.md, "Room state").
const (
	stFailed       = 0
	stBootstrap    = 1
	stWaiting      = 2
	stTransferring = 3
	stSuccess      = 4
)

// sglSetup is a prefill engine and a decode engine on one sidecar, each
// on its own connection with one TP-1 rank, and the sidecar's bootstrap
// server.
type sglSetup struct {
	side         *sidecar
	P, D         *conn
	pre, dec     *sglPool
	pRank, dRank uint64
	boot         string
}

func newSGL(t *testing.T, extra ...string) *sglSetup {
	t.Helper()
	return newSGLOn(t, startSidecar(t, extra...), true)
}

// newSGLOn sets up on side; without prefill, P has no rank (another
// process will register the prefill rank with the bootstrap server).
func newSGLOn(t *testing.T, side *sidecar, prefill bool) *sglSetup {
	t.Helper()
	x := &sglSetup{side: side}
	x.P = x.side.engine(t, "prefill")
	x.D = x.side.engine(t, "decode")
	x.boot = strOf(x.P.ok("start_bootstrap", m("host", "127.0.0.1", "port", 0)), "addr")
	if _, _, err := net.SplitHostPort(x.boot); err != nil {
		t.Fatalf("start_bootstrap addr %q is not host:port", x.boot)
	}
	x.pre = newSGLPool(t, 2, 16, 4, 2, 8)
	x.dec = newSGLPool(t, 2, 16, 4, 2, 8)
	x.P.register(x.pre.region())
	x.D.register(x.dec.region())
	dv := x.D.ok("open_rank", x.dec.fields("decode"))
	x.dRank = must(t, dv, "rank")
	if !prefill {
		return x
	}
	pv := x.P.ok("open_rank", x.pre.fields("prefill").with("bootstrap_addr", x.boot))
	x.pRank = must(t, pv, "rank")
	for _, v := range []msgpack.Value{pv, dv} {
		if strOf(v, "agent") == "" || !strings.HasPrefix(strOf(v, "endpoint"), "tcp://") {
			t.Fatalf("open_rank reply without agent or tcp endpoint: %s", show(v))
		}
	}
	return x
}

// receiver creates a decode room and waits until it is WaitingForInput.
func (x *sglSetup) receiver(room uint64) {
	x.D.t.Helper()
	x.D.ok("receiver_create", m("rank", x.dRank, "room", room, "bootstrap_addr", x.boot))
	x.D.seen("room", roomEvent(x.dRank, room, stWaiting))
}

// sender creates a prefill room and waits until it is WaitingForInput
// (the decode's metadata arrived): only then may chunks be sent.
func (x *sglSetup) sender(room uint64) {
	x.P.t.Helper()
	x.P.ok("sender_create", m("rank", x.pRank, "room", room))
}

// states takes the room's events in order until a final state and
// returns the states; they must start at Bootstrapping and only rise.
func (c *conn) states(rank, room uint64) []int {
	c.t.Helper()
	var out []int
	for {
		v := c.event("room", roomEvent(rank, room, -1))
		st := int(must(c.t, v, "state"))
		_, hasReason := v.Get("reason")
		if hasReason != (st == stFailed) {
			c.t.Fatalf("%s: room event %s: reason goes with Failed, and only with it", c.name, show(v))
		}
		if len(out) == 0 && st != stBootstrap {
			c.t.Fatalf("%s: room %d's first event is state %d, want 1 (its creation)", c.name, room, st)
		}
		if len(out) > 0 && st != stFailed && st <= out[len(out)-1] {
			c.t.Fatalf("%s: room %d went from %d to %d: states only rise", c.name, room, out[len(out)-1], st)
		}
		out = append(out, st)
		if st == stFailed || st == stSuccess {
			return out
		}
	}
}

// poll returns the states poll reports for rooms, and the reasons.
func (c *conn) poll(rank uint64, rooms ...uint64) ([]byte, msgpack.Value) {
	c.t.Helper()
	v := c.ok("poll", m("rank", rank, "rooms", u64s(rooms...)))
	st := binOf(v, "states")
	if len(st) != len(rooms) {
		c.t.Fatalf("poll: %d states for %d rooms: %s", len(st), len(rooms), show(v))
	}
	r, _ := v.Get("reasons")
	return st, r
}

// TestSGLangTransfer: a room moves KV and aux from the prefill's pages to
// the decode's, every byte checked; each side's room events start at
// Bootstrapping, only rise and end at Success; poll agrees (255 for a
// room it does not know) and close_room forgets the room. (That Success
// stays final under abort, close_rank and SIGTERM is pending_test.go's.)
func TestSGLangTransfer(t *testing.T) {
	x := newSGL(t)
	const room = 7
	x.receiver(room)
	x.sender(room)
	x.pre.fill(11, []int{2, 3, 5}, 1)
	x.D.ok("receiver_init", m("rank", x.dRank, "room", uint64(room), "pages", i32s(9, 10, 4), "aux_index", 3, "prefix_len", 0))
	x.P.ok("sender_init", m("rank", x.pRank, "room", uint64(room), "num_pages", 3, "aux_index", 1))
	x.P.seen("room", roomEvent(x.pRank, room, stWaiting))
	x.P.ok("sender_send", m("rank", x.pRank, "room", uint64(room), "pages", i32s(2, 3)))
	x.P.ok("sender_send", m("rank", x.pRank, "room", uint64(room), "pages", i32s(5)))
	ps := x.P.states(x.pRank, room)
	ds := x.D.states(x.dRank, room)
	if ps[len(ps)-1] != stSuccess || ds[len(ds)-1] != stSuccess {
		t.Fatalf("room states: prefill %v, decode %v; want both to end in Success", ps, ds)
	}
	sameKV(t, x.pre, []int{2, 3, 5}, 1, x.dec, []int{9, 10, 4}, 3)

	st, _ := x.P.poll(x.pRank, room, 12345)
	if st[0] != stSuccess || st[1] != 255 {
		t.Fatalf("prefill poll %v, want [4 255]", st)
	}
	st, _ = x.D.poll(x.dRank, room)
	if st[0] != stSuccess {
		t.Fatalf("decode poll %v, want [4]", st)
	}
	x.P.ok("close_room", m("rank", x.pRank, "room", uint64(room)))
	if st, _ := x.P.poll(x.pRank, room); st[0] != 255 {
		t.Fatalf("poll after close_room: %v, want 255", st)
	}
	x.P.fail("abort", m("rank", x.pRank, "room", uint64(room)), "unknown")
}

// TestSGLangAbortIsFinal: abort fails a room (event with a reason, poll
// with the same reason) and Failed is final.
func TestSGLangAbortIsFinal(t *testing.T) {
	x := newSGL(t)
	const room = 8
	x.receiver(room)
	x.D.ok("abort", m("rank", x.dRank, "room", uint64(room)))
	ds := x.D.states(x.dRank, room)
	if ds[len(ds)-1] != stFailed {
		t.Fatalf("decode states after abort %v, want Failed last", ds)
	}
	st, reasons := x.D.poll(x.dRank, room)
	if st[0] != stFailed || strOf(reasons, "8") == "" {
		t.Fatalf("poll after abort: %v %s, want Failed with a reason", st, show(reasons))
	}
	x.D.ok("abort", m("rank", x.dRank, "room", uint64(room)))
	x.D.fail("receiver_init", m("rank", x.dRank, "room", uint64(room), "pages", i32s(1), "aux_index", 0), "out_of_order")
	x.D.noEvent("room", roomEvent(x.dRank, room, -1))
}

// TestSGLangRoomErrors: every refusal of the room ops, with its code and
// the field it names.
func TestSGLangRoomErrors(t *testing.T) {
	x := newSGL(t)
	P, D := x.P, x.D
	pr, dr := x.pRank, x.dRank
	P.ok("sender_create", m("rank", pr, "room", uint64(1)))
	P.fail("sender_create", m("rank", pr, "room", uint64(1)), "exists")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(0)), "out_of_order")
	P.fail("sender_init", m("rank", pr, "room", uint64(1), "num_pages", 2, "aux_index", 8), "bad_request", "aux_index")
	P.fail("sender_init", m("rank", pr, "room", uint64(1), "num_pages", 2, "aux_index", -1), "bad_request", "aux_index")
	P.fail("sender_init", m("rank", pr, "room", uint64(1), "num_pages", "2", "aux_index", 0), "bad_request", "num_pages")
	P.fail("sender_init", m("rank", pr, "room", uint64(1), "aux_index", 0), "bad_request", "num_pages")
	P.ok("sender_init", m("rank", pr, "room", uint64(1), "num_pages", 2, "aux_index", 0))
	P.fail("sender_init", m("rank", pr, "room", uint64(1), "num_pages", 2, "aux_index", 0), "out_of_order")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(16)), "bad_request", "pages")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(-1)), "bad_request", "pages")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", []byte{1, 0, 0}), "bad_request", "pages")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", []int{1}), "bad_request", "pages")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(0, 1, 2)), "out_of_order")
	P.fail("sender_send", m("rank", pr, "room", uint64(2), "pages", i32s(0)), "unknown")
	P.fail("sender_send", m("rank", pr+1000, "room", uint64(1), "pages", i32s(0)), "unknown")
	P.fail("sender_send", m("room", uint64(1), "pages", i32s(0)), "bad_request", "rank")
	// Ops of the other role.
	P.fail("receiver_create", m("rank", pr, "room", uint64(3), "bootstrap_addr", x.boot), "bad_request")
	D.fail("sender_create", m("rank", dr, "room", uint64(3)), "bad_request")
	// Another connection's rank is not visible.
	D.fail("sender_create", m("rank", pr, "room", uint64(3)), "unknown")
	P.fail("poll", m("rank", dr, "rooms", u64s(1)), "unknown")
	P.fail("poll", m("rank", pr, "rooms", []byte{1, 2, 3}), "bad_request", "rooms")

	D.fail("receiver_create", m("rank", dr, "room", uint64(4), "bootstrap_addr", "nowhere"), "bad_request", "bootstrap_addr")
	D.fail("receiver_create", m("rank", dr, "room", uint64(4), "bootstrap_addr", x.boot, "prefill_dp_rank", "0"), "bad_request", "prefill_dp_rank")
	// A bootstrap server that never answers keeps the room Bootstrapping:
	// receiver_init is out_of_order until WaitingForInput.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	D.ok("receiver_create", m("rank", dr, "room", uint64(5), "bootstrap_addr", ln.Addr().String()))
	D.fail("receiver_create", m("rank", dr, "room", uint64(5), "bootstrap_addr", ln.Addr().String()), "exists")
	D.fail("receiver_init", m("rank", dr, "room", uint64(5), "pages", i32s(1), "aux_index", 0), "out_of_order")
	x.receiver(6)
	D.fail("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(16), "aux_index", 0), "bad_request", "pages")
	D.fail("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(1), "aux_index", 8), "bad_request", "aux_index")
	D.fail("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(1), "aux_index", 0, "prefix_len", -1), "bad_request", "prefix_len")
	D.fail("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(1)), "bad_request", "aux_index")
	D.ok("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(1), "aux_index", 0))
	D.fail("receiver_init", m("rank", dr, "room", uint64(6), "pages", i32s(1), "aux_index", 0), "out_of_order")
}

// TestStartBootstrap: one bootstrap server per sidecar; asking again for
// the same port answers the same addr, another port is exists.
func TestStartBootstrap(t *testing.T) {
	side := startSidecar(t)
	a := side.engine(t, "a")
	b := side.engine(t, "b")
	addr := strOf(a.ok("start_bootstrap", m("host", "127.0.0.1", "port", 0)), "addr")
	if got := strOf(b.ok("start_bootstrap", m("host", "127.0.0.1", "port", 0)), "addr"); got != addr {
		t.Fatalf("second start_bootstrap port 0: %q, want %q", got, addr)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	other := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	b.fail("start_bootstrap", m("host", "127.0.0.1", "port", other), "exists")
	b.fail("start_bootstrap", m("host", "127.0.0.1", "port", 70000), "bad_request", "port")
	b.fail("start_bootstrap", m("host", "127.0.0.1"), "bad_request", "port")
}

// closedPort is a local TCP port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestUnreachableBootstrap: a decode room whose bootstrap server cannot
// be reached fails (event with the reason) within --bootstrap-timeout;
// a prefill rank that cannot register with its bootstrap server is
// answered backend.
func TestUnreachableBootstrap(t *testing.T) {
	x := newSGL(t, "--bootstrap-timeout", "2")
	addr := closedPort(t)
	x.D.ok("receiver_create", m("rank", x.dRank, "room", uint64(1), "bootstrap_addr", addr))
	r := x.D.failedWith(x.dRank, 1, "")
	t.Logf("decode room: %q", r)
	q := newSGLPool(t, 1, 4, 2, 1, 8)
	c := x.side.engine(t, "p2")
	c.register(q.region())
	start := time.Now()
	v := c.fail("open_rank", q.fields("prefill").with("bootstrap_addr", addr), "backend")
	t.Logf("prefill open_rank after %v: %s", time.Since(start), show(v))
}

// TestSendBeforeWaiting: a chunk sent before the prefill's room is
// WaitingForInput (the decode's metadata has not arrived) is accepted
// and fails the room, as SGLang's connector does.
func TestSendBeforeWaiting(t *testing.T) {
	x := newSGL(t)
	x.P.ok("sender_create", m("rank", x.pRank, "room", uint64(3)))
	x.P.ok("sender_init", m("rank", x.pRank, "room", uint64(3), "num_pages", 1, "aux_index", 0))
	x.P.ok("sender_send", m("rank", x.pRank, "room", uint64(3), "pages", i32s(1)))
	x.P.failedWith(x.pRank, 3, "No transfer info found for bootstrap_room=3")
}
