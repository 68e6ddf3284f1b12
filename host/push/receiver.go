package push

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// Receiver is one request's transfer on a decode rank (SGLang's
// KVReceiver). Safe for concurrent use.
type Receiver struct {
	roomHandle
	d    *Decode
	addr string // the prefill's bootstrap address

	mu       sync.Mutex
	targets  []target
	dstInfos int // required_dst_info_num
	expected map[int]bool
	got      map[int]bool
	arr      arrivals
	sent     time.Time // when the metadata went out (zero: not yet)
	auxIndex int64
	counted  bool // counted in d.waiting
	done     bool // Success or Failed reached
	aborted  bool // ABORT sent
	closed   bool
	initDone bool
}

// NewReceiver opens the room on this rank (Bootstrapping). bootstrapAddr is
// the prefill deployment's bootstrap server ("host:port").
func (d *Decode) NewReceiver(bootstrapAddr string, room uint64) (*Receiver, error) {
	if d.closed.Load() {
		return nil, ErrClosed
	}
	r := &Receiver{d: d, roomHandle: roomHandle{room: room, table: d.rooms}, addr: bootstrapAddr}
	d.mu.Lock()
	if _, ok := d.recvs[room]; ok {
		d.mu.Unlock()
		return nil, fmt.Errorf("%w: %d", ErrRoomExists, room)
	}
	d.recvs[room] = r
	rs := d.addrRooms[bootstrapAddr]
	if rs == nil {
		rs = make(map[uint64]struct{})
		d.addrRooms[bootstrapAddr] = rs
	}
	rs[room] = struct{}{}
	d.rooms.Create(room, sglang.KVPollBootstrapping)
	d.mu.Unlock()
	return r, nil
}

// Init learns the prefill deployment's layout (once per bootstrap address,
// retrying while the server is down or not ready, until ctx ends: give ctx
// a deadline), maps this rank onto the
// prefill ranks, registers this rank's buffers with each of them (once),
// and moves the room to WaitingForInput. A failure fails the room.
func (r *Receiver) Init(ctx context.Context) error {
	d := r.d
	r.mu.Lock()
	if r.initDone || r.closed {
		r.mu.Unlock()
		return fmt.Errorf("%w: Init called twice or after Close", ErrState)
	}
	r.initDone = true
	r.mu.Unlock()
	pi, err := d.parallelInfo(ctx, r.addr)
	if err != nil {
		r.fail(err.Error(), false)
		return err
	}
	dp := 0
	if pi.info.DPSize > 1 {
		dp = int(r.room % uint64(pi.info.DPSize)) // follow_bootstrap_room
	}
	ts, err := d.targets(ctx, r.addr, pi, dp)
	if err != nil {
		r.fail(err.Error(), false)
		return err
	}
	r.mu.Lock()
	r.targets = ts
	r.dstInfos = pi.mapping.RequiredDstInfoNum
	r.expected = make(map[int]bool, len(ts))
	for _, t := range ts {
		if !t.Dummy {
			r.expected[t.unique] = true
		}
	}
	r.mu.Unlock()
	d.rooms.Update(r.room, sglang.KVPollWaitingForInput)
	return nil
}

// Targets returns how many prefill ranks the room talks to and how many of
// them send data.
func (r *Receiver) Targets() (all, real int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range r.targets {
		if !t.Dummy {
			real++
		}
	}
	return len(r.targets), real
}

// SendMetadata tells every target prefill rank where this rank wants the
// request's pages (its own page indices, for the tokens after prefixLen),
// the aux slot, and the state slots per component (nil: none). prefixLen
// is decode_prefix_len: tokens this rank already holds (0: none). The
// waiting timeout starts now.
func (r *Receiver) SendMetadata(ctx context.Context, pages []int32, auxIndex int64, stateIndices [][]int32, prefixLen int64) error {
	d := r.d
	if st, _ := d.rooms.Get(r.room); st != sglang.KVPollWaitingForInput {
		return fmt.Errorf("%w: SendMetadata in state %v (call Init first)", ErrState, st)
	}
	r.mu.Lock()
	if !r.sent.IsZero() || r.closed {
		r.mu.Unlock()
		return fmt.Errorf("%w: metadata already sent", ErrState)
	}
	r.sent = d.clock.Now()
	r.auxIndex = auxIndex
	r.arr.expectsState = len(stateIndices) > 0
	r.arr.senders = len(r.expected)
	if d.useNote {
		r.counted = true
	}
	ts := r.targets
	required := r.dstInfos
	r.mu.Unlock()
	if d.useNote {
		d.mu.Lock()
		d.waiting++
		d.mu.Unlock()
		d.expectNotifs(1)
	}
	name := d.agent.Name()
	for _, t := range ts {
		var msg sglang.Message
		if d.cfg.Variant == VariantMORI {
			m := &sglang.MORITransferInfo{Room: r.room, Endpoint: d.cfg.Host, Port: d.pull.Port(), EngineKey: name,
				DstAuxIndex: auxIndex, RequiredDstInfoNum: required, DecodePrefixLen: prefixLen}
			if !t.Dummy {
				m.DstKVIndices, m.DstStateIndices = pages, stateIndices
			} else {
				m.DstAuxIndex = -1
			}
			msg = m
		} else {
			m := &sglang.NIXLTransferInfo{Room: r.room, Endpoint: d.cfg.Host, Port: d.pull.Port(), AgentName: name,
				DstAuxIndex: auxIndex, RequiredDstInfoNum: required, DecodePrefixLen: prefixLen}
			if !t.Dummy {
				m.DstKVIndices, m.DstStateIndices = pages, stateIndices
			}
			msg = m
		}
		frames, err := msg.Frames()
		if err == nil {
			err = d.push.Send(ctx, t.endpoint, frames...)
		}
		if err != nil {
			err = fmt.Errorf("send transfer info to prefill rank %s: %w", t.endpoint, err)
			r.fail(err.Error(), false)
			return err
		}
	}
	return nil
}

// Abort fails the room ("Aborted by AbortReq.") and tells every target
// prefill rank with ABORT, so it stops and releases the room.
func (r *Receiver) Abort() { r.failAbort("Aborted by AbortReq.") }

// Close forgets the room on this rank.
func (r *Receiver) Close() {
	d := r.d
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	counted := r.counted
	r.counted = false
	r.arr = arrivals{}
	r.mu.Unlock()
	d.mu.Lock()
	if d.recvs[r.room] == r {
		delete(d.recvs, r.room)
		if rs := d.addrRooms[r.addr]; rs != nil {
			delete(rs, r.room)
			if len(rs) == 0 {
				delete(d.addrRooms, r.addr)
			}
		}
	}
	if counted {
		d.waiting--
	}
	d.mu.Unlock()
	if counted {
		d.expectNotifs(-1)
	}
	d.rooms.Remove(r.room)
}

// finish marks the room done (no more notifications expected).
func (r *Receiver) finishLocked() (uncount bool) {
	r.done = true
	uncount, r.counted = r.counted, false
	r.arr = arrivals{}
	return uncount
}

func (r *Receiver) uncount(u bool) {
	if u {
		r.d.mu.Lock()
		r.d.waiting--
		r.d.mu.Unlock()
		r.d.expectNotifs(-1)
	}
}

func (r *Receiver) succeed() {
	r.mu.Lock()
	if r.done {
		r.mu.Unlock()
		return
	}
	u := r.finishLocked()
	r.mu.Unlock()
	r.uncount(u)
	r.d.rooms.Update(r.room, sglang.KVPollSuccess)
}

func (r *Receiver) fail(reason string, remote bool) { r.failWith(reason, remote, false) }

// failAbort fails the room locally and sends ABORT to the prefill ranks.
func (r *Receiver) failAbort(reason string) { r.failWith(reason, false, true) }

func (r *Receiver) failWith(reason string, remote, abort bool) {
	d := r.d
	r.mu.Lock()
	recorded, first, ok := r.recordFailure(reason, remote)
	if !ok {
		r.mu.Unlock()
		return
	}
	u := r.finishLocked()
	var ts []target
	if abort && !r.aborted && len(r.targets) > 0 {
		r.aborted = true
		ts = r.targets
	}
	r.mu.Unlock()
	r.uncount(u)
	if first {
		d.obs.Failure(FailureEvent{Role: RoleDecode, Room: r.room, Reason: recorded, Remote: remote})
		d.log.Debug("room failed", "room", r.room, "reason", recorded)
	}
	if len(ts) > 0 {
		frames, _ := (&sglang.Abort{Room: r.room, Endpoint: d.cfg.Host, Port: d.pull.Port()}).Frames()
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			for _, t := range ts {
				// Not d.ctx: a room failed because its rank is closing
				// still tells its prefill ranks before the sockets close.
				ctx, cancel := d.clock.WithTimeout(d.farewell, 5*time.Second)
				if err := d.push.Send(ctx, t.endpoint, slices.Clone(frames)...); err != nil {
					d.log.Debug("could not send ABORT", "room", r.room, "prefill", t.endpoint, "err", err)
				}
				cancel()
			}
		}()
	}
}

// source returns the room's prefill rank whose unique rank is rank, if a
// message from addr may speak for it: the room's metadata went to that
// rank, and the message came from that rank's host.
func (r *Receiver) source(rank int, addr net.Addr) (*target, error) {
	r.mu.Lock()
	ts := r.targets
	r.mu.Unlock()
	for i := range ts {
		if ts[i].unique != rank {
			continue
		}
		if !ts[i].sentFrom(addr) {
			return nil, fmt.Errorf("names prefill rank %d (%s) but came from %v", rank, ts[i].endpoint, addr)
		}
		return &ts[i], nil
	}
	if len(ts) == 0 {
		return nil, errors.New("the room's prefill ranks are not known yet")
	}
	return nil, fmt.Errorf("names prefill rank %d, which this room was not sent to (from %v)", rank, addr)
}

// statusSuccess counts a Success status from a prefill rank that sends the
// room data; the room succeeds once each of them reported (duplicates count
// once).
func (r *Receiver) statusSuccess(unique int) {
	r.mu.Lock()
	if r.done || r.sent.IsZero() || !r.expected[unique] {
		r.mu.Unlock()
		return
	}
	if r.got == nil {
		r.got = make(map[int]bool, len(r.expected))
	}
	r.got[unique] = true
	complete := len(r.got) == len(r.expected)
	r.mu.Unlock()
	if complete {
		r.succeed()
	}
}

// notif applies one notification from agent from (TransferStatus
// tracking, counted per prefill rank: see Decode.senderSlot). A
// notification that no prefill rank of the room may have sent is returned
// as an error and changes nothing.
func (r *Receiver) notif(n sglang.Notif, from string) error {
	r.mu.Lock()
	if r.done || r.closed || r.sent.IsZero() {
		r.mu.Unlock()
		return nil
	}
	ts := r.targets
	r.mu.Unlock()
	slot, err := r.d.senderSlot(ts, from, n)
	if err != nil {
		return err
	}
	r.mu.Lock()
	if r.done || r.closed {
		r.mu.Unlock()
		return nil
	}
	err = r.arr.apply(n, slot, len(ts))
	complete := err == nil && r.arr.done()
	r.mu.Unlock()
	switch {
	case err != nil:
		r.fail(fmt.Sprintf("bad notification %s from prefill rank %s (agent %q): %v", n.Kind, ts[slot].endpoint, from, err), true)
	case complete:
		r.succeed()
	}
	return nil
}

// RankMapping is exposed for diagnostics: the mapping this rank uses onto a
// prefill deployment, once known.
func (d *Decode) RankMapping(bootstrapAddr string) (planner.RankMapping, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if pi := d.prefills[bootstrapAddr]; pi != nil {
		return pi.mapping, true
	}
	return planner.RankMapping{}, false
}
