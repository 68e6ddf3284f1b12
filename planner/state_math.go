package planner

import (
	"math"
	"math/bits"
)

// Overflow-checked arithmetic and region tables shared by the aux, state
// and DSA tail planners. Peers send pointers, lengths and indices over the
// network, so every product is checked rather than trusted.

// mulAddU64 returns a*b + c, and false on overflow.
func mulAddU64(a, b, c uint64) (uint64, bool) {
	hi, lo := bits.Mul64(a, b)
	if hi != 0 {
		return 0, false
	}
	sum, carry := bits.Add64(lo, c, 0)
	return sum, carry == 0
}

// slotOffset returns index*itemLen + extra as a byte offset, failing on a
// negative index or overflow. field names the input in errors.
func slotOffset(field string, index int64, itemLen, extra uint64) (uint64, error) {
	if index < 0 {
		return 0, errorf(field, "negative index %d", index)
	}
	off, ok := mulAddU64(uint64(index), itemLen, extra)
	if !ok {
		return 0, errorf(field, "index %d x item length %d overflows", index, itemLen)
	}
	return off, nil
}

// unboundedLen is the length given to a region whose size the peer does
// not publish (SGLang NIXL sends aux and state pointers without lengths):
// everything up to the top of the address space. Validate then only guards
// against arithmetic overflow; the backend checks the bytes against the
// peer's registration.
func unboundedLen(addr uint64) uint64 { return math.MaxUint64 - addr }

// regionTable builds one side's region table from pointers and optional
// region lengths (nil: unknown, see unboundedLen).
func regionTable(field string, ptrs, lens []uint64, kind MemKind) ([]Region, error) {
	if lens != nil && len(lens) != len(ptrs) {
		return nil, errorf(field, "%d lengths for %d pointers", len(lens), len(ptrs))
	}
	regions := make([]Region, len(ptrs))
	for i, p := range ptrs {
		n := unboundedLen(p)
		if lens != nil {
			n = lens[i]
			if _, ok := (Region{Addr: p, Len: n}).End(); !ok {
				return nil, errorf(field, "region %d at %#x of %d bytes overflows the address space", i, p, n)
			}
		}
		regions[i] = Region{Addr: p, Len: n, Kind: kind}
	}
	return regions, nil
}

// appendCoalesced appends c to copies, folding it into the previous copy
// when it continues that copy's arithmetic progression (same regions and
// length, offsets one stride further on both sides). Both offsets must
// advance, so strides stay positive. The blocks described are unchanged;
// only the descriptor count drops.
func appendCoalesced(copies []Copy, c Copy) []Copy {
	if n := len(copies); n > 0 && c.Count == 1 {
		p := &copies[n-1]
		if p.SrcRegion == c.SrcRegion && p.DstRegion == c.DstRegion && p.Len == c.Len {
			if p.Count == 1 {
				if c.SrcOff > p.SrcOff && c.DstOff > p.DstOff {
					p.SrcStride, p.DstStride = c.SrcOff-p.SrcOff, c.DstOff-p.DstOff
					p.Count = 2
					return copies
				}
			} else if nextS, ok := mulAddU64(p.Count, p.SrcStride, p.SrcOff); ok && nextS == c.SrcOff {
				if nextD, ok := mulAddU64(p.Count, p.DstStride, p.DstOff); ok && nextD == c.DstOff {
					p.Count++
					return copies
				}
			}
		}
	}
	if c.Count == 1 {
		c.SrcStride, c.DstStride = 0, 0
	}
	return append(copies, c)
}
