package planner

import (
	"fmt"
	"math"
)

// Paths of SGLang's NIXL connector (sglang_nixl_conn.py).
const (
	// PathNIXLPreppedEqualTP: MHA with equal attention TP, prepped dlists of
	// every slot of every region (send_kvcache, prepped branch).
	PathNIXLPreppedEqualTP = "nixl-prepped-equal-tp"
	// PathNIXLPreppedMLA: MLA (any TP), the same prepped whole-page path.
	PathNIXLPreppedMLA = "nixl-prepped-mla"
	// PathNIXLPreppedSlice: MHA with different attention TP, per-token head
	// slices (send_kvcache_slice).
	PathNIXLPreppedSlice = "nixl-prepped-slice"
	// PathNIXLPreppedMixed: equal TP or MLA where decode regions mix VRAM
	// and DRAM: one prepped pair and one transfer per segment
	// (send_kvcache_mixed).
	PathNIXLPreppedMixed = "nixl-prepped-mixed"
	// PathNIXLRuns / PathNIXLRunsMLA: the non-prepped path
	// (_send_kvcache_generic): group_concurrent_contiguous runs x layers.
	PathNIXLRuns    = "nixl-runs"
	PathNIXLRunsMLA = "nixl-runs-mla"
)

// NIXLKV plans the KV pages one SGLang prefill rank pushes to one decode
// peer with NIXL WRITEs. Build it once per peer (when the peer registers),
// then call Plan for every chunk. It is immutable after construction and
// safe for concurrent use.
type NIXLKV struct {
	sglangPair
	path  string
	pairs []pagePair // whole-page paths, in prefill region order
	slice headSlice  // slice path
	// segments are ranges of prefill regions with one (source kind,
	// destination kind), as Part values indexing prefill regions.
	segments []Part
	prepped  bool
}

// NewNIXLKV checks the geometry of a (prefill rank, decode peer) pair and
// chooses SGLang's disaggregation/nixl/conn.py's path (NixlKVManager._prepare_payload_xfer).
// prepped false selects the non-prepped path, which SGLang's disaggregation/nixl/conn.py keeps for
// state buffers; it moves whole pages, so it needs MLA or equal TP.
// Geometry SGLang's disaggregation/nixl/conn.py rejects is an *Error with the same meaning.
func NewNIXLKV(g SGLangKV, prepped bool) (*NIXLKV, error) {
	// SGLang's disaggregation/nixl/conn.py checks kinds and region counts when the peer
	// registers, before it slices pointers for PP.
	if err := g.Prefill.Check("prefill"); err != nil {
		return nil, err
	}
	if err := g.Decode.Check("decode"); err != nil {
		return nil, err
	}
	srcKind, err := homogeneousKind("prefill.mem_kinds", "source", g.Prefill.Kinds)
	if err != nil {
		return nil, err
	}
	nSrc, nDst := len(g.Prefill.Ptrs), len(g.Decode.Ptrs)
	if nDst < nSrc {
		return nil, errorf("decode.kv_ptrs", "NIXL PD transfer: decode registered fewer KV regions (%d) than prefill (%d); unexpected geometry", nDst, nSrc)
	}
	sp, err := newSGLangPair(g, PairCommon)
	if err != nil {
		return nil, err
	}
	n := &NIXLKV{sglangPair: sp, prepped: prepped}
	decodeOnlySpecDec := nDst > nSrc

	if !prepped {
		if !n.equalTP() {
			return nil, errorf("prepped", "the non-prepped path moves whole pages; heterogeneous TP (prefill %d, decode %d) needs the prepped slice path", g.Prefill.TPSize, g.Decode.TPSize)
		}
		dstKind, err := homogeneousKind("decode.mem_kinds", "destination", n.pairedKinds())
		if err != nil {
			return nil, err
		}
		n.path = PathNIXLRuns
		if g.MLA {
			n.path = PathNIXLRunsMLA
		}
		// _send_kvcache_generic addresses K and V of layer j, on both
		// sides, with kv_item_lens[j] of the prefill side.
		half := nSrc
		if !g.MLA {
			half = nSrc / 2
		}
		for i, d := range n.pairOf {
			item := g.Prefill.ItemLens[i%half]
			n.pairs = append(n.pairs, pagePair{src: int32(i), dst: d, srcStride: item, dstStride: item, xfer: item})
		}
		n.segments = []Part{{Start: 0, End: nSrc, SrcKind: srcKind, DstKind: dstKind}}
		return n, nil
	}

	if n.equalTP() {
		dstKinds := n.pairedKinds()
		dstKind, mixedErr := homogeneousKind("decode.mem_kinds", "destination", dstKinds)
		if mixedErr != nil {
			if decodeOnlySpecDec {
				return nil, errorf("decode.mem_kinds", "NIXL PD transfer does not support HiSparse combined with decode-only speculative decoding")
			}
			n.path = PathNIXLPreppedMixed
			n.segments = memSegments(g.Prefill.Kinds, dstKinds)
		} else {
			if decodeOnlySpecDec && dstKind != VRAM {
				return nil, errorf("decode.mem_kinds", "NIXL PD transfer does not support HiSparse combined with decode-only speculative decoding")
			}
			n.path = PathNIXLPreppedEqualTP
			if g.MLA {
				n.path = PathNIXLPreppedMLA
			}
			n.segments = []Part{{Start: 0, End: nSrc, SrcKind: srcKind, DstKind: dstKind}}
		}
		// Destination dlists use decode's slot stride but prefill's
		// transfer length (HiSparse host pools have a wider stride).
		for i, d := range n.pairOf {
			xfer, stride := g.Prefill.ItemLens[i], g.Decode.ItemLens[d]
			if xfer > stride {
				return nil, errorf(fmt.Sprintf("decode.kv_item_lens[%d]", d), "NIXL prepared dlist transfer length exceeds item stride: xfer_len=%d, item_len=%d, mem_kind=%v", xfer, stride, g.Decode.kind(int(d)))
			}
			n.pairs = append(n.pairs, pagePair{src: int32(i), dst: d, srcStride: xfer, dstStride: stride, xfer: xfer})
		}
		return n, nil
	}

	dstKind, err := homogeneousKind("decode.mem_kinds", "destination", n.pairedKinds())
	if err != nil {
		return nil, err
	}
	if dstKind != VRAM {
		return nil, errorf("decode.mem_kinds", "NIXL heterogeneous-TP direct-to-host KV transfer is not implemented safely yet")
	}
	if n.slice, err = n.headSlice(sliceNIXL); err != nil {
		return nil, err
	}
	n.path = PathNIXLPreppedSlice
	n.segments = []Part{{Start: 0, End: nSrc, SrcKind: srcKind, DstKind: dstKind}}
	return n, nil
}

// pairedKinds returns the memory kinds of the decode regions paired with
// the prefill regions, in prefill order.
func (n *NIXLKV) pairedKinds() []MemKind {
	kinds := make([]MemKind, len(n.pairOf))
	for i, d := range n.pairOf {
		kinds[i] = n.g.Decode.kind(int(d))
	}
	return kinds
}

// homogeneousKind returns the one memory kind of kinds (nil: VRAM) or the
// NotImplementedError SGLang's disaggregation/nixl/conn.py raises for mixed
// kinds.
func homogeneousKind(field, context string, kinds []MemKind) (MemKind, error) {
	if len(kinds) == 0 {
		return VRAM, nil
	}
	for _, k := range kinds[1:] {
		if k != kinds[0] {
			return 0, errorf(field, "NIXL %s mixed KV memory kinds are not implemented safely yet: [DRAM VRAM]", context)
		}
	}
	return kinds[0], nil
}

// memSegments splits regions into runs of one (source kind, destination
// kind) (_kv_xfer_mem_segments); Start and End index prefill regions.
func memSegments(src, dst []MemKind) []Part {
	kind := func(ks []MemKind, i int) MemKind {
		if ks == nil {
			return VRAM
		}
		return ks[i]
	}
	var segs []Part
	for i := range dst {
		s, d := kind(src, i), dst[i]
		if n := len(segs); n > 0 && segs[n-1].SrcKind == s && segs[n-1].DstKind == d {
			segs[n-1].End = i + 1
			continue
		}
		segs = append(segs, Part{Start: i, End: i + 1, SrcKind: s, DstKind: d})
	}
	return segs
}

// Path names SGLang's disaggregation/nixl/conn.py path this peer uses.
func (n *NIXLKV) Path() string { return n.path }

// Regions returns the prefill and decode region tables (borrowed).
func (n *NIXLKV) Regions() (src, dst []Region) { return n.src, n.dst }

// Parts returns the segments of prefill regions posted as separate
// transfers (one unless the path is nixl-prepped-mixed), with their kinds.
// Start and End index prefill regions. Callers must not modify it.
func (n *NIXLKV) Parts() []Part { return n.segments }

// chunkPages applies the transfer worker's chunk rules: prefill indices
// beyond the decode ones are dropped (SGLang's disaggregation/nixl/conn.py warns and truncates),
// decode indices beyond the prefill ones are an error (SGLang's disaggregation/nixl/conn.py's
// transfer fails), and every index must name a page of its side.
func chunkPages(src []int32, srcPages uint64, dst []int32, dstPages uint64) ([]int32, []int32, error) {
	if len(dst) < len(src) {
		src = src[:len(dst)]
	}
	if err := CheckPagePairs(src, srcPages, dst, dstPages); err != nil {
		return nil, nil, err
	}
	return src, dst, nil
}

// Plan fills p with the copies of one chunk: prefillPages on the prefill
// side go to decodePages on the decode peer. p is reset first; its slices
// are reused, so a warm Plan allocates nothing. Copies are in prefill
// region order (SGLang's disaggregation/nixl/conn.py's descriptor order), one strided copy per
// region per page run; mixed paths split them into parts.
func (n *NIXLKV) Plan(p *Plan, prefillPages, decodePages []int32) error {
	p.Reset()
	p.Path, p.Src, p.Dst = n.path, n.src, n.dst
	src, dst, err := chunkPages(prefillPages, n.g.Prefill.NumPages, decodePages, n.g.Decode.NumPages)
	if err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if n.path == PathNIXLPreppedSlice {
		addSlices(p, &n.slice, n.pairOf, src, dst)
		return nil
	}
	if !n.prepped {
		// Only this path strides a decode region with a prefill item length.
		if err := checkPairsFit(n.pairs, src, dst, n.src, n.dst); err != nil {
			return err
		}
	}
	runs := p.pageRuns(src, dst, false)
	for _, seg := range n.segments {
		addPairsRuns(p, n.pairs[seg.Start:seg.End], runs)
		if n.path == PathNIXLPreppedMixed {
			p.ClosePart(seg.SrcKind, seg.DstKind)
		}
	}
	if n.prepped {
		p.ReferenceDescriptors = uint64(len(n.pairs)) * uint64(len(src))
	} else {
		p.ReferenceDescriptors = uint64(len(n.pairs)) * uint64(len(runs))
	}
	return nil
}

// maxDlistEntries bounds prepped dlists: NIXL indices are int32.
const maxDlistEntries = math.MaxInt32
