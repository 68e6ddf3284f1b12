package push

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// Sender is one request's transfer on a prefill rank (SGLang's KVSender).
// Its methods are safe for concurrent use, but chunks must be sent in order
// by one caller.
type Sender struct {
	roomHandle
	m *Prefill
	// ctx ends when the room fails or is closed: it cancels the room's
	// transfers in flight.
	ctx    context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	inited   bool
	numPages int
	auxIndex int64
	curr     int // pages sent so far
	chunkID  int
	sentLast bool
	closed   bool
}

// NewSender opens the room on this rank: Bootstrapping until every decode
// rank of the room sent its transfer info (then WaitingForInput).
func (m *Prefill) NewSender(room uint64) (*Sender, error) {
	if m.closed.Load() {
		return nil, ErrClosed
	}
	s := &Sender{m: m, roomHandle: roomHandle{room: room, table: m.rooms}}
	s.ctx, s.cancel = context.WithCancel(m.ctx)
	m.mu.Lock()
	if _, ok := m.senders[room]; ok {
		m.mu.Unlock()
		s.cancel()
		return nil, fmt.Errorf("%w: %d", ErrRoomExists, room)
	}
	m.senders[room] = s
	m.closedRooms.remove(room)
	ri := m.infos[room]
	ready := ri != nil && ri.complete
	aborted, overflow := "", ""
	if ri != nil {
		aborted, overflow = ri.aborted, ri.overflow
		if ready {
			m.unchargeLocked(ri) // the engine holds the room now
		}
	}
	m.rooms.Create(room, sglang.KVPollBootstrapping)
	m.mu.Unlock()
	switch {
	case aborted != "":
		s.fail(aborted, true)
	case overflow != "":
		s.fail(overflow, false)
	case ready:
		m.rooms.Update(room, sglang.KVPollWaitingForInput)
	}
	return s, nil
}

// Init sets the number of pages the request will send in total (after any
// decode prefix hit, see DecodePrefixLen) and the prefill aux slot, which
// the last chunk sends.
func (s *Sender) Init(numPages int, auxIndex int64) error {
	if numPages < 0 {
		return fmt.Errorf("%w: %d pages", ErrState, numPages)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inited {
		return fmt.Errorf("%w: Init called twice", ErrState)
	}
	s.inited, s.numPages, s.auxIndex = true, numPages, auxIndex
	return nil
}

// DecodePrefixLen returns how many tokens the decode side already holds
// (decode_prefix_len), known once the room is WaitingForInput; the engine
// sends only the pages after them. 0 means no prefix hit.
func (s *Sender) DecodePrefixLen() int64 {
	s.m.mu.Lock()
	defer s.m.mu.Unlock()
	if ri := s.m.infos[s.room]; ri != nil && ri.complete {
		return ri.prefixLen
	}
	return 0
}

// Send queues the next chunk: pages are this rank's KV page indices of the
// chunk, in request order. The chunk that completes Init's page count is the
// last; it also sends aux and, when stateIndices is not nil, the hybrid
// state (per component, prefill side indices). Send copies its arguments
// and returns at once; transfers run on the room's worker shard. A Send on
// a failed room does nothing (Poll reports Failed).
func (s *Sender) Send(pages []int32, stateIndices [][]int32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return fmt.Errorf("%w: sender closed", ErrState)
	case !s.inited:
		return fmt.Errorf("%w: Send before Init", ErrState)
	case s.sentLast:
		return fmt.Errorf("%w: Send after the last chunk", ErrState)
	case s.curr+len(pages) > s.numPages:
		return fmt.Errorf("%w: %d pages sent after %d exceed the %d of Init", ErrState, len(pages), s.curr, s.numPages)
	}
	if st, _ := s.m.rooms.Get(s.room); st == sglang.KVPollFailed {
		return nil
	}
	start := s.curr
	s.curr += len(pages)
	last := s.curr == s.numPages
	if len(pages) == 0 && !last {
		return nil // should_send_kv_chunk: nothing to send, no chunk id used
	}
	c := &chunk{
		s: s, room: s.room, id: s.chunkID, last: last,
		pages: slices.Clone(pages), slice: planner.IndexSlice{Start: start, Stop: s.curr},
		auxIndex: s.auxIndex,
	}
	if last && stateIndices != nil {
		c.state = make([][]int32, len(stateIndices))
		for i, x := range stateIndices {
			if x != nil {
				c.state[i] = slices.Clone(x)
			}
		}
		c.hasState = len(stateIndices) > 0
	}
	s.chunkID++
	s.sentLast = last
	s.m.enqueue(c)
	return nil
}

// WaitReady blocks until decode's transfer info arrived (WaitingForInput or
// later) or the room failed, or ctx ends.
func (s *Sender) WaitReady(ctx context.Context) (sglang.KVPoll, error) {
	st, _, err := s.m.rooms.Wait(ctx, s.room, func(st sglang.KVPoll) bool { return st != sglang.KVPollBootstrapping })
	return st, err
}

// Abort fails the room ("Aborted by AbortReq."), cancels its transfers and
// tells decode.
func (s *Sender) Abort() { s.fail("Aborted by AbortReq.", false) }

// Close forgets the room on this rank (SGLang's clear): its status, its
// transfer info and anything still queued. Transfers in flight are
// cancelled. Close the sender once the room succeeded or failed.
func (s *Sender) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	m := s.m
	m.mu.Lock()
	if m.senders[s.room] == s {
		delete(m.senders, s.room)
		if ri := m.infos[s.room]; ri != nil {
			m.unchargeLocked(ri)
			delete(m.infos, s.room)
		}
		m.closedRooms.add(s.room, m.clock.Now())
	}
	m.mu.Unlock()
	m.rooms.Remove(s.room)
}

// fail marks the room Failed with reason (the first reason wins), cancels
// its transfers and tells decode. remote: the reason came from decode.
func (s *Sender) fail(reason string, remote bool) {
	m := s.m
	// Take the decode endpoints before the room is marked failed: from then
	// on the engine may Close the sender, which drops the room's infos.
	eps := m.failureTargets(s.room)
	recorded, first, ok := s.recordFailure(reason, remote)
	if !ok {
		return
	}
	s.cancel()
	if !first {
		return
	}
	m.obs.Failure(FailureEvent{Role: RolePrefill, Room: s.room, Reason: recorded, Remote: remote})
	m.log.Debug("room failed", "room", s.room, "reason", recorded)
	m.sendFailure(s.room, recorded, eps)
}
