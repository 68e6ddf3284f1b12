package conformance

import (
	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// The suite's agents are peerproc.MemAgents: its local agents, and its
// peers, which live in this process or in the helper process (a
// peerproc.RemoteAgent there). The suite drives a peer only through
// peerproc.Peer, so every case runs the same in both modes.

// peerHost makes peer agents.
type peerHost interface {
	NewAgent(name string, params []plugin.Param, sizes []int) (peerproc.Peer, error)
	Close() error
}

// inProcHost makes peers in this process, with the suite's plugin.
type inProcHost struct{ p *plugin.Plugin }

func (h inProcHost) NewAgent(name string, params []plugin.Param, sizes []int) (peerproc.Peer, error) {
	m, err := newMemAgent(h.p, name, params, sizes)
	if err != nil {
		return nil, err
	}
	return m, nil
}

func (inProcHost) Close() error { return nil }

// newMemAgent makes an agent of this process with one registered buffer
// per size.
func newMemAgent(p *plugin.Plugin, name string, params []plugin.Param, sizes []int) (*peerproc.MemAgent, error) {
	return peerproc.NewMemAgent(p, name, params, u64s(sizes))
}

func u64s(sizes []int) []uint64 {
	out := make([]uint64, len(sizes))
	for i, s := range sizes {
		out[i] = uint64(s)
	}
	return out
}
