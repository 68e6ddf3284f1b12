package planner

// Paths of SGLang's MORI-IO connector (sglang_mori_conn.py).
const (
	// PathMORIRuns: MHA with equal attention TP: grouped index plans
	// materialized with kv_item_lens[0] for K and V of every layer.
	PathMORIRuns = "mori-runs"
	// PathMORIRunsMLA: MLA, one grouped plan per layer with that layer's
	// item length.
	PathMORIRunsMLA = "mori-runs-mla"
	// PathMORITPSlice: MHA with different attention TP: the TP-slice plan
	// (per page, per token head slices) for K and V of every layer.
	PathMORITPSlice = "mori-tp-slice"
)

// TPSliceConfig is MORI's heterogeneous-TP slice geometry
// (_build_tp_slice_config), in bytes.
type TPSliceConfig struct {
	PageSize                 uint64
	SrcItemLen, DstItemLen   uint64
	BytesPerTokenSrc         uint64
	BytesPerTokenDst         uint64
	SrcHeadSliceOffset       uint64
	DstHeadSliceOffset       uint64
	HeadsBytesPerTokenToSend uint64
}

// MORIKV plans the KV pages one SGLang prefill rank writes to one decode
// peer with MORI-IO batch_write. Copies are region-relative (local offset,
// remote offset, size) with strides; consecutive copies of one
// (SrcRegion, DstRegion) form one batch_write region pair. Build once per
// peer; immutable and safe for concurrent use.
type MORIKV struct {
	sglangPair
	path  string
	pairs []pagePair
	slice headSlice
}

// NewMORIKV checks the geometry of a (prefill rank, decode peer) pair and
// chooses MORI's path (MoriKVManager.send_kvcache).
func NewMORIKV(g SGLangKV) (*MORIKV, error) {
	for _, side := range []struct {
		name  string
		kinds []MemKind
	}{{"prefill", g.Prefill.Kinds}, {"decode", g.Decode.Kinds}} {
		for i, k := range side.kinds {
			if k != VRAM {
				return nil, errorf(side.name+".mem_kinds", "MORI registers KV regions as GPU memory; region %d is %v", i, k)
			}
		}
	}
	sp, err := newSGLangPair(g, PairMORI)
	if err != nil {
		return nil, err
	}
	m := &MORIKV{sglangPair: sp}
	switch {
	case g.MLA:
		m.path = PathMORIRunsMLA
		for i, d := range m.pairOf {
			item := g.Prefill.ItemLens[i]
			m.pairs = append(m.pairs, pagePair{src: int32(i), dst: d, srcStride: item, dstStride: item, xfer: item})
		}
	case g.Prefill.TPSize == g.Decode.TPSize:
		m.path = PathMORIRuns
		item := g.Prefill.ItemLens[0]
		for i, d := range m.pairOf {
			m.pairs = append(m.pairs, pagePair{src: int32(i), dst: d, srcStride: item, dstStride: item, xfer: item})
		}
	default:
		m.path = PathMORITPSlice
		if m.slice, err = m.headSlice(sliceMORI); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Path names SGLang's disaggregation/mori/conn.py path this peer uses.
func (m *MORIKV) Path() string { return m.path }

// Regions returns the prefill and decode region tables (borrowed).
func (m *MORIKV) Regions() (src, dst []Region) { return m.src, m.dst }

// TPSlice returns the slice configuration of the mori-tp-slice path.
func (m *MORIKV) TPSlice() (TPSliceConfig, bool) {
	h := &m.slice
	return TPSliceConfig{
		PageSize: h.pageSize, SrcItemLen: h.srcItem, DstItemLen: h.dstItem,
		BytesPerTokenSrc: h.srcToken, BytesPerTokenDst: h.dstToken,
		SrcHeadSliceOffset: h.srcOff, DstHeadSliceOffset: h.dstOff,
		HeadsBytesPerTokenToSend: h.length,
	}, m.path == PathMORITPSlice
}

// Plan fills p with the copies of one chunk (see NIXLKV.Plan). The
// grouped paths need equally long page lists (group_concurrent_contiguous
// raises otherwise); the slice path sends the first min(len) pairs, as the
// reference does.
func (m *MORIKV) Plan(p *Plan, prefillPages, decodePages []int32) error {
	p.Reset()
	p.Path, p.Src, p.Dst = m.path, m.src, m.dst
	src, dst := prefillPages, decodePages
	if len(src) == 0 || len(dst) == 0 {
		return nil
	}
	if m.path == PathMORITPSlice {
		n := min(len(src), len(dst))
		src, dst = src[:n], dst[:n]
	}
	if err := CheckPagePairs(src, m.g.Prefill.NumPages, dst, m.g.Decode.NumPages); err != nil {
		return err
	}
	if m.path == PathMORITPSlice {
		addSlices(p, &m.slice, m.pairOf, src, dst)
		return nil
	}
	// MORI strides K and V of every layer, on both sides, with one prefill
	// item length, which may not fit a region of another size.
	if err := checkPairsFit(m.pairs, src, dst, m.src, m.dst); err != nil {
		return err
	}
	runs := p.pageRuns(src, dst, false)
	addPairsRuns(p, m.pairs, runs)
	p.ReferenceDescriptors = uint64(len(m.pairs)) * uint64(len(runs))
	return nil
}
