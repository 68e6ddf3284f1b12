package kvpool

import (
	"fmt"
	"unsafe"
)

// Size returns the bytes a pool of g takes: its KV regions, then aux.
func Size(g Geometry) (uint64, error) {
	if err := g.Validate(); err != nil {
		return 0, err
	}
	return uint64(g.Pages)*g.itemLen()*uint64(g.NumRegions()) + uint64(g.AuxItems)*uint64(g.AuxItemLen), nil
}

// NewOver lays a pool of g over mem, which the caller owns (an engine's
// shared memory that kvhost serve maps too): the same layout as New.
// Close forgets mem without unmapping it.
func NewOver(g Geometry, mem []byte) (*Pool, error) {
	total, err := Size(g)
	if err != nil {
		return nil, err
	}
	if uint64(len(mem)) < total || total == 0 {
		return nil, fmt.Errorf("kvpool: %d bytes of memory for a pool of %d", len(mem), total)
	}
	kvLen := uint64(g.Pages) * g.itemLen()
	p := &Pool{g: g, mem: mem[:total:total], kvLen: kvLen, borrowed: true}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	for i := 0; i < g.NumRegions(); i++ {
		p.regions = append(p.regions, Region{Addr: base + uint64(i)*kvLen, Len: kvLen})
	}
	if auxLen := uint64(g.AuxItems) * uint64(g.AuxItemLen); auxLen > 0 {
		p.aux = Region{Addr: base + kvLen*uint64(g.NumRegions()), Len: auxLen}
	}
	return p, nil
}
