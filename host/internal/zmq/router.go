package zmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"
)

// ErrUnknownPeer is returned by Router.Send for a peer id that is not (or
// no longer) connected. libzmq drops such messages silently; we say so.
var ErrUnknownPeer = errors.New("zmq: unknown or disconnected peer")

// ErrPeerBusy is returned by Router.Enqueue when the peer's send queue is
// full: it is not reading what it was sent. libzmq's ROUTER drops a
// message to a peer at its high-water mark silently; we say so.
var ErrPeerBusy = errors.New("zmq: peer's send queue is full")

// RouterMsg is a message received by a Router: the id of the connection it
// came from and its frames. From a REQ peer the frames are the empty
// delimiter followed by the request body, exactly as libzmq's ROUTER
// returns them after the identity frame.
//
// Cred is the sending process's credentials for a peer connected over
// ipc (see PeerCred), nil over TCP; it is the same for every message of
// a connection and must not be modified.
type RouterMsg struct {
	Peer   []byte
	Frames [][]byte
	Cred   *PeerCred
}

// Router is a bound ROUTER socket: any number of REQ/DEALER peers, each
// addressed by the id the router gave its connection (5 bytes, 0x00 and a
// counter, like libzmq's generated ids; ids are never reused). Safe for
// concurrent use.
//
// A slow or stuck peer only delays messages to itself: Send blocks only
// its caller, and Enqueue never blocks (it writes what the peer's socket
// takes at once and queues the rest), so one loop can receive requests
// and answer them without a peer that stopped reading holding up the
// others.
type Router struct {
	srv    *server
	msgs   chan routerItem
	budget *recvBudget

	mu      sync.RWMutex
	peers   map[string]*routerPeer
	nextID  uint32
	closing bool           // set by Close before it waits for writers
	writers sync.WaitGroup // goroutines draining send queues
	// unreported holds the ids of connections whose end has not been
	// passed to o.onDisconnect yet (only when it is set); whoever
	// deletes an id from it calls the handler (report).
	unreported map[string]struct{}
}

// routerPeer is one connection of a Router and its send queue (Enqueue).
type routerPeer struct {
	c *conn

	mu    sync.Mutex
	queue [][][]byte // messages waiting to be written, oldest first
	bytes int64      // the frames' bytes in queue, and restBytes
	// rest is what Enqueue's inline write left of a message (see
	// writeInline): while it is set, c.wmu is held for it, and the drain
	// goroutine writes it before anything else. It counts as one
	// message of restBytes bytes (headers included) of the queue.
	rest      net.Buffers
	restBytes int64
	writing   bool // a goroutine is draining rest and queue
	// last is when Enqueue last took a message for p; burst counts the
	// messages before this one that came each within burstGap of the
	// one before (see burstInline).
	last  time.Time
	burst int
}

// waiting is the number of messages p holds (queue and rest).
func (p *routerPeer) waiting() int {
	if p.rest != nil {
		return len(p.queue) + 1
	}
	return len(p.queue)
}

// ListenRouter binds a ROUTER socket to endpoint.
func ListenRouter(endpoint string, opts ...Option) (*Router, error) {
	o := buildOptions(opts)
	r := &Router{msgs: make(chan routerItem, o.recvQueue), budget: newRecvBudget(o.recvBudget, o.contendedTimeout),
		peers: make(map[string]*routerPeer), unreported: make(map[string]struct{})}
	srv, err := listen(endpoint, typeRouter, o, r.serve)
	if err != nil {
		return nil, err
	}
	r.srv = srv
	srv.start()
	return r, nil
}

// routerItem is a message waiting for Recv and the bytes of the receive
// budget it holds, or (gone) the end of msg.Peer's connection, after its
// last message.
type routerItem struct {
	msg  RouterMsg
	size int64
	gone bool
}

func (r *Router) serve(c *conn) {
	c.useBudget(r.budget, r.srv.done)
	id := r.register(c)
	for {
		frames, size, err := c.recv()
		if err != nil {
			r.srv.readError(c, err)
			r.unregister(id)
			if r.srv.o.onDisconnect != nil {
				select {
				case r.msgs <- routerItem{msg: RouterMsg{Peer: []byte(id)}, gone: true}:
				case <-r.srv.done: // Close reports it
				}
			}
			return
		}
		select {
		case r.msgs <- routerItem{msg: RouterMsg{Peer: []byte(id), Frames: frames, Cred: c.cred}, size: size}:
		case <-r.srv.done:
			r.unregister(id)
			return
		}
	}
}

func (r *Router) register(c *conn) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.nextID++
	var id [5]byte
	binary.BigEndian.PutUint32(id[1:], r.nextID)
	r.peers[string(id[:])] = &routerPeer{c: c}
	if r.srv.o.onDisconnect != nil {
		r.unreported[string(id[:])] = struct{}{}
	}
	return string(id[:])
}

// report passes the end of peer's connection to the disconnect handler,
// unless that was done already.
func (r *Router) report(peer string) {
	r.mu.Lock()
	_, ok := r.unreported[peer]
	delete(r.unreported, peer)
	r.mu.Unlock()
	if ok {
		r.srv.o.onDisconnect([]byte(peer))
	}
}

func (r *Router) unregister(id string) {
	r.mu.Lock()
	delete(r.peers, id)
	r.mu.Unlock()
}

// Recv returns the next message from any peer. It blocks until one
// arrives, ctx ends or the socket is closed (ErrClosed). With
// WithDisconnectHandler, Recv also calls the handler for each peer whose
// connection ended, after returning that peer's last message.
func (r *Router) Recv(ctx context.Context) (RouterMsg, error) {
	for {
		m, err := r.next(ctx)
		if err != nil {
			return RouterMsg{}, err
		}
		if m.gone {
			r.report(string(m.msg.Peer))
			continue
		}
		r.budget.release(m.size)
		return m.msg, nil
	}
}

func (r *Router) next(ctx context.Context) (routerItem, error) {
	select {
	case <-r.srv.done:
		return routerItem{}, ErrClosed
	default:
	}
	select {
	case m := <-r.msgs: // a waiting message wins over an expired ctx
		return m, nil
	default:
	}
	select {
	case m := <-r.msgs:
		return m, nil
	case <-ctx.Done():
		return routerItem{}, ctx.Err()
	case <-r.srv.done:
		return routerItem{}, ErrClosed
	}
}

// Disconnect closes the connection of the peer with the given id (a peer
// that broke the caller's protocol, say); what was queued for it is
// dropped, and the disconnect handler (WithDisconnectHandler) runs as for
// any other end. ErrUnknownPeer if it is not (or no longer) connected.
func (r *Router) Disconnect(peer []byte) error {
	r.mu.RLock()
	p := r.peers[string(peer)]
	r.mu.RUnlock()
	if p == nil {
		return fmt.Errorf("%w: %x", ErrUnknownPeer, peer)
	}
	p.c.close()
	return nil
}

// Send sends frames to the peer with the given id. To answer a REQ peer,
// the first frame must be the empty delimiter: Send(ctx, peer, nil, reply).
// ctx bounds the write, and a ctx without a deadline is bounded by
// WithSendTimeout, so a peer that stopped reading cannot hold Send
// forever; a write that fails or runs out of time closes that peer's
// connection (a partly written message leaves it unusable).
func (r *Router) Send(ctx context.Context, peer []byte, frames ...[]byte) error {
	select {
	case <-r.srv.done:
		return ErrClosed
	default:
	}
	if _, ok := ctx.Deadline(); !ok && r.srv.o.sendTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.srv.o.sendTimeout)
		defer cancel()
	}
	r.mu.RLock()
	p := r.peers[string(peer)]
	r.mu.RUnlock()
	if p == nil {
		return fmt.Errorf("%w: %x", ErrUnknownPeer, peer)
	}
	return p.c.send(ctx, frames)
}

// Enqueue sends frames to the peer with the given id without blocking.
// A peer with nothing waiting is written to at once, by Enqueue itself,
// as much as its socket takes without waiting; whatever remains, and
// every message to a peer that still has some waiting, is queued and
// written in order by a goroutine of that peer, each write within the
// send timeout (WithSendTimeout). A write that fails or runs out of time
// closes the peer's connection and drops what is still queued for it
// (logged at debug level). Enqueue fails with ErrUnknownPeer for a peer
// that is not (or no longer) connected, with ErrPeerBusy when the peer
// already has WithSendQueue messages waiting or the message would take
// its queue past WithSendQueueBytes (it is not reading them; a message
// is always taken into an empty queue, however large; the rest of a
// partly written message counts as one waiting message), and with
// ErrClosed after Close.
//
// The frames may be written after Enqueue returns: the caller must not
// modify them afterwards. Messages of Send and Enqueue to one peer are
// never interleaved, but their order between the two is not defined.
func (r *Router) Enqueue(peer []byte, frames ...[]byte) error {
	if len(frames) == 0 {
		return errors.New("zmq: a message needs at least one frame")
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closing {
		return ErrClosed
	}
	p := r.peers[string(peer)]
	if p == nil || p.c.closed() {
		return fmt.Errorf("%w: %x", ErrUnknownPeer, peer)
	}
	size := int64(msgSize(frames))
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := p.waiting(); n >= r.srv.o.sendQueue {
		return fmt.Errorf("%w: %x has %d messages waiting", ErrPeerBusy, peer, n)
	}
	if max := r.srv.o.sendQueueBytes; max > 0 && p.waiting() > 0 && p.bytes+size > max {
		return fmt.Errorf("%w: %x has %d bytes waiting", ErrPeerBusy, peer, p.bytes)
	}
	now := time.Now()
	if now.Sub(p.last) < r.srv.o.burstGap {
		p.burst++
	} else {
		p.burst = 0
	}
	p.last = now
	if !p.writing && p.burst < burstInline && r.writeInline(p, frames) {
		return nil
	}
	r.hook(pathQueued)
	p.queue = append(p.queue, frames)
	p.bytes += size
	if !p.writing {
		r.startDrain(p)
	}
	return nil
}

// A burst of messages to one peer, each within burstGap of the one
// before, is written inline only for its first burstInline messages;
// the rest are queued, and drain writes what accumulates while it
// writes in one writev. A write costs a system call (2 µs on a small
// VM) and a wakeup of the peer, so a long burst written message by
// message cost twice the CPU of one written in batches
// (BenchmarkRouterEnqueue), while messages that come farther apart than
// a write takes would not batch anyway: they, and the start of a burst,
// go inline. Where a sender waits whenever 16 messages are queued (so
// every 16 start a burst: BenchmarkRouterEnqueue/queue=16) that still
// costs CPU: 1.25×, 1.3× and 1.4× that of queueing everything with 1,
// 2 and 4 inline; a request's reply costs 0.7× (BenchmarkRouterReply).
const (
	burstGap    = 5 * time.Microsecond
	burstInline = 2
)

// writeInline writes frames to p's idle connection (p.mu held, nothing
// waiting, no drain running) without blocking and without a goroutine,
// and reports whether it took care of the message: written whole; or
// written in part, the rest handed to a drain goroutine together with
// the connection's writer lock, so that no other write (Send, a PONG,
// the next message) can come between a message's parts; or the write
// failed and the connection is closed. false: nothing was written (the
// writer lock is busy or the socket's buffer full); queue it.
func (r *Router) writeInline(p *routerPeer, frames [][]byte) bool {
	c := p.c
	if !c.wmu.TryLock() {
		return false
	}
	rest, restBytes, err := c.writeNow(frames)
	switch {
	case err == errNotNow:
		c.wmu.Unlock()
		return false
	case err != nil:
		c.wmu.Unlock()
		r.dropped(p, err, 0)
		return true
	case rest == nil:
		c.wmu.Unlock()
		r.hook(pathInline)
		return true
	}
	r.hook(pathPartial)
	p.rest, p.restBytes = rest, int64(restBytes)
	p.bytes += p.restBytes
	r.startDrain(p)
	return true
}

// startDrain starts p's writer. The caller holds r.mu's read lock, with
// closing unset (so Close's Wait comes after this Add), and p.mu.
func (r *Router) startDrain(p *routerPeer) {
	p.writing = true
	r.writers.Add(1)
	go r.drain(p)
}

// enqueuePath names what Enqueue did with a message, for tests
// (withEnqueueHook).
type enqueuePath int

const (
	pathInline  enqueuePath = iota // written whole by Enqueue
	pathPartial                    // written in part by Enqueue, the rest by drain
	pathQueued                     // queued for drain
)

func (r *Router) hook(path enqueuePath) {
	if h := r.srv.o.enqueueHook; h != nil {
		h(path)
	}
}

// drainBatchBytes bounds the bytes drain hands to one write: the messages
// queued for a peer go out together (one writev, one wakeup of the peer's
// reader instead of one per message) up to this much, so that one write's
// send timeout still bounds a similar amount of data.
const drainBatchBytes = 256 << 10

// drain writes what Enqueue's inline write left of a message, if it
// left anything, then p's queue until it is empty or a write fails.
func (r *Router) drain(p *routerPeer) {
	defer r.writers.Done()
	p.mu.Lock()
	rest := p.rest
	p.bytes -= p.restBytes
	p.rest, p.restBytes = nil, 0
	p.mu.Unlock()
	if rest != nil {
		// c.wmu is held for it: nothing was written since its first part.
		ctx, cancel := r.sendCtx()
		err := p.c.writeRest(ctx, rest) // closes the connection on failure
		cancel()
		if err != nil {
			r.dropQueue(p, err)
			return
		}
	}
	var batch [][][]byte
	for {
		p.mu.Lock()
		if len(p.queue) == 0 {
			p.writing = false
			p.mu.Unlock()
			return
		}
		// Always at least one message, however large.
		batch = batch[:0]
		size := 0
		for len(p.queue) > 0 && (len(batch) == 0 || size+msgSize(p.queue[0]) <= drainBatchBytes) {
			size += msgSize(p.queue[0])
			batch = append(batch, p.queue[0])
			p.queue[0] = nil
			p.queue = p.queue[1:]
		}
		p.bytes -= int64(size)
		p.mu.Unlock()

		ctx, cancel := r.sendCtx()
		err := p.c.sendBatch(ctx, batch) // closes the connection on failure
		cancel()
		clear(batch)
		if err != nil {
			r.dropQueue(p, err)
			return
		}
	}
}

// sendCtx bounds one write of drain by the send timeout.
func (r *Router) sendCtx() (context.Context, context.CancelFunc) {
	if t := r.srv.o.sendTimeout; t > 0 {
		return context.WithTimeout(context.Background(), t)
	}
	return context.Background(), func() {}
}

// dropQueue ends drain after a failed write (the connection is closed):
// what is still queued for p is dropped.
func (r *Router) dropQueue(p *routerPeer, err error) {
	p.mu.Lock()
	dropped := len(p.queue)
	p.queue, p.bytes = nil, 0
	p.writing = false
	p.mu.Unlock()
	r.dropped(p, err, dropped)
}

// dropped logs a message not written to p, whose connection a failed
// write closed, and how many queued after it went with it.
func (r *Router) dropped(p *routerPeer, err error, also int) {
	select {
	case <-r.srv.done:
	default:
		r.srv.log.Debug("zmq dropping peer: queued message not written", "peer", p.c.peer, "err", err, "also_dropped", also)
	}
}

// Queued returns the messages and bytes Enqueue holds for peer, waiting
// to be written (zeros for a peer that is not connected).
func (r *Router) Queued(peer []byte) (msgs int, bytes int64) {
	r.mu.RLock()
	p := r.peers[string(peer)]
	r.mu.RUnlock()
	if p == nil {
		return 0, 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiting(), p.bytes
}

// msgSize is the bytes of a message's frames.
func msgSize(frames [][]byte) int {
	n := 0
	for _, f := range frames {
		n += len(f)
	}
	return n
}

// Endpoint is the endpoint peers connect to.
func (r *Router) Endpoint() string { return r.srv.addr }

// Addr is the listener's address.
func (r *Router) Addr() net.Addr { return r.srv.ln.Addr() }

// Port is the TCP port the socket listens on (0 for an ipc endpoint).
func (r *Router) Port() int { return portOf(r.srv.ln.Addr()) }

// Close stops listening, closes every connection (messages still queued
// by Enqueue are dropped), waits for the socket's goroutines and calls the
// disconnect handler (WithDisconnectHandler) for every connection whose
// end Recv had not reported. Calling it again returns nil.
func (r *Router) Close() error {
	r.mu.Lock()
	r.closing = true
	r.mu.Unlock()
	err := r.srv.close()
	r.writers.Wait()
	// Every connection has ended and no more register: report those no
	// Recv reported, in the order they connected.
	r.mu.Lock()
	ids := make([]string, 0, len(r.unreported))
	for id := range r.unreported {
		ids = append(ids, id)
	}
	r.mu.Unlock()
	slices.Sort(ids)
	for _, id := range ids {
		r.report(id)
	}
	return err
}
