package planner

// Layer pairing between peers whose pipeline-parallel (PP) layouts differ.
//
// A prefill PP stage registers only its own layers; a decode engine with
// PP 1 registers every layer. Three mechanisms pair the two lists:
//
//   - by position with the stage's start layer (SGLang's disaggregation/common/conn.py's
//     get_mha_kv_ptrs_with_pp / get_mla_kv_ptrs_with_pp: PairKVRegions in
//     geometry.go);
//   - for compressed-MLA pools (DeepSeek V4), by position inside each
//     compression-ratio section (PairCompressedMLARegions, below);
//   - by global layer id (build_transfer_entry_pairs), when both peers
//     publish the id of every registered entry.
//
// Everything here works on entry (region) indices rather than pointers, so
// a plan keeps the peer's full region table and only picks entries from it.

// EntryPair pairs entry Src of the prefill list with entry Dst of the decode
// list.
type EntryPair struct {
	Src, Dst int
}

// BuildTransferEntryPairs pairs prefill entries with decode entries by
// global layer id (SGLang's disaggregation/utils.py's build_transfer_entry_pairs).
//
// Layer ids may repeat across tensor groups (K then V, conv then temporal
// state), so the k-th occurrence of an id on the prefill side pairs with the
// k-th occurrence on the decode side. Without ids on both sides the pairing
// is positional, which is only allowed when both lists have the same length,
// or when allowPositionalFallback is set and decode has at least as many
// entries (SGLang's disaggregation/{nixl,mori}/conn.py sets it when prefill PP size is 1).
func BuildTransferEntryPairs(srcLayerIDs, dstLayerIDs []int, nSrc, nDst int, allowPositionalFallback bool) ([]EntryPair, error) {
	if nSrc < 0 || nDst < 0 || nSrc > maxEntries || nDst > maxEntries {
		return nil, errorf("layer_ids", "entry counts out of range (src %d, dst %d)", nSrc, nDst)
	}
	if nSrc == 0 {
		return nil, nil
	}
	if (len(srcLayerIDs) > 0) != (len(dstLayerIDs) > 0) {
		if !allowPositionalFallback {
			return nil, errorf("layer_ids", "layer metadata must be provided by both PD peers or neither (src %d ids, dst %d ids)", len(srcLayerIDs), len(dstLayerIDs))
		}
		srcLayerIDs, dstLayerIDs = nil, nil
	}
	if len(srcLayerIDs) > 0 {
		if len(srcLayerIDs) != nSrc || len(dstLayerIDs) != nDst {
			return nil, errorf("layer_ids", "layer metadata length must match transfer entries: src metadata=%d entries=%d, dst metadata=%d entries=%d",
				len(srcLayerIDs), nSrc, len(dstLayerIDs), nDst)
		}
		// Queue of decode positions per layer id, consumed in order.
		positions := make(map[int][]int, nDst)
		for j, id := range dstLayerIDs {
			positions[id] = append(positions[id], j)
		}
		pairs := make([]EntryPair, 0, nSrc)
		for i, id := range srcLayerIDs {
			q := positions[id]
			if len(q) == 0 {
				return nil, errorf("layer_ids", "decode peer is missing a transfer entry for model layer %d", id)
			}
			pairs = append(pairs, EntryPair{Src: i, Dst: q[0]})
			positions[id] = q[1:]
		}
		return pairs, nil
	}
	if nDst < nSrc || (nSrc != nDst && !allowPositionalFallback) {
		// A positional pairing of unequal lists would silently move the
		// wrong layers (e.g. a PP prefill stage paired with a stale decode).
		return nil, errorf("layer_ids", "PP-heterogeneous transfer requires layer ids on both peers; got src=%d dst=%d entries", nSrc, nDst)
	}
	pairs := make([]EntryPair, nSrc)
	for i := range pairs {
		pairs[i] = EntryPair{Src: i, Dst: i}
	}
	return pairs, nil
}

// maxEntries bounds entry (tensor) counts given as numbers rather than
// lists, so a bad count cannot make a planner allocate without limit.
const maxEntries = 1 << 24

// DraftPool describes a speculative-decoding draft model's KV pool for
// BuildKVLayerIDs.
type DraftPool struct {
	// Hybrid is true when the pool reports per-entry layer ids itself
	// (a HybridLinearKVPool); LayerIDs are then those ids.
	Hybrid   bool
	LayerIDs []int
	// LayerNum is the pool's layer count for non-hybrid pools, which
	// register k0..k(L-1) then v0..v(L-1) (or one group for MLA).
	LayerNum int
}

// KVLayerIDsInput is the input of BuildKVLayerIDs.
type KVLayerIDsInput struct {
	// Hybrid is true when the target pool can report per-entry layer ids
	// (a HybridLinearKVPool); otherwise peers pair positionally and
	// BuildKVLayerIDs returns nil.
	Hybrid   bool
	LayerIDs []int // the target pool's get_kv_layer_ids()
	// Draft is the draft pool whose buffers are appended after the
	// target's, or nil.
	Draft           *DraftPool
	NumDraftEntries int // draft entries appended to kv_data_ptrs
	NumHiddenLayers int // the target model's layer count
}

// BuildKVLayerIDs returns the global layer id of every entry of
// kv_data_ptrs (SGLang's disaggregation/utils.py's build_kv_layer_ids). Draft entries get ids
// in a band above the target's layers, numbered by first appearance of the
// draft's own ids, so both peers agree on them. It returns nil for pools
// that cannot report ids.
func BuildKVLayerIDs(in KVLayerIDsInput) ([]int, error) {
	if !in.Hybrid {
		return nil, nil
	}
	if in.Draft == nil {
		return append([]int(nil), in.LayerIDs...), nil
	}
	draftIDs, err := DraftEntryLayerIDs(*in.Draft, in.NumDraftEntries)
	if err != nil {
		return nil, err
	}
	band := make(map[int]int, len(draftIDs))
	for _, id := range draftIDs {
		if _, ok := band[id]; !ok {
			band[id] = len(band)
		}
	}
	out := make([]int, 0, len(in.LayerIDs)+len(draftIDs))
	out = append(out, in.LayerIDs...)
	for _, id := range draftIDs {
		out = append(out, in.NumHiddenLayers+band[id])
	}
	return out, nil
}

// DraftEntryLayerIDs returns the draft pool's own layer id for each of its
// numEntries registered entries (SGLang's disaggregation/utils.py's _draft_entry_layer_ids).
func DraftEntryLayerIDs(pool DraftPool, numEntries int) ([]int, error) {
	var ids []int
	if pool.Hybrid {
		ids = pool.LayerIDs
	} else {
		if pool.LayerNum <= 0 || numEntries < 0 || numEntries > maxEntries || numEntries%pool.LayerNum != 0 {
			return nil, errorf("draft_layer_num", "draft KV buffers must register a whole number of per-layer groups: entries=%d, layers=%d", numEntries, pool.LayerNum)
		}
		groups := numEntries / pool.LayerNum
		ids = make([]int, 0, numEntries)
		for g := 0; g < groups; g++ {
			for l := 0; l < pool.LayerNum; l++ {
				ids = append(ids, l)
			}
		}
	}
	if len(ids) != numEntries {
		return nil, errorf("draft_layer_ids", "draft KV layer ids must cover every registered entry: ids=%d, entries=%d", len(ids), numEntries)
	}
	return ids, nil
}

// ResolveDCPDstEntryIndices returns, for each local KV entry, the decode
// entry it lands in for a decode-context-parallel relayout (SGLang's disaggregation/utils.py's
// resolve_dcp_dst_entry_indices). Without layer ids on either side it is the
// identity (decode may hold extra draft entries); otherwise entries pair by
// layer id.
func ResolveDCPDstEntryIndices(srcLayerIDs, dstLayerIDs []int, nSrc, nDst int) ([]int, error) {
	if nSrc < 0 || nSrc > maxEntries {
		return nil, errorf("layer_ids", "entry count %d out of range", nSrc)
	}
	if len(srcLayerIDs) == 0 && len(dstLayerIDs) == 0 {
		out := make([]int, nSrc)
		for i := range out {
			out[i] = i
		}
		return out, nil
	}
	pairs, err := BuildTransferEntryPairs(srcLayerIDs, dstLayerIDs, nSrc, nDst, false)
	if err != nil {
		return nil, err
	}
	out := make([]int, len(pairs))
	for k, p := range pairs {
		out[k] = p.Dst
	}
	return out, nil
}

// PPLayout is what PP pointer slicing knows about the prefill stage.
type PPLayout struct {
	StartLayer int // kv_args.prefill_start_layer
	// EndLayer is kv_args.prefill_end_layer; HasEnd says it is known.
	// Compressed-MLA slicing needs it.
	EndLayer int
	HasEnd   bool
	// CompressionRatios is kv_args.mla_compression_ratios (one entry per
	// model layer: 0, 4 or 128) for compressed-MLA pools (DeepSeek V4);
	// empty otherwise.
	CompressionRatios []int
}

// pyRange clamps the Python slice [start:stop] of a list of n elements,
// for non-negative start and stop, and returns the resulting index range.
func pyRange(n, start, stop int) (lo, hi int) {
	lo, hi = min(start, n), min(stop, n)
	if hi < lo {
		hi = lo
	}
	return lo, hi
}

// PairCompressedMLARegions pairs a compressed-MLA prefill stage's entries
// with a PP-1 decode list (SGLang's disaggregation/common/conn.py's _mla_slice_ptrs_for_pp, reached
// from get_mla_kv_ptrs_with_pp when mla_compression_ratios is set and the
// lists differ in length). The decode list is one of three layouts:
//   - KV data, 2*c4 + c128 entries: [c4 layers, c4 indexer layers, c128 layers];
//   - SWA state data, swa + 2*c4 entries: [swa layers, c4 compress states,
//     c4 indexer compress states];
//   - C128 state, c128 entries (stateType c128_state); SWA_RING state is
//     per model layer like the swa section.
//
// Each section is indexed by a layer's rank within its compression bucket,
// so the stage's range [StartLayer, EndLayer) is located per section and
// the pieces concatenated; prefill entry k pairs with the k-th decode entry
// of that concatenation. stateType is "" for KV. The result is appended to
// dst.
func PairCompressedMLARegions(dst []int32, nSrc, nDst int, pp PPLayout, stateType StateType) ([]int32, error) {
	if nSrc < 0 || nDst < 0 || nSrc > maxEntries || nDst > maxEntries || pp.StartLayer < 0 {
		return dst, errorf("prefill.start_layer", "invalid PP layout: src=%d dst=%d entries, start_layer=%d", nSrc, nDst, pp.StartLayer)
	}
	if !pp.HasEnd {
		return dst, errorf("prefill.end_layer", "prefill_end_layer must be set when using compressed-MLA PD with PP")
	}
	ratios := pp.CompressionRatios
	start, end := pp.StartLayer, pp.EndLayer
	if end < 0 {
		return dst, errorf("prefill.end_layer", "must not be negative, got %d", end)
	}
	count := func(upto, ratio int) int {
		n := 0
		for _, r := range ratios[:min(upto, len(ratios))] {
			if r == ratio {
				n++
			}
		}
		return n
	}
	c4Full, c128Full := count(len(ratios), 4), count(len(ratios), 128)
	kvLayoutLen := 2*c4Full + c128Full
	c4S, c4E := count(start, 4), count(end, 4)
	c128S, c128E := count(start, 128), count(end, 128)

	// sections lists the decode index ranges, in order, that make up the
	// sliced decode list.
	var sections [3][2]int
	n := 0
	add := func(a, b int) {
		lo, hi := pyRange(nDst, a, b)
		sections[n] = [2]int{lo, hi}
		n++
	}
	switch {
	case stateType == StateC128State:
		add(c128S, c128E)
	case stateType == StateSWARing:
		add(min(start, nDst), min(end, nDst))
	case stateType != StateSWA && nDst == kvLayoutLen:
		add(c4S, c4E)
		add(c4Full+c4S, c4Full+c4E)
		add(2*c4Full+c128S, 2*c4Full+c128E)
	default:
		swaL := nDst - 2*c4Full
		if swaL < 0 || swaL > len(ratios) {
			return dst, errorf("prefill.mla_compression_ratios", "unexpected compressed-MLA decode entry count %d; expected %d (kv data) or swa_L + %d (state data) given compression ratios (c4=%d, c128=%d, total=%d)",
				nDst, kvLayoutLen, 2*c4Full, c4Full, c128Full, len(ratios))
		}
		add(min(start, swaL), min(end, swaL))
		add(swaL+c4S, swaL+c4E)
		add(swaL+c4Full+c4S, swaL+c4Full+c4E)
	}
	k := 0
	for _, s := range sections[:n] {
		for j := s[0]; j < s[1] && k < nSrc; j++ {
			dst = append(dst, int32(j))
			k++
		}
	}
	if k < nSrc {
		return dst, errorf("decode.state_ptrs", "compressed-MLA slice of the decode list has %d entries for %d prefill entries (layers [%d, %d))", k, nSrc, start, end)
	}
	return dst, nil
}
