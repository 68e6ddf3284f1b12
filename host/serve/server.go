package serve

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/serve/engmem"
)

// Protocol version of docs/engine-api.md.
const (
	ProtocolMajor = 1
	ProtocolMinor = 0
)

// Defaults of Config.
const (
	// DefaultMaxMessage bounds one request (and what the sidecar reads of
	// a larger one: it is discarded, answered too_large). The largest an
	// engine sends are page and block lists: sender_send and
	// receiver_init's pages of a million-page request are 4 MiB, a read's
	// block ids of a million blocks 4 MiB (and as much again as
	// kv_transfer_params' list), register_memory of 4096 regions a few
	// hundred KiB.
	DefaultMaxMessage = 16 << 20
	DefaultMaxRanks   = 64
	DefaultMaxRegions = 4096
	DefaultMaxRooms   = 1 << 16
	// DefaultEventQueue and DefaultEventQueueBytes bound the replies and
	// events waiting to be written to one connection. An engine past
	// either (or that does not take one message within the send timeout)
	// is dropped as one that does not read: its session is torn down as
	// if it had disconnected; other connections are not affected. They
	// are floors: Config.defaults raises them to hold the largest burst
	// of events the sidecar's own limits allow one connection to be sent
	// at once (eventBurst), so an engine that reads is never dropped for
	// a burst the sidecar made.
	DefaultEventQueue      = 1 << 18
	DefaultEventQueueBytes = 256 << 20
	// DefaultRequestQueue bounds the requests of one connection waiting
	// for its session; more are answered with `limit` at once, as are
	// requests beyond 2 MaxMessage bytes waiting on one connection or 8
	// MaxMessage bytes on all of them.
	DefaultRequestQueue = 1024
	// DefaultSendTimeout bounds writing one message to an engine.
	DefaultSendTimeout = 30 * time.Second
	// DefaultOpenTimeout bounds creating a rank: its agent, its socket
	// and, for an SGLang prefill rank, its registration with the
	// bootstrap server.
	DefaultOpenTimeout = 30 * time.Second
)

// Limits bound what one connection may hold (sent in hello).
type Limits struct {
	Ranks   int
	Regions int
	Rooms   int
}

// Config configures a Server.
type Config struct {
	// Control is the endpoint of the ROUTER socket (ipc://path; tcp://
	// works too, for tests).
	Control string
	// Plugin moves the bytes: every rank gets its own agent of it.
	Plugin      *plugin.Plugin
	Backend     string // the plugin's name, for hello
	AgentParams []plugin.Param
	// Settings are the push runtime's tunables for SGLang ranks.
	Settings push.Settings
	// Observer, if set, also sees every push runtime event (metrics).
	Observer push.Observer
	// PullObserver, if set, sees every pull runtime event of vLLM ranks.
	PullObserver pull.Observer
	// HandshakeTimeout bounds a vLLM decode rank's handshake with a
	// prefill's side channel (0: pull.DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
	// Host is the default IP ranks bind to and advertise (default
	// 127.0.0.1); a rank's own `host` field wins.
	Host string

	Limits          Limits
	MaxMessage      int64
	EventQueue      int   // messages; 0: DefaultEventQueue or the burst bound
	EventQueueBytes int64 // bytes; 0: DefaultEventQueueBytes or the burst bound
	RequestQueue    int
	SendTimeout     time.Duration
	OpenTimeout     time.Duration
	// Version is the sidecar's version string for hello.
	Version string
	Logger  *slog.Logger
	// CUDALibrary is the libcudart VRAM regions are opened with ("":
	// $KVHOST_CUDART, then libcudart.so, .so.13, .so.12).
	CUDALibrary string
}

func (c *Config) defaults() {
	if c.Limits.Ranks <= 0 {
		c.Limits.Ranks = DefaultMaxRanks
	}
	if c.Limits.Regions <= 0 {
		c.Limits.Regions = DefaultMaxRegions
	}
	if c.Limits.Rooms <= 0 {
		c.Limits.Rooms = DefaultMaxRooms
	}
	if c.MaxMessage <= 0 {
		c.MaxMessage = DefaultMaxMessage
	}
	if c.RequestQueue <= 0 {
		c.RequestQueue = DefaultRequestQueue
	}
	msgs, bytes := eventBurst(c.Limits, c.RequestQueue, c.MaxMessage)
	if c.EventQueue <= 0 {
		c.EventQueue = max(DefaultEventQueue, msgs)
	}
	if c.EventQueueBytes <= 0 {
		c.EventQueueBytes = max(DefaultEventQueueBytes, bytes)
	}
	if c.SendTimeout <= 0 {
		c.SendTimeout = DefaultSendTimeout
	}
	if c.OpenTimeout <= 0 {
		c.OpenTimeout = DefaultOpenTimeout
	}
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	if c.Version == "" {
		c.Version = "kvhost"
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if c.Observer == nil {
		c.Observer = push.NopObserver{}
	}
}

// Largest events, in bytes, for eventBurst: a room event (its reason
// clipped to maxReason), a released event (two ids of at most vllmMaxID).
const (
	roomEventMax     = 64 + maxReason
	releasedEventMax = 64 + 2*vllmMaxID
)

// eventBurst is the most one connection can be sent at once by the
// sidecar's own doing, within its limits: a failure event for every room
// (its prefill's sidecar died, its rank closed), a released event for
// every request its engine holds (the scheduler's connection closed), a
// read event for every read in flight on a rank, and the replies of its
// queued requests, with one request queue of replies as slack.
func eventBurst(l Limits, requests int, maxMessage int64) (msgs int, bytes int64) {
	msgs = l.Rooms + vllmMaxHolds + vllmMaxReads + 2*requests
	bytes = int64(l.Rooms)*roomEventMax + vllmMaxHolds*releasedEventMax + 4*maxMessage
	return msgs, bytes
}

// Server is the control server of `kvhost serve`: one session per engine
// connection on a ZeroMQ ROUTER socket. See the package doc.
type Server struct {
	cfg     Config
	log     *slog.Logger
	router  *zmq.Router
	session string // random per process (hello's session)
	opener  engmem.Opener

	nextRank atomic.Uint64 // rank ids, unique in the process
	closing  atomic.Bool
	queued   atomic.Int64 // bytes of requests waiting in every session's queue

	mu       sync.Mutex
	sessions map[string]*session
	wg       sync.WaitGroup // the receive loop and every session goroutine
	ext      map[string]any // per-style server state (see Server.state)

	// The bootstrap server of start_bootstrap (bootserver.go).
	bootMu   sync.Mutex
	boot     *bootstrap.Running
	bootSrv  *bootstrap.Server
	bootPort int // the port it serves

	stop     context.CancelFunc
	loopDone chan struct{}
	closed   chan struct{}
	once     sync.Once
	closeErr error
}

// New binds the control socket and starts serving.
func New(cfg Config) (*Server, error) {
	cfg.defaults()
	if cfg.Plugin == nil {
		return nil, errors.New("serve: no plugin")
	}
	var id [8]byte
	rand.Read(id[:])
	s := &Server{
		cfg: cfg, log: cfg.Logger, session: hex.EncodeToString(id[:]),
		sessions: make(map[string]*session), ext: make(map[string]any),
		loopDone: make(chan struct{}), closed: make(chan struct{}),
	}
	s.opener.CUDALibrary = cfg.CUDALibrary
	r, err := zmq.ListenRouter(cfg.Control, s.zmqOptions()...)
	if err != nil {
		return nil, fmt.Errorf("serve: control socket: %w", err)
	}
	s.router = r
	ctx, cancel := context.WithCancel(context.Background())
	s.stop = cancel
	go s.loop(ctx)
	return s, nil
}

// Endpoint is the control endpoint engines connect to.
func (s *Server) Endpoint() string { return s.router.Endpoint() }

// Session is this process's session id (hello's session).
func (s *Server) Session() string { return s.session }

// Sessions is the number of engine connections with a session.
func (s *Server) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}

// state returns the server-wide state a style keeps under key, made by mk
// the first time (vLLM's engine groups span connections).
func (s *Server) state(key string, mk func() any) any {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.ext[key]
	if !ok {
		v = mk()
		s.ext[key] = v
	}
	return v
}

// forEachSession calls fn for every live session (events to several
// connections).
func (s *Server) forEachSession(fn func(*session)) {
	s.mu.Lock()
	ss := make([]*session, 0, len(s.sessions))
	for _, x := range s.sessions {
		ss = append(ss, x)
	}
	s.mu.Unlock()
	for _, x := range ss {
		fn(x)
	}
}

// loop receives every engine message and hands it to its session.
func (s *Server) loop(ctx context.Context) {
	defer close(s.loopDone)
	for {
		m, err := s.router.Recv(ctx)
		if err != nil {
			return
		}
		s.dispatch(m)
	}
}

func (s *Server) dispatch(m zmq.RouterMsg) {
	peer := string(m.Peer)
	if len(m.Frames) == 0 {
		// zmq.WithDiscardOversize's marker: the message was read and
		// dropped; its seq is unknown.
		s.replyRaw(m.Peer, encodeError(0, false, errorf(CodeTooLarge, "the message is larger than max_message (%d bytes) and was discarded unread", s.cfg.MaxMessage)))
		return
	}
	if len(m.Frames) != 1 {
		// A REQ peer's delimiter or a multi-frame message: the API is one
		// frame per message.
		s.replyRaw(m.Peer, encodeError(0, false, errorf(CodeBadRequest, "a request is one frame holding a msgpack map, got %d frames", len(m.Frames))))
		return
	}
	s.mu.Lock()
	sess := s.sessions[peer]
	if sess == nil {
		if s.closing.Load() {
			s.mu.Unlock()
			s.replyRaw(m.Peer, encodeError(0, false, errorf(CodeShuttingDown, "the sidecar is stopping")))
			return
		}
		sess = newSession(s, m.Peer)
		s.sessions[peer] = sess
		s.wg.Add(1)
		go sess.run()
	}
	// Queued under s.mu: once forget has removed the session, nothing
	// more reaches its queue (teardown drains it).
	b := m.Frames[0]
	n := int64(len(b))
	// Bytes waiting for sessions: at most two max_message per
	// connection (one request may always wait) and eight in all.
	var refuse *Error
	if q := sess.queued.Add(n); q > n && q > 2*s.cfg.MaxMessage {
		refuse = errorf(CodeLimit, "more than %d bytes of requests waiting on this connection", 2*s.cfg.MaxMessage)
	} else if t := s.queued.Add(n); t > n && t > 8*s.cfg.MaxMessage {
		s.queued.Add(-n)
		refuse = errorf(CodeLimit, "the sidecar has more than %d bytes of requests waiting", 8*s.cfg.MaxMessage)
	}
	if refuse == nil {
		select {
		case sess.in <- b:
			s.mu.Unlock()
			return
		default:
			s.queued.Add(-n)
			refuse = errorf(CodeLimit, "more than %d requests waiting on this connection", cap(sess.in))
		}
	}
	s.mu.Unlock()
	sess.queued.Add(-n)
	r, seqOK, _ := parseRequest(b)
	var seq uint64
	if r != nil {
		seq = r.seq
	}
	sess.send(encodeError(seq, seqOK, refuse))
}

// replyRaw answers a peer that has no session.
func (s *Server) replyRaw(peer []byte, msg []byte) {
	if err := s.router.Enqueue(peer, msg); err != nil {
		s.log.Debug("serve: reply not queued", "err", err)
	}
}

// peerGone tears down the session of a connection that closed.
func (s *Server) peerGone(peer []byte) {
	s.mu.Lock()
	sess := s.sessions[string(peer)]
	s.mu.Unlock()
	if sess != nil {
		sess.stop("engine disconnected", false)
	}
}

// forget removes a finished session.
func (s *Server) forget(sess *session) {
	s.mu.Lock()
	if s.sessions[string(sess.peer)] == sess {
		delete(s.sessions, string(sess.peer))
	}
	s.mu.Unlock()
}

// Close stops the sidecar (docs/engine-api.md, Lifecycle): new requests
// are refused with shutting_down, every session fails its unfinished rooms
// with "sidecar shutting down" and sends those events (within ctx), then
// everything is released and the control socket closed.
func (s *Server) Close(ctx context.Context) error {
	s.once.Do(func() {
		s.closing.Store(true)
		s.mu.Lock()
		ss := make([]*session, 0, len(s.sessions))
		for _, x := range s.sessions {
			ss = append(ss, x)
		}
		s.mu.Unlock()
		for _, x := range ss {
			x.stop("sidecar shutting down", true)
		}
		for _, x := range ss {
			select {
			case <-x.done:
			case <-ctx.Done():
			}
		}
		// Let the failure events reach the engines.
		s.router.Flush(ctx)
		s.stop()
		<-s.loopDone
		s.closeErr = s.router.Close()
		// Sessions made after the snapshot (none: closing refuses them)
		// and the ones ctx cut short.
		s.forEachSession(func(x *session) { x.stop("sidecar shutting down", false) })
		s.wg.Wait()
		s.closeBootstrap()
		close(s.closed)
	})
	return s.closeErr
}

func (s *Server) zmqOptions() []zmq.Option {
	return []zmq.Option{
		zmq.WithLogger(s.log),
		zmq.WithMaxMessageSize(s.cfg.MaxMessage),
		zmq.WithDiscardOversize(),
		zmq.WithSendQueue(s.cfg.EventQueue),
		zmq.WithSendQueueBytes(s.cfg.EventQueueBytes),
		zmq.WithSendTimeout(s.cfg.SendTimeout),
		// An engine may stay quiet for hours between requests; its
		// connection is its session.
		zmq.WithIdleTimeout(0),
		// The connection is the session: its end tears the session down.
		zmq.WithDisconnectHandler(s.peerGone),
	}
}

// closeBootstrap stops the bootstrap server of start_bootstrap, if any.
func (s *Server) closeBootstrap() {
	s.bootMu.Lock()
	b := s.boot
	s.boot, s.bootSrv = nil, nil
	s.bootMu.Unlock()
	if b != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		b.Close(ctx)
	}
}

// DefaultControl is the control endpoint of docs/engine-api.md:
// ipc://$XDG_RUNTIME_DIR/kvhost.sock, else ipc:///tmp/kvhost-<uid>.sock.
func DefaultControl() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return "ipc://" + filepath.Join(d, "kvhost.sock")
	}
	return fmt.Sprintf("ipc:///tmp/kvhost-%d.sock", os.Getuid())
}

// CountRooms reports the rooms open on every connection (a metrics
// RoomSource: state "open").
func (s *Server) CountRooms(count func(state string, n int)) {
	n := int64(0)
	s.forEachSession(func(x *session) { n += x.rooms.Load() })
	count("open", int(n))
}
