package planner

import "fmt"

// Hybrid-model state: besides paged KV, hybrid models keep per-request or
// per-page state in extra buffers, registered as "components" (one state
// type each, one list of tensors each). On the last chunk the prefill side
// sends every component to decode. The plans here reproduce the SGLang
// NIXL connector's maybe_send_extra and the MORI connector's send_state,
// component by component.

// StateType names a hybrid state component, as on the SGLang wire.
type StateType string

// State types (SGLang StateType values).
const (
	StateMamba         StateType = "mamba"           // one slot per request (linear attention)
	StateSWA           StateType = "swa"             // sliding-window KV pages
	StateDSA           StateType = "dsa"             // DeepSeek sparse attention index pages
	StateMiniMaxIndexK StateType = "minimax_index_k" // MiniMax sparse index K pages
	StateSWARing       StateType = "swa_ring"        // unified-KV SWA ring rows
	StateC128State     StateType = "c128_state"      // DeepSeek V4 C128 compressor state
)

// ParseStateType accepts the SGLang StateType strings. Types the reference
// connectors do not transfer (e.g. "dsa_tail", "block_scale") are accepted
// here and rejected when planned, with the reference's message.
func ParseStateType(s string) (StateType, error) {
	if s == "" {
		return "", fmt.Errorf("empty state type")
	}
	return StateType(s), nil
}

// StateBuffers is one side's hybrid-state registration (the reference's
// kv_args.state_*), indexed [component][tensor]. Decode-side fields that
// the wire does not carry may be left empty.
type StateBuffers struct {
	Ptrs [][]uint64 // state_data_ptrs
	// DataLens are the region lengths (state_data_lens); a missing
	// component means unknown (the SGLang NIXL wire does not carry them).
	DataLens [][]uint64
	ItemLens [][]uint64 // state_item_lens: bytes per slot (Mamba) or per page
	// DimPerTensor is state_dim_per_tensor: per-rank size of the
	// TP-sharded axis of each Mamba tensor; empty disables slicing.
	DimPerTensor [][]int
	// ConvShardGroups is state_conv_shard_groups (prefill side only): for
	// each tensor, the full dims of its independently sharded sub-blocks,
	// or nil. The reference NIXL and MORI connectors predate it; leaving it
	// empty reproduces them exactly.
	ConvShardGroups [][][]int
	// SliceOuterCounts is state_slice_outer_counts (prefill side only):
	// outer rows per tensor (default 1).
	SliceOuterCounts [][]int
	// LayerIDs is state_layer_ids: the global layer id of every tensor, for
	// pairing a PP stage's tensors with a PP-1 decode by layer. Empty on
	// both sides keeps the reference's positional pairing.
	LayerIDs [][]int
}

// StateTopology is the parallel layout both planners need.
type StateTopology struct {
	PrefillTPSize int // prefill attn_tp_size
	PrefillTPRank int // prefill kv_args.engine_rank (taken modulo the TP size)
	PrefillPPSize int // prefill pp_size (0 is taken as 1)
	PP            PPLayout
	// MLA is the prefill's is_mla_backend: it selects per-layer (MLA)
	// rather than K/V-halved (MHA) PP slicing and allows TP-mismatched
	// SWA/DSA state.
	MLA          bool
	DecodeTPSize int // decode attn_tp_size
	DecodeTPRank int // decode engine rank as sent on the wire (taken modulo its TP size)
}

// StateRequest is one request's state transfer to one decode peer.
type StateRequest struct {
	Types    []StateType // prefill kv_args.state_types; decode registers the same order
	Src, Dst StateBuffers
	// SrcIndices and DstIndices are the per-component slot or page indices
	// (nil entry: None). Mamba components carry one slot index.
	SrcIndices, DstIndices [][]int32
	Topology               StateTopology
}

// StatePlan is the plan of one component: one NIXL transfer (notification
// "<room>_state_<rank>_<component>") or one set of MORI batch writes. Its
// region tables are that component's tensors on each side.
type StatePlan struct {
	Component int
	Type      StateType
	Plan      Plan
}

// Plan paths of the state planners.
const (
	PathNIXLMamba      = "nixl-state-mamba"
	PathNIXLMambaSlice = "nixl-state-mamba-slice"
	PathNIXLPaged      = "nixl-state-paged"
	PathMORIMamba      = "mori-state-mamba"
	PathMORIMambaSlice = "mori-state-mamba-slice"
	PathMORIPaged      = "mori-state-paged"
)

// stateView is one component's inputs, missing entries read as empty (the
// reference's "x[i] if i < len(x) else []").
type stateView struct {
	i                  int
	st                 StateType
	srcIdx, dstIdx     []int32
	srcPtrs, dstPtrs   []uint64
	srcLens, dstLens   []uint64
	srcData, dstData   []uint64
	srcDims, dstDims   []int
	srcConv            [][]int
	srcOuter           []int
	srcLayers, dstLays []int
}

func stateAt[T any](xs []T, i int) T {
	var zero T
	if i < len(xs) {
		return xs[i]
	}
	return zero
}

func (r *StateRequest) view(i int) stateView {
	return stateView{
		i: i, st: r.Types[i],
		srcIdx: stateAt(r.SrcIndices, i), dstIdx: stateAt(r.DstIndices, i),
		srcPtrs: stateAt(r.Src.Ptrs, i), dstPtrs: stateAt(r.Dst.Ptrs, i),
		srcLens: stateAt(r.Src.ItemLens, i), dstLens: stateAt(r.Dst.ItemLens, i),
		srcData: stateAt(r.Src.DataLens, i), dstData: stateAt(r.Dst.DataLens, i),
		srcDims: stateAt(r.Src.DimPerTensor, i), dstDims: stateAt(r.Dst.DimPerTensor, i),
		srcConv: stateAt(r.Src.ConvShardGroups, i), srcOuter: stateAt(r.Src.SliceOuterCounts, i),
		srcLayers: stateAt(r.Src.LayerIDs, i), dstLays: stateAt(r.Dst.LayerIDs, i),
	}
}

// field names component i's input in errors, e.g. "state_item_lens[2]".
func stateField(name string, i int) string { return fmt.Sprintf("%s[%d]", name, i) }

// newStatePlan builds the component's region tables (state lives in VRAM).
func (v *stateView) newPlan(path string) (StatePlan, error) {
	src, err := regionTable(stateField("prefill.state_data_lens", v.i), v.srcPtrs, v.srcData, VRAM)
	if err != nil {
		return StatePlan{}, err
	}
	dst, err := regionTable(stateField("decode.state_data_lens", v.i), v.dstPtrs, v.dstData, VRAM)
	if err != nil {
		return StatePlan{}, err
	}
	return StatePlan{Component: v.i, Type: v.st, Plan: Plan{Path: path, Src: src, Dst: dst}}, nil
}

func (t StateTopology) check() error {
	if t.PrefillTPSize <= 0 {
		return errorf("prefill.tp_size", "must be positive, got %d", t.PrefillTPSize)
	}
	if t.DecodeTPSize <= 0 {
		return errorf("decode.tp_size", "must be positive, got %d", t.DecodeTPSize)
	}
	if t.PrefillTPRank < 0 || t.DecodeTPRank < 0 {
		return errorf("tp_rank", "negative rank (prefill %d, decode %d)", t.PrefillTPRank, t.DecodeTPRank)
	}
	if t.PrefillPPSize < 0 {
		return errorf("prefill.pp_size", "negative %d", t.PrefillPPSize)
	}
	return nil
}

func (t StateTopology) tpMismatch() bool { return t.PrefillTPSize != t.DecodeTPSize }

func (t StateTopology) ppSize() int { return sizeOrOne(t.PrefillPPSize) }

// PlanStateNIXL plans every component the way the SGLang NIXL connector's
// maybe_send_extra sends it: components without prefill indices are
// skipped; Mamba copies one slot (sliced when TP sizes differ and both
// sides publish dims); SWA, DSA, SWA_RING and C128 state move page runs per
// layer with PP slicing (TP sizes must match unless MLA, and index lists
// must have equal length); MiniMax index K is like them but flat, PP 1 and
// equal TP only. Other state types are an error.
func PlanStateNIXL(req *StateRequest) ([]StatePlan, error) {
	t := req.Topology
	if err := t.check(); err != nil {
		return nil, err
	}
	var plans []StatePlan
	for i := range req.Types {
		v := req.view(i)
		if len(v.srcIdx) == 0 {
			continue
		}
		var sp StatePlan
		var err error
		switch v.st {
		case StateMamba:
			if t.tpMismatch() {
				sp, err = nixlMambaSlice(&v, t)
			} else {
				sp, err = nixlMambaWhole(&v, t)
			}
		case StateSWA, StateDSA, StateSWARing, StateC128State:
			if !t.MLA && t.tpMismatch() {
				return nil, errorf("decode.tp_size", "PD disaggregation does not support different prefill/decode TP sizes (%d/%d) for non-MLA %s hybrid models",
					t.PrefillTPSize, t.DecodeTPSize, v.st)
			}
			if len(v.srcIdx) != len(v.dstIdx) {
				return nil, errorf(stateField("decode_state_indices", i), "state index length mismatch at component %d: prefill=%d, dst=%d", i, len(v.srcIdx), len(v.dstIdx))
			}
			sp, err = nixlPaged(&v, t, !t.MLA)
		case StateMiniMaxIndexK:
			if t.ppSize() > 1 {
				return nil, errorf("prefill.pp_size", "PP>1 not supported for MiniMax sparse index")
			}
			if t.tpMismatch() {
				return nil, errorf("decode.tp_size", "heterogeneous TP not supported for MiniMax sparse index")
			}
			if len(v.srcIdx) != len(v.dstIdx) {
				return nil, errorf(stateField("decode_state_indices", i), "state index length mismatch at component %d: prefill=%d, dst=%d", i, len(v.srcIdx), len(v.dstIdx))
			}
			v.st = "" // force_flat slices like MLA KV, without a state type
			sp, err = nixlPaged(&v, t, false)
			sp.Type = StateMiniMaxIndexK
		default:
			return nil, errorf(stateField("state_types", i), "PD disaggregation via NIXL does not support %q hybrid models", string(v.st))
		}
		if err != nil {
			return nil, err
		}
		if err := checkPlanBounds(&sp.Plan, stateField("prefill_state_indices", i), stateField("decode_state_indices", i)); err != nil {
			return nil, err
		}
		plans = append(plans, sp)
	}
	return plans, nil
}

// PlanStateMORI plans every component the way the SGLang MORI connector's
// send_state sends it. Components pair tensor by tensor (no PP slicing);
// a component with no indices on either side is skipped; Mamba needs one
// index per side; SWA (non-MLA), MiniMax need equal TP; paged index lists
// of unequal length are truncated to the shorter one, except SWA_RING and
// C128 state, which are position-indexed and must match.
func PlanStateMORI(req *StateRequest) ([]StatePlan, error) {
	t := req.Topology
	if err := t.check(); err != nil {
		return nil, err
	}
	if len(req.Src.Ptrs) == 0 {
		return nil, nil // no local state tensors (e.g. no SWA layers on this PP stage)
	}
	if len(req.Types) == 0 {
		return nil, errorf("state_types", "state types are empty but state buffers are registered")
	}
	if len(req.Dst.Ptrs) != len(req.Src.Ptrs) {
		return nil, errorf("decode.state_ptrs", "state component count mismatch (local=%d, remote=%d)", len(req.Src.Ptrs), len(req.Dst.Ptrs))
	}
	var plans []StatePlan
	for i := range req.Types {
		v := req.view(i)
		if len(v.srcIdx) == 0 || len(v.dstIdx) == 0 {
			continue
		}
		if i >= len(req.Src.Ptrs) {
			return nil, errorf(stateField("state_types", i), "component %d has no registered state buffers", i)
		}
		var sp StatePlan
		var err error
		switch v.st {
		case StateMamba:
			sp, err = moriMamba(&v, t)
		case StateSWA, StateDSA, StateSWARing, StateC128State, StateMiniMaxIndexK:
			sp, err = moriPaged(&v, t)
		default:
			return nil, errorf(stateField("state_types", i), "PD state transfer failed: unknown state_type=%q", string(v.st))
		}
		if err != nil {
			return nil, err
		}
		if err := checkPlanBounds(&sp.Plan, stateField("prefill_state_indices", i), stateField("decode_state_indices", i)); err != nil {
			return nil, err
		}
		plans = append(plans, sp)
	}
	return plans, nil
}

// checkStateIndices rejects negative indices up front: the reference would
// compute an address below the buffer and fail in the backend.
func checkStateIndices(field string, idx []int32) error {
	for k, x := range idx {
		if x < 0 {
			return errorf(field, "negative state index %d at position %d", x, k)
		}
	}
	return nil
}

// statePairs returns the tensor pairing of a component: by layer id when
// either side publishes ids (pairing needs both, unless prefill PP is 1),
// else nil, meaning the caller's positional rule applies.
func statePairs(v *stateView, t StateTopology) ([]EntryPair, bool, error) {
	if len(v.srcLayers) == 0 && len(v.dstLays) == 0 {
		return nil, false, nil
	}
	pairs, err := BuildTransferEntryPairs(v.srcLayers, v.dstLays, len(v.srcPtrs), len(v.dstPtrs), t.ppSize() == 1)
	if err != nil {
		return nil, false, err
	}
	return pairs, true, nil
}

// positionalPairs pairs tensors i with i for i < n.
func positionalPairs(n int) []EntryPair {
	pairs := make([]EntryPair, n)
	for i := range pairs {
		pairs[i] = EntryPair{Src: i, Dst: i}
	}
	return pairs
}

// statePair is one tensor copy of a paged component: prefill tensor src to
// decode tensor dst, with the length of prefill item_lens[item].
type statePair struct {
	src, dst, item int
}

// nixlPaged plans a paged component (the non-prepped path of the NIXL
// connector's _send_kvcache_generic): contiguous runs of (prefill, decode)
// indices, per tensor pair, with the prefill item length of the layer.
// mha selects K/V-halved PP slicing (the V half uses the K layer's item
// length, as the reference does); otherwise MLA slicing, compressed-MLA
// aware for v.st.
func nixlPaged(v *stateView, t StateTopology, mha bool) (StatePlan, error) {
	sp, err := v.newPlan(PathNIXLPaged)
	if err != nil {
		return sp, err
	}
	if err := checkStateIndices(stateField("prefill_state_indices", v.i), v.srcIdx); err != nil {
		return sp, err
	}
	if err := checkStateIndices(stateField("decode_state_indices", v.i), v.dstIdx); err != nil {
		return sp, err
	}
	pairs, ok, err := statePairs(v, t)
	if err != nil {
		return sp, err
	}
	var tensors []statePair
	switch {
	case ok:
		tensors = make([]statePair, len(pairs))
		for k, p := range pairs {
			tensors[k] = statePair{src: p.Src, dst: p.Dst, item: p.Src}
		}
	case len(v.srcPtrs) == 0:
		// The reference divides by the local layer count on the MHA path
		// when decode has layers; MLA simply has nothing to send.
		if mha && len(v.dstPtrs)/2 > 0 {
			return sp, errorf(stateField("prefill.state_ptrs", v.i), "prefill registers no tensors but decode has %d", len(v.dstPtrs))
		}
	default:
		var dsts []int32
		if !mha && len(t.PP.CompressionRatios) > 0 && len(v.srcPtrs) != len(v.dstPtrs) {
			dsts, err = PairCompressedMLARegions(nil, len(v.srcPtrs), len(v.dstPtrs), t.PP, v.st)
		} else {
			dsts, err = PairKVRegions(nil, PairCommon, !mha, len(v.srcPtrs), len(v.dstPtrs), t.PP.StartLayer, DraftUnknown)
		}
		if err != nil {
			return sp, stateFieldError(err, v.i)
		}
		layers := len(v.srcPtrs) / 2
		tensors = make([]statePair, len(dsts))
		for k, d := range dsts {
			item := k
			if mha && k >= layers {
				item = k - layers
			}
			tensors[k] = statePair{src: k, dst: int(d), item: item}
		}
	}
	for _, tp := range tensors {
		if tp.item >= len(v.srcLens) {
			return sp, errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", tp.item, len(v.srcLens))
		}
	}
	err = addRunCopies(&sp.Plan, v, tensors, v.srcIdx, v.dstIdx)
	return sp, err
}

// stateFieldError renames the region-list field of a KV pairing error
// ("prefill.kv_ptrs", "decode.kv_ptrs") to the state component's.
func stateFieldError(err error, i int) error {
	e, ok := err.(*Error)
	if !ok {
		return err
	}
	switch e.Field {
	case "prefill.kv_ptrs":
		return &Error{Field: stateField("prefill.state_ptrs", i), Msg: e.Msg}
	case "decode.kv_ptrs":
		return &Error{Field: stateField("decode.state_ptrs", i), Msg: e.Msg}
	}
	return err
}

// addRunCopies adds, for every tensor pair, one block per contiguous run of
// (src, dst) indices; srcIdx and dstIdx have equal length and are not
// negative.
func addRunCopies(p *Plan, v *stateView, tensors []statePair, srcIdx, dstIdx []int32) error {
	runs := CountRuns(srcIdx, dstIdx)
	p.Copies = make([]Copy, 0, min(len(tensors)*runs, 1<<16))
	for _, tp := range tensors {
		item := v.srcLens[tp.item]
		if item == 0 {
			continue
		}
		for k, n := 0, 0; k < len(srcIdx); k += n {
			n = NextRun(srcIdx, dstIdx, k)
			so, err := slotOffset(stateField("prefill_state_indices", v.i), int64(srcIdx[k]), item, 0)
			if err != nil {
				return err
			}
			do, err := slotOffset(stateField("decode_state_indices", v.i), int64(dstIdx[k]), item, 0)
			if err != nil {
				return err
			}
			length, ok := mul64(uint64(n), item)
			if !ok {
				return errorf(stateField("prefill.state_item_lens", v.i), "run of %d items of %d bytes overflows", n, item)
			}
			p.Add(Copy{SrcRegion: int32(tp.src), DstRegion: int32(tp.dst), SrcOff: so, DstOff: do, Len: length, Count: 1})
		}
	}
	return nil
}

// moriPaged plans a paged component the way the MORI connector's
// _send_swa_dsa_state does.
func moriPaged(v *stateView, t StateTopology) (StatePlan, error) {
	switch v.st {
	case StateSWA:
		if !t.MLA && t.tpMismatch() {
			return StatePlan{}, errorf("decode.tp_size", "PD state transfer does not support TP-mismatched non-MLA SWA models (prefill_tp_size=%d, decode_tp_size=%d)", t.PrefillTPSize, t.DecodeTPSize)
		}
	case StateMiniMaxIndexK:
		if t.ppSize() > 1 {
			return StatePlan{}, errorf("prefill.pp_size", "PP>1 not supported for MiniMax sparse index")
		}
		if t.tpMismatch() {
			return StatePlan{}, errorf("decode.tp_size", "heterogeneous TP not supported for MiniMax sparse index")
		}
	}
	srcIdx, dstIdx := v.srcIdx, v.dstIdx
	common := min(len(srcIdx), len(dstIdx))
	if common == 0 {
		if len(srcIdx) == 0 && len(dstIdx) == 0 {
			return v.newPlan(PathMORIPaged)
		}
		return StatePlan{}, errorf(stateField("decode_state_indices", v.i), "no overlapping state indices for state_type=%s", v.st)
	}
	if len(srcIdx) != len(dstIdx) {
		// Position- or request-indexed components would be misaligned by
		// truncation; paged SWA/DSA tolerate a one-page drift.
		if v.st == StateSWARing || v.st == StateC128State {
			return StatePlan{}, errorf(stateField("decode_state_indices", v.i), "%s state index length mismatch: src=%d, dst=%d", v.st, len(srcIdx), len(dstIdx))
		}
		srcIdx, dstIdx = srcIdx[:common], dstIdx[:common]
	}
	sp, err := v.newPlan(PathMORIPaged)
	if err != nil {
		return sp, err
	}
	if err := checkStateIndices(stateField("prefill_state_indices", v.i), srcIdx); err != nil {
		return sp, err
	}
	if err := checkStateIndices(stateField("decode_state_indices", v.i), dstIdx); err != nil {
		return sp, err
	}
	pairs, ok, err := statePairs(v, t)
	if err != nil {
		return sp, err
	}
	if !ok {
		if len(v.dstPtrs) < len(v.srcPtrs) {
			return sp, errorf(stateField("decode.state_ptrs", v.i), "decode registers %d state tensors, prefill %d", len(v.dstPtrs), len(v.srcPtrs))
		}
		pairs = positionalPairs(len(v.srcPtrs))
	}
	tensors := make([]statePair, len(pairs))
	for k, p := range pairs {
		if p.Src >= len(v.srcLens) {
			return sp, errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Src, len(v.srcLens))
		}
		tensors[k] = statePair{src: p.Src, dst: p.Dst, item: p.Src}
	}
	err = addRunCopies(&sp.Plan, v, tensors, srcIdx, dstIdx)
	return sp, err
}
