package zmq

import (
	"context"
	"errors"
	"time"
)

// errOversized is readMessage's answer for a message it read to its end
// and dropped (WithDiscardOversize).
var errOversized = errors.New("zmq: oversized message discarded")

// WithDiscardOversize makes a bound socket read a data message larger
// than WithMaxMessageSize (or with more than WithMaxFrames frames) to its
// end without keeping it, and hand the application a message of zero
// frames in its place (Router.Recv: RouterMsg.Frames empty), instead of
// dropping the connection. A real message always has a frame, so the
// marker is unambiguous. The peer must still finish the message within
// the message timeout. kvhost serve answers the marker with too_large.
func WithDiscardOversize() Option {
	return func(o *options) { o.discardOversize = true }
}

// Flush waits until every message queued by Enqueue was written (or
// dropped with its connection), or ctx ends.
func (r *Router) Flush(ctx context.Context) {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		busy := false
		r.mu.RLock()
		for _, p := range r.peers {
			p.mu.Lock()
			busy = busy || p.writing
			p.mu.Unlock()
		}
		r.mu.RUnlock()
		if !busy {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
