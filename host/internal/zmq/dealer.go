package zmq

import (
	"context"
	"errors"
	"fmt"
)

// ErrDisconnected is returned by Dealer.Recv, once per connection, when
// the connection to the peer ended (the peer closed it or died, or a
// write on it failed).
var ErrDisconnected = errors.New("zmq: connection lost")

// Dealer is a DEALER socket connected to exactly one endpoint (a ROUTER,
// DEALER or REP peer): Send and Recv are independent, so a client can
// have many requests in flight on one connection and receive replies and
// events as they come, the way a libzmq DEALER talks to a ROUTER (the
// ROUTER sees our messages with our connection's id in front and routes
// its replies back by it; no delimiter frame is added). Safe for
// concurrent use; messages of concurrent Sends are never interleaved.
//
// Connection and reconnection work like Push: the first Send connects,
// and a Send that finds the connection gone connects again, with backoff
// (WithReconnectInterval), until its context ends; a context without a
// deadline is bounded by WithSendTimeout. There is no send queue of its
// own: a Send returns nil once its message was handed to the kernel on a
// live connection, and fails if that has not happened within its
// context and the send timeout (concurrent Sends wait for each other).
// As with libzmq, a message written just before the peer dies is lost.
//
// Every connection's end is reported in order through Recv: after the
// messages received on it, Recv returns an error wrapping
// ErrDisconnected, exactly once per connection that completed its
// handshake, so a client can fail the requests it had in flight. The
// ROUTER gives a new connection a new id and, in a protocol with
// sessions, has forgotten the old one's state; Send does not wait for
// the report, so a message sent on a new connection may go out before
// Recv reports the old connection's end.
//
// Received messages are bounded like those of bound sockets: at most
// WithRecvQueue of them wait for Recv, within WithRecvBudget bytes, and
// WithMaxMessageSize and WithMaxFrames apply to each.
type Dealer struct {
	dialer
	budget *recvBudget
	msgs   chan dealerItem
}

// dealerItem is a received message and the bytes of the receive budget
// it holds, or (err set) the end of a connection.
type dealerItem struct {
	frames [][]byte
	size   int64
	err    error
}

// DialDealer returns a DEALER socket for endpoint ("tcp://host:port" or
// "ipc:///path/to/socket"). It does not connect yet: the first Send does,
// so the peer need not be up.
func DialDealer(endpoint string, opts ...Option) (*Dealer, error) {
	d := &Dealer{}
	if err := d.init(endpoint, typeDealer, opts, d.read); err != nil {
		return nil, err
	}
	d.budget = newRecvBudget(d.o.recvBudget, d.o.contendedTimeout)
	d.msgs = make(chan dealerItem, d.o.recvQueue)
	return d, nil
}

// Endpoint is the endpoint this socket talks to.
func (d *Dealer) Endpoint() string { return d.endpoint }

// Send sends one message made of frames (at least one; empty frames are
// fine), connecting first if there is no live connection (see Dealer).
// Frames are not retained after Send returns.
func (d *Dealer) Send(ctx context.Context, frames ...[]byte) error {
	return d.send(ctx, frames)
}

// read queues c's messages for Recv, then the report of its end.
func (d *Dealer) read(c *conn) {
	defer d.wg.Done()
	c.useBudget(d.budget, d.life.Done())
	var err error
	for {
		frames, size, rerr := c.recv()
		if rerr != nil {
			err = rerr
			break
		}
		select {
		case d.msgs <- dealerItem{frames: frames, size: size}:
		case <-d.life.Done():
			d.budget.release(size)
			c.close()
			return
		}
	}
	c.close() // so that the next Send reconnects
	if !isClosedErr(err) {
		d.log.Warn("zmq connection failed", "peer", c.peer, "err", err)
	}
	select {
	case d.msgs <- dealerItem{err: fmt.Errorf("%w: %s: %v", ErrDisconnected, d.endpoint, err)}:
	case <-d.life.Done():
	}
}

// Recv returns the next message from the peer (its frames; they belong to
// the caller), or an error wrapping ErrDisconnected when the connection
// that the messages before came on has ended (see Dealer); the socket
// stays usable. It blocks until either arrives, ctx ends or the socket
// is closed (ErrClosed).
func (d *Dealer) Recv(ctx context.Context) ([][]byte, error) {
	select {
	case <-d.life.Done():
		return nil, ErrClosed
	default:
	}
	select {
	case it := <-d.msgs: // a waiting message wins over an expired ctx
		return d.take(it)
	default:
	}
	select {
	case it := <-d.msgs:
		return d.take(it)
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-d.life.Done():
		return nil, ErrClosed
	}
}

func (d *Dealer) take(it dealerItem) ([][]byte, error) {
	if it.err != nil {
		return nil, it.err
	}
	d.budget.release(it.size)
	return it.frames, nil
}

// Close closes the socket and its connection. A Send or Recv in progress
// returns ErrClosed, and so do later calls; messages not yet received
// are dropped. Calling Close again returns nil.
func (d *Dealer) Close() error {
	d.close()
	return nil
}
