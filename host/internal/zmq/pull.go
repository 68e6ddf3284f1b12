package zmq

import (
	"context"
	"net"
)

// Pull is a bound PULL socket: it accepts any number of PUSH peers and
// delivers their messages, fair-queued, through Recv. Safe for concurrent
// use.
type Pull struct {
	srv    *server
	msgs   chan received
	budget *recvBudget
}

// received is a message waiting for Recv, the bytes of the receive
// budget it holds, and the remote address of the connection it came on.
type received struct {
	frames [][]byte
	size   int64
	from   net.Addr
}

// ListenPull binds a PULL socket to endpoint ("tcp://host:port",
// "tcp://*:port"; port 0 picks a free port, see Endpoint; or
// "ipc:///path/to/socket", see the package doc).
func ListenPull(endpoint string, opts ...Option) (*Pull, error) {
	o := buildOptions(opts)
	p := &Pull{msgs: make(chan received, o.recvQueue), budget: newRecvBudget(o.recvBudget, o.contendedTimeout)}
	srv, err := listen(endpoint, typePull, o, p.serve)
	if err != nil {
		return nil, err
	}
	p.srv = srv
	srv.start()
	return p, nil
}

func (p *Pull) serve(c *conn) {
	c.useBudget(p.budget, p.srv.done)
	for {
		frames, size, err := c.recv()
		if err != nil {
			p.srv.readError(c, err)
			return
		}
		select {
		case p.msgs <- received{frames, size, c.nc.RemoteAddr()}:
		case <-p.srv.done:
			return
		}
	}
}

// Recv returns the next message (its frames, in order). It blocks until a
// message arrives, ctx ends (ctx.Err() is returned) or the socket is
// closed (ErrClosed). The returned frames belong to the caller.
func (p *Pull) Recv(ctx context.Context) ([][]byte, error) {
	frames, _, err := p.RecvFrom(ctx)
	return frames, err
}

// RecvFrom is Recv that also returns the remote address of the connection
// the message came on (a *net.TCPAddr for TCP endpoints; for ipc an
// unnamed *net.UnixAddr or nil, as unix peers have no address): what the
// transport knows about the sender, for a caller that accepts a message
// only from the peers it expects. The address is the connection's, so it
// is as trustworthy as the network's routing of it (TCP's handshake makes
// a remote host unable to claim another host's IP, but any process on the
// receiving host can connect from any local address).
func (p *Pull) RecvFrom(ctx context.Context) ([][]byte, net.Addr, error) {
	select {
	case <-p.srv.done:
		return nil, nil, ErrClosed
	default:
	}
	select {
	case m := <-p.msgs: // a waiting message wins over an expired ctx
		p.budget.release(m.size)
		return m.frames, m.from, nil
	default:
	}
	select {
	case m := <-p.msgs:
		p.budget.release(m.size)
		return m.frames, m.from, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	case <-p.srv.done:
		return nil, nil, ErrClosed
	}
}

// Endpoint is the endpoint peers connect to, with the port the listener
// actually got (useful with port 0).
func (p *Pull) Endpoint() string { return p.srv.addr }

// Addr is the listener's address.
func (p *Pull) Addr() net.Addr { return p.srv.ln.Addr() }

// Port is the TCP port the socket listens on (0 for an ipc endpoint).
func (p *Pull) Port() int { return portOf(p.srv.ln.Addr()) }

// Close stops listening and closes every connection. Messages not yet
// received are dropped. Close waits for the socket's goroutines to end;
// calling it again returns nil.
func (p *Pull) Close() error { return p.srv.close() }
