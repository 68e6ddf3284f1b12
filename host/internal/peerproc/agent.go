package peerproc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// RegionInfo is what a peer tells the near side about one of its regions.
type RegionInfo struct {
	Addr  uint64      `json:"addr"` // in the peer's address space
	Len   uint64      `json:"len"`
	DevID uint64      `json:"dev_id"`
	Kind  abi.MemKind `json:"kind"`
	Blob  []byte      `json:"blob,omitempty"` // region_export blob, if the agent can export
}

// Peer is an agent with registered buffers, in this process (*MemAgent) or
// in a peer process (*RemoteAgent). Spans are [off, off+n) of a region; a
// span outside the region is an error.
type Peer interface {
	Name() string
	Caps() abi.Caps
	// Pid is the process the agent lives in.
	Pid() int
	Regions() []RegionInfo
	Metadata() ([]byte, error)
	// Fill writes the pattern of seed (see Fill) over a span.
	Fill(region int, off, n, seed uint64) error
	// Verify checks a span against the pattern of seed and returns the
	// offset in the span of the first wrong byte, or -1.
	Verify(region int, off, n, seed uint64) (int64, error)
	// Clear zeroes a span.
	Clear(region int, off, n uint64) error
	// Sum returns the SHA-256 of a span.
	Sum(region int, off, n uint64) ([]byte, error)
	// Bytes returns a copy of a span (for failure reports).
	Bytes(region int, off, n uint64) ([]byte, error)
	LoadRemote(md []byte) (string, error)
	SendNotif(peer string, msg []byte) error
	// Notifs drains notifications until at least want arrived or timeout
	// passed, and returns them in the batches Agent.Notifs returned.
	// Running out of time is not an error: the caller compares what
	// arrived with what it expected.
	Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error)
	// Close destroys the agent, then unmaps its buffers.
	Close() error
}

// MemAgent is an agent of this process with one buffer per region: memory
// from Map, registered as DRAM, owned by the MemAgent and unmapped by
// Close after the agent is destroyed.
type MemAgent struct {
	Agent      *plugin.Agent
	Bufs       [][]byte
	Registered []*plugin.Region // Registered[i] is Bufs[i]
	blobs      [][]byte         // exported region blobs; nil without remote_blob
}

var _ Peer = (*MemAgent)(nil)

// NewMemAgent creates an agent called name, maps one buffer per size,
// registers them all (DRAM, in one call) and exports their blobs when the
// agent can.
func NewMemAgent(p *plugin.Plugin, name string, params []plugin.Param, sizes []uint64) (m *MemAgent, err error) {
	a, err := p.NewAgent(name, params...)
	if err != nil {
		return nil, err
	}
	m = &MemAgent{Agent: a}
	defer func() {
		if err != nil {
			m.Close()
		}
	}()
	descs := make([]abi.MemDesc, len(sizes))
	for i, size := range sizes {
		b, err := Map(size)
		if err != nil {
			return nil, err
		}
		m.Bufs = append(m.Bufs, b)
		descs[i] = abi.MemDesc{Addr: Addr(b), Len: size, MemKind: abi.DRAM}
	}
	if m.Registered, err = a.Register(descs); err != nil {
		return nil, err
	}
	if a.Caps().Has(abi.CapRemoteBlob) {
		for _, r := range m.Registered {
			blob, err := r.Export()
			if err != nil {
				return nil, err
			}
			m.blobs = append(m.blobs, blob)
		}
	}
	return m, nil
}

func (m *MemAgent) Name() string              { return m.Agent.Name() }
func (m *MemAgent) Caps() abi.Caps            { return m.Agent.Caps() }
func (m *MemAgent) Pid() int                  { return os.Getpid() }
func (m *MemAgent) Metadata() ([]byte, error) { return m.Agent.LocalMetadata() }

// Regions describes the regions as a peer sees them.
func (m *MemAgent) Regions() []RegionInfo {
	out := make([]RegionInfo, len(m.Registered))
	for i, r := range m.Registered {
		out[i] = RegionInfo{Addr: r.Addr(), Len: r.Len(), DevID: r.DevID(), Kind: r.Kind()}
		if m.blobs != nil {
			out[i].Blob = m.blobs[i]
		}
	}
	return out
}

// Span returns bytes [off, off+n) of region i's buffer.
func (m *MemAgent) Span(region int, off, n uint64) ([]byte, error) {
	if region < 0 || region >= len(m.Bufs) {
		return nil, fmt.Errorf("peerproc: agent %s has no region %d", m.Name(), region)
	}
	b := m.Bufs[region]
	if off > uint64(len(b)) || n > uint64(len(b))-off {
		return nil, fmt.Errorf("peerproc: bytes [%d, %d) outside region %d of %d bytes", off, off+n, region, len(b))
	}
	return b[off : off+n], nil
}

func (m *MemAgent) Fill(region int, off, n, seed uint64) error {
	b, err := m.Span(region, off, n)
	if err == nil {
		Fill(b, seed)
	}
	return err
}

func (m *MemAgent) Verify(region int, off, n, seed uint64) (int64, error) {
	b, err := m.Span(region, off, n)
	if err != nil {
		return 0, err
	}
	return Verify(b, seed), nil
}

func (m *MemAgent) Clear(region int, off, n uint64) error {
	b, err := m.Span(region, off, n)
	if err == nil {
		clear(b)
	}
	return err
}

func (m *MemAgent) Sum(region int, off, n uint64) ([]byte, error) {
	b, err := m.Span(region, off, n)
	if err != nil {
		return nil, err
	}
	return Sum(b), nil
}

func (m *MemAgent) Bytes(region int, off, n uint64) ([]byte, error) {
	b, err := m.Span(region, off, n)
	if err != nil {
		return nil, err
	}
	return append([]byte(nil), b...), nil
}

func (m *MemAgent) LoadRemote(md []byte) (string, error) { return m.Agent.LoadRemote(md) }

func (m *MemAgent) SendNotif(peer string, msg []byte) error { return m.Agent.SendNotif(peer, msg) }

func (m *MemAgent) Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error) {
	return DrainNotifs(m.Agent, want, timeout)
}

// Close destroys the agent, then unmaps the buffers (the plugin no longer
// touches them once agent_destroy returned). A second Close does nothing.
func (m *MemAgent) Close() error {
	var err error
	if m.Agent != nil {
		if err = m.Agent.Close(); errors.Is(err, plugin.ErrClosed) {
			err = nil
		}
	}
	for _, b := range m.Bufs {
		err = errors.Join(err, Unmap(b))
	}
	m.Bufs = nil
	return err
}

// DrainNotifs calls a.Notifs until want notifications arrived (in any
// number of batches) or timeout passed. Running out of time is not an
// error here: the caller compares what arrived with what it expected.
func DrainNotifs(a *plugin.Agent, want int, timeout time.Duration) ([][]plugin.Notif, error) {
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
