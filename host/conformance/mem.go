package conformance

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// memAgent is an agent with KV-like buffers: anonymous mappings outside the
// Go heap, registered with the plugin. The suite's local agents, in-process
// peers and the helper's agents are all memAgents.
type memAgent struct {
	a       *plugin.Agent
	bufs    [][]byte // mmap'd; owned here, unmapped after the agent is closed
	regions []*plugin.Region
	blobs   [][]byte // exported region blobs; nil without remote_blob
}

// newMemAgent creates an agent, maps one buffer per size, registers them all
// (DRAM) and exports their blobs when the agent can.
func newMemAgent(p *plugin.Plugin, name string, params []plugin.Param, sizes []int) (m *memAgent, err error) {
	a, err := p.NewAgent(name, params...)
	if err != nil {
		return nil, err
	}
	m = &memAgent{a: a}
	defer func() {
		if err != nil {
			m.Close()
		}
	}()
	descs := make([]abi.MemDesc, len(sizes))
	for i, size := range sizes {
		b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		if err != nil {
			return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
		}
		m.bufs = append(m.bufs, b)
		descs[i] = abi.MemDesc{Addr: addrOf(b), Len: uint64(size), MemKind: abi.DRAM}
	}
	if m.regions, err = a.Register(descs); err != nil {
		return nil, err
	}
	if a.Caps().Has(abi.CapRemoteBlob) {
		for _, r := range m.regions {
			blob, err := r.Export()
			if err != nil {
				return nil, err
			}
			m.blobs = append(m.blobs, blob)
		}
	}
	return m, nil
}

// addrOf returns the address of the first byte of b.
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// info describes region i as a peer sees it.
func (m *memAgent) info(i int) regionInfo {
	r := m.regions[i]
	ri := regionInfo{Addr: r.Addr(), Len: r.Len(), DevID: r.DevID(), Kind: r.Kind()}
	if m.blobs != nil {
		ri.Blob = m.blobs[i]
	}
	return ri
}

func (m *memAgent) infos() []regionInfo {
	out := make([]regionInfo, len(m.regions))
	for i := range out {
		out[i] = m.info(i)
	}
	return out
}

func (m *memAgent) buf(region int) ([]byte, error) {
	if region < 0 || region >= len(m.bufs) {
		return nil, fmt.Errorf("no region %d", region)
	}
	return m.bufs[region], nil
}

func (m *memAgent) span(region int, off, n uint64) ([]byte, error) {
	b, err := m.buf(region)
	if err != nil {
		return nil, err
	}
	if off > uint64(len(b)) || n > uint64(len(b))-off {
		return nil, fmt.Errorf("bytes [%d, %d) outside region %d of %d bytes", off, off+n, region, len(b))
	}
	return b[off : off+n], nil
}

// Close destroys the agent, then unmaps the buffers (the plugin no longer
// touches them once agent_destroy returned).
func (m *memAgent) Close() error {
	err := m.a.Close()
	if errors.Is(err, plugin.ErrClosed) {
		err = nil
	}
	for _, b := range m.bufs {
		if uerr := syscall.Munmap(b); uerr != nil && err == nil {
			err = uerr
		}
	}
	m.bufs = nil
	return err
}

// fillPattern fills b with the pattern of seed: every 8-byte word depends
// on the seed and on its position, so a block landing at the wrong offset,
// a shifted copy or a stale byte all show.
func fillPattern(b []byte, seed uint64) {
	i := 0
	for ; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], splitmix(seed^uint64(i)*0x9e3779b97f4a7c15))
	}
	if i < len(b) {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], splitmix(seed^uint64(i)*0x9e3779b97f4a7c15))
		copy(b[i:], w[:])
	}
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func sum(b []byte) []byte {
	s := sha256.Sum256(b)
	return s[:]
}

// firstDiff describes where got and want differ, for failure messages.
func firstDiff(got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("length %d, want %d", len(got), len(want))
	}
	first, n := -1, 0
	for i := range got {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	if first < 0 {
		return "no difference"
	}
	end := min(first+8, len(got))
	return fmt.Sprintf("%d bytes differ, the first at offset %d: got % x, want % x", n, first, got[first:end], want[first:end])
}
