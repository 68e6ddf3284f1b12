package conformance

import (
	"context"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// regionInfo is what a peer tells the suite about one of its regions.
type regionInfo struct {
	Addr  uint64      `json:"addr"`
	Len   uint64      `json:"len"`
	DevID uint64      `json:"dev_id"`
	Kind  abi.MemKind `json:"kind"`
	Blob  []byte      `json:"blob,omitempty"` // region_export blob, if the peer agent can export
}

// peerAgent is the remote side of a test: an agent with registered buffers,
// either in this process or in the helper process. The suite drives it only
// through this interface, so every case runs the same in both modes.
type peerAgent interface {
	Name() string
	Caps() abi.Caps
	Metadata() ([]byte, error)
	Regions() []regionInfo
	// Fill writes the pattern of seed over the whole region.
	Fill(region int, seed uint64) error
	// Sum returns the SHA-256 of bytes [off, off+n) of a region.
	Sum(region int, off, n uint64) ([]byte, error)
	// Bytes returns bytes [off, off+n) of a region (for failure reports).
	Bytes(region int, off, n uint64) ([]byte, error)
	LoadRemote(md []byte) (string, error)
	SendNotif(peer string, msg []byte) error
	// Notifs drains notifications until at least want arrived or timeout
	// passed, and returns them in the batches Agent.Notifs returned.
	Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error)
	Close() error
}

// peerHost makes peer agents.
type peerHost interface {
	NewAgent(name string, params []plugin.Param, sizes []int) (peerAgent, error)
	Close() error
}

// inProcHost makes peers in this process, with the suite's plugin.
type inProcHost struct{ p *plugin.Plugin }

func (h inProcHost) NewAgent(name string, params []plugin.Param, sizes []int) (peerAgent, error) {
	m, err := newMemAgent(h.p, name, params, sizes)
	if err != nil {
		return nil, err
	}
	return inProcPeer{m}, nil
}

func (inProcHost) Close() error { return nil }

// inProcPeer is a memAgent seen as a peer.
type inProcPeer struct{ m *memAgent }

func (p inProcPeer) Name() string              { return p.m.a.Name() }
func (p inProcPeer) Caps() abi.Caps            { return p.m.a.Caps() }
func (p inProcPeer) Metadata() ([]byte, error) { return p.m.a.LocalMetadata() }
func (p inProcPeer) Regions() []regionInfo     { return p.m.infos() }
func (p inProcPeer) Close() error              { return p.m.Close() }

func (p inProcPeer) Fill(region int, seed uint64) error {
	b, err := p.m.buf(region)
	if err == nil {
		fillPattern(b, seed)
	}
	return err
}

func (p inProcPeer) Sum(region int, off, n uint64) ([]byte, error) {
	b, err := p.m.span(region, off, n)
	if err != nil {
		return nil, err
	}
	return sum(b), nil
}

func (p inProcPeer) Bytes(region int, off, n uint64) ([]byte, error) {
	b, err := p.m.span(region, off, n)
	if err != nil {
		return nil, err
	}
	return append([]byte(nil), b...), nil
}

func (p inProcPeer) LoadRemote(md []byte) (string, error) { return p.m.a.LoadRemote(md) }

func (p inProcPeer) SendNotif(peer string, msg []byte) error { return p.m.a.SendNotif(peer, msg) }

func (p inProcPeer) Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error) {
	return drainNotifs(p.m.a, want, timeout)
}

// drainNotifs calls a.Notifs until want notifications arrived (in any
// number of batches) or timeout passed. Running out of time is not an
// error here: the caller compares what arrived with what it expected.
func drainNotifs(a *plugin.Agent, want int, timeout time.Duration) ([][]plugin.Notif, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var batches [][]plugin.Notif
	got := 0
	for {
		ns, err := a.Notifs()
		if len(ns) > 0 {
			batches = append(batches, ns)
			got += len(ns)
		}
		if err != nil {
			return batches, fmt.Errorf("after %d notifications: %w", got, err)
		}
		if got >= want {
			return batches, nil
		}
		select {
		case <-ctx.Done():
			return batches, nil
		case <-time.After(time.Millisecond):
		}
	}
}
