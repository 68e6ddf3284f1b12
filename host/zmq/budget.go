package zmq

import (
	"sync"
	"time"
)

// frameOverhead is what one received frame costs beyond its bytes (its
// slice header in the message), charged to the receive budget so that a
// message of thousands of empty frames is not free.
const frameOverhead = 24

// recvBudget bounds the memory a bound socket (PULL, ROUTER) holds for
// received messages: those queued for Recv and those still being read.
// A connection reserves memory before it allocates it; while the socket
// is over budget, its readers stop reading (so TCP flow control pushes
// back on the senders, like libzmq's high-water mark) instead of dropping
// anything. Recv gives a message's memory back.
//
// Readers each holding part of a message could fill the budget between
// them and wait for each other forever, since nothing queued would be
// there for Recv to give back. So when nothing is queued, one reader at a
// time may go past the limit to finish the message it has started. Every
// other reservation leaves at most limit bytes reserved, so the socket
// holds at most limit + one message (MaxMessageSize plus frame overheads)
// of received data.
//
// Safe for concurrent use.
type recvBudget struct {
	limit int64 // bytes

	mu         sync.Mutex
	used       int64         // bytes reserved: queued messages plus partial ones
	queued     int64         // the part of used held by complete messages awaiting Recv
	overdraft  *conn         // the reader allowed past limit, nil when none
	freed      chan struct{} // closed (and replaced) when memory is given back
	peak       int64         // largest used seen (tests)
	overdrafts int           // times a reader was let past the limit (tests)
}

func newRecvBudget(limit int64) *recvBudget {
	return &recvBudget{limit: limit, freed: make(chan struct{})}
}

// reserve takes n bytes for c's current message, of which c already holds
// held. It waits while the socket is over budget, until done is closed
// (then it returns ErrClosed). It reports how long it waited, so that the
// caller does not blame its peer for that time.
func (b *recvBudget) reserve(c *conn, held, n int64, done <-chan struct{}) (time.Duration, error) {
	var start time.Time
	for {
		b.mu.Lock()
		ok := b.used+n <= b.limit || b.overdraft == c
		if !ok && b.overdraft == nil && b.queued == 0 && (held > 0 || b.used == 0) {
			// Only partial messages hold the budget, so no Recv can free
			// any of it, and c is inside a message (or its first frame
			// alone exceeds the budget): let c finish past the limit.
			b.overdraft = c
			b.overdrafts++
			ok = true
		}
		if ok {
			b.used += n
			b.peak = max(b.peak, b.used)
			b.mu.Unlock()
			if start.IsZero() {
				return 0, nil
			}
			return time.Since(start), nil
		}
		freed := b.freed
		b.mu.Unlock()
		if start.IsZero() {
			start = time.Now()
		}
		select {
		case <-freed:
		case <-done:
			return 0, ErrClosed
		}
	}
}

// endMessage is called when c's current message is complete or abandoned:
// c gives up the right to go past the limit. held bytes are released when
// the message was abandoned (keep == false); a complete message keeps them
// until release.
func (b *recvBudget) endMessage(c *conn, held int64, keep bool) {
	b.mu.Lock()
	wake := false
	if b.overdraft == c {
		b.overdraft = nil
		wake = true
	}
	if keep {
		b.queued += held
	} else if held > 0 {
		b.used -= held
		wake = true
	}
	if wake {
		b.wakeLocked()
	}
	b.mu.Unlock()
}

// release gives back the n bytes of a message taken from the queue.
func (b *recvBudget) release(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	b.queued -= n
	b.wakeLocked()
	b.mu.Unlock()
}

func (b *recvBudget) wakeLocked() {
	close(b.freed)
	b.freed = make(chan struct{})
}

// usage returns the bytes reserved now and the most ever reserved.
func (b *recvBudget) usage() (used, peak int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used, b.peak
}
