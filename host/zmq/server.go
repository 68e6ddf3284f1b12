package zmq

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// maxPendingHandshakes bounds connections that have not finished their
// handshake yet; more are closed at once, so a flood of silent TCP clients
// costs at most this many goroutines for one handshake timeout each.
const maxPendingHandshakes = 1024

// server is the listening half shared by Pull and Router: an accept loop
// that hands each connection to its own goroutine for the handshake (under
// a deadline) and then to the socket's read loop.
type server struct {
	typ  string
	o    options
	log  *slog.Logger
	ln   net.Listener
	addr string // connectable endpoint of ln

	// serve runs the read loop of one connection; it returns when the
	// connection ends or the server closes.
	serve func(c *conn)

	pending chan struct{} // semaphore of handshakes in progress
	live    atomic.Int64  // connections accepted and not yet ended (≤ o.maxConns)

	// Refusals are logged at most once a second; the accept loop alone
	// touches these.
	lastRefusalLog time.Time
	refusedQuietly int

	done      chan struct{}
	closeOnce sync.Once
	mu        sync.Mutex
	conns     map[*conn]struct{}
	wg        sync.WaitGroup
}

// listen binds endpoint; start begins accepting.
func listen(endpoint, typ string, o options, serve func(*conn)) (*server, error) {
	addr, err := tcpAddress(endpoint, true)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &server{
		typ:     typ,
		o:       o,
		log:     o.logger.With("zmq_socket", typ, "zmq_endpoint", endpointOf(ln.Addr())),
		ln:      ln,
		addr:    endpointOf(ln.Addr()),
		serve:   serve,
		pending: make(chan struct{}, maxPendingHandshakes),
		done:    make(chan struct{}),
		conns:   make(map[*conn]struct{}),
	}
	return s, nil
}

// start begins accepting; the owner must be fully set up by then.
func (s *server) start() {
	s.wg.Add(1)
	go s.acceptLoop()
}

func (s *server) acceptLoop() {
	defer s.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: wait instead of spinning.
			s.log.Warn("zmq accept failed", "err", err, "retry_in", backoff)
			select {
			case <-time.After(backoff):
			case <-s.done:
				return
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if s.live.Load() >= int64(s.o.maxConns) {
			s.refuse(nc, "zmq connection limit reached; refusing a connection", "max_conns", s.o.maxConns)
			continue
		}
		select {
		case s.pending <- struct{}{}:
		default:
			s.refuse(nc, "zmq too many connections in handshake; refusing a connection", "max_handshakes", maxPendingHandshakes)
			continue
		}
		s.live.Add(1)
		s.wg.Add(1)
		go s.handle(nc)
	}
}

// refuse closes a connection the socket will not serve and logs it, at
// most once a second: a flood of connections must not flood the log.
func (s *server) refuse(nc net.Conn, msg string, args ...any) {
	nc.Close()
	now := time.Now()
	if now.Sub(s.lastRefusalLog) < time.Second {
		s.refusedQuietly++
		return
	}
	args = append(args, "peer", nc.RemoteAddr(), "unlogged_refusals", s.refusedQuietly)
	s.log.Warn(msg, args...)
	s.lastRefusalLog = now
	s.refusedQuietly = 0
}

func (s *server) handle(nc net.Conn) {
	defer s.wg.Done()
	defer s.live.Add(-1)
	// Closing the server interrupts a handshake in progress.
	handshaking := make(chan struct{})
	go func() {
		select {
		case <-s.done:
			nc.Close()
		case <-handshaking:
		}
	}()
	c, err := handshake(nc, s.typ, &s.o)
	close(handshaking)
	<-s.pending
	if err != nil {
		select {
		case <-s.done:
		default:
			s.log.Warn("zmq peer rejected", "peer", nc.RemoteAddr(), "err", err)
		}
		return
	}
	c.msgTimeout = s.o.messageTimeout
	if !s.track(c) {
		c.close()
		return
	}
	defer s.untrack(c)
	s.serve(c)
}

// track registers c; false when the server is already closed.
func (s *server) track(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.done:
		return false
	default:
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *server) untrack(c *conn) {
	c.close()
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// readError logs why a connection's read loop ended, at a level that
// matches its cause: peers going away is normal, protocol violations are
// not.
func (s *server) readError(c *conn, err error) {
	select {
	case <-s.done:
		return
	default:
	}
	if isClosedErr(err) {
		s.log.Debug("zmq peer disconnected", "peer", c.peer, "err", err)
		return
	}
	s.log.Warn("zmq dropping peer", "peer", c.peer, "err", err)
}

// close stops accepting, closes every connection and waits for all
// goroutines of the server.
func (s *server) close() error {
	var err error
	s.closeOnce.Do(func() {
		s.mu.Lock()
		close(s.done)
		conns := make([]*conn, 0, len(s.conns))
		for c := range s.conns {
			conns = append(conns, c)
		}
		s.mu.Unlock()
		err = s.ln.Close()
		for _, c := range conns {
			c.close()
		}
		s.wg.Wait()
	})
	return err
}
