// Package memtransport is an in-process, deterministic network for the
// control messages of kvhost's runtimes: one-way messages to a bound
// endpoint (what push's ZMQ PULL/PUSH sockets carry) and request/reply
// exchanges (vLLM's handshake side channel), with a filter that drops or
// delays any message. A delay is timed on the Network's clock, so a test
// on a clock.Fake decides exactly when a delayed message arrives. Tests
// adapt a Network to push.Transport and pull.Transport.
//
// Endpoints are "tcp://host:port" strings as the runtimes advertise them;
// port 0 binds the next free port (from 40000). Nothing touches the
// operating system's network.
package memtransport

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
)

// ErrRefused is returned for a message to an endpoint nobody is bound to
// (it wraps syscall.ECONNREFUSED, as a TCP connect does).
var ErrRefused = fmt.Errorf("memtransport: connection refused: %w", syscall.ECONNREFUSED)

// InboxQueue bounds the messages waiting in one Inbox; a send to a full
// inbox blocks until there is room or its context ends.
const InboxQueue = 1024

// Msg is a message in flight, as the filter sees it.
type Msg struct {
	From    net.Addr // the sender's address
	To      string   // the endpoint
	Frames  [][]byte
	Request bool // a request of a request/reply exchange
}

// Verdict is what the filter does with a message: deliver it (the zero
// Verdict), drop it (a dropped request is never answered) or deliver it
// after Delay on the Network's clock.
type Verdict struct {
	Drop  bool
	Delay time.Duration
}

// Network is a set of endpoints. Safe for concurrent use.
type Network struct {
	clock clock.Clock

	mu       sync.Mutex
	inboxes  map[string]*Inbox
	servers  map[string]*Server
	nextPort int
	filter   func(Msg) Verdict
	sent     int64
	dropped  int64
}

// New returns an empty Network whose delays are timed on c (nil: the wall
// clock).
func New(c clock.Clock) *Network {
	return &Network{clock: clock.Or(c), inboxes: map[string]*Inbox{}, servers: map[string]*Server{}, nextPort: 40000}
}

// SetFilter sets what happens to every later message (nil: deliver all).
func (n *Network) SetFilter(f func(Msg) Verdict) {
	n.mu.Lock()
	n.filter = f
	n.mu.Unlock()
}

// Counts returns how many messages were sent and how many the filter
// dropped.
func (n *Network) Counts() (sent, dropped int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.sent, n.dropped
}

// bindLocked resolves endpoint to the bound one (port 0: the next free
// port) and checks it is free.
func (n *Network) bindLocked(endpoint string) (string, netip.AddrPort, error) {
	ap, err := parse(endpoint)
	if err != nil {
		return "", ap, err
	}
	if ap.Port() == 0 {
		for {
			n.nextPort++
			cand := netip.AddrPortFrom(ap.Addr(), uint16(n.nextPort))
			ep := "tcp://" + cand.String()
			if n.inboxes[ep] == nil && n.servers[ep] == nil {
				return ep, cand, nil
			}
		}
	}
	ep := "tcp://" + ap.String()
	if n.inboxes[ep] != nil || n.servers[ep] != nil {
		return "", ap, fmt.Errorf("memtransport: bind %s: %w", endpoint, syscall.EADDRINUSE)
	}
	return ep, ap, nil
}

func parse(endpoint string) (netip.AddrPort, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("memtransport: endpoint %q: want tcp://host:port", endpoint)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("memtransport: endpoint %q: %w", endpoint, err)
	}
	if host == "*" || host == "" {
		host = "0.0.0.0"
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("memtransport: endpoint %q: host must be an IP: %w", endpoint, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("memtransport: endpoint %q: %w", endpoint, err)
	}
	return netip.AddrPortFrom(addr, uint16(p)), nil
}

// verdict counts a message and applies the filter.
func (n *Network) verdict(m Msg) Verdict {
	n.mu.Lock()
	f := n.filter
	n.sent++
	n.mu.Unlock()
	if f == nil {
		return Verdict{}
	}
	v := f(m)
	if v.Drop {
		n.mu.Lock()
		n.dropped++
		n.mu.Unlock()
	}
	return v
}

// after runs fn now when d is 0, else after d on the Network's clock.
func (n *Network) after(d time.Duration, fn func()) {
	if d <= 0 {
		fn()
		return
	}
	n.clock.AfterFunc(d, fn)
}

// ---- one-way messages ----

type message struct {
	frames [][]byte
	from   net.Addr
}

// Inbox is a bound endpoint receiving one-way messages.
type Inbox struct {
	n        *Network
	endpoint string
	port     int
	msgs     chan message
	done     chan struct{}
	once     sync.Once
}

// Listen binds endpoint for one-way messages.
func (n *Network) Listen(endpoint string) (*Inbox, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	ep, ap, err := n.bindLocked(endpoint)
	if err != nil {
		return nil, err
	}
	in := &Inbox{n: n, endpoint: ep, port: int(ap.Port()), msgs: make(chan message, InboxQueue), done: make(chan struct{})}
	n.inboxes[ep] = in
	return in, nil
}

// RecvFrom returns the next message and its sender's address; it fails
// with ctx.Err() or, once the inbox is closed, net.ErrClosed.
func (in *Inbox) RecvFrom(ctx context.Context) ([][]byte, net.Addr, error) {
	select {
	case m := <-in.msgs:
		return m.frames, m.from, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	case <-in.done:
		return nil, nil, fmt.Errorf("memtransport: inbox %s: %w", in.endpoint, net.ErrClosed)
	}
}

// Endpoint is the bound endpoint; Port its port.
func (in *Inbox) Endpoint() string { return in.endpoint }
func (in *Inbox) Port() int        { return in.port }

// Close unbinds the endpoint; messages still queued are lost.
func (in *Inbox) Close() error {
	in.once.Do(func() {
		in.n.mu.Lock()
		if in.n.inboxes[in.endpoint] == in {
			delete(in.n.inboxes, in.endpoint)
		}
		in.n.mu.Unlock()
		close(in.done)
	})
	return nil
}

// Outbox sends one-way messages from one address.
type Outbox struct {
	n      *Network
	from   net.Addr
	mu     sync.Mutex
	closed bool
}

// Outbox returns a sender whose messages come from host (an IP) and a
// port of its own.
func (n *Network) Outbox(host string) *Outbox {
	n.mu.Lock()
	n.nextPort++
	port := n.nextPort
	n.mu.Unlock()
	return &Outbox{n: n, from: &net.TCPAddr{IP: net.ParseIP(host), Port: port}}
}

// Addr is the address receivers see the messages come from.
func (o *Outbox) Addr() net.Addr { return o.from }

// Send delivers a copy of frames to endpoint's inbox (after the filter's
// delay; not at all if it drops it). It fails at once when nobody is
// bound to endpoint, and waits for room in a full inbox until ctx ends.
func (o *Outbox) Send(ctx context.Context, endpoint string, frames ...[]byte) error {
	o.mu.Lock()
	closed := o.closed
	o.mu.Unlock()
	if closed {
		return fmt.Errorf("memtransport: outbox: %w", net.ErrClosed)
	}
	o.n.mu.Lock()
	in := o.n.inboxes[endpoint]
	o.n.mu.Unlock()
	if in == nil {
		return fmt.Errorf("memtransport: send to %s: %w", endpoint, ErrRefused)
	}
	m := message{frames: cloneFrames(frames), from: o.from}
	v := o.n.verdict(Msg{From: o.from, To: endpoint, Frames: m.frames})
	if v.Drop {
		return nil
	}
	if v.Delay > 0 {
		o.n.after(v.Delay, func() {
			select {
			case in.msgs <- m:
			case <-in.done:
			default: // a full inbox loses a late message (never block the clock)
			}
		})
		return nil
	}
	select {
	case in.msgs <- m:
		return nil
	case <-in.done:
		return fmt.Errorf("memtransport: send to %s: %w", endpoint, ErrRefused)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Forget is a no-op: an Outbox holds no connections.
func (o *Outbox) Forget(string) {}

// Close makes later sends fail.
func (o *Outbox) Close() error {
	o.mu.Lock()
	o.closed = true
	o.mu.Unlock()
	return nil
}

// ---- request/reply ----

// Handler answers one request; ok false leaves it unanswered (the client
// waits until its context ends).
type Handler func(from net.Addr, request [][]byte) (reply [][]byte, ok bool)

// Server is a bound endpoint answering requests.
type Server struct {
	n        *Network
	endpoint string
	port     int
	handle   Handler
	mu       sync.Mutex
	closed   bool
	wg       sync.WaitGroup // handlers running
}

// begin counts a handler in, unless the server closed.
func (s *Server) begin() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// Serve binds endpoint and answers each request with handle (in a
// goroutine of its own) until Close.
func (n *Network) Serve(endpoint string, handle Handler) (*Server, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	ep, ap, err := n.bindLocked(endpoint)
	if err != nil {
		return nil, err
	}
	s := &Server{n: n, endpoint: ep, port: int(ap.Port()), handle: handle}
	n.servers[ep] = s
	return s, nil
}

// Endpoint is the bound endpoint; Port its port.
func (s *Server) Endpoint() string { return s.endpoint }
func (s *Server) Port() int        { return s.port }

// Close unbinds the endpoint and waits for the handlers running (which
// must return); requests not yet handled get no reply.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.n.mu.Lock()
	if s.n.servers[s.endpoint] == s {
		delete(s.n.servers, s.endpoint)
	}
	s.n.mu.Unlock()
	s.wg.Wait()
	return nil
}

// ErrNoReply is returned by Request when the server closed without
// answering.
var ErrNoReply = errors.New("memtransport: server closed without a reply")

// Request sends request to endpoint from host's address and waits for the
// reply. It fails at once when nobody serves endpoint, and with ctx.Err()
// when ctx ends first (a dropped request, an unanswered one). The filter
// sees the request and the reply; a delay on either holds it on the
// Network's clock.
func (n *Network) Request(ctx context.Context, host, endpoint string, request [][]byte) ([][]byte, error) {
	n.mu.Lock()
	s := n.servers[endpoint]
	n.nextPort++
	from := &net.TCPAddr{IP: net.ParseIP(host), Port: n.nextPort}
	n.mu.Unlock()
	if s == nil {
		return nil, fmt.Errorf("memtransport: request to %s: %w", endpoint, ErrRefused)
	}
	reply := make(chan [][]byte, 1) // never blocks the one send
	req := cloneFrames(request)
	serve := func() {
		if !s.begin() {
			return
		}
		rep, ok := s.handle(from, req)
		s.wg.Done()
		if !ok {
			return
		}
		rep = cloneFrames(rep)
		v := n.verdict(Msg{From: ep(s), To: from.String(), Frames: rep})
		if v.Drop {
			return
		}
		n.after(v.Delay, func() { reply <- rep })
	}
	switch v := n.verdict(Msg{From: from, To: endpoint, Frames: req, Request: true}); {
	case v.Drop:
	case v.Delay > 0:
		n.after(v.Delay, func() { go serve() })
	default:
		go serve()
	}
	select {
	case rep := <-reply:
		return rep, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func ep(s *Server) net.Addr {
	ap, _ := parse(s.endpoint)
	return net.TCPAddrFromAddrPort(ap)
}

func cloneFrames(frames [][]byte) [][]byte {
	out := make([][]byte, len(frames))
	for i, f := range frames {
		out[i] = append([]byte(nil), f...)
	}
	return out
}
