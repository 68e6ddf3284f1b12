// Package planner turns KV-cache geometry and page indices into transfer
// plans: which bytes of the prefill side move to which bytes of the decode
// side. It is pure computation: no I/O, no plugin calls, no imports of the
// rest of kvhost. Results are byte-exact with the upstream connectors
// (SGLang's python/sglang/srt/disaggregation/{nixl,mori}/conn.py and vLLM's
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py), but
// expressed with strided copies so a backend gets far fewer descriptors
// than upstream hands it. The JSON request and response layer of `kvhost
// plan` is package planner/planjson.
//
// Planning runs per chunk, before the first byte moves, and allocates
// nothing once a Plan has grown. BenchmarkKVPlan times every plan path
// beside the upstream connectors' own per-request planning (numpy, run in
// the same invocation); docs/plan.md, "Planning time", has the command and
// the figures.
package planner

import (
	"fmt"
	"math/bits"
	"slices"
	"strconv"
)

// MemKind is where a region lives. The planner only uses it to split plans
// into segments of one (source kind, destination kind) and to refuse kinds
// a path cannot serve. It is numbered and sized as NIXL's nixl_mem_t (and
// abi.MemKind, kvp_mem_kind), so a runtime converts kinds both ways with a
// plain conversion; host/internal/memkind is the one place the runtimes do
// it. There are two types because the planner imports nothing of kvhost and
// abi, the C ABI's mirror, must not depend on the planner. DRAM is the zero
// value; every default of the planner that is VRAM (nil Kinds, missing
// mem_kinds in JSON) is spelt out, never left to the zero value.
type MemKind uint32

// Memory kinds, numbered as NIXL's DRAM_SEG and VRAM_SEG and named as on
// the SGLang wire ("DRAM", "VRAM").
const (
	DRAM MemKind = 0
	VRAM MemKind = 1
)

func (k MemKind) String() string {
	switch k {
	case VRAM:
		return "VRAM"
	case DRAM:
		return "DRAM"
	}
	return fmt.Sprintf("MemKind(%d)", uint32(k))
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
//
// Plans are built to be reused: a per-peer planner fills one Plan per chunk
// with Reset and Add, so Copies and Parts keep their capacity and planning a
// chunk allocates nothing once they have grown. Src and Dst are borrowed
// from the planner that filled the plan (never modified through the plan)
// and stay valid as long as that planner.
type Plan struct {
	// Path names the upstream code path the plan reproduces, e.g.
	// "nixl-prepped-equal-tp" or "mori-tp-slice".
	Path   string
	Src    []Region
	Dst    []Region
	Copies []Copy
	// Parts splits Copies into transfers that the backend must post
	// separately, each with its own notification (SGLang NIXL mixed memory
	// kinds: one part per run of (source kind, destination kind)). Empty
	// means one transfer holding every copy. When set, the parts cover
	// Copies in order without gaps.
	Parts []Part
	// ReferenceDescriptors is how many descriptors the upstream connectors (SGLang's python/sglang/srt/disaggregation/{nixl,mori}/conn.py and vLLM's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py)
	// hands its backend for the same bytes (0 when not computed). Reported
	// by `kvhost plan` to show what strided descriptors save.
	ReferenceDescriptors uint64

	// mergeFloor is the first copy Add may merge into; copies before it
	// belong to a closed part.
	mergeFloor int
	// runs is scratch space for planners: a chunk's page runs, computed
	// once per chunk and kept across Reset to avoid allocating.
	runs []pageRun
}

// Part is one backend transfer of a plan: Copies[Start:End], all moving from
// SrcKind memory to DstKind memory.
type Part struct {
	Start, End int
	SrcKind    MemKind
	DstKind    MemKind
	// NotifSuffix is what SGLang's disaggregation/{nixl,mori}/conn.py appends to the transfer's base
	// notification for this part (e.g. "_2" for state component 2). Empty
	// means SGLang NIXL's mixed-memory numbering, PartNotifSuffix(i, n).
	NotifSuffix string
}

// Reset empties the plan for reuse, keeping the capacity of Copies and
// Parts. Src, Dst and Path are set by the caller afterwards.
func (p *Plan) Reset() {
	p.Path = ""
	p.Src, p.Dst = nil, nil
	p.Copies = p.Copies[:0]
	p.Parts = p.Parts[:0]
	p.ReferenceDescriptors = 0
	p.mergeFloor = 0
}

// Add appends c, merging it into the last copy when c continues it:
//   - two plain blocks that are adjacent on both sides become one block;
//   - two equal-length blocks (or a strided run and a block or run that
//     continues it with the same strides) become one strided copy, provided
//     the strides are at least the block length on both sides so blocks of
//     one copy never overlap.
//
// A strided run whose strides both equal its block length is stored as one
// plain block. Merging never changes which bytes move where. Add allocates
// only when Copies has to grow.
func (p *Plan) Add(c Copy) {
	c.normalize()
	if n := len(p.Copies); n > p.mergeFloor && p.Copies[n-1].absorb(c) {
		return
	}
	p.Copies = append(p.Copies, c)
}

// freshStart returns where the copies of region pair (src, dst) that are
// about to be added will start, or -1 when the first of them could merge
// into the last copy of the plan (same regions, no part closed since): such
// copies are no template for Plan.repeat.
func (p *Plan) freshStart(src, dst int32) int {
	n := len(p.Copies)
	if n > p.mergeFloor && p.Copies[n-1].SrcRegion == src && p.Copies[n-1].DstRegion == dst {
		return -1
	}
	return n
}

// repeat appends Copies[from:to] again with regions src and dst, and
// reports whether it did. It is what adding the same copies in those
// regions with Add would give, provided the template copies were added
// (with Add) from a fresh start (freshStart) and came from one region pair:
// Add merges a copy into the last one only when both name the same regions,
// and otherwise depends on offsets, lengths and strides alone. So repeat
// refuses (and the caller plans the copies) when the first repeated copy
// could merge into the plan's last copy.
func (p *Plan) repeat(from, to int, src, dst int32) bool {
	if from < 0 || to < from || to > len(p.Copies) {
		return false
	}
	if p.freshStart(src, dst) < 0 {
		return false
	}
	n := len(p.Copies)
	p.Copies = slices.Grow(p.Copies, to-from)[:n+to-from]
	// copy (memmove) and then the region fields: a loop assigning whole
	// Copy values is several times slower.
	out := p.Copies[n:]
	copy(out, p.Copies[from:to])
	for i := range out {
		out[i].SrcRegion, out[i].DstRegion = src, dst
	}
	return true
}

// ClosePart ends the current part: copies added so far that are not in a
// part yet become Part{..., srcKind, dstKind}, and later copies are never
// merged into them. A plan with parts must close its last part too.
func (p *Plan) ClosePart(srcKind, dstKind MemKind) {
	start := 0
	if n := len(p.Parts); n > 0 {
		start = p.Parts[n-1].End
	}
	p.Parts = append(p.Parts, Part{Start: start, End: len(p.Copies), SrcKind: srcKind, DstKind: dstKind})
	p.mergeFloor = len(p.Copies)
}

// absorb merges next into c when next continues c (see Plan.Add) and
// reports whether it did.
func (c *Copy) absorb(next Copy) bool {
	if c.SrcRegion != next.SrcRegion || c.DstRegion != next.DstRegion ||
		c.Count == 0 || next.Count == 0 || c.Len == 0 || next.Len == 0 {
		return false
	}
	if c.Count == 1 && next.Count == 1 {
		srcEnd, ok1 := add64(c.SrcOff, c.Len)
		dstEnd, ok2 := add64(c.DstOff, c.Len)
		if ok1 && ok2 && next.SrcOff == srcEnd && next.DstOff == dstEnd {
			if l, ok := add64(c.Len, next.Len); ok {
				c.Len = l
				return true
			}
			return false
		}
	}
	if c.Len != next.Len {
		return false
	}
	srcStride, dstStride := c.SrcStride, c.DstStride
	if c.Count == 1 {
		if next.SrcOff <= c.SrcOff || next.DstOff <= c.DstOff {
			return false
		}
		srcStride, dstStride = next.SrcOff-c.SrcOff, next.DstOff-c.DstOff
		if srcStride < c.Len || dstStride < c.Len {
			return false
		}
	} else {
		srcNext, ok1 := mulAdd64(c.SrcOff, c.Count, c.SrcStride)
		dstNext, ok2 := mulAdd64(c.DstOff, c.Count, c.DstStride)
		if !ok1 || !ok2 || next.SrcOff != srcNext || next.DstOff != dstNext {
			return false
		}
	}
	if next.Count > 1 && (next.SrcStride != srcStride || next.DstStride != dstStride) {
		return false
	}
	count, ok := add64(c.Count, next.Count)
	if !ok {
		return false
	}
	c.SrcStride, c.DstStride, c.Count = srcStride, dstStride, count
	c.normalize()
	return true
}

// normalize stores a run of blocks that are adjacent on both sides as one
// plain block, and clears the strides of a plain block.
func (c *Copy) normalize() {
	if c.Count > 1 && c.SrcStride == c.Len && c.DstStride == c.Len {
		if l, ok := mul64(c.Len, c.Count); ok {
			c.Len, c.Count = l, 1
		}
	}
	if c.Count == 1 {
		c.SrcStride, c.DstStride = 0, 0
	}
}

// add64 returns a+b and false on overflow.
func add64(a, b uint64) (uint64, bool) {
	s, carry := bits.Add64(a, b, 0)
	return s, carry == 0
}

// mul64 returns a*b and false on overflow.
func mul64(a, b uint64) (uint64, bool) {
	hi, lo := bits.Mul64(a, b)
	return lo, hi == 0
}

// mulAdd64 returns base + n*stride and false on overflow.
func mulAdd64(base, n, stride uint64) (uint64, bool) {
	m, ok := mul64(n, stride)
	if !ok {
		return 0, false
	}
	return add64(base, m)
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
//
// When the plan has parts, they must cover Copies in order, and every copy
// of a part must move between regions of the part's memory kinds.
func (p *Plan) Validate() error {
	if err := p.validateParts(); err != nil {
		return err
	}
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

func (p *Plan) validateParts() error {
	if len(p.Parts) == 0 {
		return nil
	}
	next := 0
	for i, pt := range p.Parts {
		if pt.Start != next || pt.End < pt.Start || pt.End > len(p.Copies) {
			return fmt.Errorf("part %d: copies [%d, %d) do not continue at %d within %d copies", i, pt.Start, pt.End, next, len(p.Copies))
		}
		for j := pt.Start; j < pt.End; j++ {
			c := p.Copies[j]
			if int(c.SrcRegion) < len(p.Src) && c.SrcRegion >= 0 && p.Src[c.SrcRegion].Kind != pt.SrcKind {
				return fmt.Errorf("part %d: copy %d reads %v region %d, part is %v", i, j, p.Src[c.SrcRegion].Kind, c.SrcRegion, pt.SrcKind)
			}
			if int(c.DstRegion) < len(p.Dst) && c.DstRegion >= 0 && p.Dst[c.DstRegion].Kind != pt.DstKind {
				return fmt.Errorf("part %d: copy %d writes %v region %d, part is %v", i, j, p.Dst[c.DstRegion].Kind, c.DstRegion, pt.DstKind)
			}
		}
		next = pt.End
	}
	if next != len(p.Copies) {
		return fmt.Errorf("parts end at copy %d of %d", next, len(p.Copies))
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
// and returns false if fn returns false. The plan must be valid (Validate).
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
// names the offending input in SGLang's disaggregation/{nixl,mori}/conn.py's terms (e.g. "kv_item_lens").
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

// PartNotifSuffix is the suffix SGLang NIXL appends to a chunk's KV
// notification for part i of n of a mixed-memory transfer.
func PartNotifSuffix(i, n int) string {
	return "_part_" + strconv.Itoa(i) + "_" + strconv.Itoa(n)
}
