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

// dialer is the connecting half that Push and Dealer share: it reaches one
// endpoint over one connection at a time, made by the first send and made
// again, with backoff, by a send that finds it gone.
type dialer struct {
	endpoint string
	addr     address
	o        options
	typ      string          // our ZMTP socket type
	log      *slog.Logger    // rate-limited: the peer can trigger its lines
	rlog     *ratelog.Logger // log's limiter, flushed by close

	life context.Context // cancelled by close; interrupts sends
	kill context.CancelFunc

	// serve runs on a goroutine of its own for every connection, from its
	// handshake until it ends, and then calls wg.Done.
	serve func(*conn)

	mu     sync.Mutex // serializes sends, reconnects and close
	c      *conn
	closed bool
	wg     sync.WaitGroup // serve goroutines
}

// init readies d for endpoint ("tcp://host:port" or
// "ipc:///path/to/socket"); it does not connect yet.
func (d *dialer) init(endpoint, typ string, opts []Option, serve func(*conn)) error {
	addr, err := parseEndpoint(endpoint, false)
	if err != nil {
		return err
	}
	d.endpoint, d.addr, d.o, d.typ, d.serve = endpoint, addr, buildOptions(opts), typ, serve
	d.rlog = ratelog.New(d.o.logger)
	d.log = d.rlog.With("zmq_socket", typ, "zmq_endpoint", endpoint)
	d.life, d.kill = context.WithCancel(context.Background())
	return nil
}

// send sends one message made of frames (at least one), (re)connecting
// with backoff until ctx ends; a context without a deadline is bounded by
// WithSendTimeout. It returns nil once the whole message was handed to
// the kernel on a live connection.
func (d *dialer) send(ctx context.Context, frames [][]byte) error {
	if len(frames) == 0 {
		return errors.New("zmq: a message needs at least one frame")
	}
	if _, ok := ctx.Deadline(); !ok && d.o.sendTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.o.sendTimeout)
		defer cancel()
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(d.life, func() { cancel(ErrClosed) })
	defer stop()

	d.mu.Lock()
	defer d.mu.Unlock()
	retry := backoff.New(d.o.reconnectMin, d.o.reconnectMax)
	var lastErr error
	for {
		if d.closed {
			return ErrClosed
		}
		if d.c != nil && (d.c.closed() || peerClosed(d.c.nc)) {
			d.log.Debug("zmq peer went away; reconnecting")
			d.c.close() // its serve goroutine sees the end
			d.c = nil
		}
		if d.c == nil {
			c, err := d.connect(ctx)
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
					return d.sendError(ctx, lastErr)
				}
			}
			d.c = c
		}
		err := d.c.send(ctx, frames)
		if err == nil {
			return nil
		}
		// The connection is closed now; the message was not completely
		// written, so the receiver will not deliver it: send it again on a
		// new connection.
		lastErr = err
		d.c = nil
		if ctx.Err() != nil {
			return d.sendError(ctx, lastErr)
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
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

func (d *dialer) sendError(ctx context.Context, last error) error {
	if errors.Is(context.Cause(ctx), ErrClosed) {
		return ErrClosed
	}
	if last == nil {
		return fmt.Errorf("zmq: send to %s: %w", d.endpoint, ctx.Err())
	}
	return fmt.Errorf("zmq: send to %s: %w (last error: %v)", d.endpoint, ctx.Err(), last)
}

// connect dials and handshakes (ctx bounds both) and starts serve on the
// new connection.
func (d *dialer) connect(ctx context.Context) (*conn, error) {
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, d.addr.network, d.addr.addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	c, err := handshake(nc, d.typ, &d.o)
	if !stop() {
		// ctx ended during the handshake and closed nc.
		if err == nil {
			c.close()
		}
		return nil, fmt.Errorf("zmq: connect to %s: %w", d.endpoint, ctx.Err())
	}
	if err != nil {
		return nil, err
	}
	d.wg.Add(1)
	go d.serve(c)
	return c, nil
}

// close closes the socket and its connection, interrupting a send in
// progress (ErrClosed), and waits for the serve goroutines. Calling it
// again does nothing.
func (d *dialer) close() {
	d.kill()
	d.mu.Lock()
	if !d.closed {
		d.closed = true
		if d.c != nil {
			d.c.close()
			d.c = nil
		}
	}
	d.mu.Unlock()
	d.wg.Wait()
	d.rlog.Close()
}
