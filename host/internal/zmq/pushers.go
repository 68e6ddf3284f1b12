package zmq

import (
	"context"
	"sync"
)

// Pushers keeps one Push socket per destination endpoint, created on
// first use: the way SGLang caches its PUSH sockets (decode to each prefill
// rank, prefill to each decode rank). Safe for concurrent use; sends to
// different endpoints do not wait for each other.
type Pushers struct {
	opts []Option

	mu     sync.Mutex
	m      map[string]*Push
	closed bool
}

// NewPushers returns an empty cache whose sockets get opts.
func NewPushers(opts ...Option) *Pushers {
	return &Pushers{opts: opts, m: make(map[string]*Push)}
}

// Get returns the socket for endpoint, creating it if needed.
func (ps *Pushers) Get(endpoint string) (*Push, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closed {
		return nil, ErrClosed
	}
	if p, ok := ps.m[endpoint]; ok {
		return p, nil
	}
	p, err := DialPush(endpoint, ps.opts...)
	if err != nil {
		return nil, err
	}
	ps.m[endpoint] = p
	return p, nil
}

// Send sends frames to endpoint through its cached socket.
func (ps *Pushers) Send(ctx context.Context, endpoint string, frames ...[]byte) error {
	p, err := ps.Get(endpoint)
	if err != nil {
		return err
	}
	return p.Send(ctx, frames...)
}

// Forget closes and drops the socket of endpoint (for example once its
// peer was declared dead), so the next Send starts afresh.
func (ps *Pushers) Forget(endpoint string) {
	ps.mu.Lock()
	p := ps.m[endpoint]
	delete(ps.m, endpoint)
	ps.mu.Unlock()
	if p != nil {
		p.Close()
	}
}

// Close closes every socket; later calls to Get and Send fail with
// ErrClosed.
func (ps *Pushers) Close() error {
	ps.mu.Lock()
	ps.closed = true
	all := ps.m
	ps.m = map[string]*Push{}
	ps.mu.Unlock()
	for _, p := range all {
		p.Close()
	}
	return nil
}
