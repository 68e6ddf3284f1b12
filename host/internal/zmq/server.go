package zmq

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/backoff"
	"github.com/kvhost/kvhost/host/internal/ratelog"
)

// maxPendingHandshakes bounds connections that have not finished their
// handshake yet (and MaxConns, when that is lower); more are closed at
// once, so a flood of silent TCP clients costs at most this many
// goroutines for one handshake timeout each.
const maxPendingHandshakes = 1024

// server is the listening half shared by Pull and Router: an accept loop
// that hands each connection to its own goroutine for the handshake (under
// a deadline) and then to the socket's read loop.
//
// It keeps at most MaxConns connections past their handshake. When a new
// one finishes its handshake with the socket full, a source (remote IP
// address; for ipc peers their process, see PeerCred.source) holding the most connections gives one up, the one least
// recently active that is not in the middle of a message (victimLocked):
// a source holding fewer than another therefore always gets in, and
// where sources hold about as many (everyone on one host) connections
// idle for at least evictIdle give way. With nothing to give up, the new
// connection is refused before it may send anything (our READY is sent
// only after this decision, so no message is lost). Connections silent
// for the idle timeout are closed in any case.
type server struct {
	typ  string
	o    options
	log  *slog.Logger    // rate-limited: peers trigger its lines
	rlog *ratelog.Logger // log's limiter, flushed by close
	ln   net.Listener
	addr string // connectable endpoint of ln
	// ipc endpoints: file is the socket file (nil when abstract),
	// removed by close; abstract sockets check each peer's credentials
	// against o.socketMode themselves.
	file     *socketFile
	abstract bool

	// serve runs the read loop of one connection; it returns when the
	// connection ends or the server closes.
	serve func(c *conn)

	pending chan struct{} // semaphore of handshakes in progress

	done      chan struct{}
	closeOnce sync.Once
	mu        sync.Mutex
	conns     map[*conn]struct{}            // past their handshake (≤ o.maxConns)
	bySource  map[string]map[*conn]struct{} // conns by c.src
	evicted   int                           // connections closed to make room (tests)
	wg        sync.WaitGroup
}

// listen binds endpoint; start begins accepting.
func listen(endpoint, typ string, o options, serve func(*conn)) (*server, error) {
	a, err := parseEndpoint(endpoint, true)
	if err != nil {
		return nil, err
	}
	var ln net.Listener
	var file *socketFile
	if a.network == "unix" {
		ln, file, err = listenUnix(a, o.socketMode)
	} else {
		ln, err = net.Listen(a.network, a.addr)
	}
	if err != nil {
		return nil, err
	}
	rlog := ratelog.New(o.logger)
	s := &server{
		typ:      typ,
		o:        o,
		log:      rlog.With("zmq_socket", typ, "zmq_endpoint", endpointOf(ln.Addr())),
		rlog:     rlog,
		ln:       ln,
		addr:     endpointOf(ln.Addr()),
		file:     file,
		abstract: a.abstract(),
		serve:    serve,
		pending:  make(chan struct{}, min(maxPendingHandshakes, o.maxConns)),
		done:     make(chan struct{}),
		conns:    make(map[*conn]struct{}),
		bySource: make(map[string]map[*conn]struct{}),
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
	retry := backoff.New(5*time.Millisecond, time.Second)
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
			wait := retry.Next()
			s.log.Warn("zmq accept failed", "err", err, "retry_in", wait)
			select {
			case <-time.After(wait):
			case <-s.done:
				return
			}
			continue
		}
		retry.Reset()
		select {
		case s.pending <- struct{}{}:
		default:
			s.refuse(nc, "zmq too many connections in handshake; refusing a connection", "max_handshakes", cap(s.pending))
			continue
		}
		s.wg.Add(1)
		go s.handle(nc)
	}
}

// refuse closes a connection the socket will not serve and logs it
// (rate-limited: a flood of connections must not flood the log).
func (s *server) refuse(nc net.Conn, msg string, args ...any) {
	nc.Close()
	s.log.Warn(msg, append(args, "peer", remoteName(nc))...)
}

func (s *server) handle(nc net.Conn) {
	defer s.wg.Done()
	// Closing the server interrupts a handshake in progress.
	handshaking := make(chan struct{})
	go func() {
		select {
		case <-s.done:
			nc.Close()
		case <-handshaking:
		}
	}()
	// An ipc peer is named by its credentials, taken before anything is
	// read from it; an abstract socket refuses other users here (it has
	// no file mode for the kernel to check).
	cred, err := peerCred(nc)
	if err == nil && cred != nil && s.abstract && !credAllowed(*cred, s.o.socketMode) {
		err = fmt.Errorf("peer %v may not connect (socket mode %v)", *cred, s.o.socketMode)
	}
	name := remoteName(nc)
	if cred != nil {
		name = "ipc " + cred.String()
	}
	var c *conn
	if err == nil {
		c, err = handshakeConn(nc, s.typ, &s.o, true)
	}
	close(handshaking)
	<-s.pending
	if err != nil {
		nc.Close()
		err = fmt.Errorf("zmq: handshake with %s: %w", name, err)
		select {
		case <-s.done:
		default:
			s.log.Warn("zmq peer rejected", "peer", name, "err", err)
		}
		return
	}
	c.msgTimeout, c.idleTimeout = s.o.messageTimeout, s.o.idleTimeout
	c.peer, c.cred = name, cred
	c.src = sourceOf(nc.RemoteAddr(), cred)
	c.lastActive.Store(time.Now().UnixNano())
	if !s.admit(c) {
		nc.Close()
		return
	}
	defer s.untrack(c)
	if err := c.finishHandshake(s.typ, &s.o); err != nil {
		s.readError(c, fmt.Errorf("zmq: handshake with %s: %w", c.peer, err))
		return
	}
	s.serve(c)
}

// sourceOf is what the connection limit is shared fairly between: the
// peer's IP address, or for an ipc peer its process (PeerCred.source;
// one shared source where the credentials are unknown).
func sourceOf(a net.Addr, cred *PeerCred) string {
	if cred != nil {
		return cred.source()
	}
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.IP.String()
	}
	if _, ok := a.(*net.UnixAddr); ok || a == nil {
		return "ipc"
	}
	return a.String()
}

// admit tracks c, making room for it when the socket is full (see
// server); false when it is refused or the server is closed.
func (s *server) admit(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.done:
		return false
	default:
	}
	if len(s.conns) >= s.o.maxConns {
		v := s.victimLocked(c.src, time.Now())
		if v == nil {
			s.log.Warn("zmq connection limit reached and no connection can give way; refusing a connection",
				"max_conns", s.o.maxConns, "peer", c.peer)
			return false
		}
		s.log.Info("zmq connection limit reached; closing the least recently active connection of the source holding the most",
			"max_conns", s.o.maxConns, "closed", v.peer, "idle", time.Since(time.Unix(0, v.lastActive.Load())).Round(time.Millisecond),
			"source_conns", len(s.bySource[v.src]), "peer", c.peer)
		s.evicted++
		s.forgetLocked(v)
		v.close() // its read loop ends and untracks it (a no-op by then)
	}
	s.conns[c] = struct{}{}
	m := s.bySource[c.src]
	if m == nil {
		m = make(map[*conn]struct{})
		s.bySource[c.src] = m
	}
	m[c] = struct{}{}
	return true
}

// victimLocked picks the connection that gives way to a new one from
// source src, or nil: the least recently active connection, not in the
// middle of a message, of the sources holding the most connections. A
// source holding at least two more than src gives one up at once;
// otherwise (src is among the largest, or every source holds about as
// many: one host, or many hosts with one connection each) only a
// connection idle for evictIdle gives way, so that new connections
// cannot push out active peers.
func (s *server) victimLocked(src string, now time.Time) *conn {
	own, most := len(s.bySource[src]), 0
	for _, cs := range s.bySource {
		most = max(most, len(cs))
	}
	var minIdle time.Duration
	if most < own+2 {
		minIdle = s.o.evictIdle
	}
	var victim *conn
	var oldest int64
	for c := range s.conns {
		if len(s.bySource[c.src]) != most || c.inMessage.Load() {
			continue
		}
		la := c.lastActive.Load()
		if now.Sub(time.Unix(0, la)) < minIdle {
			continue
		}
		if victim == nil || la < oldest {
			victim, oldest = c, la
		}
	}
	return victim
}

func (s *server) forgetLocked(c *conn) {
	if _, ok := s.conns[c]; !ok {
		return
	}
	delete(s.conns, c)
	m := s.bySource[c.src]
	delete(m, c)
	if len(m) == 0 {
		delete(s.bySource, c.src)
	}
}

func (s *server) untrack(c *conn) {
	c.close()
	s.mu.Lock()
	s.forgetLocked(c)
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
	if isClosedErr(err) || errors.Is(err, errIdle) {
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
		s.file.remove()
		for _, c := range conns {
			c.close()
		}
		s.wg.Wait()
		s.rlog.Close()
	})
	return err
}
