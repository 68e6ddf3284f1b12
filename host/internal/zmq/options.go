package zmq

import (
	"log/slog"
	"os"
	"time"
)

// Defaults of the options, sized for a control plane: every bound socket
// (PULL, ROUTER) holds at most DefaultRecvBudget + DefaultMaxMessageSize
// bytes of received messages, plus 64 KiB per connection and per message
// queued for Recv (DefaultMaxConns and DefaultRecvQueue of them), plus a
// 64 KiB read buffer per connection (DefaultMaxConns, and as many in
// their handshake): about 400 MiB at worst, whatever its peers send.
//
// The largest legitimate messages are SGLang's: a NIXL KV registration
// carries the agent's metadata blob (connection info plus a serialized
// descriptor with a remote key for each registered region: of the order
// of a kilobyte per region, so about 10 MiB for ten thousand regions); a
// MORI registration one msgpack MemoryDesc of about 150 bytes per region;
// transfer info one int32 per KV page (4 MiB for a million pages, 40 MiB
// for ten million). DefaultMaxMessageSize covers all of these with room to
// spare; raise it with WithMaxMessageSize for anything larger.
const (
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultMaxMessageSize   = 64 << 20 // bytes, all frames of one message together
	DefaultMaxFrames        = 4096     // frames per message
	DefaultRecvQueue        = 128      // messages buffered between connections and Recv
	// DefaultRecvBudget bounds, in bytes, the received messages a bound
	// socket holds (queued for Recv or being read): two of the largest.
	DefaultRecvBudget = 2 * DefaultMaxMessageSize
	// DefaultMaxConns bounds the connections of a bound socket past their
	// handshake (as many more may be in their handshake). A prefill
	// rank's PULL socket has one per decode rank that talks to it
	// (hundreds in a large deployment); a vLLM handshake ROUTER one per
	// decode worker in its handshake.
	DefaultMaxConns = 1024
	// DefaultIdleTimeout closes a bound socket's connection whose peer
	// sent nothing for that long. libzmq peers and Push reconnect by
	// themselves when they next send.
	DefaultIdleTimeout = 5 * time.Minute
	// DefaultSendQueue bounds the messages Router.Enqueue keeps waiting
	// for one peer. A REQ peer has one request, so one reply, at a time;
	// a peer with this many waiting is not reading them.
	DefaultSendQueue    = 16
	DefaultSendTimeout  = 30 * time.Second
	DefaultReconnectMin = 50 * time.Millisecond
	DefaultReconnectMax = time.Second
	DefaultKeepAlive    = 30 * time.Second
)

// messageTimeout bounds how long a peer of a bound socket (PULL, ROUTER)
// may take to send the rest of a message once it has started it. Control
// messages are at most a few megabytes; a peer that takes longer is stuck
// or hostile.
const messageTimeout = 30 * time.Second

// evictIdle is how long a connection must have been idle before a new
// connection from the same source may replace it on a full socket (see
// server): long enough that active peers are never pushed out by new
// connections of their own host, short enough that a peer locked out by
// idle connections gets in on its next reconnect attempt.
const evictIdle = time.Second

// contendedTimeout bounds how long a connection may keep part of a
// message in the receive budget while another connection waits for the
// budget: it must finish its message within that time of the wait's
// start, or is dropped (see recvBudget). This happens only while the
// budget is spent (DefaultRecvBudget: 128 MiB of messages in flight), and
// a control message of tens of megabytes takes milliseconds on the links
// kvhost runs over.
const contendedTimeout = time.Second

// Option configures a socket.
type Option func(*options)

type options struct {
	logger           *slog.Logger
	handshakeTimeout time.Duration
	maxMessageSize   int64
	maxFrames        int
	recvQueue        int
	recvBudget       int64
	sendQueue        int
	sendQueueBytes   int64
	maxConns         int
	sendTimeout      time.Duration
	reconnectMin     time.Duration
	reconnectMax     time.Duration
	keepAlive        time.Duration
	idleTimeout      time.Duration
	messageTimeout   time.Duration // see messageTimeout; tests shorten it
	evictIdle        time.Duration // see evictIdle; tests shorten it
	contendedTimeout time.Duration // see contendedTimeout; tests shorten it
	socketMode       os.FileMode
	onDisconnect     func(peer []byte)
	discardOversize  bool // see WithDiscardOversize
	// enqueueHook, when set (tests), learns what Router.Enqueue did
	// with each message it accepted.
	enqueueHook func(enqueuePath)
	burstGap    time.Duration // see burstGap; tests change it
}

func buildOptions(opts []Option) options {
	o := options{
		logger:           slog.Default(),
		handshakeTimeout: DefaultHandshakeTimeout,
		maxMessageSize:   DefaultMaxMessageSize,
		maxFrames:        DefaultMaxFrames,
		recvQueue:        DefaultRecvQueue,
		recvBudget:       DefaultRecvBudget,
		sendQueue:        DefaultSendQueue,
		maxConns:         DefaultMaxConns,
		sendTimeout:      DefaultSendTimeout,
		reconnectMin:     DefaultReconnectMin,
		reconnectMax:     DefaultReconnectMax,
		keepAlive:        DefaultKeepAlive,
		idleTimeout:      DefaultIdleTimeout,
		messageTimeout:   messageTimeout,
		evictIdle:        evictIdle,
		contendedTimeout: contendedTimeout,
		socketMode:       DefaultSocketMode,
		burstGap:         burstGap,
	}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithLogger sets the logger for connection-level events (peers rejected,
// protocol violations, reconnects). A socket writes through it
// rate-limited (host/internal/ratelog), since peers trigger these lines.
// Default: slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.logger = l
		}
	}
}

// WithHandshakeTimeout bounds the ZMTP greeting and READY exchange of each
// connection. A peer that does not finish in time is dropped.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.handshakeTimeout = d
		}
	}
}

// WithMaxMessageSize bounds the total size in bytes of one received message
// (all frames). A peer that exceeds it is disconnected (the oversized
// message is refused by its frame header, before it is read).
// Default: DefaultMaxMessageSize.
func WithMaxMessageSize(n int64) Option {
	return func(o *options) {
		if n > 0 {
			o.maxMessageSize = n
		}
	}
}

// WithMaxFrames bounds the number of frames of one received message.
func WithMaxFrames(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.maxFrames = n
		}
	}
}

// WithRecvQueue sets how many received messages a PULL, ROUTER or DEALER
// socket buffers before it stops reading from its connections (back-pressure
// reaches the senders through TCP flow control, like libzmq's RCVHWM).
func WithRecvQueue(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.recvQueue = n
		}
	}
}

// WithRecvBudget bounds the memory in bytes that a PULL, ROUTER or DEALER
// socket holds for received messages, those waiting for Recv and those still
// being read. While it is spent the socket stops reading from its
// connections until Recv frees some (back-pressure on the senders, as
// with WithRecvQueue); nothing is dropped. One message may go past the
// budget when nothing else could free it, so the socket holds at most the
// budget plus one message. Default: DefaultRecvBudget.
func WithRecvBudget(n int64) Option {
	return func(o *options) {
		if n > 0 {
			o.recvBudget = n
		}
	}
}

// WithMaxConns bounds the connections a PULL or ROUTER socket keeps open
// past their handshake; at most as many more (and at most 1024) may be in
// their handshake, and one past that is closed as soon as it is accepted.
// A connection that finishes its handshake with the socket full makes
// room by closing the least recently active connection of a source (IP
// address; for ipc, the peer process) holding the most: at once if that
// source holds at least two more than the new connection's, otherwise
// only one idle for a second;
// with nothing to close it is refused before it may send a message.
// Refusals are logged, rate-limited. Default: DefaultMaxConns.
func WithMaxConns(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.maxConns = n
		}
	}
}

// WithIdleTimeout closes a PULL or ROUTER socket's connection whose peer
// sends nothing for d (zero: never). Default: DefaultIdleTimeout.
func WithIdleTimeout(d time.Duration) Option {
	return func(o *options) {
		if d >= 0 {
			o.idleTimeout = d
		}
	}
}

// WithSendQueue bounds the messages Router.Enqueue keeps waiting to be
// written to one peer; past it Enqueue fails with ErrPeerBusy. Default:
// DefaultSendQueue.
func WithSendQueue(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.sendQueue = n
		}
	}
}

// WithSendQueueBytes bounds the bytes of the messages Router.Enqueue
// keeps waiting to be written to one peer; past it Enqueue fails with
// ErrPeerBusy, as past WithSendQueue. A message is always taken into an
// empty queue, so one larger than n still goes out. Default: no bound
// but WithSendQueue's count.
func WithSendQueueBytes(n int64) Option {
	return func(o *options) {
		if n > 0 {
			o.sendQueueBytes = n
		}
	}
}

// WithSendTimeout bounds a Push.Send, Dealer.Send or Router.Send whose
// context has no deadline, and each message written for Router.Enqueue
// (SGLang uses SNDTIMEO 30 s for prefill-side sockets, 5 s for MORI's
// status sockets).
// Zero means no bound. Default: DefaultSendTimeout.
func WithSendTimeout(d time.Duration) Option {
	return func(o *options) {
		if d >= 0 {
			o.sendTimeout = d
		}
	}
}

// WithReconnectInterval sets the first and the largest wait between two
// connection attempts of a PUSH or DEALER socket (doubling in between).
func WithReconnectInterval(min, max time.Duration) Option {
	return func(o *options) {
		if min > 0 {
			o.reconnectMin = min
		}
		if max >= o.reconnectMin {
			o.reconnectMax = max
		}
	}
}

// WithSocketMode sets the permission bits of the socket file a PULL or
// ROUTER bound to an ipc:// endpoint creates (the kernel checks them when
// a peer connects; connecting needs write permission). For an abstract
// socket (ipc://@name), which has no file, the socket applies the same
// bits itself to each peer's SO_PEERCRED before the handshake (see
// PeerCred). Default: DefaultSocketMode (0600, the user only).
func WithSocketMode(mode os.FileMode) Option {
	return func(o *options) { o.socketMode = mode.Perm() }
}

// WithDisconnectHandler makes a Router call fn with a peer's id once its
// connection is gone, exactly once for every connection that completed
// its handshake, whatever ended it: the peer closed it or died, a
// protocol error, the idle timeout, eviction for a new connection, a
// failed write, or Router.Close.
//
// fn runs on the goroutine of the Router.Recv call that reaches the
// peer's end in the receive queue: after Recv has returned every message
// that peer sent, so a handler that tears the peer's state down never
// sees a message of it afterwards (Send and Enqueue to the id already
// fail with ErrUnknownPeer). The connections still open when Close is
// called, and those whose end no Recv reached, get fn from Close before
// it returns; while nothing calls Recv, fn waits like the messages do.
// fn must not block for long (it holds up Recv) and must not call Close.
// Other sockets ignore the option (a Dealer reports its connection's end
// through Recv: ErrDisconnected).
func WithDisconnectHandler(fn func(peer []byte)) Option {
	return func(o *options) { o.onDisconnect = fn }
}
