package planner

import (
	"encoding/binary"
	"fmt"
	"slices"
	"unsafe"
)

// This file is the prepped representation of SGLang NIXL's KV paths: the
// descriptor lists SGLang's disaggregation/nixl/conn.py prepares once per peer (prep_xfer_dlist)
// and the index arrays it builds per chunk (repeat_indices_over_layers,
// expand_page_indices_for_slice), exactly as SGLang's disaggregation/nixl/conn.py builds them, for
// a runtime that uses the ABI's prepped path (prep_dlist and
// make_prepped_xfer) instead of strided copies.

// DlistBlock is the part of a descriptor list that covers one region: for
// s < Slots, t < Tokens, g < Groups, entry
// ((s*Tokens)+t)*Groups+g of the block is Len bytes at region address +
// Off + s*SlotStride + t*TokenStride + g*GroupStride.
type DlistBlock struct {
	Region                               int32
	Off                                  uint64
	Slots, Tokens, Groups                uint64
	SlotStride, TokenStride, GroupStride uint64
	Len                                  uint64
}

// Entries returns the number of descriptors of the block.
func (b *DlistBlock) Entries() uint64 { return b.Slots * b.Tokens * b.Groups }

// Dlist describes a prepared descriptor list compactly: its entries are
// those of Blocks, in order. Regions is the side's region table (borrowed).
type Dlist struct {
	Kind    MemKind
	Regions []Region
	Blocks  []DlistBlock
}

// Len returns the number of descriptors in the list.
func (d *Dlist) Len() uint64 {
	var n uint64
	for i := range d.Blocks {
		n += d.Blocks[i].Entries()
	}
	return n
}

// ForEach calls fn with the absolute address and length of every
// descriptor, in list order, until fn returns false.
func (d *Dlist) ForEach(fn func(addr, length uint64) bool) bool {
	for _, b := range d.Blocks {
		base := d.Regions[b.Region].Addr + b.Off
		for s := uint64(0); s < b.Slots; s++ {
			for t := uint64(0); t < b.Tokens; t++ {
				for g := uint64(0); g < b.Groups; g++ {
					if !fn(base+s*b.SlotStride+t*b.TokenStride+g*b.GroupStride, b.Len) {
						return false
					}
				}
			}
		}
	}
	return true
}

// Validate checks that every descriptor lies inside its region (NIXL
// refuses to prepare a list that does not) and that the list can be
// indexed with int32.
func (d *Dlist) Validate() error {
	var total uint64
	for i, b := range d.Blocks {
		if b.Region < 0 || int(b.Region) >= len(d.Regions) {
			return fmt.Errorf("dlist block %d: region %d out of range", i, b.Region)
		}
		n := b.Entries()
		if n == 0 || b.Len == 0 {
			continue
		}
		total += n
		if total > maxDlistEntries {
			return fmt.Errorf("dlist has more than %d descriptors; NIXL indices are int32", maxDlistEntries)
		}
		last := b.Off
		ok := true
		for _, dim := range [3][2]uint64{{b.Slots, b.SlotStride}, {b.Tokens, b.TokenStride}, {b.Groups, b.GroupStride}} {
			var ok1 bool
			last, ok1 = mulAdd64(last, dim[0]-1, dim[1])
			ok = ok && ok1
		}
		end, ok2 := add64(last, b.Len)
		if !ok || !ok2 || end > d.Regions[b.Region].Len {
			return fmt.Errorf("dlist block %d: last descriptor ends at offset %d, past region %d (%d bytes)", i, end, b.Region, d.Regions[b.Region].Len)
		}
	}
	return nil
}

// PreppedPart is one prepped transfer of a chunk: a source and a
// destination dlist and how chunk pages index them. Entry index of page q,
// token t, group g in region block r is
// r*Slots*Tokens*Groups + q*Tokens*Groups + t*Groups + g.
type PreppedPart struct {
	Src, Dst Dlist
	// SrcGroup is the head group this peer reads from each source token
	// (0 unless the source interleaves several groups).
	SrcGroup uint64
}

// PreppedKV is the prepped representation of a NIXLKV peer.
type PreppedKV struct {
	// Parts holds one part per separately posted transfer: one, or one per
	// memory segment on nixl-prepped-mixed (notification suffix
	// PartNotifSuffix(i, len(Parts))).
	Parts []PreppedPart
	// SrcShared reports that the source dlists depend only on the prefill
	// geometry (and, for slices, on the decode TP size): SGLang's disaggregation/nixl/conn.py
	// prepares them once and reuses them for every peer.
	SrcShared bool
}

// Prepped returns the dlists SGLang's disaggregation/nixl/conn.py prepares for this peer, or an
// *Error when the path is not prepped or SGLang's disaggregation/nixl/conn.py's lists would be
// rejected by NIXL (a descriptor outside its region, or more than 2^31-1
// descriptors). The strided-copy Plan does not depend on this.
func (n *NIXLKV) Prepped() (*PreppedKV, error) {
	if !n.prepped {
		return nil, errorf("prepped", "path %s uses no prepped dlists", n.path)
	}
	pk := &PreppedKV{SrcShared: true}
	srcPages, dstPages := n.g.Prefill.NumPages, n.g.Decode.NumPages
	if n.path == PathNIXLPreppedSlice {
		h := &n.slice
		part := PreppedPart{SrcGroup: h.groupIdx}
		part.Src = Dlist{Kind: n.segments[0].SrcKind, Regions: n.src}
		part.Dst = Dlist{Kind: n.segments[0].DstKind, Regions: n.dst}
		for i, d := range n.pairOf {
			part.Src.Blocks = append(part.Src.Blocks, DlistBlock{
				Region: int32(i), Slots: srcPages, Tokens: h.pageSize, Groups: h.groups,
				SlotStride: h.srcItem, TokenStride: h.srcToken, GroupStride: h.length, Len: h.length,
			})
			part.Dst.Blocks = append(part.Dst.Blocks, DlistBlock{
				Region: d, Off: h.dstOff, Slots: dstPages, Tokens: h.pageSize, Groups: 1,
				SlotStride: h.dstItem, TokenStride: h.dstToken, Len: h.length,
			})
		}
		pk.Parts = append(pk.Parts, part)
	} else {
		for _, seg := range n.segments {
			part := PreppedPart{
				Src: Dlist{Kind: seg.SrcKind, Regions: n.src},
				Dst: Dlist{Kind: seg.DstKind, Regions: n.dst},
			}
			for _, pp := range n.pairs[seg.Start:seg.End] {
				part.Src.Blocks = append(part.Src.Blocks, DlistBlock{
					Region: pp.src, Slots: srcPages, Tokens: 1, Groups: 1, SlotStride: pp.srcStride, Len: pp.xfer,
				})
				part.Dst.Blocks = append(part.Dst.Blocks, DlistBlock{
					Region: pp.dst, Slots: dstPages, Tokens: 1, Groups: 1, SlotStride: pp.dstStride, Len: pp.xfer,
				})
			}
			pk.Parts = append(pk.Parts, part)
		}
	}
	for i := range pk.Parts {
		if err := pk.Parts[i].Src.Validate(); err != nil {
			return nil, errorf("prefill.kv_item_lens", "SGLang's disaggregation/nixl/conn.py's source dlist would be rejected: %v", err)
		}
		if err := pk.Parts[i].Dst.Validate(); err != nil {
			return nil, errorf("decode.kv_item_lens", "SGLang's disaggregation/nixl/conn.py's destination dlist would be rejected: %v", err)
		}
	}
	return pk, nil
}

// Indices appends to srcIdx and dstIdx the index arrays of part for one
// chunk, exactly as SGLang's disaggregation/nixl/conn.py computes them (repeat_indices_over_layers
// for whole pages, expand_page_indices_for_slice for head slices), after
// the same chunk rules as NIXLKV.Plan. Pass reused slices to avoid
// allocating.
func (n *NIXLKV) Indices(pk *PreppedKV, part int, srcIdx, dstIdx []int32, prefillPages, decodePages []int32) ([]int32, []int32, error) {
	if part < 0 || part >= len(pk.Parts) {
		return srcIdx, dstIdx, errorf("part", "part %d of %d", part, len(pk.Parts))
	}
	src, dst, err := chunkPages(prefillPages, n.g.Prefill.NumPages, decodePages, n.g.Decode.NumPages)
	if err != nil {
		return srcIdx, dstIdx, err
	}
	pp := &pk.Parts[part]
	srcIdx = appendDlistIndices(srcIdx, &pp.Src, src, pp.SrcGroup)
	dstIdx = appendDlistIndices(dstIdx, &pp.Dst, dst, 0)
	return srcIdx, dstIdx, nil
}

// appendDlistIndices appends, block after block, the entry index of every
// token of every page for head group g. It grows out once, plans the first
// block and, for every later block of the same shape (every block of
// SGLang's prepped lists), adds the block's offset to the first block's indices:
// the per-page multiply then runs once per chunk, not once per layer. The
// indices fit in int32: Validate bounds the list to MaxInt32 entries and
// the chunk's pages are checked against the list's slots.
func appendDlistIndices(out []int32, d *Dlist, pages []int32, g uint64) []int32 {
	var total int
	for i := range d.Blocks {
		total += int(d.Blocks[i].Tokens) * len(pages)
	}
	n := len(out)
	out = slices.Grow(out, total)[:n+total]
	var base, tmplBase uint64
	tmpl := -1 // index of the block planned in full
	o := n
	for i := range d.Blocks {
		b := &d.Blocks[i]
		m := int(b.Tokens) * len(pages)
		dst := out[o : o+m]
		if t := tmpl; t >= 0 && b.Tokens == d.Blocks[t].Tokens && b.Groups == d.Blocks[t].Groups {
			addInt32(dst, out[n:n+m], int32(base-tmplBase))
		} else {
			fillDlistBlock(dst, b, pages, base+g)
			if tmpl < 0 {
				tmpl, tmplBase = i, base
			}
		}
		o += m
		base += b.Entries()
	}
	return out
}

// fillDlistBlock writes the indices of one block: page q, token t at
// first + q*Tokens*Groups + t*Groups.
func fillDlistBlock(dst []int32, b *DlistBlock, pages []int32, first uint64) {
	per := b.Tokens * b.Groups
	if b.Tokens == 1 {
		dst = dst[:len(pages)]
		for i, q := range pages {
			dst[i] = int32(first + uint64(q)*per)
		}
		return
	}
	tokens := int(b.Tokens)
	for i, q := range pages {
		row := dst[i*tokens : (i+1)*tokens]
		v := first + uint64(q)*per
		for t := range row {
			row[t] = int32(v)
			v += b.Groups
		}
	}
}

// addInt32 sets dst[i] = src[i] + delta, for src[i] and src[i] + delta in
// [0, MaxInt32] (dlist indices). It adds two indices per 64-bit add: no
// lane carries into the next, since no sum reaches 2^32. This is what makes
// the index arrays of a chunk cost less than numpy's (which writes them
// twice: the broadcast add, then astype's copy).
func addInt32(dst, src []int32, delta int32) {
	src = src[:len(dst)]
	n := len(dst) &^ 7
	if n > 0 {
		d := unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 4*n)
		s := unsafe.Slice((*byte)(unsafe.Pointer(&src[0])), 4*n)
		dd := uint64(uint32(delta)) | uint64(uint32(delta))<<32
		e := binary.NativeEndian
		for len(d) >= 32 && len(s) >= 32 {
			e.PutUint64(d[0:8], e.Uint64(s[0:8])+dd)
			e.PutUint64(d[8:16], e.Uint64(s[8:16])+dd)
			e.PutUint64(d[16:24], e.Uint64(s[16:24])+dd)
			e.PutUint64(d[24:32], e.Uint64(s[24:32])+dd)
			d, s = d[32:], s[32:]
		}
	}
	for i := n; i < len(dst); i++ {
		dst[i] = src[i] + delta
	}
}
