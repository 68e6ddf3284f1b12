package zmq

import (
	"log/slog"
	"time"
)

// Defaults of the options. They are generous for control messages: the
// largest SGLang message is a registration carrying agent metadata and
// pointer lists (kilobytes to a few megabytes).
const (
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultMaxMessageSize   = 256 << 20 // bytes, all frames of one message together
	DefaultMaxFrames        = 4096      // frames per message
	DefaultRecvQueue        = 128       // messages buffered between connections and Recv
	DefaultSendTimeout      = 30 * time.Second
	DefaultReconnectMin     = 50 * time.Millisecond
	DefaultReconnectMax     = time.Second
	DefaultKeepAlive        = 30 * time.Second
)

// messageTimeout bounds how long a peer of a bound socket (PULL, ROUTER)
// may take to send the rest of a message once it has started it. Control
// messages are at most a few megabytes; a peer that takes longer is stuck
// or hostile.
const messageTimeout = 30 * time.Second

// Option configures a socket.
type Option func(*options)

type options struct {
	logger           *slog.Logger
	handshakeTimeout time.Duration
	maxMessageSize   int64
	maxFrames        int
	recvQueue        int
	sendTimeout      time.Duration
	reconnectMin     time.Duration
	reconnectMax     time.Duration
	keepAlive        time.Duration
	messageTimeout   time.Duration // see messageTimeout; tests shorten it
}

func buildOptions(opts []Option) options {
	o := options{
		logger:           slog.Default(),
		handshakeTimeout: DefaultHandshakeTimeout,
		maxMessageSize:   DefaultMaxMessageSize,
		maxFrames:        DefaultMaxFrames,
		recvQueue:        DefaultRecvQueue,
		sendTimeout:      DefaultSendTimeout,
		reconnectMin:     DefaultReconnectMin,
		reconnectMax:     DefaultReconnectMax,
		keepAlive:        DefaultKeepAlive,
		messageTimeout:   messageTimeout,
	}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithLogger sets the logger for connection-level events (peers rejected,
// protocol violations, reconnects). Default: slog.Default().
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
// (all frames). A peer that exceeds it is disconnected.
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

// WithRecvQueue sets how many received messages a PULL or ROUTER socket
// buffers before it stops reading from its connections (back-pressure
// reaches the senders through TCP flow control, like libzmq's RCVHWM).
func WithRecvQueue(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.recvQueue = n
		}
	}
}

// WithSendTimeout bounds a Push.Send whose context has no deadline
// (SGLang uses SNDTIMEO 30 s for prefill-side sockets, 5 s for MORI's
// status sockets). Zero means no bound.
func WithSendTimeout(d time.Duration) Option {
	return func(o *options) {
		if d >= 0 {
			o.sendTimeout = d
		}
	}
}

// WithReconnectInterval sets the first and the largest wait between two
// connection attempts of a PUSH socket (doubling in between).
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
