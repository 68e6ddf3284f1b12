package planjson

import (
	"encoding/json"
	"fmt"

	"github.com/kvhost/kvhost/planner"
)

// JSON requests of kind "aux", "state" and "dsa_tail" for `kvhost plan`
// (styles sglang-nixl and sglang-mori). Field names follow SGLang's disaggregation/{nixl,mori}/conn.py's
// KVArgs / register-info names; docs/plan.md documents them.

func init() {
	for _, style := range []string{StyleSGLangNIXL, StyleSGLangMORI} {
		registerHandler(style, KindAux, planAuxRequest)
		registerHandler(style, KindState, planStateRequest)
		registerHandler(style, KindDSATail, planDSATailRequest)
	}
}

// KindDSATail is the request kind of the DSA kpool-compress tail remap.
const KindDSATail = "dsa_tail"

// AuxSideJSON is one side of an aux request.
type AuxSideJSON struct {
	AuxPtrs     []uint64 `json:"aux_ptrs"`
	AuxItemLens []uint64 `json:"aux_item_lens,omitempty"`
	AuxDataLens []uint64 `json:"aux_data_lens,omitempty"`
}

// AuxRequest is the "aux" request: one request's metadata slot, from
// prefill slot prefill_aux_index to decode slot dst_aux_index.
type AuxRequest struct {
	Style           string      `json:"style"`
	Kind            string      `json:"kind"`
	Prefill         AuxSideJSON `json:"prefill"`
	Decode          AuxSideJSON `json:"decode"`
	PrefillAuxIndex int64       `json:"prefill_aux_index"`
	DstAuxIndex     int64       `json:"dst_aux_index"`
}

func (s *AuxSideJSON) buffers() planner.AuxBuffers {
	return planner.AuxBuffers{Ptrs: s.AuxPtrs, ItemLens: s.AuxItemLens, DataLens: s.AuxDataLens}
}

func planAuxRequest(raw json.RawMessage) (*planner.Plan, error) {
	var req AuxRequest
	if err := DecodeStrict(raw, &req); err != nil {
		return nil, err
	}
	if len(req.Prefill.AuxItemLens) != len(req.Prefill.AuxPtrs) {
		return nil, errorf("prefill.aux_item_lens", "%d item lengths for %d aux buffers", len(req.Prefill.AuxItemLens), len(req.Prefill.AuxPtrs))
	}
	if n := len(req.Decode.AuxItemLens); n != 0 && n != len(req.Decode.AuxPtrs) {
		return nil, errorf("decode.aux_item_lens", "%d item lengths for %d aux buffers", n, len(req.Decode.AuxPtrs))
	}
	if req.Style == StyleSGLangNIXL {
		return planner.PlanAuxNIXL(req.Prefill.buffers(), req.Decode.buffers(), req.PrefillAuxIndex, req.DstAuxIndex)
	}
	return planner.PlanAuxMORI(req.Prefill.buffers(), req.Decode.buffers(), req.PrefillAuxIndex, req.DstAuxIndex)
}

// StateSideJSON is one side of a state request. Prefill-only fields are
// rejected on the decode side.
type StateSideJSON struct {
	TPSize int `json:"tp_size"`
	TPRank int `json:"tp_rank"`
	// Prefill only.
	PPSize               int   `json:"pp_size,omitempty"`
	StartLayer           int   `json:"start_layer,omitempty"`
	EndLayer             *int  `json:"end_layer,omitempty"`
	MLACompressionRatios []int `json:"mla_compression_ratios,omitempty"`

	StatePtrs             [][]uint64 `json:"state_ptrs"`
	StateDataLens         [][]uint64 `json:"state_data_lens,omitempty"`
	StateItemLens         [][]uint64 `json:"state_item_lens"`
	StateDimPerTensor     [][]int    `json:"state_dim_per_tensor,omitempty"`
	StateConvShardGroups  [][][]int  `json:"state_conv_shard_groups,omitempty"`  // prefill only
	StateSliceOuterCounts [][]int    `json:"state_slice_outer_counts,omitempty"` // prefill only
	StateLayerIDs         [][]int    `json:"state_layer_ids,omitempty"`
}

// StateRequestJSON is the "state" request: every hybrid state component of
// one request, prefill to one decode peer.
type StateRequestJSON struct {
	Style      string        `json:"style"`
	Kind       string        `json:"kind"`
	Attention  string        `json:"attention"`
	StateTypes []string      `json:"state_types"`
	Prefill    StateSideJSON `json:"prefill"`
	Decode     StateSideJSON `json:"decode"`
	// Per component; null for a component the request does not send.
	PrefillStateIndices [][]int64 `json:"prefill_state_indices"`
	DecodeStateIndices  [][]int64 `json:"decode_state_indices"`
}

func (s *StateSideJSON) buffers() planner.StateBuffers {
	return planner.StateBuffers{
		Ptrs: s.StatePtrs, DataLens: s.StateDataLens, ItemLens: s.StateItemLens,
		DimPerTensor: s.StateDimPerTensor, ConvShardGroups: s.StateConvShardGroups,
		SliceOuterCounts: s.StateSliceOuterCounts, LayerIDs: s.StateLayerIDs,
	}
}

// stateIndices converts per-component JSON indices to int32 (the wire's
// type), keeping null entries nil.
func stateIndices(field string, in [][]int64) ([][]int32, error) {
	out := make([][]int32, len(in))
	for i, comp := range in {
		if comp == nil {
			continue
		}
		out[i] = make([]int32, len(comp))
		for k, x := range comp {
			if x < -1<<31 || x > 1<<31-1 {
				return nil, errorf(fmt.Sprintf("%s[%d][%d]", field, i, k), "index %d is not an int32", x)
			}
			out[i][k] = int32(x)
		}
	}
	return out, nil
}

// stateRequest decodes a state request into a StateRequest.
func stateRequest(raw json.RawMessage) (*planner.StateRequest, *StateRequestJSON, error) {
	var j StateRequestJSON
	if err := DecodeStrict(raw, &j); err != nil {
		return nil, nil, err
	}
	kv := KVRequest{Attention: j.Attention}
	mla, err := kv.MLA()
	if err != nil {
		return nil, nil, err
	}
	d := &j.Decode
	switch {
	case d.PPSize != 0:
		return nil, nil, errorf("decode.pp_size", "prefill only: state pairing uses the prefill stage")
	case d.StartLayer != 0:
		return nil, nil, errorf("decode.start_layer", "prefill only: decode holds its layers from 0")
	case d.EndLayer != nil:
		return nil, nil, errorf("decode.end_layer", "prefill only")
	case d.MLACompressionRatios != nil:
		return nil, nil, errorf("decode.mla_compression_ratios", "prefill only")
	case d.StateConvShardGroups != nil:
		return nil, nil, errorf("decode.state_conv_shard_groups", "prefill only: the sender slices with its own groups")
	case d.StateSliceOuterCounts != nil:
		return nil, nil, errorf("decode.state_slice_outer_counts", "prefill only: the sender slices with its own outer counts")
	}
	req := &planner.StateRequest{Src: j.Prefill.buffers(), Dst: j.Decode.buffers()}
	for i, s := range j.StateTypes {
		st, err := planner.ParseStateType(s)
		if err != nil {
			return nil, nil, errorf(fmt.Sprintf("state_types[%d]", i), "%v", err)
		}
		req.Types = append(req.Types, st)
	}
	if req.SrcIndices, err = stateIndices("prefill_state_indices", j.PrefillStateIndices); err != nil {
		return nil, nil, err
	}
	if req.DstIndices, err = stateIndices("decode_state_indices", j.DecodeStateIndices); err != nil {
		return nil, nil, err
	}
	p := &j.Prefill
	req.Topology = planner.StateTopology{
		PrefillTPSize: p.TPSize, PrefillTPRank: p.TPRank, PrefillPPSize: p.PPSize,
		PP:  planner.PPLayout{StartLayer: p.StartLayer, CompressionRatios: p.MLACompressionRatios},
		MLA: mla, DecodeTPSize: d.TPSize, DecodeTPRank: d.TPRank,
	}
	if p.EndLayer != nil {
		req.Topology.PP.EndLayer, req.Topology.PP.HasEnd = *p.EndLayer, true
	}
	return req, &j, nil
}

func planStateRequest(raw json.RawMessage) (*planner.Plan, error) {
	req, j, err := stateRequest(raw)
	if err != nil {
		return nil, err
	}
	var plans []planner.StatePlan
	if j.Style == StyleSGLangNIXL {
		plans, err = planner.PlanStateNIXL(req)
	} else {
		plans, err = planner.PlanStateMORI(req)
	}
	if err != nil {
		return nil, err
	}
	return planner.JoinStatePlans(plans, j.Style == StyleSGLangNIXL), nil
}

// DSATailSideJSON is one side of a dsa_tail request.
type DSATailSideJSON struct {
	// DSATailPtrs are [key per layer..., score per layer...] of the side's
	// kpool-compress tail buffers.
	DSATailPtrs     []uint64 `json:"dsa_tail_ptrs"`
	DSATailItemLens []uint64 `json:"dsa_tail_item_lens,omitempty"` // decode: optional, default the prefill's
	DSATailDataLens []uint64 `json:"dsa_tail_data_lens,omitempty"`
	// The 6-tuple of get_dsa_tail_state_indices on this side.
	DSATailIndices []int `json:"dsa_tail_indices"`
	// Prefill only: the stage's layers, to slice a PP-1 decode list.
	StartLayer int  `json:"start_layer,omitempty"`
	EndLayer   *int `json:"end_layer,omitempty"`
}

// DSATailRequest is the "dsa_tail" request.
type DSATailRequest struct {
	Style   string          `json:"style"`
	Kind    string          `json:"kind"`
	Prefill DSATailSideJSON `json:"prefill"`
	Decode  DSATailSideJSON `json:"decode"`
}

func planDSATailRequest(raw json.RawMessage) (*planner.Plan, error) {
	var req DSATailRequest
	if err := DecodeStrict(raw, &req); err != nil {
		return nil, err
	}
	if req.Decode.StartLayer != 0 || req.Decode.EndLayer != nil {
		return nil, errorf("decode.start_layer", "prefill only: the decode list is sliced with the prefill stage's layers")
	}
	p, d := &req.Prefill, &req.Decode
	end, hasEnd := 0, p.EndLayer != nil
	if hasEnd {
		end = *p.EndLayer
	}
	sel, err := planner.SliceDSATailDstForPP(len(p.DSATailPtrs), len(d.DSATailPtrs), p.StartLayer, end, hasEnd)
	if err != nil {
		return nil, err
	}
	return planner.PlanDSATail(
		planner.DSATailBuffers{Ptrs: p.DSATailPtrs, ItemLens: p.DSATailItemLens, DataLens: p.DSATailDataLens},
		planner.DSATailBuffers{Ptrs: d.DSATailPtrs, ItemLens: d.DSATailItemLens, DataLens: d.DSATailDataLens},
		sel, p.DSATailIndices, d.DSATailIndices)
}
