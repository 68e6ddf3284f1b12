package push

import (
	"context"
	"sync"

	"github.com/kvhost/kvhost/host/push/rooms"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// roomHandle is what a Sender and a Receiver share: their room in the
// rank's table (Room, Poll, Wait, Failure) and where the room's failure
// came from.
type roomHandle struct {
	room  uint64
	table *rooms.Table

	failMu    sync.Mutex
	failNoted bool // a failure was recorded through this handle
	remote    bool // the first one came from the peer
}

// Room returns the request's bootstrap room.
func (h *roomHandle) Room() uint64 { return h.room }

// Poll returns the room's status (KVPoll); Failed once the room is gone.
func (h *roomHandle) Poll() sglang.KVPoll {
	st, ok := h.table.Get(h.room)
	if !ok {
		return sglang.KVPollFailed
	}
	return st
}

// Wait blocks until the room succeeded or failed, or ctx ends.
func (h *roomHandle) Wait(ctx context.Context) (sglang.KVPoll, error) {
	st, _, err := h.table.Wait(ctx, h.room, sglang.KVPoll.Terminal)
	return st, err
}

// Failure returns the room's failure as a *TransferError (nil if it did
// not fail).
func (h *roomHandle) Failure() error {
	if h.Poll() != sglang.KVPollFailed {
		return nil
	}
	reason := h.table.Reason(h.room)
	h.failMu.Lock()
	remote := h.remote
	h.failMu.Unlock()
	if reason == "" {
		reason, remote = "KV transfer failed", true
	}
	return &TransferError{Room: h.room, Reason: reason, Remote: remote}
}

// recordFailure fails the room with reason (the first reason wins) and,
// on the first failure through h, notes whether it came from the peer, in
// the same step (under failMu, which Failure takes too), so whoever sees
// Failed sees where it came from. It returns the reason recorded, whether
// this was h's first failure, and false if the room is gone or has
// succeeded (Success is final: there is no failure to report or send).
func (h *roomHandle) recordFailure(reason string, remote bool) (recorded string, first, ok bool) {
	h.failMu.Lock()
	defer h.failMu.Unlock()
	if recorded, ok = h.table.Fail(h.room, reason); !ok {
		return "", false, false
	}
	first = !h.failNoted
	if first {
		h.failNoted, h.remote = true, remote
	}
	return recorded, first, true
}
