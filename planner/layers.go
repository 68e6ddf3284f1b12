package planner

// Layer pairing between peers whose pipeline-parallel (PP) layouts differ.
//
// A prefill PP stage registers only its own layers; a decode engine with
// PP 1 registers every layer. Two mechanisms pair the two lists:
//
//   - by position with the stage's start layer (the reference's
//     get_mha_kv_ptrs_with_pp / get_mla_kv_ptrs_with_pp), and
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

// LayerPair is one per-layer copy of a PP pointer slicing: prefill region
// Src pairs with decode region Dst, and the copy length comes from the
// prefill item_lens[Item]. For MHA the V half uses the K layer's item length
// (Item is the layer number, not the V region index), exactly as the
// reference's _send_kvcache_generic does.
type LayerPair struct {
	Src, Dst, Item int
}

// BuildTransferEntryPairs pairs prefill entries with decode entries by
// global layer id (the reference's build_transfer_entry_pairs).
//
// Layer ids may repeat across tensor groups (K then V, conv then temporal
// state), so the k-th occurrence of an id on the prefill side pairs with the
// k-th occurrence on the decode side. Without ids on both sides the pairing
// is positional, which is only allowed when both lists have the same length,
// or when allowPositionalFallback is set and decode has at least as many
// entries (the reference sets it when prefill PP size is 1).
func BuildTransferEntryPairs(srcLayerIDs, dstLayerIDs []int, nSrc, nDst int, allowPositionalFallback bool) ([]EntryPair, error) {
	if nSrc < 0 || nDst < 0 {
		return nil, errorf("layer_ids", "negative entry count (src %d, dst %d)", nSrc, nDst)
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
// kv_data_ptrs (the reference's build_kv_layer_ids). Draft entries get ids
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
// numEntries registered entries (the reference's _draft_entry_layer_ids).
func DraftEntryLayerIDs(pool DraftPool, numEntries int) ([]int, error) {
	var ids []int
	if pool.Hybrid {
		ids = pool.LayerIDs
	} else {
		if pool.LayerNum <= 0 || numEntries < 0 || numEntries%pool.LayerNum != 0 {
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
// entry it lands in for a decode-context-parallel relayout (the reference's
// resolve_dcp_dst_entry_indices). Without layer ids on either side it is the
// identity (decode may hold extra draft entries); otherwise entries pair by
// layer id.
func ResolveDCPDstEntryIndices(srcLayerIDs, dstLayerIDs []int, nSrc, nDst int) ([]int, error) {
	if nSrc < 0 {
		return nil, errorf("layer_ids", "negative entry count %d", nSrc)
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

// pyRange clamps the Python slice [start:stop] of a list of n elements,
// for non-negative start and stop, and returns the resulting index range.
func pyRange(n, start, stop int) (lo, hi int) {
	lo, hi = min(start, n), min(stop, n)
	if hi < lo {
		hi = lo
	}
	return lo, hi
}

// PairMHALayersPP pairs prefill MHA regions (K of each local layer, then V)
// with decode regions (the reference's get_mha_kv_ptrs_with_pp): K pairs
// first, then V pairs. With L = nSrc/2 local layers and T = nDst/2 decode
// layers:
//   - L == T: same layout, K with K and V with V positionally;
//   - L < T and T % L != 0: decode holds draft layers after its main K and
//     V ([K..., V..., draftK..., draftV...]); K = dst[start:start+L] and V
//     starts at L*(T/L)+start;
//   - otherwise decode has PP 1 and prefill PP > 1: K = dst[start:start+L],
//     V = dst[T+start:T+start+L].
//
// A slice that runs past the decode list is an error (the reference fails
// with an index error when it addresses the missing entry).
func PairMHALayersPP(nSrc, nDst, startLayer int) ([]LayerPair, error) {
	if nSrc < 0 || nDst < 0 || startLayer < 0 {
		return nil, errorf("start_layer", "invalid PP layout: src=%d dst=%d entries, start_layer=%d", nSrc, nDst, startLayer)
	}
	layers := nSrc / 2
	total := nDst / 2
	var kLo, kHi, vLo, vHi int
	switch {
	case layers == total:
		kLo, kHi = 0, total
		vLo, vHi = total, nDst
	case layers == 0:
		// The reference divides by the local layer count here.
		return nil, errorf("kv_ptrs", "prefill registers no full layers (src=%d entries) but decode has %d", nSrc, nDst)
	case layers < total && total%layers != 0:
		vOff := layers * (total / layers)
		kLo, kHi = pyRange(nDst, startLayer, startLayer+layers)
		vLo, vHi = pyRange(nDst, vOff+startLayer, vOff+startLayer+layers)
	default:
		kLo, kHi = pyRange(nDst, startLayer, startLayer+layers)
		vLo, vHi = pyRange(nDst, total+startLayer, total+startLayer+layers)
	}
	if kHi-kLo < layers || vHi-vLo < layers {
		return nil, errorf("start_layer", "decode registers %d entries; prefill layers [%d, %d) (K and V) do not fit", nDst, startLayer, startLayer+layers)
	}
	pairs := make([]LayerPair, 0, 2*layers)
	for l := 0; l < layers; l++ {
		pairs = append(pairs, LayerPair{Src: l, Dst: kLo + l, Item: l})
	}
	for l := 0; l < layers; l++ {
		pairs = append(pairs, LayerPair{Src: layers + l, Dst: vLo + l, Item: l})
	}
	return pairs, nil
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

// PairMLALayersPP pairs prefill MLA regions (one per local layer) with
// decode regions (the reference's get_mla_kv_ptrs_with_pp). Equal lengths
// pair positionally. Otherwise decode has PP 1: regular MLA takes
// dst[start:start+n]; compressed-MLA pools (pp.CompressionRatios set) locate
// the stage's sub-range inside each section of the decode list, depending on
// stateType ("" for KV, or the state component being sliced).
func PairMLALayersPP(nSrc, nDst int, pp PPLayout, stateType StateType) ([]LayerPair, error) {
	if nSrc < 0 || nDst < 0 || pp.StartLayer < 0 {
		return nil, errorf("start_layer", "invalid PP layout: src=%d dst=%d entries, start_layer=%d", nSrc, nDst, pp.StartLayer)
	}
	pairs := make([]LayerPair, 0, nSrc)
	if nSrc == nDst {
		for l := 0; l < nSrc; l++ {
			pairs = append(pairs, LayerPair{Src: l, Dst: l, Item: l})
		}
		return pairs, nil
	}
	if len(pp.CompressionRatios) > 0 {
		return appendCompressedMLAPairs(pairs, nSrc, nDst, pp, stateType)
	}
	lo, hi := pyRange(nDst, pp.StartLayer, pp.StartLayer+nSrc)
	if hi-lo < nSrc {
		return nil, errorf("start_layer", "decode registers %d MLA entries; prefill layers [%d, %d) do not fit", nDst, pp.StartLayer, pp.StartLayer+nSrc)
	}
	for l := 0; l < nSrc; l++ {
		pairs = append(pairs, LayerPair{Src: l, Dst: lo + l, Item: l})
	}
	return pairs, nil
}

// appendCompressedMLAPairs implements the reference's _mla_slice_ptrs_for_pp
// for compressed-MLA pools. The decode list is one of three layouts:
//   - KV data, 2*c4 + c128 entries: [c4 layers, c4 indexer layers, c128 layers];
//   - SWA state data, swa + 2*c4 entries: [swa layers, c4 compress states,
//     c4 indexer compress states];
//   - C128 state, c128 entries.
//
// Each section is indexed by the layer's rank within its compression
// bucket, so the stage's range is found per section and concatenated.
func appendCompressedMLAPairs(pairs []LayerPair, nSrc, nDst int, pp PPLayout, st StateType) ([]LayerPair, error) {
	if !pp.HasEnd {
		return nil, errorf("end_layer", "prefill_end_layer must be set when using compressed-MLA PD with PP")
	}
	ratios := pp.CompressionRatios
	start, end := pp.StartLayer, pp.EndLayer
	if end < 0 {
		return nil, errorf("end_layer", "negative prefill_end_layer %d", end)
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
	case st == StateC128State:
		add(c128S, c128E)
	case st == StateSWARing:
		add(min(start, nDst), min(end, nDst))
	case st != StateSWA && nDst == kvLayoutLen:
		add(c4S, c4E)
		add(c4Full+c4S, c4Full+c4E)
		add(2*c4Full+c128S, 2*c4Full+c128E)
	default:
		swaL := nDst - 2*c4Full
		if swaL < 0 || swaL > len(ratios) {
			return nil, errorf("mla_compression_ratios", "unexpected compressed-MLA decode entry count %d; expected %d (kv data) or swa_L + %d (state data) given compression ratios (c4=%d, c128=%d, total=%d)",
				nDst, kvLayoutLen, 2*c4Full, c4Full, c128Full, len(ratios))
		}
		add(min(start, swaL), min(end, swaL))
		add(swaL+c4S, swaL+c4E)
		add(swaL+c4Full+c4S, swaL+c4Full+c4E)
	}
	l := 0
	for _, s := range sections[:n] {
		for j := s[0]; j < s[1] && l < nSrc; j++ {
			pairs = append(pairs, LayerPair{Src: l, Dst: j, Item: l})
			l++
		}
	}
	if l < nSrc {
		return nil, errorf("start_layer", "compressed-MLA slice of the decode list has %d entries for %d prefill entries (layers [%d, %d))", l, nSrc, start, end)
	}
	return pairs, nil
}
