// Package rooms keeps the transfer state of every request ("room") of one
// kvhost worker: its sglang.KVPoll status. A room's status only moves up
// (the maximum of the old and the new status), except Failed, which wins
// over every unfinished status; Success and Failed are final. A failure
// carries a reason, kept with the room until the room is removed.
//
// SGLang's update_status (disaggregation/common/conn.py) lets Failed
// replace Success too; kvhost does not: a room whose KV arrived whole has
// succeeded, and what happens to its rank afterwards (closing it, its
// engine leaving) must not turn that into a failure the engine or its
// peer acts on (docs/engine-api.md: "Failed and Success final").
//
// A Table is safe for concurrent use. Waiting for a status change blocks on
// a channel (never a busy loop) and honours a context.
package rooms

import (
	"context"
	"github.com/kvhost/kvhost/host/internal/clock"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// Merge is the update rule: Success and Failed are final, Failed wins
// over every unfinished status, otherwise the status never moves down.
func Merge(old, next sglang.KVPoll) sglang.KVPoll {
	switch {
	case old.Terminal():
		return old
	case next == sglang.KVPollFailed:
		return sglang.KVPollFailed
	}
	return max(old, next)
}

// Change is one status transition of a room, reported to the table's
// observer. Reason is set when To is Failed.
type Change struct {
	Room     uint64
	From, To sglang.KVPoll
	Reason   string
	// New is set when the room was just created (From == To then).
	New bool
	// Age is the time since the room was created.
	Age time.Duration
}

// Table holds the rooms of one worker.
type Table struct {
	mu       sync.Mutex
	rooms    map[uint64]*entry
	onChange func(Change) // called with mu held (see NewTable); may be nil
	clock    clock.Clock
}

type entry struct {
	status  sglang.KVPoll
	reason  string
	created time.Time
	// changed is closed (and replaced) on every status change; nil until
	// someone waits, so rooms nobody waits on allocate no channel.
	changed chan struct{}
}

// NewTable returns an empty table. onChange, if not nil, is called for
// every status change, under the table's lock: changes are reported in the
// order they happen and before anyone can observe the new status, but
// onChange must be quick and must not call back into the table.
func NewTable(onChange func(Change)) *Table { return NewTableOn(clock.Real{}, onChange) }

// NewTableOn is NewTable with room ages (Change.Age) timed on c.
func NewTableOn(c clock.Clock, onChange func(Change)) *Table {
	return &Table{rooms: make(map[uint64]*entry), onChange: onChange, clock: clock.Or(c)}
}

// Create adds a room with status s, or, if the room exists, merges s into
// it (SGLang's disaggregation/{nixl,mori}/conn.py's update_status on a room that exists). It reports
// whether the room was created.
func (t *Table) Create(room uint64, s sglang.KVPoll) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.rooms[room]
	if ok {
		t.setLocked(room, e, s, "")
		return false
	}
	e = &entry{status: s, created: t.clock.Now()}
	t.rooms[room] = e
	t.report(Change{Room: room, From: s, To: s, New: true})
	return true
}

// Update merges s into the room's status. A room that does not exist is not
// created: once a room is removed, late updates (a transfer finishing, an
// abort) must not resurrect it for a future request reusing its id. It
// returns the room's status after the update and false if the room does not
// exist.
func (t *Table) Update(room uint64, s sglang.KVPoll) (sglang.KVPoll, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.rooms[room]
	if !ok {
		return sglang.KVPollFailed, false
	}
	t.setLocked(room, e, s, "")
	return e.status, true
}

// Fail marks the room Failed with reason. The first reason recorded is kept:
// it is the root cause, later ones are consequences. It returns the reason
// recorded (read in the same step: once the room is Failed, whoever owns it
// may remove it at any moment, and a later Reason would find nothing), and
// false if the room does not exist or has succeeded (Success is final:
// nothing failed, so nobody should be told of a failure).
func (t *Table) Fail(room uint64, reason string) (recorded string, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.rooms[room]
	if !ok || e.status == sglang.KVPollSuccess {
		return "", false
	}
	t.setLocked(room, e, sglang.KVPollFailed, reason)
	return e.reason, true
}

// setLocked merges s (and, for Failed, reason) into e and reports the
// change, if any.
func (t *Table) setLocked(room uint64, e *entry, s sglang.KVPoll, reason string) {
	next := Merge(e.status, s)
	if next == sglang.KVPollFailed && e.reason == "" {
		e.reason = reason
	}
	if next == e.status {
		return
	}
	c := Change{Room: room, From: e.status, To: next, Age: t.clock.Since(e.created)}
	if next == sglang.KVPollFailed {
		c.Reason = e.reason
	}
	e.status = next
	if e.changed != nil {
		close(e.changed)
		e.changed = nil
	}
	t.report(c)
}

// report passes c to onChange; the caller holds t.mu.
func (t *Table) report(c Change) {
	if t.onChange != nil {
		t.onChange(c)
	}
}

// Get returns the room's status and whether it exists.
func (t *Table) Get(room uint64) (sglang.KVPoll, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.rooms[room]; ok {
		return e.status, true
	}
	return sglang.KVPollFailed, false
}

// Reason returns the failure reason recorded for the room ("" if none).
func (t *Table) Reason(room uint64) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.rooms[room]; ok {
		return e.reason
	}
	return ""
}

// Created returns when the room was created.
func (t *Table) Created(room uint64) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.rooms[room]; ok {
		return e.created, true
	}
	return time.Time{}, false
}

// Remove forgets the room. Waiters are woken and see it gone.
func (t *Table) Remove(room uint64) {
	t.mu.Lock()
	if e, ok := t.rooms[room]; ok {
		if e.changed != nil {
			close(e.changed)
		}
		delete(t.rooms, room)
	}
	t.mu.Unlock()
}

// Len returns the number of rooms.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.rooms)
}

// Each calls fn for every room with its status and creation time, under
// the table's lock: fn must be quick and must not call the table.
func (t *Table) Each(fn func(room uint64, s sglang.KVPoll, created time.Time)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for r, e := range t.rooms {
		fn(r, e.status, e.created)
	}
}

// Wait blocks until done(status) is true for the room, the room is
// removed (then it returns Failed, false), or ctx ends (ctx.Err()).
func (t *Table) Wait(ctx context.Context, room uint64, done func(sglang.KVPoll) bool) (sglang.KVPoll, bool, error) {
	for {
		t.mu.Lock()
		e, ok := t.rooms[room]
		if !ok {
			t.mu.Unlock()
			return sglang.KVPollFailed, false, nil
		}
		if done(e.status) {
			s := e.status
			t.mu.Unlock()
			return s, true, nil
		}
		if e.changed == nil {
			e.changed = make(chan struct{})
		}
		ch := e.changed
		t.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			s, ok := t.Get(room)
			return s, ok, ctx.Err()
		}
	}
}
