package push

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/zmq"
)

// Transport carries what a rank exchanges with its peers: the control
// messages (SGLang's ZMQ PULL socket every rank binds, and the PUSH
// sockets it sends to its peers' with) and the bootstrap server's API, so
// that the runtime never holds a socket itself (as hashicorp/raft's
// Transport): ZMQ is the one SGLang peers speak, and tests use an
// in-memory one. A Transport is used by one rank or many.
type Transport interface {
	// Listen binds the endpoint peers send control messages to
	// ("tcp://host:port"; port 0 picks a free one).
	Listen(endpoint string, log *slog.Logger) (Inbox, error)
	// Outbox returns what the rank sends control messages with.
	// sendTimeout bounds one message's send (0: the transport's default).
	Outbox(log *slog.Logger, sendTimeout time.Duration) Outbox
	// Bootstrap returns a client of the bootstrap server at addr
	// ("host:port").
	Bootstrap(addr string) BootstrapClient
}

// BootstrapClient is what a rank asks the bootstrap server (SGLang's
// python/sglang/srt/disaggregation/common/conn.py bootstrap server);
// *bootstrap.Client is the HTTP one.
type BootstrapClient interface {
	// Register announces a prefill rank (PUT /route).
	Register(ctx context.Context, reg bootstrap.Registration) error
	// Route looks up a prefill rank's endpoint (GET /route).
	Route(ctx context.Context, dpRank, cpRank, tpRank, ppRank int) (bootstrap.RankInfo, error)
	// ParallelInfo is the prefill deployment's layout (GET /route with
	// every rank -1).
	ParallelInfo(ctx context.Context) (bootstrap.ParallelInfo, error)
	// Health checks the server (GET /health: the decode's heartbeat).
	Health(ctx context.Context) error
}

// Inbox is a bound control endpoint. Safe for concurrent use.
type Inbox interface {
	// RecvFrom returns the next message (its frames, owned by the caller)
	// and the remote address of the connection it came on. It blocks
	// until a message arrives, ctx ends (ctx.Err()) or the inbox is
	// closed (an error wrapping net.ErrClosed).
	RecvFrom(ctx context.Context) ([][]byte, net.Addr, error)
	// Endpoint is "tcp://ip:port" as bound; Port its port.
	Endpoint() string
	Port() int
	Close() error
}

// Outbox sends control messages to peers' endpoints. Safe for concurrent
// use.
type Outbox interface {
	// Send sends one message to endpoint, connecting on first use; it
	// fails when ctx ends first.
	Send(ctx context.Context, endpoint string, frames ...[]byte) error
	// Forget drops the connection to endpoint (a peer that went away).
	Forget(endpoint string)
	Close() error
}

// ZMQ is the Transport SGLang peers speak: ZeroMQ PULL and PUSH sockets
// (host/internal/zmq), and the bootstrap server's HTTP API (host/bootstrap).
// Options apply to every socket, after the rank's logger.
type ZMQ struct {
	Options []zmq.Option
}

// Listen binds a PULL socket.
func (t ZMQ) Listen(endpoint string, log *slog.Logger) (Inbox, error) {
	p, err := zmq.ListenPull(endpoint, append([]zmq.Option{zmq.WithLogger(log)}, t.Options...)...)
	if err != nil {
		return nil, err
	}
	return zmqInbox{p}, nil
}

// Outbox returns a set of PUSH sockets, one per endpoint.
func (t ZMQ) Outbox(log *slog.Logger, sendTimeout time.Duration) Outbox {
	opts := []zmq.Option{zmq.WithLogger(log)}
	if sendTimeout > 0 {
		opts = append(opts, zmq.WithSendTimeout(sendTimeout))
	}
	return zmq.NewPushers(append(opts, t.Options...)...)
}

// Bootstrap returns an HTTP client of the bootstrap server.
func (ZMQ) Bootstrap(addr string) BootstrapClient { return bootstrap.NewClient(addr) }

type zmqInbox struct{ *zmq.Pull }

func (p zmqInbox) RecvFrom(ctx context.Context) ([][]byte, net.Addr, error) {
	frames, from, err := p.Pull.RecvFrom(ctx)
	if errors.Is(err, zmq.ErrClosed) {
		err = fmt.Errorf("%w: %w", net.ErrClosed, err)
	}
	return frames, from, err
}

// tcpEndpoint is the endpoint a peer advertises as host and port.
func tcpEndpoint(host string, port int) string { return zmq.TCPEndpoint(host, port) }
