package zmq

import (
	"context"
	"time"
)

// Disconnect closes the connection of the peer with the given id (a
// misbehaving peer: one that does not read what it is sent). Messages
// still queued for it are dropped. Unknown ids are ignored.
func (r *Router) Disconnect(peer []byte) {
	r.mu.RLock()
	p := r.peers[string(peer)]
	r.mu.RUnlock()
	if p != nil {
		p.c.close()
	}
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
