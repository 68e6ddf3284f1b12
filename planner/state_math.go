package planner

import "math"

// Slot offsets and region tables shared by the aux, state and DSA tail
// planners. Peers send pointers, lengths and indices over the network, so
// every product is overflow-checked rather than trusted.

// fieldRef names an input field in errors, built only when an error is:
// name, or name[i] for a component i >= 0. Passing one costs nothing on
// the success path (plans must not allocate per request).
type fieldRef struct {
	name string
	i    int
}

func namedField(name string) fieldRef { return fieldRef{name, -1} }

func (f fieldRef) String() string {
	if f.i < 0 {
		return f.name
	}
	return stateField(f.name, f.i)
}

// slotOffset returns index*itemLen + extra as a byte offset, failing on a
// negative index or overflow. f names the input in errors.
func slotOffset(f fieldRef, index int64, itemLen, extra uint64) (uint64, error) {
	if index < 0 {
		return 0, errorf(f.String(), "negative index %d", index)
	}
	off, ok := mulAdd64(extra, uint64(index), itemLen)
	if !ok {
		return 0, errorf(f.String(), "index %d x item length %d overflows", index, itemLen)
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

// checkPlanBounds reports the first copy of p that leaves its regions as a
// geometry error naming the side's input field: an index too large for
// the registered buffer is the caller's input error, never a plan to post.
func checkPlanBounds(p *Plan, srcField, dstField fieldRef) error {
	for i, c := range p.Copies {
		if err := checkSide(p.Src, c.SrcRegion, c.SrcOff, c.Len, c.SrcStride, c.Count); err != nil {
			return errorf(srcField.String(), "copy %d leaves the prefill buffers: %v", i, err)
		}
		if err := checkSide(p.Dst, c.DstRegion, c.DstOff, c.Len, c.DstStride, c.Count); err != nil {
			return errorf(dstField.String(), "copy %d leaves the decode buffers: %v", i, err)
		}
	}
	return nil
}
