package pull

import (
	"context"
	"log/slog"

	"github.com/kvhost/kvhost/host/internal/zmq"
)

// Transport carries vLLM's handshake side channel (the prefill's ROUTER
// that answers metadata requests, the decode's REQ exchange), so that the
// runtime never holds a socket itself (as hashicorp/raft's Transport): ZMQ
// is the one vLLM peers speak, and tests use an in-memory one.
// Notifications go through the plugin, not the Transport.
type Transport interface {
	// ListenHandshake binds endpoint and serves svc (the encoded
	// handshake payload per TP rank, in its generation's shape) until the
	// listener is closed (see ListenHandshake).
	ListenHandshake(endpoint string, svc HandshakeService, log *slog.Logger) (HandshakeListener, error)
	// Request sends one request to endpoint and returns its reply (a REQ
	// exchange), failing when ctx ends first.
	Request(ctx context.Context, endpoint string, request [][]byte) ([][]byte, error)
}

// HandshakeListener is a bound side channel.
type HandshakeListener interface {
	// Endpoint is "tcp://ip:port" as bound; Port its port.
	Endpoint() string
	Port() int
	Close() error
}

// ZMQOption configures a ZMQ socket (the type of the configs' ZMQ field).
type ZMQOption = zmq.Option

// ZMQ is the Transport vLLM speaks: a ZeroMQ ROUTER serving handshakes
// and a REQ socket per exchange (host/internal/zmq). Options apply to every socket.
type ZMQ struct {
	Options []zmq.Option
}

// ListenHandshake binds a ROUTER socket (ListenHandshake).
func (t ZMQ) ListenHandshake(endpoint string, svc HandshakeService, log *slog.Logger) (HandshakeListener, error) {
	return ListenHandshake(endpoint, svc, log, t.Options...)
}

// Request runs one REQ exchange (zmq.Request).
func (t ZMQ) Request(ctx context.Context, endpoint string, request [][]byte) ([][]byte, error) {
	return zmq.Request(ctx, endpoint, request, t.Options...)
}

// transportOr returns t, or ZMQ with opts when t is nil.
func transportOr(t Transport, opts []zmq.Option) Transport {
	if t == nil {
		return ZMQ{Options: opts}
	}
	return t
}
