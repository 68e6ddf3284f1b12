package serve

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
)

// vtConn is a connection that records its events.
type vtConn struct {
	name string
	ch   chan vllmEvent
}

func newVTConn(name string) *vtConn { return &vtConn{name: name, ch: make(chan vllmEvent, 1024)} }

func (c *vtConn) vllmEmit(ev vllmEvent) {
	select {
	case c.ch <- ev:
	default:
		panic("vtConn " + c.name + ": event queue full")
	}
}

// next waits for the connection's next event.
func (c *vtConn) next(t *testing.T) vllmEvent {
	t.Helper()
	select {
	case ev := <-c.ch:
		return ev
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: no event within 20 s", c.name)
	}
	return vllmEvent{}
}

// none checks that no event is queued.
func (c *vtConn) none(t *testing.T) {
	t.Helper()
	select {
	case ev := <-c.ch:
		t.Fatalf("%s: unexpected event %+v", c.name, ev)
	default:
	}
}

func vtLogger() *slog.Logger {
	if os.Getenv("KVHOST_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

var vtAgentSeq struct {
	sync.Mutex
	n int
}

func vtAgent(t *testing.T, name string) *plugin.Agent {
	t.Helper()
	vtAgentSeq.Lock()
	vtAgentSeq.n++
	n := vtAgentSeq.n
	vtAgentSeq.Unlock()
	a, err := faketest.Plugin(t).NewAgent(fmt.Sprintf("%s-%d-%d", name, os.Getpid(), n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// vtGeom: 2 layers, 4 KV heads, HND, 16-byte heads.
func vtPool(t *testing.T, tp, rank, blocks, blockSize int) (*kvpool.Pool, pull.Cache) {
	t.Helper()
	p, err := kvpool.New(kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.Interleaved, HeadMajor: true, Layers: 2,
		Pages: blocks, PageSize: blockSize, TotalHeads: 4, TPSize: tp, TPRank: rank, HeadBytes: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	mem := p.Bytes()
	base := p.Regions()[0].Addr
	c := pull.Cache{NumBlocks: blocks, BlockSize: blockSize, Layout: pull.LayoutHND}
	for _, r := range p.Regions() {
		c.Regions = append(c.Regions, pull.Region{Addr: r.Addr, Len: r.Len})
		off := r.Addr - base
		c.Host = append(c.Host, mem[off:off+r.Len:off+r.Len])
	}
	return p, c
}

const vtHash = "vt-hash"

func vtPrefillSpec(engine string, tp, rank int) vllmPrefillSpec {
	return vllmPrefillSpec{EngineID: engine, TPSize: tp, TPRank: rank, CompatHash: vtHash, SideHost: "127.0.0.1"}
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	var ve *vllmError
	if !errors.As(err, &ve) || ve.Code != code {
		t.Fatalf("err = %v, want code %s", err, code)
	}
}

// TestVLLMHubPull runs prefill TP 2 (ranks from two connections) to
// decode TP 2 through the hub: the group opens when both ranks are open,
// the hold's params drive the read, every byte arrives, and the decode's
// notifications release the request to both rank connections and the
// holder.
func TestVLLMHubPull(t *testing.T) {
	hub := newVLLMHub(vllmConfig{Logger: vtLogger(), AbortTimeout: time.Minute})
	t.Cleanup(func() { hub.close() })
	w0, w1, sched, dec := newVTConn("w0"), newVTConn("w1"), newVTConn("sched"), newVTConn("dec")

	pp0, pc0 := vtPool(t, 2, 0, 32, 4)
	pp1, pc1 := vtPool(t, 2, 1, 32, 4)
	r0, ep, err := hub.joinPrefill(w0, vtPrefillSpec("P", 2, 0), vtAgent(t, "p0"), pc0)
	if err != nil || ep != "" {
		t.Fatalf("join rank 0: %q %v", ep, err)
	}
	if _, _, err := hub.hold(sched, "P", "req-early", []int32{1}); err == nil {
		t.Fatal("hold before the group is complete succeeded")
	} else {
		wantCode(t, err, "out_of_order")
	}
	if _, _, err := hub.joinPrefill(w1, vtPrefillSpec("P", 2, 0), vtAgent(t, "p0b"), pc1); err == nil {
		t.Fatal("a second TP rank 0 joined")
	} else {
		wantCode(t, err, "exists")
	}
	bad := vtPrefillSpec("P", 2, 1)
	bad.CompatHash = "other"
	if _, _, err := hub.joinPrefill(w1, bad, vtAgent(t, "p1x"), pc1); err == nil {
		t.Fatal("a rank with another compat hash joined")
	} else {
		wantCode(t, err, "bad_request")
	}
	r1, ep, err := hub.joinPrefill(w1, vtPrefillSpec("P", 2, 1), vtAgent(t, "p1"), pc1)
	if err != nil || ep == "" {
		t.Fatalf("join rank 1: %q %v", ep, err)
	}
	for _, c := range []*vtConn{w0, w1} {
		if ev := c.next(t); ev.Kind != "engine_ready" || ev.EngineID != "P" || ev.Endpoint != ep {
			t.Fatalf("%s: %+v, want engine_ready %s", c.name, ev, ep)
		}
	}
	_ = r0
	_ = r1

	blocks := []int32{5, 9, 2}
	for i, pp := range []*kvpool.Pool{pp0, pp1} {
		if err := pp.Fill(kvpool.Tokens{Request: 7, Pages: blocks, Count: 10}); err != nil {
			t.Fatal(i, err)
		}
	}
	params, _, err := hub.hold(sched, "P", "req-1", blocks)
	if err != nil {
		t.Fatal(err)
	}
	if !params.DoRemotePrefill || params.RemoteEngineID != "P" || params.RemoteRequestID != "req-1" || params.TPSize != 2 ||
		fmt.Sprint(params.RemoteBlockIDs) != fmt.Sprint(blocks) || params.RemotePort == 0 || params.RemoteHost != "127.0.0.1" {
		t.Fatalf("params %+v", params)
	}
	if _, _, err := hub.hold(sched, "P", "req-1", blocks); err == nil {
		t.Fatal("second hold of a held request")
	} else {
		wantCode(t, err, "exists")
	}
	if _, _, err := hub.hold(sched, "P", "req-x", []int32{32}); err == nil {
		t.Fatal("hold of a block out of range")
	} else {
		wantCode(t, err, "bad_request")
	}

	local := []int32{3, 0, 11}
	for rank := 0; rank < 2; rank++ {
		dp, dc := vtPool(t, 2, rank, 16, 4)
		drank, err := hub.openDecode(dec, uint64(rank+1), vllmDecodeSpec{EngineID: "D", TPSize: 2, TPRank: rank, CompatHash: vtHash, TotalKVHeads: 4},
			vtAgent(t, "d"), dc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { drank.close("test over") })
		if err := drank.read("dreq-1", params, nil, local); err != nil {
			t.Fatal(err)
		}
		ev := dec.next(t)
		if ev.Kind != "read" || !ev.OK || ev.RequestID != "dreq-1" || ev.Rank != uint64(rank+1) || len(ev.InvalidBlocks) != 0 || ev.Bytes == 0 {
			t.Fatalf("read event %+v", ev)
		}
		if err := dp.Verify(kvpool.Tokens{Request: 7, Pages: local, Count: 10}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []*vtConn{w0, w1, sched} {
		if ev := c.next(t); ev.Kind != "released" || ev.RequestID != "req-1" || ev.Reason != "notified" || ev.EngineID != "P" {
			t.Fatalf("%s: %+v, want released notified", c.name, ev)
		}
	}
	for _, c := range []*vtConn{w0, w1, sched, dec} {
		c.none(t)
	}
}

// TestVLLMHubReleaseAndScope: release reports "aborted" once; another
// engine's connection cannot release or hold for the engine.
func TestVLLMHubReleaseAndScope(t *testing.T) {
	hub := newVLLMHub(vllmConfig{Logger: vtLogger(), AbortTimeout: time.Minute})
	t.Cleanup(func() { hub.close() })
	w, sched, other := newVTConn("w"), newVTConn("sched"), newVTConn("other")
	_, pc := vtPool(t, 1, 0, 8, 4)
	if _, _, err := hub.joinPrefill(w, vtPrefillSpec("P", 1, 0), vtAgent(t, "p"), pc); err != nil {
		t.Fatal(err)
	}
	w.next(t) // engine_ready
	_, oc := vtPool(t, 1, 0, 8, 4)
	if _, _, err := hub.joinPrefill(other, vtPrefillSpec("Q", 1, 0), vtAgent(t, "q"), oc); err != nil {
		t.Fatal(err)
	}
	other.next(t)
	if _, _, err := hub.hold(sched, "P", "a", []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	if err := hub.release(other, "P", "a"); err == nil {
		t.Fatal("engine Q's connection released engine P's request")
	} else {
		wantCode(t, err, "unknown")
	}
	if _, _, err := hub.hold(other, "P", "b", []int32{1}); err == nil {
		t.Fatal("engine Q's connection held for engine P")
	} else {
		wantCode(t, err, "unknown")
	}
	if _, _, err := hub.hold(sched, "Q", "b", []int32{1}); err == nil {
		t.Fatal("engine P's scheduler held for engine Q")
	} else {
		wantCode(t, err, "unknown")
	}
	if _, _, err := hub.hold(sched, "nope", "b", []int32{1}); err == nil {
		t.Fatal("hold for a connection's other engine")
	}
	if err := hub.release(w, "P", "a"); err != nil { // a rank connection of P may release
		t.Fatal(err)
	}
	for _, c := range []*vtConn{w, sched} {
		if ev := c.next(t); ev.Kind != "released" || ev.RequestID != "a" || ev.Reason != "aborted" {
			t.Fatalf("%s: %+v", c.name, ev)
		}
	}
	if err := hub.release(sched, "P", "a"); err == nil {
		t.Fatal("released twice")
	} else {
		wantCode(t, err, "unknown")
	}
	// Empty blocks: params without a hold (vLLM's request_finished with
	// no blocks does not delay the free).
	p, _, err := hub.hold(sched, "P", "empty", nil)
	if err != nil || len(p.RemoteBlockIDs) != 0 || !p.DoRemotePrefill {
		t.Fatalf("empty hold: %+v %v", p, err)
	}
	for _, c := range []*vtConn{w, sched, other} {
		c.none(t)
	}
}

// TestVLLMHubTimeout: a hold nobody reads is released "timeout".
func TestVLLMHubTimeout(t *testing.T) {
	hub := newVLLMHub(vllmConfig{Logger: vtLogger(), AbortTimeout: time.Minute})
	t.Cleanup(func() { hub.close() })
	w, sched := newVTConn("w"), newVTConn("sched")
	_, pc := vtPool(t, 1, 0, 8, 4)
	spec := vtPrefillSpec("P", 1, 0)
	spec.AbortTimeout = 200 * time.Millisecond
	if _, _, err := hub.joinPrefill(w, spec, vtAgent(t, "p"), pc); err != nil {
		t.Fatal(err)
	}
	w.next(t)
	if _, _, err := hub.hold(sched, "P", "t", []int32{3}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*vtConn{w, sched} {
		if ev := c.next(t); ev.Kind != "released" || ev.RequestID != "t" || ev.Reason != "timeout" {
			t.Fatalf("%s: %+v", c.name, ev)
		}
	}
}

// TestVLLMHubLeaveAndClose: a rank leaving closes the Sender and
// releases its holds "closed"; a rejoin opens it again; a holder's
// connection closing releases its holds "closed".
func TestVLLMHubLeaveAndClose(t *testing.T) {
	hub := newVLLMHub(vllmConfig{Logger: vtLogger(), AbortTimeout: time.Minute})
	t.Cleanup(func() { hub.close() })
	w0, w1, sched := newVTConn("w0"), newVTConn("w1"), newVTConn("sched")
	_, pc0 := vtPool(t, 2, 0, 8, 4)
	_, pc1 := vtPool(t, 2, 1, 8, 4)
	r0, _, err := hub.joinPrefill(w0, vtPrefillSpec("P", 2, 0), vtAgent(t, "p0"), pc0)
	if err != nil {
		t.Fatal(err)
	}
	a1 := vtAgent(t, "p1")
	r1, _, err := hub.joinPrefill(w1, vtPrefillSpec("P", 2, 1), a1, pc1)
	if err != nil {
		t.Fatal(err)
	}
	w0.next(t)
	w1.next(t)
	if _, _, err := hub.hold(sched, "P", "x", []int32{1}); err != nil {
		t.Fatal(err)
	}
	if err := r1.leave(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*vtConn{w0, w1, sched} {
		if ev := c.next(t); ev.Kind != "released" || ev.RequestID != "x" || ev.Reason != "closed" {
			t.Fatalf("%s: %+v", c.name, ev)
		}
	}
	if _, _, err := hub.hold(sched, "P", "y", []int32{1}); err == nil {
		t.Fatal("hold on an incomplete group")
	} else {
		wantCode(t, err, "out_of_order")
	}
	if err := r1.leave(); err != nil { // again: no-op
		t.Fatal(err)
	}
	// Rejoin: the group opens again.
	if _, ep, err := hub.joinPrefill(w1, vtPrefillSpec("P", 2, 1), a1, pc1); err != nil || ep == "" {
		t.Fatalf("rejoin: %q %v", ep, err)
	}
	w0.next(t)
	w1.next(t)
	if _, _, err := hub.hold(sched, "P", "z", []int32{1}); err != nil {
		t.Fatal(err)
	}
	hub.connClosed(sched)
	for _, c := range []*vtConn{w0, w1, sched} {
		if ev := c.next(t); ev.Kind != "released" || ev.RequestID != "z" || ev.Reason != "closed" {
			t.Fatalf("%s: %+v", c.name, ev)
		}
	}
	if err := r0.leave(); err != nil {
		t.Fatal(err)
	}
	hub.mu.Lock()
	n := len(hub.engines)
	hub.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d engines, want 1 (rank 1 still open)", n)
	}
	for _, c := range []*vtConn{w0, w1, sched} {
		c.none(t)
	}
}

// TestVLLMHubReadFailures: bad params and an unreachable or wrong engine
// fail the read with every block invalid; closing the rank fails reads
// in flight with its reason.
func TestVLLMHubReadFailures(t *testing.T) {
	hub := newVLLMHub(vllmConfig{Logger: vtLogger(), HandshakeTimeout: 2 * time.Second})
	t.Cleanup(func() { hub.close() })
	w, sched, dec := newVTConn("w"), newVTConn("sched"), newVTConn("dec")
	_, pc := vtPool(t, 1, 0, 8, 4)
	if _, _, err := hub.joinPrefill(w, vtPrefillSpec("P", 1, 0), vtAgent(t, "p"), pc); err != nil {
		t.Fatal(err)
	}
	w.next(t)
	params, _, err := hub.hold(sched, "P", "r", []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	_, dc := vtPool(t, 1, 0, 8, 4)
	d, err := hub.openDecode(dec, 4, vllmDecodeSpec{EngineID: "D", TPSize: 1, CompatHash: vtHash, TotalKVHeads: 4}, vtAgent(t, "d"), dc)
	if err != nil {
		t.Fatal(err)
	}
	check := func(id string, want []int32) {
		t.Helper()
		ev := dec.next(t)
		if ev.Kind != "read" || ev.RequestID != id || ev.OK || ev.Reason == "" || fmt.Sprint(ev.InvalidBlocks) != fmt.Sprint(want) {
			t.Fatalf("%+v", ev)
		}
	}
	wrong := params
	wrong.RemoteEngineID = "not-P"
	if err := d.read("a", wrong, nil, []int32{4, 5}); err != nil {
		t.Fatal(err)
	}
	check("a", []int32{4, 5})
	if err := d.read("b", pull.KVTransferParams{}, errors.New("remote_port: not an int"), []int32{6}); err != nil {
		t.Fatal(err)
	}
	check("b", []int32{6})
	if err := d.read("c", pull.KVTransferParams{DoRemotePrefill: true}, nil, []int32{7}); err != nil {
		t.Fatal(err)
	}
	check("c", []int32{7})
	// Local blocks the rank does not have fail the read, not the sidecar.
	if err := d.read("oob", params, nil, []int32{2, 1000}); err != nil {
		t.Fatal(err)
	}
	check("oob", []int32{2, 1000})
	if err := d.close("rank closed"); err != nil {
		t.Fatal(err)
	}
	if err := d.read("d", params, nil, []int32{1}); err == nil {
		t.Fatal("read on a closed rank")
	}
}
