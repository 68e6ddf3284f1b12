package plugin

import (
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/kvhost/kvhost/abi"
)

// This file holds the arithmetic of capability emulation, free of plugin
// calls so that it can be tested on its own:
//
//   - prepped lists over batch transfers (agents without CapPrepped): a list
//     is kept in Go as (region, offset) per descriptor, resolved once at prep
//     time; a prepped transfer becomes one make_batch_xfer;
//   - batch transfers over prepped lists (agents without CapBatch): the
//     entries become two temporary lists and one make_prepped_xfer;
//   - strided descriptors on agents without CapStrided: expanded into plain
//     ones.

// maxExpandedBlocks bounds the plain descriptors (or batch entries) the host
// makes when it expands strided ones for an agent without CapStrided: per
// list, and per transfer. A strided descriptor may name any number of
// blocks (count is a uint64, and stride 0 repeats one block), so without
// this bound one descriptor could make the host allocate without limit.
// 16 Mi plain descriptors is far beyond what a KV layout needs (vLLM's
// largest unstrided lists held a few million).
const maxExpandedBlocks = 1 << 24

// expandable reports whether count more plain descriptors fit beside have
// within maxExpandedBlocks.
func expandable(have int, count uint64) bool {
	return count <= maxExpandedBlocks && uint64(have)+count <= maxExpandedBlocks
}

func tooManyBlocks(what string) *codedError {
	return errf(abi.ErrInvalidParam, "%s expand to more than %d plain descriptors (the agent has no native strides)", what, maxExpandedBlocks)
}

// codedError is an error of the emulation arithmetic; the agent turns it into
// an *Error naming the plugin and operation.
type codedError struct {
	code abi.Status
	msg  string
}

func (e *codedError) Error() string { return e.code.String() + ": " + e.msg }

func errf(code abi.Status, format string, args ...any) *codedError {
	return &codedError{code: code, msg: fmt.Sprintf(format, args...)}
}

// extent returns the end (exclusive) of a strided run: count blocks of
// length bytes, stride apart, the first at start. ok is false for zero
// length or count, and on overflow.
func extent(start, length, stride, count uint64) (end uint64, ok bool) {
	if length == 0 || count == 0 {
		return 0, false
	}
	last := uint64(0)
	if count > 1 {
		if stride != 0 && count-1 > math.MaxUint64/stride {
			return 0, false
		}
		last = (count - 1) * stride
	}
	if start > math.MaxUint64-last || start+last > math.MaxUint64-length {
		return 0, false
	}
	return start + last + length, true
}

// memRange is a piece of memory: a registered region, an imported remote
// region, or the span a descriptor covers.
type memRange struct {
	addr, end uint64 // [addr, end)
	dev       uint64
	kind      abi.MemKind
}

// rangeOf is the memory a registered or imported region covers.
func rangeOf(d abi.MemDesc) memRange {
	return memRange{addr: d.Addr, end: d.Addr + d.Len, dev: d.DevID, kind: d.MemKind}
}

func (r memRange) contains(x memRange) bool {
	return r.kind == x.kind && r.dev == x.dev && r.addr <= x.addr && x.end <= r.end
}

// coverIndex returns the index of a range in sorted (by addr) that contains
// x, or -1.
func coverIndex(sorted []memRange, x memRange) int {
	i := sort.Search(len(sorted), func(k int) bool { return sorted[k].addr > x.addr })
	// sorted[:i] start at or before x.addr; the nearest is the likeliest.
	for j := i - 1; j >= 0; j-- {
		if sorted[j].contains(x) {
			return j
		}
	}
	return -1
}

// mergeRanges sorts ranges by (kind, dev, addr) and merges overlapping ones,
// and also touching ones when adjacent is true. The input is reordered.
func mergeRanges(rs []memRange, adjacent bool) []memRange {
	slices.SortFunc(rs, func(x, y memRange) int {
		if x.kind != y.kind {
			return cmpU64(uint64(x.kind), uint64(y.kind))
		}
		if x.dev != y.dev {
			return cmpU64(x.dev, y.dev)
		}
		return cmpU64(x.addr, y.addr)
	})
	var out []memRange
	for _, r := range rs {
		if n := len(out); n > 0 {
			last := &out[n-1]
			if last.kind == r.kind && last.dev == r.dev && (r.addr < last.end || adjacent && r.addr == last.end) {
				last.end = max(last.end, r.end)
				continue
			}
		}
		out = append(out, r)
	}
	return out
}

// emuDesc is one descriptor of an emulated list: count blocks of len bytes,
// stride apart, starting off bytes into the list's region ref.
type emuDesc struct {
	ref                     int32 // index into emuList.handles
	off, len, stride, count uint64
}

// emuList is the Go side of a prepared list on an agent without native
// prepped lists.
type emuList struct {
	handles []uint64 // region (local list) or remote region handles, by ref
	descs   []emuDesc
	locals  []*Region       // local list: the regions behind handles (users counted)
	remotes []*RemoteRegion // remote list: the user's regions it uses (users counted)
	owned   []*RemoteRegion // remote list: regions imported for this list
}

// unref drops the list's claims on regions it does not own. Idempotent.
func (e *emuList) unref() {
	for _, r := range e.locals {
		r.users.Add(-1)
	}
	for _, r := range e.remotes {
		r.users.Add(-1)
	}
	e.locals, e.remotes = nil, nil
}

// resolveDescs maps each descriptor to (index of a covering range in
// sorted, offset into it), appending to out. Descriptors nothing covers are
// reported in missing (their index) instead, with ref -1.
func resolveDescs(descs []abi.XferDesc, kind abi.MemKind, sorted []memRange, out []emuDesc) ([]emuDesc, []int, *codedError) {
	var missing []int
	for i, d := range descs {
		end, ok := extent(d.Addr, d.Len, d.Stride, d.Count)
		if !ok {
			return nil, nil, errf(abi.ErrInvalidParam, "descriptor %d (addr %#x len %d stride %d count %d): zero length or count, or overflow", i, d.Addr, d.Len, d.Stride, d.Count)
		}
		e := emuDesc{ref: -1, len: d.Len, count: d.Count}
		if d.Count > 1 {
			e.stride = d.Stride
		}
		if j := coverIndex(sorted, memRange{addr: d.Addr, end: end, dev: d.DevID, kind: kind}); j >= 0 {
			e.ref, e.off = int32(j), d.Addr-sorted[j].addr
		} else {
			missing = append(missing, i)
		}
		out = append(out, e)
	}
	return out, missing, nil
}

// compactRefs renumbers the refs of descs to the ranges actually used, and
// returns for each new ref the old index, so a list keeps only the regions
// it needs.
func compactRefs(descs []emuDesc) []int {
	var used []int
	renum := map[int32]int32{}
	for i := range descs {
		old := descs[i].ref
		n, ok := renum[old]
		if !ok {
			n = int32(len(used))
			renum[old] = n
			used = append(used, int(old))
		}
		descs[i].ref = n
	}
	return used
}

// scratch holds reusable buffers of one in-flight call on a hot path. An
// agent keeps a pool of them; the plugin copies every array it is given, so
// a scratch is reusable as soon as the call returns.
type scratch struct {
	pairs    []abi.RegionPair
	entries  []abi.BatchEntry
	local    []int32
	remote   []int32
	ldescs   []abi.XferDesc
	rdescs   []abi.XferDesc
	slots    []int32        // dense (local ref, remote ref) -> pair; -1 outside a build
	slotKeys []int          // slots set by the current build
	pairMap  map[uint64]int // used instead of slots for very large ref products
}

// maxDenseSlots bounds the dense pair table (4 bytes per slot).
const maxDenseSlots = 1 << 20

// beginPairs prepares the pair table for lists with nl x nr refs.
func (s *scratch) beginPairs(nl, nr int) {
	s.pairs = s.pairs[:0]
	s.slotKeys = s.slotKeys[:0]
	if n := nl * nr; n <= maxDenseSlots {
		if len(s.slots) < n {
			s.slots = make([]int32, n)
			for i := range s.slots {
				s.slots[i] = -1
			}
		}
	} else if s.pairMap == nil {
		s.pairMap = map[uint64]int{}
	}
}

// pairFor returns the index in s.pairs of the pair (local ref l, remote ref
// r), adding it on first use.
func (s *scratch) pairFor(l, r int32, nl, nr int, lh, rh []uint64) uint32 {
	if nl*nr <= maxDenseSlots {
		key := int(l)*nr + int(r)
		if p := s.slots[key]; p >= 0 {
			return uint32(p)
		}
		s.slots[key] = int32(len(s.pairs))
		s.slotKeys = append(s.slotKeys, key)
	} else {
		key := uint64(l)<<32 | uint64(uint32(r))
		if p, ok := s.pairMap[key]; ok {
			return uint32(p)
		}
		s.pairMap[key] = len(s.pairs)
	}
	s.pairs = append(s.pairs, abi.RegionPair{Local: abi.Region(lh[l]), Remote: abi.RRegion(rh[r])})
	return uint32(len(s.pairs) - 1)
}

// endPairs restores the pair table's invariant (every slot -1).
func (s *scratch) endPairs() {
	for _, k := range s.slotKeys {
		s.slots[k] = -1
	}
	s.slotKeys = s.slotKeys[:0]
	if s.pairMap != nil {
		clear(s.pairMap)
	}
}

// buildPreppedBatch turns the prepped transfer local[li[k]] <-> remote[ri[k]]
// of two emulated lists into region pairs and batch entries (in s.pairs and
// s.entries). Strided descriptors are expanded when expand is true.
func (s *scratch) buildPreppedBatch(l, r *emuList, li, ri []int32, expand bool) *codedError {
	if len(li) != len(ri) {
		return errf(abi.ErrInvalidParam, "%d local indices but %d remote indices", len(li), len(ri))
	}
	nl, nr := len(l.handles), len(r.handles)
	s.beginPairs(nl, nr)
	defer s.endPairs()
	s.entries = slices.Grow(s.entries[:0], len(li))
	for k := range li {
		i, j := li[k], ri[k]
		if i < 0 || int(i) >= len(l.descs) {
			return errf(abi.ErrInvalidParam, "local index %d (position %d) outside the list of %d descriptors", i, k, len(l.descs))
		}
		if j < 0 || int(j) >= len(r.descs) {
			return errf(abi.ErrInvalidParam, "remote index %d (position %d) outside the list of %d descriptors", j, k, len(r.descs))
		}
		ld, rd := &l.descs[i], &r.descs[j]
		if ld.len != rd.len || ld.count != rd.count {
			return errf(abi.ErrMismatch, "position %d: local descriptor %d (len %d count %d) and remote descriptor %d (len %d count %d) differ",
				k, i, ld.len, ld.count, j, rd.len, rd.count)
		}
		if expand && ld.count > 1 && !expandable(len(s.entries), ld.count) {
			return tooManyBlocks("the transfer's descriptors")
		}
		pair := s.pairFor(ld.ref, rd.ref, nl, nr, l.handles, r.handles)
		s.entries = appendEntry(s.entries, abi.BatchEntry{
			Pair: pair, LocalOffset: ld.off, RemoteOffset: rd.off, Len: ld.len,
			LocalStride: ld.stride, RemoteStride: rd.stride, Count: ld.count,
		}, expand)
	}
	return nil
}

// appendEntry appends e, expanded into count plain entries when expand is
// true and e is strided. Entries with count 0 are kept as they are, so that
// the plugin rejects them.
func appendEntry(dst []abi.BatchEntry, e abi.BatchEntry, expand bool) []abi.BatchEntry {
	if !expand || e.Count <= 1 {
		return append(dst, e)
	}
	lo, ro := e.LocalOffset, e.RemoteOffset
	for range e.Count {
		dst = append(dst, abi.BatchEntry{Pair: e.Pair, LocalOffset: lo, RemoteOffset: ro, Len: e.Len, Count: 1})
		lo += e.LocalStride
		ro += e.RemoteStride
	}
	return dst
}

// expandEntries expands the strided entries of a batch into s.entries.
func (s *scratch) expandEntries(entries []abi.BatchEntry) ([]abi.BatchEntry, *codedError) {
	s.entries = s.entries[:0]
	for i := range entries {
		if !expandable(len(s.entries), max(entries[i].Count, 1)) {
			return nil, tooManyBlocks("the batch entries")
		}
		s.entries = appendEntry(s.entries, entries[i], true)
	}
	return s.entries, nil
}

// hasStrided reports whether any entry has count > 1.
func hasStrided(entries []abi.BatchEntry) bool {
	for i := range entries {
		if entries[i].Count > 1 {
			return true
		}
	}
	return false
}

// expandDescs expands strided descriptors into plain ones for a native list
// on an agent without CapStrided. first[i] is the index of descriptor i's
// first plain descriptor (len(first) == len(descs)+1); first is nil when no
// descriptor is strided, and then out is descs itself.
func expandDescs(descs []abi.XferDesc) (out []abi.XferDesc, first []int32, err *codedError) {
	total := uint64(0)
	strided := false
	for i, d := range descs {
		if d.Count > 1 {
			strided = true
		}
		if d.Count == 0 || d.Len == 0 {
			return nil, nil, errf(abi.ErrInvalidParam, "descriptor %d (addr %#x): zero length or count", i, d.Addr)
		}
		if _, ok := extent(d.Addr, d.Len, d.Stride, d.Count); !ok {
			return nil, nil, errf(abi.ErrInvalidParam, "descriptor %d (addr %#x): address overflow", i, d.Addr)
		}
		if !expandable(int(total), d.Count) {
			return nil, nil, tooManyBlocks("the list's descriptors")
		}
		total += d.Count
	}
	if !strided {
		return descs, nil, nil
	}
	out = make([]abi.XferDesc, 0, total)
	first = make([]int32, len(descs)+1)
	for i, d := range descs {
		first[i] = int32(len(out))
		addr := d.Addr
		for range d.Count {
			out = append(out, abi.XferDesc{Addr: addr, Len: d.Len, Count: 1, DevID: d.DevID})
			addr += d.Stride
		}
	}
	first[len(descs)] = int32(len(out))
	return out, first, nil
}

// blocksOf returns the plain-descriptor range of descriptor i of a list with
// n descriptors and prefix offsets first (nil: not expanded).
func blocksOf(first []int32, n int, i int32) (lo, hi int32, ok bool) {
	if i < 0 || int(i) >= n {
		return 0, 0, false
	}
	if first == nil {
		return i, i + 1, true
	}
	return first[i], first[i+1], true
}

// expandIndices expands the index arrays of a prepped transfer over native
// lists whose strided descriptors the host expanded (first arrays as from
// expandDescs; nil for a list that was not expanded) into s.local/s.remote.
func (s *scratch) expandIndices(lfirst []int32, ln int, li []int32, rfirst []int32, rn int, ri []int32) *codedError {
	if len(li) != len(ri) {
		return errf(abi.ErrInvalidParam, "%d local indices but %d remote indices", len(li), len(ri))
	}
	s.local, s.remote = s.local[:0], s.remote[:0]
	for k := range li {
		llo, lhi, ok := blocksOf(lfirst, ln, li[k])
		if !ok {
			return errf(abi.ErrInvalidParam, "local index %d (position %d) outside the list of %d descriptors", li[k], k, ln)
		}
		rlo, rhi, ok := blocksOf(rfirst, rn, ri[k])
		if !ok {
			return errf(abi.ErrInvalidParam, "remote index %d (position %d) outside the list of %d descriptors", ri[k], k, rn)
		}
		if lhi-llo != rhi-rlo {
			return errf(abi.ErrMismatch, "position %d: local descriptor %d has %d blocks, remote descriptor %d has %d", k, li[k], lhi-llo, ri[k], rhi-rlo)
		}
		if !expandable(len(s.local), uint64(lhi-llo)) {
			return tooManyBlocks("the transfer's indices")
		}
		for b := int32(0); b < lhi-llo; b++ {
			s.local = append(s.local, llo+b)
			s.remote = append(s.remote, rlo+b)
		}
	}
	return nil
}

// batchSide is what batch emulation needs to know of a pair's region.
type batchSide struct {
	addr, len, dev uint64
	kind           abi.MemKind
}

// buildBatchDescs turns batch entries over pairs into the local and remote
// descriptor lists of an equivalent prepped transfer (in s.ldescs and
// s.rdescs; the transfer uses identity indices). Offsets are checked against
// the regions here, because the prepped path would only see addresses.
func (s *scratch) buildBatchDescs(local, remote []batchSide, entries []abi.BatchEntry, expand bool) (lkind, rkind abi.MemKind, err *codedError) {
	s.ldescs, s.rdescs = s.ldescs[:0], s.rdescs[:0]
	for k := range entries {
		e := &entries[k]
		if int(e.Pair) >= len(local) {
			return 0, 0, errf(abi.ErrInvalidParam, "entry %d: pair %d outside %d pairs", k, e.Pair, len(local))
		}
		if e.Reserved != 0 {
			return 0, 0, errf(abi.ErrInvalidParam, "entry %d: reserved field is %d, want 0", k, e.Reserved)
		}
		l, r := local[e.Pair], remote[e.Pair]
		if k == 0 {
			lkind, rkind = l.kind, r.kind
		} else if l.kind != lkind || r.kind != rkind {
			return 0, 0, errf(abi.ErrNotSupported, "entry %d: memory kinds %v->%v differ from entry 0's %v->%v; batch emulation over prepped lists needs one kind per side", k, l.kind, r.kind, lkind, rkind)
		}
		lend, lok := extent(e.LocalOffset, e.Len, e.LocalStride, e.Count)
		rend, rok := extent(e.RemoteOffset, e.Len, e.RemoteStride, e.Count)
		if !lok || !rok {
			return 0, 0, errf(abi.ErrInvalidParam, "entry %d: zero length or count, or overflow", k)
		}
		if lend > l.len {
			return 0, 0, errf(abi.ErrInvalidParam, "entry %d: local bytes [%d, %d) beyond the %d-byte region", k, e.LocalOffset, lend, l.len)
		}
		if rend > r.len {
			return 0, 0, errf(abi.ErrInvalidParam, "entry %d: remote bytes [%d, %d) beyond the %d-byte region", k, e.RemoteOffset, rend, r.len)
		}
		ld := abi.XferDesc{Addr: l.addr + e.LocalOffset, Len: e.Len, Stride: e.LocalStride, Count: e.Count, DevID: l.dev}
		rd := abi.XferDesc{Addr: r.addr + e.RemoteOffset, Len: e.Len, Stride: e.RemoteStride, Count: e.Count, DevID: r.dev}
		if e.Count == 1 {
			ld.Stride, rd.Stride = 0, 0
		}
		if !expand || e.Count == 1 {
			s.ldescs = append(s.ldescs, ld)
			s.rdescs = append(s.rdescs, rd)
			continue
		}
		if !expandable(len(s.ldescs), e.Count) {
			return 0, 0, tooManyBlocks("the batch entries")
		}
		for range e.Count {
			s.ldescs = append(s.ldescs, abi.XferDesc{Addr: ld.Addr, Len: ld.Len, Count: 1, DevID: ld.DevID})
			s.rdescs = append(s.rdescs, abi.XferDesc{Addr: rd.Addr, Len: rd.Len, Count: 1, DevID: rd.DevID})
			ld.Addr += e.LocalStride
			rd.Addr += e.RemoteStride
		}
	}
	if len(s.ldescs) > math.MaxInt32 { // indices are int32
		return 0, 0, errf(abi.ErrInvalidParam, "a batch of %d entries has more than %d descriptors", len(entries), math.MaxInt32)
	}
	return lkind, rkind, nil
}

// identity returns [0, 1, ..., n-1] in s.local.
func (s *scratch) identity(n int) []int32 {
	s.local = s.local[:0]
	for i := range n {
		s.local = append(s.local, int32(i))
	}
	return s.local
}
