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
// time may go past the limit to finish the message it has started.
//
// One peer's unfinished messages must not hold up the others' (peers
// that start large messages and stop, holding the budget until the
// message timeout, stalled everyone's control messages for 30 s). Two
// rules see to it:
//   - a message of at most smallMessage bytes (with frame overheads)
//     never waits: every connection may hold one such message past the
//     limit, so small control messages pass whatever others hold;
//   - when a reader has to wait, every other connection holding part of a
//     message (and not waiting itself) must finish it within
//     contendedTimeout or is dropped, giving back what it holds. Time a
//     connection spends waiting for the budget is never held against it.
//
// Every other reservation leaves at most limit bytes reserved, so the
// socket holds at most limit + one message (MaxMessageSize plus frame
// overheads) + smallMessage per connection and per message queued for
// Recv of received data.
//
// Safe for concurrent use.
type recvBudget struct {
	limit     int64         // bytes
	contended time.Duration // see contendedTimeout

	mu         sync.Mutex
	used       int64         // bytes reserved: queued messages plus partial ones
	queued     int64         // the part of used held by complete messages awaiting Recv
	overdraft  *conn         // the reader allowed past limit, nil when none
	freed      chan struct{} // closed (and replaced) when memory is given back
	peak       int64         // largest used seen (tests)
	overdrafts int           // times a reader was let past the limit (tests)
	// holders are the connections whose current message holds part of
	// the budget; with each conn's waiting and contendBy, guarded by mu.
	holders     map[*conn]struct{}
	contentions int // times a holder was given contendedTimeout (tests)
}

// smallMessage is what a message may hold without waiting for the budget:
// the size of a connection's read buffer, more than the control messages
// of a request need (an SGLang transfer info of 16k pages).
const smallMessage = 64 << 10

func newRecvBudget(limit int64, contended time.Duration) *recvBudget {
	return &recvBudget{limit: limit, contended: contended, freed: make(chan struct{}), holders: make(map[*conn]struct{})}
}

// reserve takes n bytes for c's current message, of which c already holds
// held. It waits while the socket is over budget, until done is closed
// (then it returns ErrClosed). After a wait it gives c's message a new
// deadline (c.msgTimeout from now, or the contendedTimeout it was given
// if that comes first), so that the peer is not blamed for the socket's
// time.
func (b *recvBudget) reserve(c *conn, held, n int64, done <-chan struct{}) error {
	waited := false
	for {
		b.mu.Lock()
		ok := held+n <= smallMessage || b.used+n <= b.limit || b.overdraft == c
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
			b.holders[c] = struct{}{}
			c.waiting = false
			var err error
			if waited && c.msgTimeout > 0 {
				deadline := time.Now().Add(c.msgTimeout)
				if !c.contendBy.IsZero() && c.contendBy.Before(deadline) {
					deadline = c.contendBy
				}
				err = c.nc.SetReadDeadline(deadline)
			}
			b.mu.Unlock()
			return err
		}
		if !waited {
			// c's own wait is the socket's doing, not its peer's: what it
			// was given before no longer applies (a later waiter gives it
			// a new one once it reads again).
			waited = true
			c.contendBy = time.Time{}
		}
		c.waiting = true
		b.contendLocked(c)
		freed := b.freed
		b.mu.Unlock()
		select {
		case <-freed:
		case <-done:
			b.mu.Lock()
			c.waiting = false
			b.mu.Unlock()
			return ErrClosed
		}
	}
}

// contendLocked gives every connection that holds part of a message and
// is reading it (not waiting for the budget itself) contendedTimeout to
// finish it, as waiter has to wait. One already given a time keeps it.
func (b *recvBudget) contendLocked(waiter *conn) {
	if b.contended <= 0 {
		return
	}
	var until time.Time
	for h := range b.holders {
		if h == waiter || h.waiting || !h.contendBy.IsZero() {
			continue
		}
		if until.IsZero() {
			until = time.Now().Add(b.contended)
		}
		h.contendBy = until
		h.contended.Store(true)
		h.nc.SetReadDeadline(until) // an error means h is closed anyway
		b.contentions++
	}
}

// endMessage is called when c's current message is complete or abandoned:
// c gives up the right to go past the limit. held bytes are released when
// the message was abandoned (keep == false); a complete message keeps them
// until release.
func (b *recvBudget) endMessage(c *conn, held int64, keep bool) {
	b.mu.Lock()
	delete(b.holders, c)
	c.contendBy = time.Time{}
	c.contended.Store(false)
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
