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
	// LocalClock converts a time on Clock into this side's
	// perf_counter-like seconds, for the clock offset; nil: no offset.
	LocalClock func(time.Time) float64
}

// FetchHandshake is the decode side of the handshake (vLLM's
// _nixl_handshake): connect a REQ socket to endpoint
// (tcp://remote_host:remote_port), ask for remoteTPRank's metadata in the
// shape of o.Gen, decode the reply in two phases (vllm.DecodeHandshake)
// and disconnect.
func FetchHandshake(ctx context.Context, endpoint string, remoteTPRank int, o FetchOptions) (*vllm.AgentMetadata, error) {
	md, _, err := FetchHandshakeClock(ctx, endpoint, remoteTPRank, o)
	return md, err
}

// FetchHandshakeClock is FetchHandshake that also returns, for a
// generation whose reply carries the prefill's clock, the prefill's clock
// minus this side's at the middle of the round trip, in seconds (vLLM's
// clock offset; 0 otherwise), as measured on o.Clock.
func FetchHandshakeClock(ctx context.Context, endpoint string, remoteTPRank int, o FetchOptions) (*vllm.AgentMetadata, float64, error) {
	g := vllm.Or(o.Gen)
	c := clock.Or(o.Clock)
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = DefaultHandshakeTimeout
	}
	ctx, cancel := c.WithTimeout(ctx, timeout)
	defer cancel()
	request := o.Request
	if request == nil {
		request = func(ctx context.Context, endpoint string, req [][]byte) ([][]byte, error) {
			return zmq.Request(ctx, endpoint, req, o.ZMQ...)
		}
	}
	sent := c.Now()
	reply, err := request(ctx, endpoint, [][]byte{g.EncodeMetaRequest(0, remoteTPRank)})
	if err != nil {
		return nil, 0, fmt.Errorf("vllm: handshake with %s (TP rank %d): %w", endpoint, remoteTPRank, err)
	}
	rtt := c.Since(sent)
	payload, remoteClock, err := g.SplitReply(reply)
	if err != nil {
		return nil, 0, fmt.Errorf("vllm: handshake with %s: %w", endpoint, err)
	}
	if len(reply) == 1 && len(reply[0]) == 0 {
		// A kvhost side channel's refusal (vLLM has no error reply).
		return nil, 0, fmt.Errorf("vllm: handshake with %s (TP rank %d): %w: it speaks another NIXL connector version than "+
			"this engine's %s, or does not serve that rank (its log says which)", endpoint, remoteTPRank, vllm.ErrRefused, g)
	}
	md, err := vllm.DecodeHandshake(payload, o.Expect)
	if err != nil {
		return nil, 0, fmt.Errorf("vllm: handshake with %s (TP rank %d): %w", endpoint, remoteTPRank, err)
	}
	offset := 0.0
	if g.ReplyClock && o.LocalClock != nil {
		offset = remoteClock - (o.LocalClock(sent) + rtt.Seconds()/2)
	}
	return md, offset, nil
}
