package kvpool

import (
	"fmt"
	"unsafe"
)

// Size is the bytes a pool of g occupies: its KV regions, then aux.
func (g Geometry) Size() uint64 {
	return uint64(g.Pages)*g.itemLen()*uint64(g.NumRegions()) + uint64(g.AuxItems)*uint64(g.AuxItemLen)
}

// Wrap makes a pool of g over mem instead of a private mapping: a test
// engine keeps its KV cache in memory it shares with a sidecar (a POSIX
// shared-memory object mapped MAP_SHARED). mem must be a mapping made
// with syscall.Mmap of at least g.Size() bytes; the pool owns it from
// now on and Close unmaps it.
func Wrap(g Geometry, mem []byte) (*Pool, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if uint64(len(mem)) < g.Size() || len(mem) == 0 {
		return nil, fmt.Errorf("kvpool: wrap: %d bytes, the geometry needs %d", len(mem), g.Size())
	}
	kvLen := uint64(g.Pages) * g.itemLen()
	p := &Pool{g: g, mem: mem, kvLen: kvLen}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	for i := 0; i < g.NumRegions(); i++ {
		p.regions = append(p.regions, Region{Addr: base + uint64(i)*kvLen, Len: kvLen})
	}
	if auxLen := uint64(g.AuxItems) * uint64(g.AuxItemLen); auxLen > 0 {
		p.aux = Region{Addr: base + kvLen*uint64(g.NumRegions()), Len: auxLen}
	}
	return p, nil
}
