package push_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

func quietLog() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
}

// side is one rank's synthetic pool and what it registers.
type side struct {
	pool  *kvpool.Pool
	args  push.KVArgs
	state []byte // state tensors' memory (mmap), when the rig has state
}

const (
	rigLayers   = 2
	rigHeads    = 2
	rigHeadB    = 16
	rigPageSize = 4
	rigPages    = 64
	rigAuxSlots = 16
	rigAuxLen   = 32
	stateSlots  = 8
	stateItem   = 96 // bytes per slot of each state tensor
)

func newSide(t testing.TB, pages int, withState bool) *side {
	t.Helper()
	g := kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.KThenV, Layers: rigLayers, Pages: pages, PageSize: rigPageSize,
		TotalHeads: rigHeads, TPSize: 1, HeadBytes: rigHeadB, AuxItems: rigAuxSlots, AuxItemLen: rigAuxLen}
	pool, err := kvpool.New(g)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	s := &side{pool: pool}
	for _, r := range pool.Regions() {
		s.args.KV = append(s.args.KV, push.Buffer{Addr: r.Addr, Len: r.Len, ItemLen: g.ItemLen(), Kind: abi.VRAM})
	}
	s.args.PageSize, s.args.KVHeadNum, s.args.TotalKVHeads = rigPageSize, rigHeads, rigHeads
	a := pool.Aux()
	off := a.Addr - pool.Regions()[0].Addr
	s.args.Aux = []push.AuxBuffer{{Mem: pool.Bytes()[off : off+a.Len], ItemLen: rigAuxLen}}
	if withState {
		mem, err := syscall.Mmap(-1, 0, 2*stateSlots*stateItem, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Munmap(mem) })
		s.state = mem
		base := uint64(uintptr(unsafe.Pointer(&mem[0])))
		s.args.State = []push.StateComponent{{Type: planner.StateMamba, Tensors: []push.Buffer{
			{Addr: base, Len: stateSlots * stateItem, ItemLen: stateItem, Kind: abi.VRAM},
			{Addr: base + stateSlots*stateItem, Len: stateSlots * stateItem, ItemLen: stateItem, Kind: abi.VRAM},
		}}}
	}
	return s
}

// stateSlot returns tensor k's slot i of a side's state memory.
func (s *side) stateSlot(k, i int) []byte {
	off := (k*stateSlots + i) * stateItem
	return s.state[off : off+stateItem]
}

type rigOpts struct {
	variant      push.Variant
	completion   push.Completion
	pset, dset   push.Settings
	pparams      []plugin.Param
	dparams      []plugin.Param
	state        bool
	pobs, dobs   push.Observer
	prefillPages int
	noDecode     bool
	xfer         push.XferMode
	clock        *clock.Fake           // both ranks' clock (nil: the wall clock)
	mem          *memtransport.Network // both ranks' transport (nil: ZMQ)
	// boot replaces the bootstrap client of the in-memory transport.
	boot func(addr string) push.BootstrapClient
	// sides, if set, changes what the ranks register before they open.
	sides func(p, d *side)
}

// seams returns the Transport and Clock the options ask for (nil
// interfaces for the defaults).
func (o rigOpts) seams() (push.Transport, clock.Clock) {
	var tr push.Transport
	var c clock.Clock
	if o.mem != nil {
		tr = memTransport{n: o.mem, boot: o.boot}
	}
	if o.clock != nil {
		c = o.clock
	}
	return tr, c
}

// rig is one prefill rank and one decode rank (TP 1) in this process.
type rig struct {
	t    testing.TB
	pl   *plugin.Plugin
	srv  *bootstrap.Running
	pf   *push.Prefill
	dec  *push.Decode
	p, d *side
	// afterReady, if set, runs in transfer once prefill is ready (decode
	// registered and sent its metadata), before anything is sent.
	afterReady func()
}

func newRig(t testing.TB, o rigOpts) *rig {
	t.Helper()
	r := &rig{t: t, pl: faketest.Plugin(t)}
	var err error
	if r.srv, err = bootstrap.NewServer(bootstrap.WithLogger(quietLog())).Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		r.srv.Close(ctx)
	})
	pages := o.prefillPages
	if pages == 0 {
		pages = rigPages
	}
	r.p = newSide(t, pages, o.state)
	r.d = newSide(t, rigPages, o.state)
	if o.sides != nil {
		o.sides(r.p, r.d)
	}
	ctx := context.Background()
	tr, clk := o.seams()
	r.pf, err = push.NewPrefill(ctx, push.PrefillConfig{Plugin: r.pl, AgentParams: o.pparams, Variant: o.variant, Completion: o.completion,
		XferMode: o.xfer, KV: r.p.args, Parallel: push.Parallel{TPSize: 1}, BootstrapAddr: r.srv.Addr(),
		Settings: o.pset, Observer: o.pobs, Logger: quietLog(), Transport: tr, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.pf.Close() })
	if o.noDecode {
		return r
	}
	r.dec, err = push.NewDecode(ctx, push.DecodeConfig{Plugin: r.pl, AgentParams: o.dparams, Variant: o.variant, Completion: o.completion,
		KV: r.d.args, Parallel: push.Parallel{TPSize: 1}, Settings: o.dset, Observer: o.dobs, Logger: quietLog(),
		Transport: tr, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.dec.Close() })
	return r
}

// request is one room's pages on both sides.
type request struct {
	room       uint64
	tokens     int
	ppages     []int32
	dpages     []int32
	paux, daux int64
	pstate     [][]int32
	dstate     [][]int32
	s          *push.Sender
	rcv        *push.Receiver
}

// slotPages is how many pages each concurrent request slot owns, so
// requests in different slots never share a page.
const slotPages = 4

// prepare opens the room on both sides with the pages of its slot
// ([slot*4, slot*4+n) on prefill, mirrored on decode).
func (r *rig) prepare(room uint64, tokens int, slot int) *request {
	r.t.Helper()
	n := (tokens + rigPageSize - 1) / rigPageSize
	q := &request{room: room, tokens: tokens, paux: int64(slot % rigAuxSlots), daux: int64((slot + 3) % rigAuxSlots)}
	if n > slotPages {
		r.t.Fatalf("%d tokens need %d pages; a slot has %d", tokens, n, slotPages)
	}
	for i := 0; i < n; i++ {
		p := (slot*slotPages + i) % rigPages
		q.ppages = append(q.ppages, int32(p))
		q.dpages = append(q.dpages, int32(rigPages-1-p))
	}
	var err error
	if q.s, err = r.pf.NewSender(room); err != nil {
		r.t.Fatal(err)
	}
	if r.dec != nil {
		if q.rcv, err = r.dec.NewReceiver(r.srv.Addr(), room); err != nil {
			r.t.Fatal(err)
		}
	}
	return q
}

// transfer runs one request end to end and verifies decode's bytes.
func (r *rig) transfer(ctx context.Context, q *request) error {
	if err := r.open(ctx, q); err != nil {
		return err
	}
	if r.afterReady != nil {
		r.afterReady()
	}
	return r.deliver(ctx, q, func() error {
		for i := 0; i < len(q.ppages); i += 2 { // chunks of two pages
			end := min(i+2, len(q.ppages))
			var st [][]int32
			if end == len(q.ppages) {
				st = q.pstate
			}
			if err := q.s.Send(q.ppages[i:end], st); err != nil {
				return err
			}
		}
		return nil
	})
}

// open runs a request up to the point where the prefill waits for its
// KV: decode sent the metadata, prefill has it, no byte moved.
func (r *rig) open(ctx context.Context, q *request) error {
	if err := q.rcv.Init(ctx); err != nil {
		return err
	}
	if err := q.rcv.SendMetadata(ctx, q.dpages, q.daux, q.dstate, 0); err != nil {
		return err
	}
	if st, err := q.s.WaitReady(ctx); err != nil || st == sglang.KVPollFailed {
		return fmt.Errorf("prefill not ready: %v %v", st, err)
	}
	return nil
}

// complete runs an opened request to the end, its pages in one chunk, and
// verifies decode's bytes.
func (r *rig) complete(ctx context.Context, q *request) error {
	return r.deliver(ctx, q, func() error { return q.s.Send(q.ppages, nil) })
}

// deliver fills the prefill's pages of an opened request, sends them with
// send, waits for both sides' outcomes and verifies decode's bytes.
func (r *rig) deliver(ctx context.Context, q *request, send func() error) error {
	if err := r.p.pool.Fill(kvpool.Tokens{Request: q.room, Pages: q.ppages, Count: q.tokens}); err != nil {
		return err
	}
	if err := r.p.pool.FillAux(q.room, int(q.paux)); err != nil {
		return err
	}
	if err := q.s.Init(len(q.ppages), q.paux); err != nil {
		return err
	}
	if err := send(); err != nil {
		return err
	}
	ps, err := q.s.Wait(ctx)
	if err != nil {
		return err
	}
	ds, err := q.rcv.Wait(ctx)
	if err != nil {
		return err
	}
	if ps != sglang.KVPollSuccess || ds != sglang.KVPollSuccess {
		return fmt.Errorf("room %d: prefill %v (%v), decode %v (%v)", q.room, ps, q.s.Failure(), ds, q.rcv.Failure())
	}
	if err := r.d.pool.Verify(kvpool.Tokens{Request: q.room, Pages: q.dpages, Count: q.tokens}); err != nil {
		return err
	}
	return r.d.pool.VerifyAux(q.room, int(q.daux))
}

func (q *request) close() {
	q.s.Close()
	if q.rcv != nil {
		q.rcv.Close()
	}
}
