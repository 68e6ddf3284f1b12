package pull

import (
	"context"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// DefaultHandshakeTimeout is vLLM's receive timeout for the handshake
// (RCVTIMEO 5000 ms): a dead prefill cannot hang decode longer.
const DefaultHandshakeTimeout = 5 * time.Second

// FetchOptions configure FetchHandshake.
type FetchOptions struct {
	vllm.Expect
	// Timeout bounds the whole exchange when ctx has no earlier deadline;
	// 0 means DefaultHandshakeTimeout.
	Timeout time.Duration
	// ZMQ options for the REQ socket (logger, limits).
	ZMQ []zmq.Option
	// Request runs the exchange; nil means a zmq REQ socket with ZMQ
	// (zmq.Request). A runtime passes its Transport's.
	Request func(ctx context.Context, endpoint string, request [][]byte) ([][]byte, error)
	// Clock times Timeout; nil means the wall clock.
	Clock clock.Clock
}

// FetchHandshake is the decode side of the handshake (vLLM's
// _nixl_handshake): connect a REQ socket to endpoint
// (tcp://remote_host:remote_port), ask for remoteTPRank's metadata,
// decode the reply in two phases (vllm.DecodeHandshake) and disconnect.
func FetchHandshake(ctx context.Context, endpoint string, remoteTPRank int, o FetchOptions) (*vllm.AgentMetadata, error) {
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = DefaultHandshakeTimeout
	}
	ctx, cancel := clock.Or(o.Clock).WithTimeout(ctx, timeout)
	defer cancel()
	request := o.Request
	if request == nil {
		request = func(ctx context.Context, endpoint string, req [][]byte) ([][]byte, error) {
			return zmq.Request(ctx, endpoint, req, o.ZMQ...)
		}
	}
	reply, err := request(ctx, endpoint, [][]byte{vllm.EncodeMetaRequest(remoteTPRank)})
	if err != nil {
		return nil, fmt.Errorf("vllm: handshake with %s (TP rank %d): %w", endpoint, remoteTPRank, err)
	}
	if len(reply) != 1 {
		return nil, fmt.Errorf("vllm: handshake with %s: %w: reply has %d frames, want 1", endpoint, vllm.ErrMalformed, len(reply))
	}
	md, err := vllm.DecodeHandshake(reply[0], o.Expect)
	if err != nil {
		return nil, fmt.Errorf("vllm: handshake with %s (TP rank %d): %w", endpoint, remoteTPRank, err)
	}
	return md, nil
}
