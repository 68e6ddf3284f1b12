package zmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
)

// ErrUnknownPeer is returned by Router.Send for a peer id that is not (or
// no longer) connected. libzmq drops such messages silently; we say so.
var ErrUnknownPeer = errors.New("zmq: unknown or disconnected peer")

// RouterMsg is a message received by a Router: the id of the connection it
// came from and its frames. From a REQ peer the frames are the empty
// delimiter followed by the request body, exactly as libzmq's ROUTER
// returns them after the identity frame.
type RouterMsg struct {
	Peer   []byte
	Frames [][]byte
}

// Router is a bound ROUTER socket: any number of REQ/DEALER peers, each
// addressed by the id the router gave its connection (5 bytes, 0x00 and a
// counter, like libzmq's generated ids; ids are never reused). Safe for
// concurrent use; a slow or stuck peer only delays replies to itself.
type Router struct {
	srv    *server
	msgs   chan routerItem
	budget *recvBudget

	mu     sync.RWMutex
	peers  map[string]*conn
	nextID uint32
}

// ListenRouter binds a ROUTER socket to endpoint.
func ListenRouter(endpoint string, opts ...Option) (*Router, error) {
	o := buildOptions(opts)
	r := &Router{msgs: make(chan routerItem, o.recvQueue), budget: newRecvBudget(o.recvBudget), peers: make(map[string]*conn)}
	srv, err := listen(endpoint, typeRouter, o, r.serve)
	if err != nil {
		return nil, err
	}
	r.srv = srv
	srv.start()
	return r, nil
}

// routerItem is a message waiting for Recv and the bytes of the receive
// budget it holds.
type routerItem struct {
	msg  RouterMsg
	size int64
}

func (r *Router) serve(c *conn) {
	c.useBudget(r.budget, r.srv.done)
	id := r.register(c)
	defer r.unregister(id)
	for {
		frames, size, err := c.recv()
		if err != nil {
			r.srv.readError(c, err)
			return
		}
		select {
		case r.msgs <- routerItem{RouterMsg{Peer: []byte(id), Frames: frames}, size}:
		case <-r.srv.done:
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
	r.peers[string(id[:])] = c
	return string(id[:])
}

func (r *Router) unregister(id string) {
	r.mu.Lock()
	delete(r.peers, id)
	r.mu.Unlock()
}

// Recv returns the next message from any peer. It blocks until one
// arrives, ctx ends or the socket is closed (ErrClosed).
func (r *Router) Recv(ctx context.Context) (RouterMsg, error) {
	select {
	case <-r.srv.done:
		return RouterMsg{}, ErrClosed
	default:
	}
	select {
	case m := <-r.msgs: // a waiting message wins over an expired ctx
		r.budget.release(m.size)
		return m.msg, nil
	default:
	}
	select {
	case m := <-r.msgs:
		r.budget.release(m.size)
		return m.msg, nil
	case <-ctx.Done():
		return RouterMsg{}, ctx.Err()
	case <-r.srv.done:
		return RouterMsg{}, ErrClosed
	}
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
	c := r.peers[string(peer)]
	r.mu.RUnlock()
	if c == nil {
		return fmt.Errorf("%w: %x", ErrUnknownPeer, peer)
	}
	return c.send(ctx, frames)
}

// Endpoint is the endpoint peers connect to.
func (r *Router) Endpoint() string { return r.srv.addr }

// Addr is the listener's address.
func (r *Router) Addr() net.Addr { return r.srv.ln.Addr() }

// Port is the TCP port the socket listens on.
func (r *Router) Port() int { return r.srv.ln.Addr().(*net.TCPAddr).Port }

// Close stops listening, closes every connection and waits for the
// socket's goroutines. Calling it again returns nil.
func (r *Router) Close() error { return r.srv.close() }
