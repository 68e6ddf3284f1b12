package planner

import "fmt"

// KVSide is one side's registered KV cache in SGLang's terms (KVArgs on the
// prefill side, KVArgsRegisterInfo for a decode peer). Slices are borrowed:
// a planner built from a KVSide keeps referring to them, so callers must not
// modify them afterwards.
type KVSide struct {
	// TPSize is attn_tp_size and TPRank the rank's engine_rank (used modulo
	// TPSize, as SGLang's disaggregation/{nixl,mori}/conn.py does).
	TPSize int
	TPRank int
	// KVHeadNum is kv_head_num: the KV heads this rank holds.
	KVHeadNum int
	// Ptrs are kv_data_ptrs, region base addresses: MHA K of every layer
	// then V of every layer; MLA one region per layer.
	Ptrs []uint64
	// ItemLens are kv_item_lens: bytes per page (slot) of each region.
	ItemLens []uint64
	// NumPages is the number of pages (slots) of every region, so region i
	// spans ItemLens[i]*NumPages bytes (kv_data_lens).
	NumPages uint64
	// Kinds is the memory kind of each region; nil means all VRAM.
	Kinds []MemKind
	// StartLayer is prefill_start_layer: the first model layer this side
	// holds under pipeline parallelism (prefill side only).
	StartLayer int
	// DraftLayers is the number of decode-only speculative-decoding draft
	// layers registered after the main K and V regions (decode side only).
	// It counts only when DraftLayersKnown is set; otherwise SGLang's disaggregation/{nixl,mori}/conn.py's
	// heuristic decides (see PairKVRegions).
	DraftLayers      int
	DraftLayersKnown bool
}

// draft returns the draftLayers argument of PairKVRegions.
func (s *KVSide) draft() int {
	if !s.DraftLayersKnown {
		return DraftUnknown
	}
	return s.DraftLayers
}

// kind returns the memory kind of region i.
func (s *KVSide) kind(i int) MemKind {
	if s.Kinds == nil {
		return VRAM
	}
	return s.Kinds[i]
}

// Check validates the side's own geometry. name is "prefill" or "decode"
// and prefixes the field of any error.
func (s *KVSide) Check(name string) error {
	if s.TPSize < 1 {
		return errorf(name+".tp_size", "must be at least 1, got %d", s.TPSize)
	}
	if s.TPRank < 0 {
		return errorf(name+".tp_rank", "must not be negative, got %d", s.TPRank)
	}
	if s.KVHeadNum < 0 {
		return errorf(name+".kv_head_num", "must not be negative, got %d", s.KVHeadNum)
	}
	if s.StartLayer < 0 {
		return errorf(name+".start_layer", "must not be negative, got %d", s.StartLayer)
	}
	if len(s.Ptrs) == 0 {
		return errorf(name+".kv_ptrs", "no KV regions")
	}
	if len(s.ItemLens) != len(s.Ptrs) {
		return errorf(name+".kv_item_lens", "length mismatch: got %d, expected %d (one per kv_ptrs entry)", len(s.ItemLens), len(s.Ptrs))
	}
	if s.Kinds != nil && len(s.Kinds) != len(s.Ptrs) {
		return errorf(name+".mem_kinds", "kv_data_mem_kinds length mismatch: got %d, expected %d", len(s.Kinds), len(s.Ptrs))
	}
	if s.NumPages == 0 {
		return errorf(name+".num_pages", "must be at least 1")
	}
	for i, l := range s.ItemLens {
		if l == 0 {
			return errorf(fmt.Sprintf("%s.kv_item_lens[%d]", name, i), "must be at least 1")
		}
		size, ok := mul64(l, s.NumPages)
		if !ok {
			return errorf(fmt.Sprintf("%s.kv_item_lens[%d]", name, i), "%d bytes x %d pages overflows", l, s.NumPages)
		}
		if _, ok := add64(s.Ptrs[i], size); !ok {
			return errorf(fmt.Sprintf("%s.kv_ptrs[%d]", name, i), "region [%#x, +%d) wraps past the end of the address space", s.Ptrs[i], size)
		}
	}
	return nil
}

// appendRegions appends the side's regions (kv_data_ptrs with kv_data_lens
// = item_len * num_pages) to dst.
func (s *KVSide) appendRegions(dst []Region) []Region {
	for i, p := range s.Ptrs {
		dst = append(dst, Region{Addr: p, Len: s.ItemLens[i] * s.NumPages, Kind: s.kind(i)})
	}
	return dst
}

// KVPairing selects which reference pointer slicing PairKVRegions
// reproduces.
type KVPairing uint8

const (
	// PairCommon is CommonKVManager.get_mha_kv_ptrs_with_pp and
	// get_mla_kv_ptrs_with_pp (regular MLA): the NIXL connector's slicing.
	PairCommon KVPairing = iota
	// PairMORI is MoriKVManager._get_mha_mem_desc_slices and
	// _get_mla_mem_desc_slices.
	PairMORI
)

// DraftUnknown is the draftLayers argument of PairKVRegions when the
// decode side's draft layer count is not known: SGLang's disaggregation/{nixl,mori}/conn.py's own rules
// then decide.
const DraftUnknown = -1

// PairKVRegions returns, for every prefill KV region, the decode region
// holding the same model layer and tensor (K or V): SGLang's disaggregation/{nixl,mori}/conn.py's pointer
// slicing for pipeline parallelism. startLayer is the prefill stage's first
// layer; nSrc and nDst count regions. The result is appended to dst (reuse
// it to avoid allocating).
//
// With draftLayers == DraftUnknown SGLang's disaggregation/{nixl,mori}/conn.py's rules apply. PairCommon,
// MHA, with L = nSrc/2 prefill layers and T = nDst/2 decode layers:
//   - L == T: decode holds the same stage; K_j -> j, V_j -> T+j.
//   - L < T and T % L != 0: taken as decode-only draft layers after the main
//     K and V ([K_main, V_main, K_draft, V_draft]); K_j -> start+j,
//     V_j -> L*(T/L)+start+j.
//   - otherwise (decode PP 1, prefill PP > 1): K_j -> start+j,
//     V_j -> T+start+j.
//
// PairCommon, MLA: equal counts pair one to one, else layer j -> start+j.
// PairMORI: K_j -> start+j and V_j -> T+start+j (MLA: start+j), with no
// equal-stage or draft case.
//
// SGLang's disaggregation/{nixl,mori}/conn.py's second rule cannot tell a decode-only draft from a
// pipeline stage whose layer count does not divide decode's (61 layers split
// 31+30 pairs V with the wrong regions). When the decode side's draft layer
// count is known (draftLayers >= 0, main layers M = T - draftLayers) the
// pairing is exact for both styles: L == M pairs K_j -> j, V_j -> M+j;
// otherwise K_j -> start+j, V_j -> M+start+j (MLA: j or start+j).
//
// Where SGLang's disaggregation/{nixl,mori}/conn.py would slice past the end of the decode list (and then
// fail on an index error, or in MORI raise "Destination KV descriptors do
// not match prefill pp configuration"), PairKVRegions returns an *Error.
func PairKVRegions(dst []int32, how KVPairing, mla bool, nSrc, nDst, startLayer, draftLayers int) ([]int32, error) {
	if nSrc <= 0 {
		return dst, errorf("prefill.kv_ptrs", "no KV regions")
	}
	if nDst <= 0 {
		return dst, errorf("decode.kv_ptrs", "no KV regions")
	}
	if startLayer < 0 {
		return dst, errorf("prefill.start_layer", "must not be negative, got %d", startLayer)
	}
	if draftLayers < DraftUnknown {
		return dst, errorf("decode.draft_layers", "must not be negative, got %d", draftLayers)
	}
	perLayer := 2
	if mla {
		perLayer = 1
	}
	if draftLayers > 0 && draftLayers*perLayer >= nDst {
		return dst, errorf("decode.draft_layers", "%d draft layers leave no main layers in %d decode regions", draftLayers, nDst)
	}
	if mla {
		base := startLayer
		switch {
		case draftLayers >= 0:
			if nSrc == nDst-draftLayers {
				base = 0
			}
		case how == PairCommon && nSrc == nDst:
			base = 0
		}
		limit := nDst
		if draftLayers > 0 {
			limit = nDst - draftLayers
		}
		if base+nSrc > limit {
			return dst, errorf("decode.kv_ptrs", "decode holds %d MLA layers; prefill layers [%d, %d) do not fit (PP configuration mismatch)", limit, startLayer, startLayer+nSrc)
		}
		for j := 0; j < nSrc; j++ {
			dst = append(dst, int32(base+j))
		}
		return dst, nil
	}
	if nSrc%2 != 0 {
		return dst, errorf("prefill.kv_ptrs", "MHA needs K then V regions of every layer: got an odd count %d", nSrc)
	}
	if nDst < 2 {
		return dst, errorf("decode.kv_ptrs", "MHA needs K then V regions of every layer: got %d region", nDst)
	}
	l, t := nSrc/2, nDst/2
	kBase, vBase, kLimit := startLayer, t+startLayer, t
	switch {
	case draftLayers >= 0:
		if (nDst-2*draftLayers)%2 != 0 {
			return dst, errorf("decode.draft_layers", "%d decode regions minus %d draft K and V regions is odd", nDst, 2*draftLayers)
		}
		m := t - draftLayers
		kLimit = m
		if l == m {
			kBase, vBase = 0, m
		} else {
			vBase = m + startLayer
		}
	case how == PairMORI:
	case l == t:
		kBase, vBase = 0, t
	case l < t && t%l != 0:
		vBase = l*(t/l) + startLayer
	}
	if kBase+l > kLimit || vBase+l > nDst {
		return dst, errorf("decode.kv_ptrs", "decode holds %d MHA layers (%d regions); prefill layers [%d, %d) do not fit (PP configuration mismatch)", t, nDst, startLayer, startLayer+l)
	}
	for j := 0; j < l; j++ {
		dst = append(dst, int32(kBase+j))
	}
	for j := 0; j < l; j++ {
		dst = append(dst, int32(vBase+j))
	}
	return dst, nil
}

// NextRun returns the length of the run of page pairs starting at i: the
// longest stretch in which prefill and decode indices both advance by
// exactly one (SGLang's group_concurrent_contiguous). Iterate with
//
//	for i := 0; i < len(src); i += n { n = NextRun(src, dst, i); ... }
//
// src and dst must have equal lengths (CheckPagePairs).
func NextRun(src, dst []int32, i int) int {
	n := 1
	for i+n < len(src) && src[i+n] == src[i+n-1]+1 && dst[i+n] == dst[i+n-1]+1 {
		n++
	}
	return n
}

// CountRuns returns how many runs NextRun splits the page pairs into.
func CountRuns(src, dst []int32) int {
	runs := 0
	for i := 0; i < len(src); i += NextRun(src, dst, i) {
		runs++
	}
	return runs
}

// CheckPagePairs checks the page indices of a chunk the way
// group_concurrent_contiguous does (equal lengths) and that every index
// names a page of its side: 0 <= index < numPages.
func CheckPagePairs(src []int32, srcPages uint64, dst []int32, dstPages uint64) error {
	if len(src) != len(dst) {
		return errorf("decode_pages", "group_concurrent_contiguous requires equal-length src/dst index arrays, got %d and %d", len(src), len(dst))
	}
	if err := CheckPages("prefill_pages", src, srcPages); err != nil {
		return err
	}
	return CheckPages("decode_pages", dst, dstPages)
}

// CheckPages checks that every index names one of numPages pages.
func CheckPages(field string, pages []int32, numPages uint64) error {
	for i, p := range pages {
		if p < 0 || uint64(p) >= numPages {
			return errorf(fmt.Sprintf("%s[%d]", field, i), "page %d outside [0, %d)", p, numPages)
		}
	}
	return nil
}
