package planner

import "fmt"

// KVSide is one side's registered KV cache in SGLang's terms (KVArgs on the
// prefill side, KVArgsRegisterInfo for a decode peer). Slices are borrowed:
// a planner built from a KVSide keeps referring to them, so callers must not
// modify them afterwards.
type KVSide struct {
	// TPSize is attn_tp_size and TPRank the rank's engine_rank (used modulo
	// TPSize, as the reference does).
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
}

// kind returns the memory kind of region i.
func (s *KVSide) kind(i int) MemKind {
	if s.Kinds == nil {
		return VRAM
	}
	return s.Kinds[i]
}

// check validates the side's own geometry. name is "prefill" or "decode"
// and prefixes the field of any error.
func (s *KVSide) check(name string) error {
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

// PairKVRegions returns, for every prefill KV region, the decode region
// holding the same model layer and tensor (K or V): the pointer slicing of
// SGLang's CommonKVManager.get_mha_kv_ptrs_with_pp (MHA) and
// get_mla_kv_ptrs_with_pp (MLA, without compression ratios). startLayer is
// the prefill stage's first layer; nSrc and nDst count regions.
//
// MHA, with L = nSrc/2 prefill layers and T = nDst/2 decode layers:
//   - L == T: decode holds the same stage; K_j -> j, V_j -> T+j.
//   - L < T and T % L != 0: decode holds draft layers after the main K and V
//     ([K_main, V_main, K_draft, V_draft]); K_j -> start+j,
//     V_j -> L*(T/L)+start+j.
//   - otherwise (decode PP 1, prefill PP > 1): K_j -> start+j,
//     V_j -> T+start+j.
//
// MLA: equal counts pair one to one; otherwise layer j -> start+j.
//
// Where the reference would slice past the end of the decode list (and then
// fail on an index error, or in MORI raise "Destination KV descriptors do
// not match prefill pp configuration"), PairKVRegions returns an *Error.
// The result is appended to dst (reuse it to avoid allocating).
func PairKVRegions(dst []int32, mla bool, nSrc, nDst, startLayer int) ([]int32, error) {
	if nSrc <= 0 {
		return dst, errorf("prefill.kv_ptrs", "no KV regions")
	}
	if nDst <= 0 {
		return dst, errorf("decode.kv_ptrs", "no KV regions")
	}
	if startLayer < 0 {
		return dst, errorf("prefill.start_layer", "must not be negative, got %d", startLayer)
	}
	if mla {
		if nSrc == nDst {
			for j := 0; j < nSrc; j++ {
				dst = append(dst, int32(j))
			}
			return dst, nil
		}
		if startLayer+nSrc > nDst {
			return dst, errorf("decode.kv_ptrs", "decode holds %d MLA layers; prefill layers [%d, %d) do not fit (PP configuration mismatch)", nDst, startLayer, startLayer+nSrc)
		}
		for j := 0; j < nSrc; j++ {
			dst = append(dst, int32(startLayer+j))
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
	var kBase, vBase int
	switch {
	case l == t:
		kBase, vBase = 0, t
	case l < t && t%l != 0:
		kBase, vBase = startLayer, l*(t/l)+startLayer
	default:
		kBase, vBase = startLayer, t+startLayer
	}
	if kBase+l > t || vBase+l > nDst {
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
