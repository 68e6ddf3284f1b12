package zmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
)

// Request performs one REQ exchange with the ROUTER (or REP) socket at
// endpoint (tcp:// or ipc://): connect, send frames as one request (after the empty
// delimiter REQ adds), wait for the reply, disconnect. It returns the reply
// frames without the delimiter. ctx bounds everything: vLLM gives its
// handshake 5 s (RCVTIMEO) so a dead prefill cannot hang decode; pass a
// context with a deadline for the same effect.
func Request(ctx context.Context, endpoint string, frames [][]byte, opts ...Option) ([][]byte, error) {
	if len(frames) == 0 {
		return nil, fmt.Errorf("zmq: a request needs at least one frame")
	}
	addr, err := parseEndpoint(endpoint, false)
	if err != nil {
		return nil, err
	}
	o := buildOptions(opts)
	var d net.Dialer
	nc, err := d.DialContext(ctx, addr.network, addr.addr)
	if err != nil {
		return nil, fmt.Errorf("zmq: request to %s: %w", endpoint, err)
	}
	// Cancelling ctx interrupts whatever is in progress by closing nc.
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	defer stop()
	defer nc.Close()

	fail := func(err error) error {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("zmq: request to %s: %w", endpoint, ctxErr)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// The socket deadline is ctx's deadline; it can fire a moment
			// before ctx reports it.
			return fmt.Errorf("zmq: request to %s: %w", endpoint, context.DeadlineExceeded)
		}
		return fmt.Errorf("zmq: request to %s: %w", endpoint, err)
	}
	c, err := handshake(nc, typeReq, &o)
	if err != nil {
		return nil, fail(err)
	}
	msg := make([][]byte, 0, len(frames)+1)
	msg = append(msg, nil)
	msg = append(msg, frames...)
	if err := c.send(ctx, msg); err != nil {
		return nil, fail(err)
	}
	if dl, ok := ctx.Deadline(); ok {
		nc.SetReadDeadline(dl)
	} else {
		nc.SetReadDeadline(time.Time{})
	}
	reply, _, err := c.recv()
	if err != nil {
		return nil, fail(err)
	}
	if len(reply) == 0 || len(reply[0]) != 0 {
		return nil, fail(protoErr("reply does not start with the empty delimiter frame"))
	}
	return reply[1:], nil
}
