package planner

// Mamba component plans for the NIXL and MORI connectors. A Mamba
// component has one slot index per side; every tensor of the component
// copies that slot, whole or TP-sliced.

// mambaSrcSlot checks the one-slot rule on the prefill side and returns
// the slot index.
func mambaSrcSlot(v *stateView) (int64, error) {
	if len(v.srcIdx) != 1 {
		return 0, errorf(stateField("prefill_state_indices", v.i), "Mamba should have a single state index, got %d", len(v.srcIdx))
	}
	return int64(v.srcIdx[0]), nil
}

// mambaPairs returns the tensor pairing: by layer id when published, else
// positional over the decode tensors (NIXL iterates the decode list) or
// the prefill tensors (MORI iterates its own list); a missing partner is
// an error, as the reference's list lookup would be.
func mambaPairs(v *stateView, t StateTopology, overDst bool) ([]EntryPair, error) {
	pairs, ok, err := statePairs(v, t)
	if err != nil || ok {
		return pairs, err
	}
	if overDst {
		// A missing prefill tensor is reported when it is reached, as
		// the reference skips zero-length tensors before looking it up.
		return positionalPairs(len(v.dstPtrs)), nil
	}
	if len(v.dstPtrs) < len(v.srcPtrs) {
		return nil, errorf(stateField("decode.state_ptrs", v.i), "decode registers %d Mamba state tensors, prefill %d", len(v.dstPtrs), len(v.srcPtrs))
	}
	return positionalPairs(len(v.srcPtrs)), nil
}

// nixlMambaWhole reproduces the NIXL connector's _send_mamba_state: each
// tensor copies src item_len bytes from slot src to slot dst, both offsets
// scaled by the prefill item length; tensors with a zero length or a null
// pointer on either side are skipped.
func nixlMambaWhole(v *stateView, t StateTopology) (StatePlan, error) {
	srcSlot, err := mambaSrcSlot(v)
	if err != nil {
		return StatePlan{}, err
	}
	if len(v.dstIdx) != len(v.srcIdx) {
		return StatePlan{}, errorf(stateField("decode_state_indices", v.i), "state indices count mismatch between prefill (%d) and decode (%d)", len(v.srcIdx), len(v.dstIdx))
	}
	dstSlot := int64(v.dstIdx[0])
	sp, err := v.newPlan(PathNIXLMamba)
	if err != nil {
		return sp, err
	}
	pairs, err := mambaPairs(v, t, true)
	if err != nil {
		return sp, err
	}
	sp.Plan.Copies = make([]Copy, 0, len(pairs))
	for _, p := range pairs {
		if p.Src >= len(v.srcLens) {
			return sp, errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Src, len(v.srcLens))
		}
		length := v.srcLens[p.Src]
		if length == 0 {
			continue
		}
		if p.Src >= len(v.srcPtrs) {
			return sp, errorf(stateField("prefill.state_ptrs", v.i), "no prefill tensor %d for decode tensor %d (have %d)", p.Src, p.Dst, len(v.srcPtrs))
		}
		if v.srcPtrs[p.Src] == 0 || v.dstPtrs[p.Dst] == 0 {
			continue
		}
		c, err := mambaWholeCopy(v, p, length, length, srcSlot, dstSlot)
		if err != nil {
			return sp, err
		}
		sp.Plan.Add(c)
	}
	return sp, nil
}

// mambaWholeCopy copies one whole slot of length bytes; the slot offsets
// use srcItem and dstItem.
func mambaWholeCopy(v *stateView, p EntryPair, srcItem, length uint64, srcSlot, dstSlot int64) (Copy, error) {
	so, err := slotOffset(stateField("prefill_state_indices", v.i), srcSlot, srcItem, 0)
	if err != nil {
		return Copy{}, err
	}
	do, err := slotOffset(stateField("decode_state_indices", v.i), dstSlot, srcItem, 0)
	if err != nil {
		return Copy{}, err
	}
	return Copy{SrcRegion: int32(p.Src), DstRegion: int32(p.Dst), SrcOff: so, DstOff: do, Len: length, Count: 1}, nil
}

// nixlMambaSlice reproduces the NIXL connector's _send_mamba_state_slice:
// without dims on both sides it degrades to the whole-slot copy; otherwise
// every tensor copies its TP slice (see MambaStateSliceBlocks), the prefill
// slot offset scaled by the prefill item length and the decode one by the
// decode item length.
func nixlMambaSlice(v *stateView, t StateTopology) (StatePlan, error) {
	srcSlot, err := mambaSrcSlot(v)
	if err != nil {
		return StatePlan{}, err
	}
	if len(v.srcDims) == 0 || len(v.dstDims) == 0 {
		return nixlMambaWhole(v, t)
	}
	sp, err := v.newPlan(PathNIXLMambaSlice)
	if err != nil {
		return sp, err
	}
	pairs, err := mambaPairs(v, t, true)
	if err != nil {
		return sp, err
	}
	sp.Plan.Copies = make([]Copy, 0, len(pairs))
	for _, p := range pairs {
		if p.Src >= len(v.srcLens) {
			return sp, errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Src, len(v.srcLens))
		}
		if p.Dst >= len(v.dstLens) {
			return sp, errorf(stateField("decode.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Dst, len(v.dstLens))
		}
		srcItem := v.srcLens[p.Src]
		if srcItem == 0 {
			continue
		}
		if p.Src >= len(v.srcPtrs) {
			return sp, errorf(stateField("prefill.state_ptrs", v.i), "no prefill tensor %d for decode tensor %d (have %d)", p.Src, p.Dst, len(v.srcPtrs))
		}
		if v.srcPtrs[p.Src] == 0 || v.dstPtrs[p.Dst] == 0 {
			continue
		}
		if len(v.dstIdx) == 0 {
			return sp, errorf(stateField("decode_state_indices", v.i), "missing decode Mamba state index")
		}
		if err = addMambaSliceCopies(&sp.Plan, v, t, p, srcSlot, int64(v.dstIdx[0])); err != nil {
			return sp, err
		}
	}
	return sp, nil
}

// moriMamba reproduces the MORI connector's _send_mamba_state: one index
// per side; whole-slot copies unless TP sizes differ and both sides publish
// dims, then TP slices.
func moriMamba(v *stateView, t StateTopology) (StatePlan, error) {
	if len(v.srcIdx) != 1 || len(v.dstIdx) != 1 {
		return StatePlan{}, errorf(stateField("decode_state_indices", v.i), "mamba requires a single state index, got src=%d, dst=%d", len(v.srcIdx), len(v.dstIdx))
	}
	srcSlot, dstSlot := int64(v.srcIdx[0]), int64(v.dstIdx[0])
	slice := t.tpMismatch() && len(v.srcDims) > 0 && len(v.dstDims) > 0
	path := PathMORIMamba
	if slice {
		path = PathMORIMambaSlice
	}
	sp, err := v.newPlan(path)
	if err != nil {
		return sp, err
	}
	pairs, err := mambaPairs(v, t, false)
	if err != nil {
		return sp, err
	}
	sp.Plan.Copies = make([]Copy, 0, len(pairs))
	for _, p := range pairs {
		if p.Src >= len(v.srcLens) {
			return sp, errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Src, len(v.srcLens))
		}
		srcItem := v.srcLens[p.Src]
		if !slice {
			if srcItem == 0 {
				continue
			}
			c, err := mambaWholeCopy(v, p, srcItem, srcItem, srcSlot, dstSlot)
			if err != nil {
				return sp, err
			}
			sp.Plan.Add(c)
			continue
		}
		if p.Dst >= len(v.dstLens) {
			return sp, errorf(stateField("decode.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Dst, len(v.dstLens))
		}
		if err = addMambaSliceCopies(&sp.Plan, v, t, p, srcSlot, dstSlot); err != nil {
			return sp, err
		}
	}
	return sp, nil
}

// addMambaSliceCopies adds the TP-slice copies of one tensor pair: one
// strided copy per logical block, repeated over the outer rows.
func addMambaSliceCopies(plan *Plan, v *stateView, t StateTopology, p EntryPair, srcSlot, dstSlot int64) error {
	if p.Src >= len(v.srcDims) {
		return errorf(stateField("prefill.state_dim_per_tensor", v.i), "no dim for tensor %d (have %d)", p.Src, len(v.srcDims))
	}
	if p.Dst >= len(v.dstDims) {
		return errorf(stateField("decode.state_dim_per_tensor", v.i), "no dim for tensor %d (have %d)", p.Dst, len(v.dstDims))
	}
	in := MambaSliceInput{
		SrcDim: v.srcDims[p.Src], DstDim: v.dstDims[p.Dst],
		SrcTPSize: t.PrefillTPSize, DstTPSize: t.DecodeTPSize,
		DstTPRank: t.DecodeTPRank % t.DecodeTPSize, LocalTPRank: t.PrefillTPRank % t.PrefillTPSize,
		ConvShardGroups: stateAt(v.srcConv, p.Src),
		SrcItemLen:      v.srcLens[p.Src], DstItemLen: v.dstLens[p.Dst],
		OuterCount: 1,
	}
	if p.Src < len(v.srcOuter) {
		in.OuterCount = v.srcOuter[p.Src]
	}
	srcBPD, dstBPD, err := mambaBytesPerDim(in)
	if err != nil {
		return err
	}
	var buf [4]MambaSliceBlock
	logical, err := appendMambaSliceBlocks(buf[:0], in)
	if err != nil {
		return err
	}
	srcField, dstField := stateField("prefill_state_indices", v.i), stateField("decode_state_indices", v.i)
	srcRow, ok1 := mul64(uint64(in.SrcDim), srcBPD)
	dstRow, ok2 := mul64(uint64(in.DstDim), dstBPD)
	if !ok1 || !ok2 {
		return errorf(stateField("prefill.state_dim_per_tensor", v.i), "row size overflows")
	}
	for _, b := range logical {
		srcDelta, ok1 := mul64(uint64(b.SrcDimStart), srcBPD)
		dstDelta, ok2 := mul64(uint64(b.DstDimStart), dstBPD)
		length, ok3 := mul64(uint64(b.NumDims), srcBPD)
		if !ok1 || !ok2 || !ok3 {
			return errorf(stateField("prefill.state_dim_per_tensor", v.i), "slice offsets overflow")
		}
		if length == 0 {
			continue
		}
		so, err := slotOffset(srcField, srcSlot, in.SrcItemLen, srcDelta)
		if err != nil {
			return err
		}
		do, err := slotOffset(dstField, dstSlot, in.DstItemLen, dstDelta)
		if err != nil {
			return err
		}
		c := Copy{SrcRegion: int32(p.Src), DstRegion: int32(p.Dst), SrcOff: so, DstOff: do, Len: length, Count: uint64(in.OuterCount)}
		if c.Count > 1 {
			c.SrcStride, c.DstStride = srcRow, dstRow
		}
		plan.Add(c)
	}
	return nil
}
