package planner

import (
	"fmt"
	"slices"
)

// SGLangKV is the KV geometry of one prefill rank and one decode peer of an
// SGLang deployment: what the prefill side knows once the peer has
// registered (KVArgs plus KVArgsRegisterInfo).
type SGLangKV struct {
	// MLA selects MLA attention (one region per layer, no head slicing).
	MLA bool
	// PageSize is tokens per page; used by the heterogeneous-TP slice paths.
	PageSize int
	// TotalKVHeads is total_kv_head_num; 0 means Prefill.KVHeadNum *
	// Prefill.TPSize, as SGLang's disaggregation/{nixl,mori}/conn.py defaults it.
	TotalKVHeads int
	Prefill      KVSide
	Decode       KVSide
}

// pagePair is how one prefill region pairs with a decode region when whole
// pages move: page s of the source at s*srcStride, page t of the
// destination at t*dstStride, xfer bytes each.
type pagePair struct {
	src, dst             int32
	srcStride, dstStride uint64
	xfer                 uint64
}

// headSlice is the per-token head slice of heterogeneous TP, identical for
// every region pair: token k of page s starts at s*srcItem + k*srcToken +
// srcOff on the prefill side and t*dstItem + k*dstToken + dstOff on the
// decode side, length bytes each.
type headSlice struct {
	pageSize           uint64
	srcItem, dstItem   uint64
	srcToken, dstToken uint64
	srcOff, dstOff     uint64
	length             uint64
	// NIXL prepped dlist interleave: the source dlist holds groups slices
	// per token, this peer reads group groupIdx.
	groups, groupIdx uint64
}

// tokensAligned reports whether consecutive pages continue the per-token
// stride on both sides, so a run of pages is one strided copy.
func (h *headSlice) tokensAligned() bool {
	return h.srcItem == h.pageSize*h.srcToken && h.dstItem == h.pageSize*h.dstToken
}

// sglangPair holds what NIXL and MORI planners share: checked geometry,
// region tables and layer pairing.
type sglangPair struct {
	g      SGLangKV
	src    []Region
	dst    []Region
	pairOf []int32 // decode region of every prefill region
}

func newSGLangPair(g SGLangKV, how KVPairing) (sglangPair, error) {
	sp := sglangPair{g: g}
	if err := g.Prefill.Check("prefill"); err != nil {
		return sp, err
	}
	if err := g.Decode.Check("decode"); err != nil {
		return sp, err
	}
	if g.PageSize < 0 {
		return sp, errorf("page_size", "must not be negative, got %d", g.PageSize)
	}
	if g.TotalKVHeads < 0 {
		return sp, errorf("total_kv_heads", "must not be negative, got %d", g.TotalKVHeads)
	}
	var err error
	sp.pairOf, err = PairKVRegions(nil, how, g.MLA, len(g.Prefill.Ptrs), len(g.Decode.Ptrs), g.Prefill.StartLayer, g.Decode.draft())
	if err != nil {
		return sp, err
	}
	sp.src = g.Prefill.appendRegions(nil)
	sp.dst = g.Decode.appendRegions(nil)
	return sp, nil
}

// equalTP reports whether whole pages move (MLA, or equal attention TP).
func (sp *sglangPair) equalTP() bool {
	return sp.g.MLA || sp.g.Prefill.TPSize == sp.g.Decode.TPSize
}

// totalKVHeads resolves total_kv_head_num as SGLang's disaggregation/{nixl,mori}/conn.py does.
func (sp *sglangPair) totalKVHeads() int {
	if sp.g.TotalKVHeads > 0 {
		return sp.g.TotalKVHeads
	}
	return sp.g.Prefill.KVHeadNum * sp.g.Prefill.TPSize
}

// uniformItemLens checks that every region of a side has the item length
// SGLang's disaggregation/{nixl,mori}/conn.py's slice paths assume for all of them (kv_item_lens[0]).
func (sp *sglangPair) uniformItemLens() error {
	for i, l := range sp.g.Prefill.ItemLens {
		if l != sp.g.Prefill.ItemLens[0] {
			return errorf(fmt.Sprintf("prefill.kv_item_lens[%d]", i), "heterogeneous TP slices every region with kv_item_lens[0] = %d; got %d", sp.g.Prefill.ItemLens[0], l)
		}
	}
	for _, d := range sp.pairOf {
		if l := sp.g.Decode.ItemLens[d]; l != sp.g.Decode.ItemLens[0] {
			return errorf(fmt.Sprintf("decode.kv_item_lens[%d]", d), "heterogeneous TP slices every region with kv_item_lens[0] = %d; got %d", sp.g.Decode.ItemLens[0], l)
		}
	}
	return nil
}

// sliceStyle selects SGLang's disaggregation/{nixl,mori}/conn.py's variant of the head-slice geometry.
type sliceStyle int

const (
	sliceNIXL sliceStyle = iota // NixlKVManager._init_hetero_tp_prep_handle
	sliceMORI                   // MoriKVManager._build_tp_slice_config
)

// headSlice computes the heterogeneous-TP slice of this (prefill rank,
// decode rank) pair with SGLang's disaggregation/{nixl,mori}/conn.py's formulas, and rejects geometries
// whose slice would be empty or leave the token on either side.
func (sp *sglangPair) headSlice(style sliceStyle) (headSlice, error) {
	g := &sp.g
	if g.PageSize < 1 {
		return headSlice{}, errorf("page_size", "heterogeneous TP needs page_size >= 1, got %d", g.PageSize)
	}
	if err := sp.uniformItemLens(); err != nil {
		return headSlice{}, err
	}
	total := sp.totalKVHeads()
	if total <= 0 {
		return headSlice{}, errorf("total_kv_heads", "heterogeneous TP needs the KV head count: set total_kv_heads or prefill.kv_head_num")
	}
	p, d := g.Prefill.TPSize, g.Decode.TPSize
	srcHeads := max(1, total/p)
	dstHeads := max(1, total/d)
	page := uint64(g.PageSize)
	h := headSlice{
		pageSize: page,
		srcItem:  g.Prefill.ItemLens[0],
		dstItem:  g.Decode.ItemLens[0],
		groups:   1,
	}
	h.srcToken = h.srcItem / page
	h.dstToken = h.dstItem / page
	headBytes := h.dstToken / uint64(dstHeads) // bytes_per_head_slice
	if headBytes == 0 {
		return h, errorf("decode.kv_item_lens", "head slice size evaluates to zero (%d bytes per page / %d tokens / %d heads)", h.dstItem, page, dstHeads)
	}
	localRank := g.Prefill.TPRank % p
	dstRank := g.Decode.TPRank % d
	var heads int
	if p > d {
		// Several prefill ranks feed one decode rank: this rank sends all
		// its heads into its head range of the decode token.
		replication := max(1, p/total)
		unique := localRank / replication
		heads = srcHeads
		h.dstOff = uint64((unique*srcHeads)%dstHeads) * headBytes
	} else {
		// One prefill rank feeds several decode ranks: each takes its
		// head group out of the prefill token. Decode ranks beyond the
		// head count hold replicated heads: rank r holds head
		// r / (d/total). SGLang's disaggregation/{nixl,mori}/conn.py indexes with r itself, which sends
		// e.g. head 1 to decode rank 1 of 4 when 2 heads are replicated
		// twice (rank 1 holds head 0); kvhost uses the head the rank holds.
		// Both agree whenever d <= total.
		unique := dstRank / max(1, d/total)
		srcStart := (unique * dstHeads) % srcHeads
		heads = dstHeads
		switch style {
		case sliceNIXL:
			h.groups = uint64(d / p)
			h.groupIdx = uint64(srcStart / dstHeads)
			h.srcOff = h.groupIdx * uint64(heads) * headBytes
		case sliceMORI:
			h.srcOff = uint64(srcStart) * headBytes
		}
	}
	h.length = uint64(heads) * headBytes
	if h.length > h.dstToken || h.dstOff > h.dstToken-h.length {
		return h, errorf("decode.kv_item_lens", "slice size exceeds destination token capacity: heads bytes [%d, %d) of a %d-byte decode token", h.dstOff, h.dstOff+h.length, h.dstToken)
	}
	if h.length > h.srcToken || h.srcOff > h.srcToken-h.length {
		return h, errorf("prefill.kv_item_lens", "head slice [%d, %d) lies outside the %d-byte prefill token (check kv_head_num, total_kv_heads and kv_item_lens)", h.srcOff, h.srcOff+h.length, h.srcToken)
	}
	return h, nil
}

// pageRun is a run of page pairs: n pages from src on the prefill side to
// n pages from dst on the decode side.
type pageRun struct{ src, dst, n uint64 }

// pageRuns splits a chunk into runs (group_concurrent_contiguous), once per
// chunk, into the plan's scratch space; perPage gives every page its own
// run instead.
func (p *Plan) pageRuns(src, dst []int32, perPage bool) []pageRun {
	p.runs = p.runs[:0]
	for i, n := 0, 0; i < len(src); i += n {
		n = 1
		if !perPage {
			n = NextRun(src, dst, i)
		}
		p.runs = append(p.runs, pageRun{uint64(src[i]), uint64(dst[i]), uint64(n)})
	}
	return p.runs
}

// addPageRuns adds one copy per run for one region pair.
func addPageRuns(p *Plan, pp pagePair, runs []pageRun) {
	for _, r := range runs {
		p.Add(Copy{
			SrcRegion: pp.src, DstRegion: pp.dst,
			SrcOff: r.src * pp.srcStride, DstOff: r.dst * pp.dstStride,
			Len: pp.xfer, SrcStride: pp.srcStride, DstStride: pp.dstStride, Count: r.n,
		})
	}
}

// addPairsRuns adds the copies of every run for each region pair in turn,
// as addPageRuns would. A pair with the strides and length of the pair
// before it gets the same copies in other regions, so those are copied
// rather than planned again (see Plan.repeat): most layers of a model share
// one geometry, and re-planning them was most of the time of a plan.
func addPairsRuns(p *Plan, pairs []pagePair, runs []pageRun) {
	p.Copies = slices.Grow(p.Copies, len(pairs)*len(runs))
	var last pagePair
	from, to := -1, -1
	for _, pp := range pairs {
		if from >= 0 && pp.srcStride == last.srcStride && pp.dstStride == last.dstStride && pp.xfer == last.xfer &&
			p.repeat(from, to, pp.src, pp.dst) {
			continue
		}
		from = p.freshStart(pp.src, pp.dst)
		addPageRuns(p, pp, runs)
		to, last = len(p.Copies), pp
	}
}

// addSlices adds the head-slice copies of one chunk for every region pair
// (prefill region i to decode region pairOf[i]): one strided copy per run,
// runs of single pages when page strides do not continue the token stride
// (see headSlice.tokensAligned). SGLang's disaggregation/{nixl,mori}/conn.py
// sends one descriptor per token per region. Every pair has the same slice
// geometry, so the copies of the first pair are planned and the others
// repeat them (Plan.repeat).
func addSlices(p *Plan, h *headSlice, pairOf []int32, src, dst []int32) {
	runs := p.pageRuns(src, dst, !h.tokensAligned())
	p.Copies = slices.Grow(p.Copies, len(pairOf)*len(runs))
	from, to := -1, -1
	for i, d := range pairOf {
		if from >= 0 && p.repeat(from, to, int32(i), d) {
			continue
		}
		from = p.freshStart(int32(i), d)
		for _, r := range runs {
			p.Add(Copy{
				SrcRegion: int32(i), DstRegion: d,
				SrcOff: r.src*h.srcItem + h.srcOff, DstOff: r.dst*h.dstItem + h.dstOff,
				Len: h.length, SrcStride: h.srcToken, DstStride: h.dstToken, Count: h.pageSize * r.n,
			})
		}
		to = len(p.Copies)
	}
	p.ReferenceDescriptors = uint64(len(pairOf)) * uint64(len(src)) * h.pageSize
}

// checkPairsFit checks that every page of the chunk, at each region pair's
// strides, ends inside its regions: SGLang's disaggregation/{nixl,mori}/conn.py addresses some regions
// with another region's item length, which can run past a shorter region.
func checkPairsFit(pairs []pagePair, src, dst []int32, srcRegs, dstRegs []Region) error {
	ms, md := maxPage(src), maxPage(dst)
	for _, pp := range pairs {
		if err := checkPagesFit("prefill_pages", ms, pp.srcStride, pp.xfer, srcRegs[pp.src], pp.src); err != nil {
			return err
		}
		if err := checkPagesFit("decode_pages", md, pp.dstStride, pp.xfer, dstRegs[pp.dst], pp.dst); err != nil {
			return err
		}
	}
	return nil
}

// checkPagesFit checks that page maxPage at stride bytes, plus xfer bytes,
// ends inside region r.
func checkPagesFit(field string, maxPage int32, stride, xfer uint64, r Region, reg int32) error {
	end, ok := mulAdd64(xfer, uint64(maxPage), stride)
	if !ok || end > r.Len {
		return errorf(field, "page %d at %d bytes per page ends past region %d (%d bytes)", maxPage, stride, reg, r.Len)
	}
	return nil
}

// maxPage returns the largest index of pages (-1 when empty).
func maxPage(pages []int32) int32 {
	m := int32(-1)
	for _, p := range pages {
		m = max(m, p)
	}
	return m
}
