package push

import (
	"errors"
	"fmt"
)

// TransferError is a room's failure, as SGLang's KVTransferError: the room
// and the reason, which may come from the peer.
type TransferError struct {
	Room   uint64
	Reason string
	// Remote is true when the reason came from the peer (status message,
	// ABORT) or no reason was recorded on this side
	// (is_from_another_rank).
	Remote bool
}

func (e *TransferError) Error() string {
	return fmt.Sprintf("KVTransferError(bootstrap_room=%d): %s", e.Room, e.Reason)
}

// Errors of the API.
var (
	// ErrClosed: the manager was closed.
	ErrClosed = errors.New("push: manager closed")
	// ErrRoomExists: a sender or receiver for the room is already open.
	ErrRoomExists = errors.New("push: room already open")
	// ErrState: the call does not fit the room's state (e.g. Send after the
	// last chunk).
	ErrState = errors.New("push: call out of order")
)
