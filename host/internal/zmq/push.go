package zmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/backoff"
	"github.com/kvhost/kvhost/host/internal/ratelog"
)

// Push is a PUSH socket connected to exactly one endpoint (SGLang keeps
// one PUSH socket per destination endpoint too; with one peer there is no
// fan-out question). It connects lazily on the first Send, notices when
// the peer goes away and reconnects. Safe for concurrent use; messages of
// concurrent Sends are never interleaved.
type Push struct {
	endpoint string
	addr     address
	o        options
	log      *slog.Logger    // rate-limited: the peer can trigger its lines
	rlog     *ratelog.Logger // log's limiter, flushed by Close

	life context.Context // cancelled by Close; interrupts Sends
	kill context.CancelFunc

	mu     sync.Mutex // serializes Send, reconnects and Close
	c      *conn
	closed bool
	wg     sync.WaitGroup // connection watchers
}

// DialPush returns a PUSH socket for endpoint ("tcp://host:port" or
// "ipc:///path/to/socket"). It does not connect yet: the first Send does,
// so the peer need not be up.
func DialPush(endpoint string, opts ...Option) (*Push, error) {
	addr, err := parseEndpoint(endpoint, false)
	if err != nil {
		return nil, err
	}
	o := buildOptions(opts)
	life, kill := context.WithCancel(context.Background())
	rlog := ratelog.New(o.logger)
	return &Push{
		endpoint: endpoint,
		addr:     addr,
		o:        o,
		log:      rlog.With("zmq_socket", typePush, "zmq_endpoint", endpoint),
		rlog:     rlog,
		life:     life,
		kill:     kill,
	}, nil
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
	if len(frames) == 0 {
		return errors.New("zmq: a message needs at least one frame")
	}
	if _, ok := ctx.Deadline(); !ok && p.o.sendTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.o.sendTimeout)
		defer cancel()
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(p.life, func() { cancel(ErrClosed) })
	defer stop()

	p.mu.Lock()
	defer p.mu.Unlock()
	retry := backoff.New(p.o.reconnectMin, p.o.reconnectMax)
	var lastErr error
	for {
		if p.closed {
			return ErrClosed
		}
		if p.c != nil && (p.c.closed() || peerClosed(p.c.nc)) {
			p.log.Debug("zmq peer went away; reconnecting")
			p.c.close()
			p.c = nil
		}
		if p.c == nil {
			c, err := p.connect(ctx)
			if err != nil {
				// A dial cut short by ctx says only "i/o timeout": keep
				// the reason of the attempt before it (e.g. refused).
				if lastErr == nil || !cutShort(ctx) {
					lastErr = err
				}
				select {
				case <-time.After(retry.Next()):
					continue
				case <-ctx.Done():
					return p.sendError(ctx, lastErr)
				}
			}
			p.c = c
		}
		err := p.c.send(ctx, frames)
		if err == nil {
			return nil
		}
		// The connection is closed now; the message was not completely
		// written, so the receiver will not deliver it: send it again on a
		// new connection.
		lastErr = err
		p.c = nil
		if ctx.Err() != nil {
			return p.sendError(ctx, lastErr)
		}
	}
}

// cutShort reports whether ctx has ended or reached its deadline. A dial
// bounded by ctx's deadline may return "i/o timeout" a moment before ctx
// itself reports DeadlineExceeded (the connection's deadline and ctx's
// timer fire independently), so ctx.Err alone misses it.
func cutShort(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}

func (p *Push) sendError(ctx context.Context, last error) error {
	if errors.Is(context.Cause(ctx), ErrClosed) {
		return ErrClosed
	}
	if last == nil {
		return fmt.Errorf("zmq: send to %s: %w", p.endpoint, ctx.Err())
	}
	return fmt.Errorf("zmq: send to %s: %w (last error: %v)", p.endpoint, ctx.Err(), last)
}

// connect dials and handshakes; ctx bounds both.
func (p *Push) connect(ctx context.Context) (*conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, p.addr.network, p.addr.addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	c, err := handshake(nc, typePush, &p.o)
	if !stop() {
		// ctx ended during the handshake and closed nc.
		if err == nil {
			c.close()
		}
		return nil, fmt.Errorf("zmq: connect to %s: %w", p.endpoint, ctx.Err())
	}
	if err != nil {
		return nil, err
	}
	p.wg.Add(1)
	go p.watch(c)
	return c, nil
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
	p.kill()
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		if p.c != nil {
			p.c.close()
			p.c = nil
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
	p.rlog.Close()
	return nil
}
