package planner

import (
	"fmt"
	"strings"
)

// Hybrid-model state: besides paged KV, hybrid models keep per-request or
// per-page state in extra buffers, registered as "components" (one state
// type each, one list of tensors each). On the last chunk the prefill side
// sends every component to decode. StatePlanner reproduces the SGLang NIXL
// connector's maybe_send_extra and the MORI connector's send_state,
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

// ParseStateType accepts any non-empty SGLang StateType string. Types the
// reference connectors do not transfer (e.g. "dsa_tail", "block_scale")
// are accepted here and rejected when planned, as SGLang's disaggregation/{nixl,mori}/conn.py does.
func ParseStateType(s string) (StateType, error) {
	if s == "" {
		return "", fmt.Errorf("empty state type")
	}
	return StateType(s), nil
}

// StateBuffers is one side's hybrid-state registration (SGLang's disaggregation/{nixl,mori}/conn.py's
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
	// or nil. SGLang's disaggregation/{nixl,mori}/conn.py NIXL and MORI connectors predate it; leaving it
	// empty reproduces them exactly.
	ConvShardGroups [][][]int
	// SliceOuterCounts is state_slice_outer_counts (prefill side only):
	// outer rows per tensor (default 1).
	SliceOuterCounts [][]int
	// LayerIDs is state_layer_ids: the global layer id of every tensor, for
	// pairing a PP stage's tensors with a PP-1 decode by layer. Empty on
	// both sides keeps SGLang's disaggregation/{nixl,mori}/conn.py's positional pairing.
	LayerIDs [][]int
}

// StateTopology is the parallel layout the state planners need.
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

// StateRequest is one request's state transfer to one decode peer, for
// the one-shot PlanStateNIXL and PlanStateMORI.
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
		return errorf("prefill.pp_size", "must not be negative, got %d", t.PrefillPPSize)
	}
	return nil
}

func (t StateTopology) tpMismatch() bool { return t.PrefillTPSize != t.DecodeTPSize }

func (t StateTopology) ppSize() int { return sizeOrOne(t.PrefillPPSize) }

// StatePlanner plans the hybrid state one SGLang prefill rank sends to one
// decode peer. Build it once per peer (NewStatePlannerNIXL or
// NewStatePlannerMORI, when the peer registers); it resolves tensor
// pairing, PP slicing and Mamba slices then, and Plan only places the
// request's indices. Errors SGLang's disaggregation/{nixl,mori}/conn.py raises while sending (pairing,
// item lengths, TP rules) are reported by Plan for the components a request
// actually sends, as SGLang's disaggregation/{nixl,mori}/conn.py reports them. A StatePlanner is
// immutable after construction and safe for concurrent use.
type StatePlanner struct {
	nixl  bool
	topo  StateTopology
	comps []stateComp
	// err is a MORI send_state error that fails every request carrying
	// state (state types missing, component count mismatch).
	err error
	// none: MORI without local state tensors sends nothing.
	none bool
}

// stateKind is how a component moves.
type stateKind uint8

const (
	kindSkip  stateKind = iota // never reached (MORI: component beyond the registration)
	kindMamba                  // one slot, whole or TP-sliced
	kindPaged                  // page runs per tensor pair
	kindError                  // the type itself is rejected
)

// stateComp is one component resolved for a peer.
type stateComp struct {
	i    int
	st   StateType
	kind stateKind
	path string
	src  []Region
	dst  []Region
	// preErr is raised before the request's indices are looked at (type
	// and TP/PP rules); err after they are checked (pairing, lengths).
	preErr, err error
	// paged: one entry per tensor pair.
	paged []pagedPair
	// mamba: one entry per copy of a slot (whole tensor or slice block).
	mamba []mambaCopy
	// mambaActive: some tensor is not skipped, so the slice path needs a
	// decode slot index.
	mambaActive bool
	// refDescs is SGLang's disaggregation/{nixl,mori}/conn.py's descriptor count per run (paged) or per
	// request (Mamba), zero-length descriptors included.
	refDescs uint64
}

// pagedPair is one tensor pair of a paged component, with the length of
// one page (the prefill item length SGLang's disaggregation/{nixl,mori}/conn.py uses).
type pagedPair struct {
	src, dst int32
	item     uint64
}

// mambaCopy is one copy of a Mamba slot: slot s of the prefill tensor
// starts at s*srcItem, slot t of the decode tensor at t*dstItem; the copy
// is Count blocks of Len bytes at SrcDelta/DstDelta within the slots,
// SrcStride/DstStride apart.
type mambaCopy struct {
	src, dst             int32
	srcItem, dstItem     uint64
	srcDelta, dstDelta   uint64
	length               uint64
	srcStride, dstStride uint64
	count                uint64
}

// stateView is one component's registration, missing entries read as
// empty (SGLang's disaggregation/{nixl,mori}/conn.py's "x[i] if i < len(x) else []").
type stateView struct {
	i                  int
	st                 StateType
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

func newStateView(i int, st StateType, src, dst *StateBuffers) stateView {
	return stateView{
		i: i, st: st,
		srcPtrs: stateAt(src.Ptrs, i), dstPtrs: stateAt(dst.Ptrs, i),
		srcLens: stateAt(src.ItemLens, i), dstLens: stateAt(dst.ItemLens, i),
		srcData: stateAt(src.DataLens, i), dstData: stateAt(dst.DataLens, i),
		srcDims: stateAt(src.DimPerTensor, i), dstDims: stateAt(dst.DimPerTensor, i),
		srcConv: stateAt(src.ConvShardGroups, i), srcOuter: stateAt(src.SliceOuterCounts, i),
		srcLayers: stateAt(src.LayerIDs, i), dstLays: stateAt(dst.LayerIDs, i),
	}
}

// stateField names component i's input in errors, e.g. "state_item_lens[2]".
func stateField(name string, i int) string { return fmt.Sprintf("%s[%d]", name, i) }

// regions builds the component's region tables (state lives in VRAM). A
// bad length list is a deferred error like the others.
func (c *stateComp) regions(v *stateView) {
	var err error
	if c.src, err = regionTable(stateField("prefill.state_data_lens", v.i), v.srcPtrs, v.srcData, VRAM); err != nil {
		c.setErr(err)
		return
	}
	if c.dst, err = regionTable(stateField("decode.state_data_lens", v.i), v.dstPtrs, v.dstData, VRAM); err != nil {
		c.setErr(err)
	}
}

func (c *stateComp) setErr(err error) {
	if c.err == nil {
		c.err = err
	}
}

// NewStatePlannerNIXL resolves every component the way the SGLang NIXL
// connector's maybe_send_extra sends it: Mamba copies one slot (TP-sliced
// when TP sizes differ and both sides publish dims); SWA, DSA, SWA_RING
// and C128 state move page runs per layer with PP slicing (TP sizes must
// match unless MLA); MiniMax index K is like them but flat, PP 1 and equal
// TP only. Other state types fail when a request sends them.
func NewStatePlannerNIXL(types []StateType, src, dst StateBuffers, t StateTopology) (*StatePlanner, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	sp := &StatePlanner{nixl: true, topo: t, comps: make([]stateComp, len(types))}
	for i, st := range types {
		v := newStateView(i, st, &src, &dst)
		c := &sp.comps[i]
		c.i, c.st = i, st
		c.regions(&v)
		switch st {
		case StateMamba:
			c.resolveMamba(&v, t, true)
		case StateSWA, StateDSA, StateSWARing, StateC128State:
			c.kind, c.path = kindPaged, PathNIXLPaged
			if !t.MLA && t.tpMismatch() {
				c.preErr = errorf("decode.tp_size", "PD disaggregation does not support different prefill/decode TP sizes (%d/%d) for non-MLA %s hybrid models",
					t.PrefillTPSize, t.DecodeTPSize, st)
			}
			c.resolveNIXLPaged(&v, t, !t.MLA, st)
		case StateMiniMaxIndexK:
			c.kind, c.path = kindPaged, PathNIXLPaged
			switch {
			case t.ppSize() > 1:
				c.preErr = errorf("prefill.pp_size", "PP>1 not supported for MiniMax sparse index")
			case t.tpMismatch():
				c.preErr = errorf("decode.tp_size", "heterogeneous TP not supported for MiniMax sparse index")
			}
			// force_flat: sliced like MLA KV, without a state type.
			c.resolveNIXLPaged(&v, t, false, "")
		default:
			c.kind = kindError
			c.preErr = errorf(stateField("state_types", i), "PD disaggregation via NIXL does not support %q hybrid models", string(st))
		}
	}
	return sp, nil
}

// NewStatePlannerMORI resolves every component the way the SGLang MORI
// connector's send_state sends it: tensors pair one to one (no PP
// slicing); Mamba copies one slot (TP-sliced when TP sizes differ and both
// sides publish dims); SWA (non-MLA) and MiniMax need equal TP; paged index
// lists of unequal length are truncated to the shorter one, except SWA_RING
// and C128 state.
func NewStatePlannerMORI(types []StateType, src, dst StateBuffers, t StateTopology) (*StatePlanner, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	sp := &StatePlanner{topo: t}
	switch {
	case len(src.Ptrs) == 0:
		sp.none = true // no local state tensors (e.g. no SWA layers on this PP stage)
		return sp, nil
	case len(types) == 0:
		sp.err = errorf("state_types", "state types are empty but state buffers are registered")
	case len(dst.Ptrs) != len(src.Ptrs):
		sp.err = errorf("decode.state_ptrs", "state component count mismatch (local=%d, remote=%d)", len(src.Ptrs), len(dst.Ptrs))
	}
	sp.comps = make([]stateComp, len(types))
	for i, st := range types {
		v := newStateView(i, st, &src, &dst)
		c := &sp.comps[i]
		c.i, c.st = i, st
		if i >= len(src.Ptrs) {
			c.kind = kindError
			c.preErr = errorf(stateField("state_types", i), "component %d has no registered state buffers", i)
			continue
		}
		c.regions(&v)
		switch st {
		case StateMamba:
			c.resolveMamba(&v, t, false)
		case StateSWA, StateDSA, StateSWARing, StateC128State, StateMiniMaxIndexK:
			c.kind, c.path = kindPaged, PathMORIPaged
			switch {
			case st == StateSWA && !t.MLA && t.tpMismatch():
				c.preErr = errorf("decode.tp_size", "PD state transfer does not support TP-mismatched non-MLA SWA models (prefill_tp_size=%d, decode_tp_size=%d)", t.PrefillTPSize, t.DecodeTPSize)
			case st == StateMiniMaxIndexK && t.ppSize() > 1:
				c.preErr = errorf("prefill.pp_size", "PP>1 not supported for MiniMax sparse index")
			case st == StateMiniMaxIndexK && t.tpMismatch():
				c.preErr = errorf("decode.tp_size", "heterogeneous TP not supported for MiniMax sparse index")
			}
			c.resolveMORIPaged(&v, t)
		default:
			c.kind = kindError
			c.preErr = errorf(stateField("state_types", i), "PD state transfer failed: unknown state_type=%q", string(st))
		}
	}
	return sp, nil
}

// statePairs returns the tensor pairing of a component: by layer id when
// either side publishes ids (pairing needs both, unless prefill PP is 1),
// else ok false, meaning the caller's positional rule applies.
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

// resolveNIXLPaged pairs a paged component's tensors as the NIXL
// connector's non-prepped _send_kvcache_generic does: mha selects
// K/V-halved PP slicing (the V half uses the K layer's item length, as the
// reference does); otherwise MLA slicing, compressed-MLA aware for st.
func (c *stateComp) resolveNIXLPaged(v *stateView, t StateTopology, mha bool, st StateType) {
	pairs, ok, err := statePairs(v, t)
	if err != nil {
		c.setErr(err)
		return
	}
	switch {
	case ok:
		for _, p := range pairs {
			c.addPaged(v, p.Src, p.Dst, p.Src)
		}
	case len(v.srcPtrs) == 0:
		// SGLang's disaggregation/{nixl,mori}/conn.py divides by the local layer count on the MHA path
		// when decode has layers; MLA simply has nothing to send.
		if mha && len(v.dstPtrs)/2 > 0 {
			c.setErr(errorf(stateField("prefill.state_ptrs", v.i), "prefill registers no tensors but decode has %d", len(v.dstPtrs)))
		}
	default:
		var dsts []int32
		if !mha && len(t.PP.CompressionRatios) > 0 && len(v.srcPtrs) != len(v.dstPtrs) {
			dsts, err = PairCompressedMLARegions(nil, len(v.srcPtrs), len(v.dstPtrs), t.PP, st)
		} else {
			dsts, err = PairKVRegions(nil, PairCommon, !mha, len(v.srcPtrs), len(v.dstPtrs), t.PP.StartLayer, DraftUnknown)
		}
		if err != nil {
			c.setErr(stateFieldError(err, v.i))
			return
		}
		layers := len(v.srcPtrs) / 2
		for k, d := range dsts {
			item := k
			if mha && k >= layers {
				item = k - layers
			}
			c.addPaged(v, k, int(d), item)
		}
	}
}

// resolveMORIPaged pairs a paged component's tensors as the MORI
// connector's _send_swa_dsa_state does: tensor i with tensor i.
func (c *stateComp) resolveMORIPaged(v *stateView, t StateTopology) {
	pairs, ok, err := statePairs(v, t)
	if err != nil {
		c.setErr(err)
		return
	}
	if !ok {
		if len(v.dstPtrs) < len(v.srcPtrs) {
			c.setErr(errorf(stateField("decode.state_ptrs", v.i), "decode registers %d state tensors, prefill %d", len(v.dstPtrs), len(v.srcPtrs)))
			return
		}
		for k := range v.srcPtrs {
			c.addPaged(v, k, k, k)
		}
		return
	}
	for _, p := range pairs {
		c.addPaged(v, p.Src, p.Dst, p.Src)
	}
}

// addPaged records a tensor pair with the length of prefill item item.
func (c *stateComp) addPaged(v *stateView, src, dst, item int) {
	if c.err != nil {
		return
	}
	if item >= len(v.srcLens) {
		c.setErr(errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", item, len(v.srcLens)))
		return
	}
	c.refDescs++
	if l := v.srcLens[item]; l > 0 {
		c.paged = append(c.paged, pagedPair{src: int32(src), dst: int32(dst), item: l})
	}
}

// PlanStateNIXL plans one request with a fresh NewStatePlannerNIXL.
func PlanStateNIXL(req *StateRequest) ([]StatePlan, error) {
	return planStateOnce(NewStatePlannerNIXL, req)
}

// PlanStateMORI plans one request with a fresh NewStatePlannerMORI.
func PlanStateMORI(req *StateRequest) ([]StatePlan, error) {
	return planStateOnce(NewStatePlannerMORI, req)
}

func planStateOnce(newPlanner func([]StateType, StateBuffers, StateBuffers, StateTopology) (*StatePlanner, error), req *StateRequest) ([]StatePlan, error) {
	sp, err := newPlanner(req.Types, req.Src, req.Dst, req.Topology)
	if err != nil {
		return nil, err
	}
	var plans []StatePlan
	if err := sp.Plan(&plans, req.SrcIndices, req.DstIndices); err != nil {
		return nil, err
	}
	return plans, nil
}

// Plan fills *out with one request's state plans, one per component, like
// every planner's Plan: prefillIndices and decodeIndices are the
// per-component indices of the prefill and decode sides (nil entry: None).
// Components SGLang's disaggregation/{nixl,mori}/conn.py skips have no plan: NIXL skips a component
// without prefill indices, MORI one without indices on either side. *out is
// truncated and refilled, reusing the capacity of the slice and of its
// Plans, so a caller that keeps *out plans without allocating once warm.
// Region tables are borrowed from the planner. On error *out is empty.
func (sp *StatePlanner) Plan(out *[]StatePlan, prefillIndices, decodeIndices [][]int32) error {
	plans, err := sp.plan((*out)[:0], prefillIndices, decodeIndices)
	if err != nil {
		plans = plans[:0]
	}
	*out = plans
	return err
}

// plan appends the request's plans to plans (reusing the Plans past its
// length) and returns the extended slice.
func (sp *StatePlanner) plan(plans []StatePlan, prefillIndices, decodeIndices [][]int32) ([]StatePlan, error) {
	if sp.none || sp.err != nil {
		return plans, sp.err
	}
	for k := range sp.comps {
		c := &sp.comps[k]
		si, di := stateAt(prefillIndices, k), stateAt(decodeIndices, k)
		if len(si) == 0 || (!sp.nixl && len(di) == 0) {
			continue
		}
		if c.preErr != nil {
			return plans, c.preErr
		}
		// Reuse the caller's plan at this position if there is one.
		var p *Plan
		if len(plans) < cap(plans) {
			plans = plans[:len(plans)+1]
			p = &plans[len(plans)-1].Plan
			p.Reset()
		} else {
			plans = append(plans, StatePlan{})
			p = &plans[len(plans)-1].Plan
		}
		plans[len(plans)-1].Component, plans[len(plans)-1].Type = c.i, c.st
		p.Path, p.Src, p.Dst = c.path, c.src, c.dst
		var err error
		switch c.kind {
		case kindMamba:
			err = c.planMamba(p, si, di, sp.nixl)
		case kindPaged:
			err = c.planPaged(p, si, di, sp.nixl)
		}
		if err != nil {
			return plans, err
		}
		if c.kind == kindMamba { // planPaged checks its bounds per tensor
			if err := checkPlanBounds(p, fieldRef{"prefill_state_indices", c.i}, fieldRef{"decode_state_indices", c.i}); err != nil {
				return plans, err
			}
		}
	}
	return plans, nil
}

// checkStateIndices rejects negative indices up front: SGLang's disaggregation/{nixl,mori}/conn.py would
// compute an address below the buffer and fail in the backend.
func checkStateIndices(f fieldRef, idx []int32) error {
	for k, x := range idx {
		if x < 0 {
			return errorf(f.String(), "negative state index %d at position %d", x, k)
		}
	}
	return nil
}

// planPaged adds, for every tensor pair, one block per contiguous run of
// (prefill, decode) indices.
func (c *stateComp) planPaged(p *Plan, si, di []int32, nixl bool) error {
	if len(si) != len(di) {
		if nixl {
			return errorf(stateField("decode_state_indices", c.i), "state index length mismatch at component %d: prefill=%d, dst=%d", c.i, len(si), len(di))
		}
		// Position- or request-indexed components would be misaligned by
		// truncation; paged SWA/DSA/MiniMax tolerate a one-page drift.
		if c.st == StateSWARing || c.st == StateC128State {
			return errorf(stateField("decode_state_indices", c.i), "%s state index length mismatch: src=%d, dst=%d", c.st, len(si), len(di))
		}
		n := min(len(si), len(di))
		si, di = si[:n], di[:n]
	}
	if err := checkStateIndices(fieldRef{"prefill_state_indices", c.i}, si); err != nil {
		return err
	}
	if err := checkStateIndices(fieldRef{"decode_state_indices", c.i}, di); err != nil {
		return err
	}
	if c.err != nil {
		return c.err
	}
	// Every copy lies inside its tensors when the largest index does, so
	// bounds are checked once per tensor pair rather than per copy.
	maxS, maxD := maxIndex(si), maxIndex(di)
	for _, tp := range c.paged {
		if err := pageFits(fieldRef{"prefill_state_indices", c.i}, "prefill", maxS, tp.item, c.src[tp.src]); err != nil {
			return err
		}
		if err := pageFits(fieldRef{"decode_state_indices", c.i}, "decode", maxD, tp.item, c.dst[tp.dst]); err != nil {
			return err
		}
	}
	runs := p.pageRuns(si, di, false)
	p.ReferenceDescriptors = c.refDescs * uint64(len(runs))
	// One copy per run and tensor pair (a run of whole pages is one
	// block: pageFits bounded (index+1)*item by the region length, so the
	// products cannot overflow). Tensor pairs of one item length get the
	// same copies in their own regions (Plan.repeat).
	from, to := -1, -1
	var last uint64
	for _, tp := range c.paged {
		if from >= 0 && tp.item == last && p.repeat(from, to, tp.src, tp.dst) {
			continue
		}
		from = p.freshStart(tp.src, tp.dst)
		addPageRuns(p, pagePair{src: tp.src, dst: tp.dst, srcStride: tp.item, dstStride: tp.item, xfer: tp.item}, runs)
		to, last = len(p.Copies), tp.item
	}
	return nil
}

// maxIndex returns the largest of idx (which is not empty and not negative).
func maxIndex(idx []int32) int32 {
	m := idx[0]
	for _, x := range idx[1:] {
		m = max(m, x)
	}
	return m
}

// pageFits checks that page maxIdx of item bytes lies inside r.
func pageFits(f fieldRef, side string, maxIdx int32, item uint64, r Region) error {
	end, ok := mulAdd64(item, uint64(maxIdx), item)
	if !ok || end > r.Len {
		return errorf(f.String(), "page %d of %d bytes leaves the %s buffer at %#x of %d bytes", maxIdx, item, side, r.Addr, r.Len)
	}
	return nil
}

// PathState prefixes the path of a joined state plan.
const PathState = "state"

// JoinStatePlans joins per-component plans into one plan whose region
// tables are the components' tables concatenated in order. Its path is
// "state:" followed by the components' paths. With notify (SGLang NIXL),
// every component becomes a Part notified with suffix "_<component>", as
// the NIXL connector posts one transfer per component; otherwise (MORI,
// which reports completion by status message) the plan has no parts.
func JoinStatePlans(plans []StatePlan, notify bool) *Plan {
	out := &Plan{}
	var paths []string
	var nSrc, nDst, nCopies int
	for i := range plans {
		nSrc += len(plans[i].Plan.Src)
		nDst += len(plans[i].Plan.Dst)
		nCopies += len(plans[i].Plan.Copies)
	}
	out.Src = make([]Region, 0, nSrc)
	out.Dst = make([]Region, 0, nDst)
	out.Copies = make([]Copy, 0, nCopies)
	for i := range plans {
		sp := &plans[i]
		srcBase, dstBase := int32(len(out.Src)), int32(len(out.Dst))
		out.Src = append(out.Src, sp.Plan.Src...)
		out.Dst = append(out.Dst, sp.Plan.Dst...)
		start := len(out.Copies)
		for _, c := range sp.Plan.Copies {
			c.SrcRegion += srcBase
			c.DstRegion += dstBase
			out.Copies = append(out.Copies, c)
		}
		out.ReferenceDescriptors += sp.Plan.ReferenceDescriptors
		if notify {
			out.Parts = append(out.Parts, Part{Start: start, End: len(out.Copies), SrcKind: VRAM, DstKind: VRAM,
				NotifSuffix: fmt.Sprintf("_%d", sp.Component)})
		}
		paths = append(paths, fmt.Sprintf("%s[%d]=%s", sp.Type, sp.Component, sp.Plan.Path))
	}
	out.Path = PathState + ":" + strings.Join(paths, ",")
	return out
}
