package push

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/memfault"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// chunk is one Send: a part of a request's pages (TransferKVChunk).
type chunk struct {
	s        *Sender
	room     uint64
	id       int
	last     bool
	pages    []int32
	slice    planner.IndexSlice // position in the request's page list
	auxIndex int64
	state    [][]int32
	hasState bool
}

// shard is one transfer worker's queue: unbounded (Send never blocks the
// engine), FIFO, so a room's chunks, which all go to one shard, run in
// order.
type shard struct {
	mu   sync.Mutex
	q    []*chunk
	head int
	wake chan struct{}
}

func newShard() *shard { return &shard{wake: make(chan struct{}, 1)} }

func (sh *shard) push(c *chunk) {
	sh.mu.Lock()
	sh.q = append(sh.q, c)
	sh.mu.Unlock()
	select {
	case sh.wake <- struct{}{}:
	default:
	}
}

func (sh *shard) pop(ctx context.Context) *chunk {
	for {
		sh.mu.Lock()
		if sh.head < len(sh.q) {
			c := sh.q[sh.head]
			sh.q[sh.head] = nil
			sh.head++
			if sh.head == len(sh.q) {
				sh.q, sh.head = sh.q[:0], 0
			}
			sh.mu.Unlock()
			return c
		}
		sh.mu.Unlock()
		select {
		case <-sh.wake:
		case <-ctx.Done():
			return nil
		}
	}
}

func (m *Prefill) enqueue(c *chunk) {
	m.shards[c.room%uint64(len(m.shards))].push(c)
}

// worker is one transfer shard's state, reused chunk after chunk so that
// planning and building transfers allocate nothing once warm.
type worker struct {
	m      *Prefill
	b      batch
	flight []*inflight
	// The chunk's transfers still running, the first failure, and the
	// signal of the last completion or of a failure; written by the
	// completion engine (TransferDone).
	fmu     sync.Mutex
	left    int
	failed  error
	settled chan struct{}
	// jobs are the chunk's transfers to each decode rank (by info index):
	// check plans and validates them all, post posts them from the same
	// plans, so every chunk is planned once.
	jobs []rankJob
	// imported are remote regions imported for this chunk alone (aux
	// slots of peers with auxBySlot), released with its transfers.
	imported []*plugin.RemoteRegion
}

// rankJob is what one chunk sends to one decode rank, as check planned it:
// KV as strided copies (kv) or as indices into the peer's prepared lists
// (idx, one per part), state and aux. Its buffers are reused chunk after
// chunk. The planning times are what TransferEvent.Plan reports.
type rankJob struct {
	kvSet    bool
	kv       planner.Plan
	kvPlan   time.Duration
	idx      []preppedIdx
	stateSet bool
	states   []planner.StatePlan
	statePln time.Duration
	aux      auxJob
}

// preppedIdx is one part's indices into a peer's prepared lists.
type preppedIdx struct {
	src, dst []int32
	plan     time.Duration
}

// auxJob is one decode rank's aux copy of a chunk: the plan and the remote
// regions its destination table names.
type auxJob struct {
	set     bool
	plan    planner.Plan
	planned time.Duration
	remote  []*plugin.RemoteRegion // the peer's, or slots
	// slots and dst are the remote regions and destination table of a
	// by-slot plan (owned by the worker, reused).
	slots []*plugin.RemoteRegion
	dst   []planner.Region
}

// inflight is one submitted transfer and what the observer will be told.
// The agent's completion engine fills ev.TransferEvent when it ends.
type inflight struct {
	x    *plugin.Xfer // nil once reported; guarded by worker.fmu
	done bool         // reported; guarded by worker.fmu
	ev   TransferEvent
}

// errAbandoned aborts the transfers of a chunk that already failed: they
// are released without being reported (the chunk's failure is).
var errAbandoned = errors.New("push: chunk abandoned")

func (m *Prefill) runWorker(sh *shard) {
	w := &worker{m: m, settled: make(chan struct{}, 1)}
	for {
		c := sh.pop(m.ctx)
		if c == nil {
			return
		}
		w.run(c)
	}
}

// run processes one chunk (transfer_worker): plan and post its transfers
// to every decode rank of the room, wait for them, and move the room on.
func (w *worker) run(c *chunk) {
	m := w.m
	st, ok := m.rooms.Get(c.room)
	if !ok || st == sglang.KVPollFailed || c.s.ctx.Err() != nil {
		return // closed or failed: nothing more to do for this room
	}
	m.mu.Lock()
	ri := m.infos[c.room]
	var infos []*xferInfo
	peers := make([]*peer, 0, 4)
	complete := ri != nil && ri.complete
	if complete {
		infos = append(infos, ri.order...)
		for _, in := range infos {
			peers = append(peers, m.peers[in.peer])
		}
	}
	m.mu.Unlock()
	if !complete {
		c.s.fail(fmt.Sprintf("No transfer info found for bootstrap_room=%d (chunk sent before decode's metadata arrived)", c.room), false)
		return
	}
	m.rooms.Update(c.room, sglang.KVPollTransferring)

	ctx := c.s.ctx
	if m.set.TransferTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = m.clock.WithTimeout(ctx, m.set.TransferTimeout)
		defer cancel()
	}
	// Plan and check everything the chunk sends before posting anything:
	// a chunk is refused whole, never half sent.
	err := w.check(c, infos, peers)
	if err == nil {
		err = w.post(ctx, c, infos, peers)
	}
	if err == nil {
		err = w.wait(ctx, c)
	}
	w.release()
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && c.s.ctx.Err() == nil {
			err = fmt.Errorf("KV transfer exceeded SLA %dms", m.set.TransferTimeout.Milliseconds())
		}
		if c.s.ctx.Err() == nil { // not already failed by someone else
			c.s.fail(err.Error(), false)
		}
		return
	}
	if !c.last {
		return
	}
	if m.completion == CompletionStatus || m.cfg.Variant == VariantMORI {
		if err := w.finishByStatus(c, infos, peers); err != nil {
			c.s.fail(err.Error(), false)
			return
		}
	}
	if _, ok := m.rooms.Update(c.room, sglang.KVPollSuccess); ok {
		m.mu.Lock()
		if ri := m.infos[c.room]; ri != nil {
			ri.notified = true // nothing to tell decode any more
		}
		m.mu.Unlock()
	}
}

// check plans every transfer of the chunk, to every real decode rank, into
// w.jobs, and validates each plan against the region tables, without
// posting; post then posts exactly these plans.
func (w *worker) check(c *chunk, infos []*xferInfo, peers []*peer) error {
	m := w.m
	for len(w.jobs) < len(infos) {
		w.jobs = append(w.jobs, rankJob{})
	}
	for i := range w.jobs {
		j := &w.jobs[i]
		j.kvSet, j.stateSet, j.aux.set = false, false, false
	}
	for i, in := range infos {
		if in.dummy {
			continue
		}
		p := peers[i]
		if p == nil {
			return errors.New(m.peerMissing(in.peer))
		}
		j := &w.jobs[i]
		if len(c.pages) > 0 {
			if c.slice.Stop > len(in.dstPages) {
				return fmt.Errorf("decode %s sent %d page indices, chunk %d needs pages [%d, %d)", in.peer, len(in.dstPages), c.id, c.slice.Start, c.slice.Stop)
			}
			dst := in.dstPages[c.slice.Start:c.slice.Stop]
			if p.prepped != nil {
				// Indices into the prepared lists, never strided copies
				// the transfer would not use.
				parts := len(p.prepped.pk.Parts)
				if cap(j.idx) < parts {
					j.idx = append(j.idx[:cap(j.idx)], make([]preppedIdx, parts-cap(j.idx))...)
				}
				j.idx = j.idx[:parts]
				for part := range j.idx {
					x := &j.idx[part]
					var err error
					t0 := time.Now()
					x.src, x.dst, err = p.nixl.Indices(p.prepped.pk, part, x.src[:0], x.dst[:0], c.pages, dst)
					x.plan = time.Since(t0)
					if err != nil {
						return fmt.Errorf("prepared indices for %s: %w", p.name, err)
					}
				}
			} else {
				t0 := time.Now()
				err := p.kv.Plan(&j.kv, c.pages, dst)
				j.kvPlan = time.Since(t0)
				if err != nil {
					return fmt.Errorf("plan KV for %s: %w", p.name, err)
				}
				if err := checkTables(&j.kv, m.regs.kv, p.kvRemote); err != nil {
					return fmt.Errorf("KV for %s: %w", p.name, err)
				}
			}
			j.kvSet = true
		}
		if !c.last {
			continue
		}
		if c.hasState && p.state != nil {
			t0 := time.Now()
			err := p.state.Plan(&j.states, c.state, in.dstState)
			j.statePln = time.Since(t0)
			if err != nil {
				return fmt.Errorf("plan state for %s: %w", p.name, err)
			}
			for k := range j.states {
				comp := j.states[k].Component
				if comp >= len(m.regs.state) || comp >= len(p.stateRemote) {
					return fmt.Errorf("state component %d not registered on both sides", comp)
				}
				if err := checkTables(&j.states[k].Plan, m.regs.state[comp], p.stateRemote[comp]); err != nil {
					return fmt.Errorf("state component %d for %s: %w", comp, p.name, err)
				}
			}
			j.stateSet = true
		}
		if p.aux != nil && len(m.regs.aux) > 0 && w.sendsAuxRDMA(in, p) {
			a := &j.aux
			t0 := time.Now()
			err := p.aux.Plan(&a.plan, c.auxIndex, in.dstAux)
			a.planned = time.Since(t0)
			if err != nil {
				return fmt.Errorf("plan aux for %s: %w", p.name, err)
			}
			remote, err := w.auxRemote(p, a)
			if err != nil {
				return fmt.Errorf("aux for %s: %w", p.name, err)
			}
			if err := checkTables(&a.plan, m.regs.aux, remote); err != nil {
				return fmt.Errorf("aux for %s: %w", p.name, err)
			}
			a.remote, a.set = remote, true
		}
		if m.cfg.Variant == VariantMORI && p.auxTCP && in.dstAux >= 0 {
			for b, buf := range m.cfg.KV.Aux {
				if c.auxIndex < 0 || uint64(c.auxIndex+1)*buf.ItemLen > uint64(len(buf.Mem)) {
					return fmt.Errorf("prefill_aux_index %d outside aux buffer %d", c.auxIndex, b)
				}
			}
		}
	}
	return nil
}

// auxRemote returns the remote regions the aux plan j.plan writes into:
// the peer's imported aux regions, or, for a peer with auxBySlot, one
// region per copy imported now for this chunk (the plugin refuses a slot
// outside the memory the peer registered), with the plan's destination
// table rewritten to them.
func (w *worker) auxRemote(p *peer, j *auxJob) ([]*plugin.RemoteRegion, error) {
	if !p.auxBySlot {
		return p.auxRemote, nil
	}
	pl := &j.plan
	j.dst, j.slots = j.dst[:0], j.slots[:0]
	for k := range pl.Copies {
		c := &pl.Copies[k]
		if int(c.DstRegion) < 0 || int(c.DstRegion) >= len(pl.Dst) {
			return nil, fmt.Errorf("aux copy %d names decode buffer %d of %d", k, c.DstRegion, len(pl.Dst))
		}
		span := c.Len
		if c.Count > 1 {
			var ok bool
			if span, ok = mulAdd(c.Count-1, c.DstStride, c.Len); !ok {
				return nil, fmt.Errorf("aux copy %d spans more than the address space", k)
			}
		}
		buf := pl.Dst[c.DstRegion]
		addr, carry := bits.Add64(buf.Addr, c.DstOff, 0)
		if _, carry2 := bits.Add64(addr, span, 0); carry != 0 || carry2 != 0 {
			return nil, fmt.Errorf("aux buffer %d at %#x: slot at offset %d overflows the address space", c.DstRegion, buf.Addr, c.DstOff)
		}
		rr, err := w.m.agent.ImportRange(p.name, addr, span, 0, abi.DRAM)
		if err != nil {
			return nil, fmt.Errorf("aux buffer %d slot at %#x (+%d bytes): %w", c.DstRegion, addr, span, err)
		}
		w.imported = append(w.imported, rr)
		j.dst = append(j.dst, planner.Region{Addr: addr, Len: span, Kind: buf.Kind})
		j.slots = append(j.slots, rr)
		c.DstRegion, c.DstOff = int32(k), 0
	}
	pl.Dst = j.dst
	return j.slots, nil
}

// mulAdd returns a*b + c and whether it did not overflow.
func mulAdd(a, b, c uint64) (uint64, bool) {
	hi, lo := bits.Mul64(a, b)
	sum, carry := bits.Add64(lo, c, 0)
	return sum, hi == 0 && carry == 0
}

// sendsAuxRDMA reports whether the chunk's aux goes to this decode rank as a
// transfer (NIXL always; MORI from the last PP stage, when decode asked for
// it and the RDMA path is on).
func (w *worker) sendsAuxRDMA(in *xferInfo, p *peer) bool {
	m := w.m
	if m.cfg.Variant != VariantMORI {
		return true
	}
	return in.dstAux >= 0 && m.cfg.Parallel.PPRank == m.cfg.Parallel.PPSize-1 && !p.auxTCP
}

// post posts the chunk's transfers, as check planned them, to every real
// decode rank.
func (w *worker) post(ctx context.Context, c *chunk, infos []*xferInfo, peers []*peer) error {
	m := w.m
	statusMode := m.completion == CompletionStatus
	for i, in := range infos {
		if in.dummy {
			continue // dummy ranks (MLA) receive nothing
		}
		p := peers[i]
		if p == nil {
			return errors.New(m.peerMissing(in.peer))
		}
		j := &w.jobs[i]
		if statusMode {
			w.b.reset()
		}
		if len(c.pages) > 0 {
			if !j.kvSet {
				return fmt.Errorf("KV for %s was not planned", p.name)
			}
			if err := w.postKV(ctx, c, p, j, statusMode); err != nil {
				return err
			}
		}
		if c.last {
			if c.hasState && p.state != nil {
				if !j.stateSet {
					return fmt.Errorf("state for %s was not planned", p.name)
				}
				if err := w.postState(ctx, c, p, j, statusMode); err != nil {
					return err
				}
			}
			if err := w.postAux(ctx, c, in, p, &j.aux, statusMode); err != nil {
				return err
			}
		}
		if statusMode && !w.b.empty() {
			if err := w.postBatch(ctx, c, p, TransferKV, nil); err != nil {
				return err
			}
		}
	}
	return nil
}

// postKV posts the KV copies check planned (and validated) in j.kv, or
// the indices it planned into the peer's prepared lists.
func (w *worker) postKV(ctx context.Context, c *chunk, p *peer, j *rankJob, statusMode bool) error {
	m := w.m
	if p.prepped != nil {
		return w.postPrepped(c, p, j, statusMode)
	}
	plan := &j.kv
	parts := plan.Parts
	if len(parts) == 0 {
		parts = []planner.Part{{Start: 0, End: len(plan.Copies)}}
	}
	for i, part := range parts {
		// Each memory-kind part is its own transfer (a NIXL request holds
		// one memory kind per side). In status mode the last part stays in
		// the batch, which aux and state join.
		if !statusMode || i > 0 {
			w.b.reset()
		}
		if err := w.b.add(plan, part.Start, part.End, m.regs.kv, p.kvRemote); err != nil {
			return err
		}
		if i == 0 {
			w.b.refDesc = plan.ReferenceDescriptors
			w.b.plan += j.kvPlan
		}
		if statusMode {
			if i < len(parts)-1 {
				if err := w.postBatch(ctx, c, p, TransferKV, nil); err != nil {
					return err
				}
			}
			continue
		}
		var tag string
		if len(parts) > 1 {
			tag = sglang.KVPartNotif(c.room, c.id, c.last, m.unique, i, len(parts))
		} else {
			tag = sglang.KVNotif(c.room, c.id, c.last, m.unique)
		}
		if err := w.postBatch(ctx, c, p, TransferKV, []byte(tag)); err != nil {
			return err
		}
	}
	return nil
}

// postPrepped posts the chunk through the peer's prepared lists: one
// make_prepped_xfer per part with SGLang's disaggregation/nixl/conn.py's
// index arrays, as check
// planned them in j.idx.
func (w *worker) postPrepped(c *chunk, p *peer, j *rankJob, statusMode bool) error {
	m := w.m
	pp := p.prepped
	if len(j.idx) != len(pp.pk.Parts) {
		return fmt.Errorf("prepared indices for %s: %d parts planned, %d prepared", p.name, len(j.idx), len(pp.pk.Parts))
	}
	for i := range j.idx {
		x := &j.idx[i]
		if len(x.src) == 0 {
			continue
		}
		var notif []byte
		if !statusMode {
			tag := sglang.KVNotif(c.room, c.id, c.last, m.unique)
			if pp.notif[i] != "" {
				tag = sglang.KVPartNotif(c.room, c.id, c.last, m.unique, i, len(pp.pk.Parts))
			}
			notif = []byte(tag)
		}
		f := w.track(TransferEvent{Room: c.room, Peer: p.name, Kind: TransferKV, Chunk: c.id, ReferenceDescs: uint64(len(x.src)),
			TransferEvent: plugin.TransferEvent{Descs: uint64(len(x.src)), Plan: x.plan}})
		xf, err := m.agent.Engine().SubmitPrepped(abi.Write, pp.src[i], x.src, pp.dst[i], x.dst, notif, w.watch(f))
		if err != nil {
			w.untrack(f)
			return fmt.Errorf("submit prepped transfer to %s: %w", p.name, err)
		}
		w.submitted(f, xf)
	}
	return nil
}

// postState posts the state plans check planned (and validated) in
// j.states, one transfer per component.
func (w *worker) postState(ctx context.Context, c *chunk, p *peer, j *rankJob, statusMode bool) error {
	m := w.m
	for i := range j.states {
		sp := &j.states[i]
		comp := sp.Component
		if !statusMode {
			w.b.reset()
		}
		if err := w.b.add(&sp.Plan, 0, len(sp.Plan.Copies), m.regs.state[comp], p.stateRemote[comp]); err != nil {
			return err
		}
		if i == 0 {
			w.b.plan += j.statePln
		}
		if !statusMode {
			tag := sglang.StateNotif(c.room, m.unique, comp)
			if err := w.postBatch(ctx, c, p, TransferState, []byte(tag)); err != nil {
				return err
			}
		}
	}
	return nil
}

// postAux posts the aux copy check planned (and validated) in j.
func (w *worker) postAux(ctx context.Context, c *chunk, in *xferInfo, p *peer, j *auxJob, statusMode bool) error {
	m := w.m
	if p.aux == nil || len(m.regs.aux) == 0 {
		if m.completion == CompletionNotif {
			// Decode still needs an aux notification to finish.
			return w.notifyOnly(c, in, p)
		}
		return nil
	}
	if !w.sendsAuxRDMA(in, p) {
		// MORI: only the last PP stage sends aux, and only when decode
		// asked for it; the ZeroMQ path is sent after the transfers.
		return nil
	}
	if !j.set {
		return fmt.Errorf("aux for %s was not planned", p.name)
	}
	if !statusMode {
		w.b.reset()
	}
	if err := w.b.add(&j.plan, 0, len(j.plan.Copies), m.regs.aux, j.remote); err != nil {
		return err
	}
	w.b.plan += j.planned
	if statusMode {
		return nil
	}
	tag := sglang.AuxNotif(c.room)
	if len(c.pages) == 0 {
		tag = sglang.AuxNoKVNotif(c.room, m.unique)
	}
	if w.b.empty() {
		return w.notifyOnly(c, in, p)
	}
	return w.postBatch(ctx, c, p, TransferAux, []byte(tag))
}

// notifyOnly sends the aux tag as a bare notification (no aux bytes to
// move), so decode's completion rule can still be met.
func (w *worker) notifyOnly(c *chunk, in *xferInfo, p *peer) error {
	m := w.m
	tag := sglang.AuxNotif(c.room)
	if len(c.pages) == 0 {
		tag = sglang.AuxNoKVNotif(c.room, m.unique)
	}
	if err := m.agent.SendNotif(p.name, []byte(tag)); err != nil {
		return fmt.Errorf("notify %s: %w", p.name, err)
	}
	return nil
}

// postBatch makes and posts one batch transfer of what w.b holds.
func (w *worker) postBatch(ctx context.Context, c *chunk, p *peer, kind TransferKind, notif []byte) error {
	if w.b.empty() {
		return nil
	}
	f := w.track(TransferEvent{Room: c.room, Peer: p.name, Kind: kind, Chunk: c.id, ReferenceDescs: w.b.refDesc,
		TransferEvent: plugin.TransferEvent{Bytes: w.b.bytes, Descs: uint64(len(w.b.entries)), Plan: w.b.plan}})
	x, err := w.m.agent.Engine().SubmitBatch(abi.Write, w.b.pairs, w.b.entries, notif, w.watch(f))
	if err != nil {
		w.untrack(f)
		return fmt.Errorf("submit transfer to %s: %w", p.name, err)
	}
	w.submitted(f, x)
	return nil
}

// submitted records f's transfer, for abort, unless it is over already.
func (w *worker) submitted(f *inflight, x *plugin.Xfer) {
	w.fmu.Lock()
	if !f.done {
		f.x = x
	}
	w.fmu.Unlock()
}

// track records a transfer about to be submitted, counted as running
// until the engine reports it (TransferDone).
func (w *worker) track(ev TransferEvent) *inflight {
	f := &inflight{ev: ev}
	w.flight = append(w.flight, f)
	w.fmu.Lock()
	w.left++
	w.fmu.Unlock()
	return f
}

// untrack forgets the last tracked transfer, whose submit failed.
func (w *worker) untrack(f *inflight) {
	w.flight = w.flight[:len(w.flight)-1]
	w.fmu.Lock()
	w.left--
	w.fmu.Unlock()
}

// watch is what the completion engine is told of f.
func (w *worker) watch(f *inflight) plugin.Watch {
	// Drive: the worker waits for its chunk anyway, so it moves the bytes
	// of a plugin that copies in polls itself, as each worker did before
	// the engine (in parallel, not one engine goroutine for all).
	return plugin.Watch{Handler: w, Tag: f, Bytes: f.ev.Bytes, Descs: f.ev.Descs, Plan: f.ev.Plan, Drive: true}
}

// TransferDone is the completion engine's report of one of the chunk's
// transfers: the observer learns it (unless the chunk abandoned it after
// another failure), and wait learns the chunk's last completion or first
// failure.
func (w *worker) TransferDone(tag any, ev plugin.TransferEvent) {
	f := tag.(*inflight)
	f.ev.TransferEvent = ev
	if !errors.Is(ev.Err, errAbandoned) {
		w.m.obs.Transfer(f.ev)
	}
	w.fmu.Lock()
	f.x, f.done = nil, true // released by the engine
	w.left--
	if ev.Err != nil && w.failed == nil {
		w.failed = ev.Err
	}
	signal := w.left == 0 || ev.Err != nil
	w.fmu.Unlock()
	if signal {
		select {
		case w.settled <- struct{}{}:
		default:
		}
	}
}

// wait waits for every transfer of the chunk, or its first failure, or ctx.
func (w *worker) wait(ctx context.Context, c *chunk) error {
	for {
		w.fmu.Lock()
		left, failed := w.left, w.failed
		w.fmu.Unlock()
		switch {
		case failed != nil && ctx.Err() != nil:
			return ctx.Err()
		case failed != nil:
			return fmt.Errorf("KV transfer failed: %w", failed)
		case left == 0:
			return nil
		}
		select {
		case <-w.settled:
		case <-ctx.Done():
			// The transfers still running fail with ctx's error (and are
			// reported so); release waits for them.
			w.abort(ctx.Err())
			return ctx.Err()
		}
	}
}

// abort has the engine release (cancel) every transfer of the chunk still
// running; they end with err.
func (w *worker) abort(err error) {
	e := w.m.agent.Engine()
	for _, f := range w.flight {
		if x := w.running(f); x != nil {
			e.Abort(x, err)
		}
	}
}

// running returns f's transfer while the engine has not reported it.
func (w *worker) running(f *inflight) *plugin.Xfer {
	w.fmu.Lock()
	defer w.fmu.Unlock()
	return f.x
}

// release cancels every transfer of the chunk still running and waits
// until the engine reported them all, so no handle outlives the chunk.
func (w *worker) release() {
	w.abort(errAbandoned)
	for {
		w.fmu.Lock()
		left := w.left
		w.fmu.Unlock()
		if left == 0 {
			break
		}
		<-w.settled
	}
	w.fmu.Lock()
	w.failed = nil
	w.fmu.Unlock()
	select { // a signal of the last chunk
	case <-w.settled:
	default:
	}
	clear(w.flight)
	w.flight = w.flight[:0]
	for i, rr := range w.imported {
		if err := rr.Close(); err != nil {
			w.m.log.Debug("release aux slot region", "err", err)
		}
		w.imported[i] = nil
	}
	w.imported = w.imported[:0]
	for i := range w.jobs {
		j := &w.jobs[i]
		j.kvSet, j.stateSet = false, false
		a := &j.aux
		a.set, a.remote = false, nil
		clear(a.slots)
	}
}

// finishByStatus ends a room by status message: MORI's aux over ZeroMQ
// first (same socket, so it lands before the status), then Success to every
// real decode rank.
func (w *worker) finishByStatus(c *chunk, infos []*xferInfo, peers []*peer) error {
	m := w.m
	ctx := c.s.ctx
	lastPP := m.cfg.Parallel.PPRank == m.cfg.Parallel.PPSize-1
	for i, in := range infos {
		if in.dummy {
			continue
		}
		p := peers[i]
		if m.cfg.Variant == VariantMORI && p != nil && p.auxTCP && lastPP && in.dstAux >= 0 {
			for b, buf := range m.cfg.KV.Aux {
				off := uint64(c.auxIndex) * buf.ItemLen
				if c.auxIndex < 0 || off+buf.ItemLen > uint64(len(buf.Mem)) {
					return fmt.Errorf("aux index %d outside aux buffer %d", c.auxIndex, b)
				}
				// A copy: the frames outlive this call (the socket's writer
				// reads them), and the engine may shrink its aux memory,
				// which faults here, for this room only.
				data := make([]byte, buf.ItemLen)
				if _, err := memfault.Copy(fmt.Sprintf("aux buffer %d", b), data, buf.Mem[off:off+buf.ItemLen]); err != nil {
					return err
				}
				msg := sglang.AuxData{Room: c.room, BufferIndex: b, AuxIndex: in.dstAux, Data: data}
				frames, err := msg.Frames()
				if err == nil {
					err = m.sendFrames(ctx, in.endpoint, frames)
				}
				if err != nil {
					return fmt.Errorf("send aux to %s: %w", in.endpoint, err)
				}
			}
		}
	}
	for _, ep := range endpointsOf(infos, true) {
		if err := m.sendStatus(ctx, ep, c.room, sglang.KVPollSuccess, ""); err != nil {
			return fmt.Errorf("send status to %s: %w", ep, err)
		}
	}
	return nil
}

func (m *Prefill) sendFrames(ctx context.Context, endpoint string, frames [][]byte) error {
	ctx, cancel := m.clock.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return m.push.Send(ctx, endpoint, frames...)
}
