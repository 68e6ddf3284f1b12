// Package planner turns KV-cache geometry and page indices into transfer
// plans: which bytes of the prefill side move to which bytes of the decode
// side. It is pure computation: no I/O, no plugin calls, no imports of the
// rest of kvhost. Results are byte-exact with the reference connectors
// (SGLang NIXL and MORI, vLLM NIXL), but expressed with strided copies so a
// backend gets far fewer descriptors than the reference hands it.
package planner

import (
	"fmt"
	"math/bits"
)

// MemKind is where a region lives. The planner only uses it to split plans
// into segments of one (source kind, destination kind).
type MemKind uint8

// Memory kinds, named as on the SGLang wire ("VRAM", "DRAM").
const (
	VRAM MemKind = iota
	DRAM
)

func (k MemKind) String() string {
	switch k {
	case VRAM:
		return "VRAM"
	case DRAM:
		return "DRAM"
	}
	return fmt.Sprintf("MemKind(%d)", uint8(k))
}

// ParseMemKind parses "VRAM" or "DRAM".
func ParseMemKind(s string) (MemKind, error) {
	switch s {
	case "VRAM":
		return VRAM, nil
	case "DRAM":
		return DRAM, nil
	}
	return 0, fmt.Errorf("unknown memory kind %q (want VRAM or DRAM)", s)
}

// Region is one registered memory range: a KV buffer of one layer (K or V),
// an aux buffer or a state buffer. Addr is the address in the owning
// process; Len is in bytes.
type Region struct {
	Addr uint64
	Len  uint64
	Kind MemKind
}

// End returns the first address after the region, and false on overflow.
func (r Region) End() (uint64, bool) {
	end, carry := bits.Add64(r.Addr, r.Len, 0)
	return end, carry == 0
}

// Copy is one strided copy between a source region and a destination
// region: block k (k < Count) of Len bytes moves from
// Src[SrcRegion].Addr + SrcOff + k*SrcStride to
// Dst[DstRegion].Addr + DstOff + k*DstStride.
// Count 1 is a plain block (strides are then irrelevant). Source is always
// the prefill side and destination the decode side, in data-flow terms,
// whether the backend operation is a WRITE (push) or a READ (pull).
type Copy struct {
	SrcRegion int32
	DstRegion int32
	SrcOff    uint64
	DstOff    uint64
	Len       uint64
	SrcStride uint64
	DstStride uint64
	Count     uint64
}

// Bytes returns the bytes the copy moves.
func (c Copy) Bytes() uint64 { return c.Len * c.Count }

// Plan is a list of copies between two region tables.
type Plan struct {
	// Path names the reference code path the plan reproduces, e.g.
	// "nixl-prepped-equal-tp" or "mori-tp-slice".
	Path   string
	Src    []Region
	Dst    []Region
	Copies []Copy
}

// Bytes returns the bytes the plan moves.
func (p *Plan) Bytes() uint64 {
	var n uint64
	for _, c := range p.Copies {
		n += c.Bytes()
	}
	return n
}

// Descriptors returns how many (strided) descriptors a backend is handed.
func (p *Plan) Descriptors() int { return len(p.Copies) }

// ExpandedDescriptors returns how many plain blocks those descriptors stand
// for: what a backend without strided descriptors would be handed.
func (p *Plan) ExpandedDescriptors() uint64 {
	var n uint64
	for _, c := range p.Copies {
		n += c.Count
	}
	return n
}

// Validate checks that every block of every copy lies inside its regions,
// with no arithmetic overflow. A plan that fails Validate must never reach a
// backend.
func (p *Plan) Validate() error {
	for i, c := range p.Copies {
		if c.Len == 0 || c.Count == 0 {
			return fmt.Errorf("copy %d: empty (len %d, count %d)", i, c.Len, c.Count)
		}
		if err := checkSide(p.Src, c.SrcRegion, c.SrcOff, c.Len, c.SrcStride, c.Count); err != nil {
			return fmt.Errorf("copy %d: source: %w", i, err)
		}
		if err := checkSide(p.Dst, c.DstRegion, c.DstOff, c.Len, c.DstStride, c.Count); err != nil {
			return fmt.Errorf("copy %d: destination: %w", i, err)
		}
	}
	return nil
}

// checkSide verifies that count blocks of len bytes, stride apart from off,
// fit inside regions[idx].
func checkSide(regions []Region, idx int32, off, length, stride, count uint64) error {
	if idx < 0 || int(idx) >= len(regions) {
		return fmt.Errorf("region %d out of range (have %d)", idx, len(regions))
	}
	r := regions[idx]
	last := off
	if count > 1 {
		hi, lo := bits.Mul64(stride, count-1)
		if hi != 0 {
			return fmt.Errorf("stride %d x %d overflows", stride, count-1)
		}
		var carry uint64
		last, carry = bits.Add64(off, lo, 0)
		if carry != 0 {
			return fmt.Errorf("offset %d + %d overflows", off, lo)
		}
	}
	end, carry := bits.Add64(last, length, 0)
	if carry != 0 || end > r.Len {
		return fmt.Errorf("bytes [%d, %d+%d) outside region %d of %d bytes", last, last, length, idx, r.Len)
	}
	return nil
}

// ForEachBlock calls fn with the absolute source address, destination
// address and length of every block of the plan, in order. It stops early
// and returns false if fn returns false.
func (p *Plan) ForEachBlock(fn func(src, dst, length uint64) bool) bool {
	for _, c := range p.Copies {
		s := p.Src[c.SrcRegion].Addr + c.SrcOff
		d := p.Dst[c.DstRegion].Addr + c.DstOff
		for k := uint64(0); k < c.Count; k++ {
			if !fn(s+k*c.SrcStride, d+k*c.DstStride, c.Len) {
				return false
			}
		}
	}
	return true
}

// Error is a geometry error: the request cannot be planned as given. Field
// names the offending input in the reference's terms (e.g. "kv_item_lens").
type Error struct {
	Field string
	Msg   string
}

func (e *Error) Error() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

// errorf builds an *Error for field.
func errorf(field, format string, args ...any) error {
	return &Error{Field: field, Msg: fmt.Sprintf(format, args...)}
}
