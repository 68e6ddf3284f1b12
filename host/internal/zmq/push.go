package zmq

import (
	"context"
)

// Push is a PUSH socket connected to exactly one endpoint (SGLang keeps
// one PUSH socket per destination endpoint too; with one peer there is no
// fan-out question). It connects lazily on the first Send, notices when
// the peer goes away and reconnects. Safe for concurrent use; messages of
// concurrent Sends are never interleaved.
type Push struct {
	dialer
}

// DialPush returns a PUSH socket for endpoint ("tcp://host:port" or
// "ipc:///path/to/socket"). It does not connect yet: the first Send does,
// so the peer need not be up.
func DialPush(endpoint string, opts ...Option) (*Push, error) {
	p := &Push{}
	if err := p.init(endpoint, typePush, opts, p.watch); err != nil {
		return nil, err
	}
	return p, nil
}

// Endpoint is the endpoint this socket sends to.
func (p *Push) Endpoint() string { return p.endpoint }

// Send sends one message made of frames (at least one; empty frames are
// fine). It returns nil once the whole message was handed to the kernel on
// a live connection. Until ctx ends it keeps (re)connecting with backoff,
// so a peer that is down or restarting is waited for; a context without a
// deadline is bounded by WithSendTimeout. Frames are not retained after
// Send returns.
func (p *Push) Send(ctx context.Context, frames ...[]byte) error {
	return p.send(ctx, frames)
}

// watch reads the connection so that PINGs are answered and a closed peer
// is noticed; a PULL peer never sends messages.
func (p *Push) watch(c *conn) {
	defer p.wg.Done()
	defer c.close()
	frames, _, err := c.recv()
	switch {
	case err != nil && !isClosedErr(err):
		p.log.Warn("zmq connection failed", "peer", c.peer, "err", err)
	case err == nil:
		p.log.Warn("zmq PULL peer sent a message; dropping the connection", "peer", c.peer, "frames", len(frames))
	}
}

// Close closes the socket. A Send in progress returns ErrClosed. Calling
// Close again returns nil.
func (p *Push) Close() error {
	p.close()
	return nil
}
