package engmem

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
)

// MaxRegions bounds the regions of one Table (one engine connection): a
// client cannot make the sidecar hold unbounded mappings. The control
// API's hello reports it as limits.regions.
const MaxRegions = 4096

// Table is one engine connection's regions: engine ranges that do not
// overlap, each opened in this process. It is safe for concurrent use:
// Translate and Bytes (transfers) run beside Add and Remove (the control
// loop); Add opens its regions without holding the table's lock.
//
// A Table does not count the users of a region: the caller must stop
// using a Region (its Bytes, its Local) before removing it.
type Table struct {
	opener *Opener

	mu      sync.RWMutex
	regions []*Region // sorted by Addr; ranges disjoint
	byID    map[uint64]*Region
	pending int // regions being opened by Adds in progress, counted against MaxRegions
	nextID  uint64
	closed  bool
}

// NewTable returns an empty Table that opens regions with o (nil: a zero
// Opener).
func NewTable(o *Opener) *Table {
	if o == nil {
		o = &Opener{}
	}
	return &Table{opener: o, byID: make(map[uint64]*Region)}
}

// rangeString formats the engine range [addr, addr+length).
func rangeString(addr, length uint64) string {
	return fmt.Sprintf("[0x%x, 0x%x)", addr, addr+length)
}

// Add opens every spec and adds them all, or none: when one is refused,
// those already opened are closed and the Table is unchanged. Specs must
// not overlap each other nor a region of the Table. The regions returned
// are in the order of specs and carry their new IDs. Errors are *Error;
// the message names the spec by its index ("regions[2]: ...").
func (t *Table) Add(specs []Spec) ([]*Region, error) {
	for i, s := range specs {
		if e := checkSpec(s); e != nil {
			e.Msg = fmt.Sprintf("regions[%d]: %s", i, e.Msg)
			return nil, e
		}
	}
	if len(specs) == 0 {
		return nil, nil
	}
	if len(specs) > MaxRegions {
		return nil, errorf(CodeLimit, "%d regions: a connection may register at most %d", len(specs), MaxRegions)
	}
	// Overlaps within the request: sort the indices by address and compare
	// neighbours.
	order := make([]int, len(specs))
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool { return specs[order[a]].Addr < specs[order[b]].Addr })
	for k := 1; k < len(order); k++ {
		p, q := specs[order[k-1]], specs[order[k]]
		if q.Addr < p.Addr+p.Length {
			return nil, errorf(CodeBadRegion, "regions[%d] %s overlaps regions[%d] %s",
				order[k], rangeString(q.Addr, q.Length), order[k-1], rangeString(p.Addr, p.Length))
		}
	}

	// Reserve room under the lock, open without it (opening a CUDA IPC
	// handle can take milliseconds), insert under it again, checking what
	// another Add may have inserted in between.
	t.mu.Lock()
	if e := t.admitLocked(specs); e != nil {
		t.mu.Unlock()
		return nil, e
	}
	t.pending += len(specs)
	t.mu.Unlock()

	opened := make([]*Region, 0, len(specs))
	closeOpened := func() {
		for _, r := range opened {
			_ = r.Close() // already failing: the first error is the one reported
		}
	}
	var openErr error
	for i, s := range specs {
		r, err := t.opener.Open(s)
		if err != nil {
			var e *Error
			if errors.As(err, &e) {
				e.Msg = fmt.Sprintf("regions[%d]: %s", i, e.Msg)
				err = e
			}
			openErr = err
			break
		}
		opened = append(opened, r)
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	t.pending -= len(specs)
	if openErr != nil {
		closeOpened()
		return nil, openErr
	}
	if t.closed {
		closeOpened()
		return nil, errorf(CodeBadRegion, "the connection's regions were released while registering")
	}
	if e := t.overlapLocked(specs); e != nil {
		closeOpened()
		return nil, e
	}
	for _, r := range opened {
		t.nextID++
		r.ID = t.nextID
		t.byID[r.ID] = r
		t.regions = append(t.regions, r)
	}
	slices.SortFunc(t.regions, func(a, b *Region) int {
		switch {
		case a.Addr < b.Addr:
			return -1
		case a.Addr > b.Addr:
			return 1
		}
		return 0
	})
	return opened, nil
}

// admitLocked checks the bound and the overlaps with the regions present.
func (t *Table) admitLocked(specs []Spec) *Error {
	if t.closed {
		return errorf(CodeBadRegion, "the connection's regions were released")
	}
	if have := len(t.regions) + t.pending; have+len(specs) > MaxRegions {
		return errorf(CodeLimit, "%d regions registered or being registered, %d more: a connection may register at most %d",
			have, len(specs), MaxRegions)
	}
	return t.overlapLocked(specs)
}

// overlapLocked refuses a spec that overlaps a region of the Table.
func (t *Table) overlapLocked(specs []Spec) *Error {
	for i, s := range specs {
		// The first region ending after s starts is the only candidate.
		k := sort.Search(len(t.regions), func(k int) bool {
			r := t.regions[k]
			return r.Addr+r.Length > s.Addr
		})
		if k < len(t.regions) && t.regions[k].Addr < s.Addr+s.Length {
			r := t.regions[k]
			return errorf(CodeBadRegion, "regions[%d] %s overlaps region %d %s registered before",
				i, rangeString(s.Addr, s.Length), r.ID, rangeString(r.Addr, r.Length))
		}
	}
	return nil
}

// Translate maps the engine range [addr, addr+length) to this process:
// the local address of addr and the region holding the range. The range
// must lie inside one region (a range running from one region into the
// next is refused even when they are adjacent: they are different
// mappings). length 0 asks for addr alone, which must lie inside a region.
// Errors are *Error with code "bad_region".
func (t *Table) Translate(addr, length uint64) (uintptr, *Region, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	r, e := t.findLocked(addr, length)
	if e != nil {
		return 0, nil, e
	}
	return r.Local + uintptr(addr-r.Addr), r, nil
}

// findLocked returns the region holding [addr, addr+length).
func (t *Table) findLocked(addr, length uint64) (*Region, *Error) {
	if addr+length < addr {
		return nil, errorf(CodeBadRegion, "range of %d bytes at 0x%x wraps the address space", length, addr)
	}
	// The last region starting at or before addr.
	k := sort.Search(len(t.regions), func(k int) bool { return t.regions[k].Addr > addr }) - 1
	if k < 0 || addr >= t.regions[k].Addr+t.regions[k].Length {
		return nil, errorf(CodeBadRegion, "range %s is not backed by a region of this connection", rangeString(addr, length))
	}
	r := t.regions[k]
	if addr+length > r.Addr+r.Length {
		return nil, errorf(CodeBadRegion, "range %s runs past the end of region %d %s",
			rangeString(addr, length), r.ID, rangeString(r.Addr, r.Length))
	}
	return r, nil
}

// Bytes is Translate for a DRAM range: the bytes of the mapping that hold
// [addr, addr+length) (capacity limited to length). A VRAM range is
// refused.
func (t *Table) Bytes(addr, length uint64) ([]byte, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	r, e := t.findLocked(addr, length)
	if e != nil {
		return nil, e
	}
	if r.Kind != DRAM {
		return nil, errorf(CodeBadRegion, "range %s is in %s region %d, not host memory", rangeString(addr, length), r.Kind, r.ID)
	}
	off := addr - r.Addr
	return r.Bytes[off : off+length : off+length], nil
}

// Remove closes and removes the regions ids, or none: an id the Table
// does not hold is refused with code "unknown" and nothing is removed. An
// id listed twice is removed once.
func (t *Table) Remove(ids []uint64) error {
	t.mu.Lock()
	for _, id := range ids {
		if _, ok := t.byID[id]; !ok {
			t.mu.Unlock()
			return errorf(CodeUnknown, "region %d is not registered on this connection", id)
		}
	}
	var gone []*Region
	for _, id := range ids {
		if r, ok := t.byID[id]; ok {
			delete(t.byID, id)
			gone = append(gone, r)
		}
	}
	t.regions = slices.DeleteFunc(t.regions, func(r *Region) bool { _, ok := t.byID[r.ID]; return !ok })
	t.mu.Unlock()
	return closeAll(gone)
}

// Close closes every region and releases the Table: a later Add is
// refused. It is idempotent.
func (t *Table) Close() error {
	t.mu.Lock()
	gone := t.regions
	t.regions = nil
	t.byID = make(map[uint64]*Region)
	t.closed = true
	t.mu.Unlock()
	return closeAll(gone)
}

func closeAll(rs []*Region) error {
	var errs []error
	for _, r := range rs {
		if err := r.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Len returns the number of regions in the Table.
func (t *Table) Len() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.regions)
}

// Regions returns the Table's regions sorted by engine address (a copy
// of the list; the Regions are the Table's).
func (t *Table) Regions() []*Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return slices.Clone(t.regions)
}

// Region returns the region id, or nil.
func (t *Table) Region(id uint64) *Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.byID[id]
}
