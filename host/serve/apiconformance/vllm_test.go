package apiconformance

import (
	"net"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// vllmSetup is a TP-1 vLLM prefill engine "P" and decode engine "D" on
// one sidecar, each worker on its own connection.
type vllmSetup struct {
	side       *sidecar
	P, D       *conn
	pre, dec   *vllmPool
	pRank      uint64
	dRank      uint64
	sideChanEP string
}

func newVLLM(t *testing.T) *vllmSetup {
	t.Helper()
	x := &vllmSetup{side: startSidecar(t)}
	x.P = x.side.engine(t, "prefill worker")
	x.D = x.side.engine(t, "decode worker")
	x.pre = newVLLMPool(t, 2, 8, 4, 2, 8)
	x.dec = newVLLMPool(t, 2, 8, 4, 2, 8)
	x.P.register(x.pre.region())
	x.D.register(x.dec.region())
	pv := x.P.ok("open_rank", x.pre.fields("prefill", "P", 1, 0))
	x.pRank = must(t, pv, "rank")
	x.sideChanEP = strOf(pv, "endpoint")
	if !strings.HasPrefix(x.sideChanEP, "tcp://127.0.0.1:") {
		t.Fatalf("the complete prefill engine's open_rank endpoint is %q, want its side channel", x.sideChanEP)
	}
	ev := x.P.event("engine_ready", nil)
	if strOf(ev, "engine_id") != "P" || strOf(ev, "endpoint") != x.sideChanEP {
		t.Fatalf("engine_ready %s, want engine P at %s", show(ev), x.sideChanEP)
	}
	dv := x.D.ok("open_rank", x.dec.fields("decode", "D", 1, 0))
	x.dRank = must(t, dv, "rank")
	if strOf(dv, "endpoint") != "" {
		t.Fatalf("a decode rank's endpoint is %q, want empty", strOf(dv, "endpoint"))
	}
	return x
}

// hold holds blocks of req on engine P from c and returns the params.
func (x *vllmSetup) hold(c *conn, req string, blocks ...int) msgpack.Value {
	c.t.Helper()
	v := c.ok("hold", m("engine_id", "P", "request_id", req, "block_ids", i32s(blocks...)))
	p, ok := v.Get("kv_transfer_params")
	if !ok || p.Kind != msgpack.Map {
		c.t.Fatalf("hold reply without kv_transfer_params: %s", show(v))
	}
	return p
}

func released(engine, req, reason string) func(msgpack.Value) bool {
	return func(v msgpack.Value) bool {
		return strOf(v, "engine_id") == engine && strOf(v, "request_id") == req && (reason == "" || strOf(v, "reason") == reason)
	}
}

func readOf(rank uint64, req string) func(msgpack.Value) bool {
	return func(v msgpack.Value) bool {
		r, _ := uintOf(v, "rank")
		return r == rank && strOf(v, "request_id") == req
	}
}

// TestVLLMPull: hold answers vLLM's kv_transfer_params, keys in vLLM's
// order; a read with them moves every block (checked byte by byte),
// reports a read event and releases the hold ("notified") to the
// prefill worker.
func TestVLLMPull(t *testing.T) {
	x := newVLLM(t)
	x.pre.fill(5, []int{1, 2, 6})
	p := x.hold(x.P, "r1", 1, 2, 6)
	var keys []string
	p.Each(func(k string, _ msgpack.Value) bool { keys = append(keys, k); return true })
	want := []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"}
	if strings.Join(keys, ",") != strings.Join(want, ",") {
		t.Fatalf("kv_transfer_params keys %v, want %v", keys, want)
	}
	if b, _ := boolOf(p, "do_remote_prefill"); !b {
		t.Fatalf("do_remote_prefill: %s", show(p))
	}
	if b, ok := boolOf(p, "do_remote_decode"); !ok || b {
		t.Fatalf("do_remote_decode: %s", show(p))
	}
	ids, _ := p.Get("remote_block_ids")
	if ids.Kind != msgpack.Array || show(ids) != "[1, 2, 6]" {
		t.Fatalf("remote_block_ids %s, want the list [1, 2, 6]", show(ids))
	}
	if strOf(p, "remote_engine_id") != "P" || strOf(p, "remote_request_id") != "r1" || strOf(p, "remote_host") != "127.0.0.1" ||
		"tcp://127.0.0.1:"+show(must2(t, p, "remote_port")) != x.sideChanEP || show(must2(t, p, "tp_size")) != "1" {
		t.Fatalf("kv_transfer_params %s do not name engine P's side channel %s", show(p), x.sideChanEP)
	}
	x.D.ok("read", m("rank", x.dRank, "request_id", "r1", "kv_transfer_params", p, "block_ids", i32s(3, 0, 7)))
	ev := x.D.event("read", readOf(x.dRank, "r1"))
	if ok, _ := boolOf(ev, "ok"); !ok || len(binOf(ev, "invalid_blocks")) != 0 || must(t, ev, "bytes") == 0 {
		t.Fatalf("read event %s, want ok with bytes and no invalid blocks", show(ev))
	}
	sameBlocks(t, x.pre, []int{1, 2, 6}, x.dec, []int{3, 0, 7})
	x.P.event("released", released("P", "r1", "notified"))

	// A full prefix hit reads nothing and notifies the prefill.
	p2 := x.hold(x.P, "r2", 4)
	x.D.ok("read", m("rank", x.dRank, "request_id", "r2", "kv_transfer_params", p2, "block_ids", []byte{}))
	if ev := x.D.event("read", readOf(x.dRank, "r2")); !mustBool(ev, "ok") {
		t.Fatalf("prefix-hit read %s", show(ev))
	}
	x.P.event("released", released("P", "r2", "notified"))
	// Params passed on as bin of <i4 work too.
	p3 := x.hold(x.P, "r3", 2)
	var pm M
	p3.Each(func(k string, v msgpack.Value) bool {
		if k == "remote_block_ids" {
			pm = append(pm, F{k, i32s(2)})
		} else {
			pm = append(pm, F{k, v})
		}
		return true
	})
	x.D.ok("read", m("rank", x.dRank, "request_id", "r3", "kv_transfer_params", pm, "block_ids", i32s(1)))
	if ev := x.D.event("read", readOf(x.dRank, "r3")); !mustBool(ev, "ok") {
		t.Fatalf("read with bin remote_block_ids: %s", show(ev))
	}
	x.P.event("released", released("P", "r3", "notified"))
}

func must2(t *testing.T, v msgpack.Value, k string) msgpack.Value {
	t.Helper()
	x, ok := v.Get(k)
	if !ok {
		t.Fatalf("%q missing in %s", k, show(v))
	}
	return x
}

func mustBool(v msgpack.Value, k string) bool { b, _ := boolOf(v, k); return b }

// TestVLLMHoldErrors: hold, release and read refusals and their codes;
// an empty hold holds nothing; release answers "aborted"; the scheduler
// (a connection with no rank) may hold and release and sees its releases.
func TestVLLMHoldErrors(t *testing.T) {
	x := newVLLM(t)
	P, D := x.P, x.D
	sched := x.side.engine(t, "scheduler")
	P.fail("hold", m("engine_id", "P", "request_id", "r", "block_ids", i32s(8)), "bad_request", "block_ids")
	P.fail("hold", m("engine_id", "P", "request_id", "", "block_ids", i32s(1)), "bad_request", "request_id")
	P.fail("hold", m("engine_id", "P", "request_id", strings.Repeat("r", 1025), "block_ids", i32s(1)), "bad_request", "request_id")
	P.fail("hold", m("engine_id", "P", "request_id", "r", "block_ids", []int{1}), "bad_request", "block_ids")
	P.fail("hold", m("engine_id", "P", "request_id", "r"), "bad_request", "block_ids")
	// The scheduler's connection names the engine without a rank of it.
	sched.fail("hold", m("engine_id", "nobody", "request_id", "r", "block_ids", i32s(1)), "unknown")
	x.hold(sched, "s1", 1)
	sched.fail("hold", m("engine_id", "P", "request_id", "s1", "block_ids", i32s(1)), "exists")
	x.hold(sched, "empty")
	// Any connection bound to the engine may release; the holder and
	// the engine's ranks hear "aborted".
	P.ok("release", m("engine_id", "P", "request_id", "s1"))
	sched.event("released", released("P", "s1", "aborted"))
	P.event("released", released("P", "s1", "aborted"))
	P.fail("release", m("engine_id", "P", "request_id", "s1"), "unknown")
	P.fail("release", m("engine_id", "P", "request_id", "empty"), "unknown")
	sched.noEvent("released", released("P", "empty", ""))
	// The scheduler is bound to P now.
	sched.fail("hold", m("engine_id", "D", "request_id", "r", "block_ids", i32s(1)), "unknown")
	// A prefill engine not complete yet: out_of_order until engine_ready.
	q0 := x.side.engine(t, "Q rank 0")
	qp := newVLLMPool(t, 2, 8, 4, 1, 8)
	q0.register(qp.region())
	if ep := strOf(q0.ok("open_rank", qp.fields("prefill", "Q", 2, 0)), "endpoint"); ep != "" {
		t.Fatalf("an incomplete engine's open_rank endpoint %q, want empty", ep)
	}
	q0.fail("hold", m("engine_id", "Q", "request_id", "r", "block_ids", i32s(1)), "out_of_order")
	q0.noEvent("engine_ready", nil)

	// read refusals.
	p := x.hold(P, "r", 1)
	D.fail("read", m("rank", x.dRank, "request_id", "r", "kv_transfer_params", "x", "block_ids", i32s(1)), "bad_request", "kv_transfer_params")
	D.fail("read", m("rank", x.dRank, "request_id", "r", "block_ids", i32s(1)), "bad_request", "kv_transfer_params")
	D.fail("read", m("rank", x.dRank, "request_id", "r", "kv_transfer_params", p, "block_ids", i32s(-1)), "bad_request", "block_ids")
	D.fail("read", m("rank", x.dRank, "request_id", "", "kv_transfer_params", p, "block_ids", i32s(1)), "bad_request", "request_id")
	P.fail("read", m("rank", x.pRank, "request_id", "r", "kv_transfer_params", p, "block_ids", i32s(1)), "bad_request")
	P.fail("read", m("rank", x.dRank, "request_id", "r", "kv_transfer_params", p, "block_ids", i32s(1)), "unknown")
	// Params that cannot drive a pull end in a failed read event, every
	// block invalid.
	for i, bad := range []M{
		m("do_remote_prefill", false),
		m("remote_engine_id", 5),
		m("remote_engine_id", "not-P"),
		m("remote_port", "x"),
	} {
		var pm M
		p.Each(func(k string, v msgpack.Value) bool { pm = append(pm, F{k, v}); return true })
		for _, f := range bad {
			pm = pm.with(f.K, f.V)
		}
		req := "bad" + string(rune('0'+i))
		D.ok("read", m("rank", x.dRank, "request_id", req, "kv_transfer_params", pm, "block_ids", i32s(2, 5)))
		ev := D.event("read", readOf(x.dRank, req))
		if mustBool(ev, "ok") || strOf(ev, "reason") == "" || string(binOf(ev, "invalid_blocks")) != string(i32s(2, 5)) {
			t.Fatalf("read with params %s: %s, want a failed read with a reason and blocks 2, 5 invalid", show(encodeValue(pm)), show(ev))
		}
	}
}

func encodeValue(x M) msgpack.Value {
	v, _ := msgpack.Decode(encode(x))
	return v
}

// TestVLLMEngineReadyGoesToRanks: engine_ready goes to every connection
// with a rank of the engine once its last TP rank opens, not to a
// scheduler connection (which learns readiness from hold's
// out_of_order turning into a success).
func TestVLLMEngineReadyGoesToRanks(t *testing.T) {
	side := startSidecar(t)
	sched := side.engine(t, "scheduler")
	a := side.engine(t, "rank 0")
	b := side.engine(t, "rank 1")
	pa := newVLLMPool(t, 2, 8, 4, 1, 8)
	pb := newVLLMPool(t, 2, 8, 4, 1, 8)
	a.register(pa.region())
	b.register(pb.region())
	a.ok("open_rank", pa.fields("prefill", "P", 2, 0))
	sched.fail("hold", m("engine_id", "P", "request_id", "r", "block_ids", i32s(1)), "out_of_order")
	a.noEvent("engine_ready", nil)
	ep := strOf(b.ok("open_rank", pb.fields("prefill", "P", 2, 1)), "endpoint")
	for _, c := range []*conn{a, b} {
		if ev := c.event("engine_ready", nil); strOf(ev, "engine_id") != "P" || strOf(ev, "endpoint") != ep || ep == "" {
			t.Fatalf("%s: engine_ready %s, want P at %q", c.name, show(ev), ep)
		}
	}
	sched.noEvent("engine_ready", nil)
	p := sched.ok("hold", m("engine_id", "P", "request_id", "r", "block_ids", i32s(1)))
	pp, _ := p.Get("kv_transfer_params")
	if show(must2(t, pp, "tp_size")) != "2" {
		t.Fatalf("kv_transfer_params of a TP-2 engine: %s", show(pp))
	}
}

// TestSlowHandshakeStallsNobody: on one decode rank, a read whose prefill side channel
// never answers its handshake does not hold up a read from another
// prefill engine.
func TestSlowHandshakeStallsNobody(t *testing.T) {
	x := newVLLM(t)
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
	params := m("do_remote_prefill", true, "do_remote_decode", false, "remote_block_ids", []int{1},
		"remote_engine_id", "S", "remote_request_id", "s", "remote_host", "127.0.0.1", "remote_port", ln.Addr().(*net.TCPAddr).Port, "tp_size", 1)
	x.D.ok("read", m("rank", x.dRank, "request_id", "s", "kv_transfer_params", params, "block_ids", i32s(4)))
	p := x.hold(x.P, "r", 1)
	x.D.ok("read", m("rank", x.dRank, "request_id", "r", "kv_transfer_params", p, "block_ids", i32s(2)))
	ev := x.D.event("read", readOf(x.dRank, "r"))
	if !mustBool(ev, "ok") {
		t.Fatalf("read: %s", show(ev))
	}
	// The stalled read must still be in flight: had the good read waited
	// for the stalled handshake to time out, its event would be here.
	x.D.noEvent("read", readOf(x.dRank, "s"))
}

// TestVLLMDecodeTPSmallerRefused: a decode with a smaller TP than its
// prefill cannot pull (vLLM refuses it): the read fails, every block
// invalid, and says why.
func TestVLLMDecodeTPSmallerRefused(t *testing.T) {
	side := startSidecar(t)
	a := side.engine(t, "prefill rank 0")
	b := side.engine(t, "prefill rank 1")
	pa := newVLLMPool(t, 2, 8, 4, 1, 8)
	pb := newVLLMPool(t, 2, 8, 4, 1, 8)
	a.register(pa.region())
	b.register(pb.region())
	a.ok("open_rank", pa.fields("prefill", "P", 2, 0))
	b.ok("open_rank", pb.fields("prefill", "P", 2, 1))
	a.event("engine_ready", nil)
	p := a.ok("hold", m("engine_id", "P", "request_id", "r", "block_ids", i32s(1)))
	params, _ := p.Get("kv_transfer_params")
	d := side.engine(t, "decode")
	dp := newVLLMPool(t, 2, 8, 4, 2, 8)
	d.register(dp.region())
	rank := must(t, d.ok("open_rank", dp.fields("decode", "D", 1, 0)), "rank")
	d.ok("read", m("rank", rank, "request_id", "r", "kv_transfer_params", params, "block_ids", i32s(3)))
	ev := d.event("read", readOf(rank, "r"))
	if mustBool(ev, "ok") || !strings.Contains(strOf(ev, "reason"), "smaller than prefill TP") || string(binOf(ev, "invalid_blocks")) != string(i32s(3)) {
		t.Fatalf("read of a TP-2 prefill by a TP-1 decode: %s", show(ev))
	}
}

// TestVLLMPartialPrefix: a read naming fewer blocks than the prefill
// held (a partial prefix hit on the decode) fills them from the last
// held blocks, as vLLM reads remote_block_ids[-n:].
func TestVLLMPartialPrefix(t *testing.T) {
	x := newVLLM(t)
	x.pre.fill(9, []int{1, 2, 6})
	p := x.hold(x.P, "r", 1, 2, 6)
	x.D.ok("read", m("rank", x.dRank, "request_id", "r", "kv_transfer_params", p, "block_ids", i32s(4)))
	if ev := x.D.event("read", readOf(x.dRank, "r")); !mustBool(ev, "ok") {
		t.Fatalf("read: %s", show(ev))
	}
	sameBlocks(t, x.pre, []int{6}, x.dec, []int{4})
	x.P.event("released", released("P", "r", "notified"))
}
