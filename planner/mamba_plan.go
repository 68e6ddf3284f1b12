package planner

// Mamba components of a StatePlanner. A Mamba component has one slot index
// per side; every tensor of the component copies that slot, whole or
// TP-sliced. The copies relative to the slots are resolved once per peer;
// a request only adds its slot offsets.

// mambaPairs returns the tensor pairing: by layer id when published, else
// positional over the decode tensors (NIXL iterates the decode list) or
// the prefill tensors (MORI iterates its own list, and a missing decode
// tensor is an error there).
func mambaPairs(v *stateView, t StateTopology, overDst bool) ([]EntryPair, error) {
	pairs, ok, err := statePairs(v, t)
	if err != nil || ok {
		return pairs, err
	}
	n := len(v.srcPtrs)
	if overDst {
		// A missing prefill tensor is reported when it is reached: the
		// reference skips zero-length tensors before looking it up.
		n = len(v.dstPtrs)
	} else if len(v.dstPtrs) < n {
		return nil, errorf(stateField("decode.state_ptrs", v.i), "decode registers %d Mamba state tensors, prefill %d", len(v.dstPtrs), n)
	}
	pairs = make([]EntryPair, n)
	for i := range pairs {
		pairs[i] = EntryPair{Src: i, Dst: i}
	}
	return pairs, nil
}

// resolveMamba resolves a Mamba component: TP-sliced copies when TP sizes
// differ and both sides publish dims, else whole-slot copies.
func (c *stateComp) resolveMamba(v *stateView, t StateTopology, nixl bool) {
	c.kind = kindMamba
	slice := t.tpMismatch() && len(v.srcDims) > 0 && len(v.dstDims) > 0
	switch {
	case slice && nixl:
		c.path = PathNIXLMambaSlice
	case slice:
		c.path = PathMORIMambaSlice
	case nixl:
		c.path = PathNIXLMamba
	default:
		c.path = PathMORIMamba
	}
	if slice {
		c.resolveMambaSlice(v, t, nixl)
	} else {
		c.resolveMambaWhole(v, t, nixl)
	}
}

// eachMambaMove calls fn, in the connectors' order, for every tensor pair
// of the component that moves, after their per-tensor checks: a tensor
// without an item length (prefill's; with dstLens, decode's too) is an
// error; NIXL skips a tensor with a zero prefill length or a null pointer
// on either side, and a missing prefill tensor is an error once reached.
// The first error, of a check or of fn, is recorded and ends the loop.
func (c *stateComp) eachMambaMove(v *stateView, t StateTopology, nixl, dstLens bool, fn func(EntryPair) error) {
	pairs, err := mambaPairs(v, t, nixl)
	if err != nil {
		c.setErr(err)
		return
	}
	for _, p := range pairs {
		if p.Src >= len(v.srcLens) {
			c.setErr(errorf(stateField("prefill.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Src, len(v.srcLens)))
			return
		}
		if dstLens && p.Dst >= len(v.dstLens) {
			c.setErr(errorf(stateField("decode.state_item_lens", v.i), "no item length for tensor %d (have %d)", p.Dst, len(v.dstLens)))
			return
		}
		if nixl {
			if v.srcLens[p.Src] == 0 {
				continue
			}
			if p.Src >= len(v.srcPtrs) {
				c.setErr(errorf(stateField("prefill.state_ptrs", v.i), "no prefill tensor %d for decode tensor %d (have %d)", p.Src, p.Dst, len(v.srcPtrs)))
				return
			}
			if v.srcPtrs[p.Src] == 0 || v.dstPtrs[p.Dst] == 0 {
				continue
			}
		}
		if err := fn(p); err != nil {
			c.setErr(err)
			return
		}
	}
}

// resolveMambaWhole resolves whole-slot copies (the connectors'
// _send_mamba_state): each tensor copies the prefill item length from slot
// to slot, both offsets scaled by the prefill item length.
func (c *stateComp) resolveMambaWhole(v *stateView, t StateTopology, nixl bool) {
	c.eachMambaMove(v, t, nixl, false, func(p EntryPair) error {
		c.refDescs++
		if length := v.srcLens[p.Src]; length > 0 {
			c.mamba = append(c.mamba, mambaCopy{src: int32(p.Src), dst: int32(p.Dst), srcItem: length, dstItem: length, length: length, count: 1})
		}
		return nil
	})
}

// resolveMambaSlice resolves TP-slice copies (the connectors'
// _send_mamba_state_slice, with compute_mamba_state_slice_byte_blocks):
// one strided copy per logical block of each tensor, over its outer rows;
// the prefill slot offset is scaled by the prefill item length and the
// decode one by the decode item length.
func (c *stateComp) resolveMambaSlice(v *stateView, t StateTopology, nixl bool) {
	c.eachMambaMove(v, t, nixl, true, func(p EntryPair) error {
		if nixl {
			c.mambaActive = true
		}
		return c.addMambaSlice(v, t, p)
	})
}

// addMambaSlice records the slice copies of one tensor pair.
func (c *stateComp) addMambaSlice(v *stateView, t StateTopology, p EntryPair) error {
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
	srcRow, ok1 := mul64(uint64(in.SrcDim), srcBPD)
	dstRow, ok2 := mul64(uint64(in.DstDim), dstBPD)
	if !ok1 || !ok2 {
		return errorf(stateField("prefill.state_dim_per_tensor", v.i), "row size overflows")
	}
	for _, b := range logical {
		c.refDescs += uint64(in.OuterCount)
		srcDelta, ok1 := mul64(uint64(b.SrcDimStart), srcBPD)
		dstDelta, ok2 := mul64(uint64(b.DstDimStart), dstBPD)
		length, ok3 := mul64(uint64(b.NumDims), srcBPD)
		if !ok1 || !ok2 || !ok3 {
			return errorf(stateField("prefill.state_dim_per_tensor", v.i), "slice offsets overflow")
		}
		if length == 0 {
			continue
		}
		mc := mambaCopy{src: int32(p.Src), dst: int32(p.Dst), srcItem: in.SrcItemLen, dstItem: in.DstItemLen,
			srcDelta: srcDelta, dstDelta: dstDelta, length: length, count: uint64(in.OuterCount)}
		if mc.count > 1 {
			mc.srcStride, mc.dstStride = srcRow, dstRow
		}
		c.mamba = append(c.mamba, mc)
	}
	return nil
}

// planMamba places one request's slots. NIXL wants exactly one prefill
// slot and, for whole-slot copies, as many decode slots; the slice path
// only reads the first decode slot (and only if some tensor moves). MORI
// wants exactly one slot on each side.
func (c *stateComp) planMamba(p *Plan, si, di []int32, nixl bool) error {
	switch {
	case nixl && len(si) != 1:
		return errorf(stateField("prefill_state_indices", c.i), "Mamba should have a single state index, got %d", len(si))
	case nixl && c.path == PathNIXLMamba && len(di) != len(si):
		return errorf(stateField("decode_state_indices", c.i), "state indices count mismatch between prefill (%d) and decode (%d)", len(si), len(di))
	case !nixl && (len(si) != 1 || len(di) != 1):
		return errorf(stateField("decode_state_indices", c.i), "mamba requires a single state index, got src=%d, dst=%d", len(si), len(di))
	}
	if c.err != nil {
		return c.err
	}
	if c.mambaActive && len(di) == 0 {
		return errorf(stateField("decode_state_indices", c.i), "missing decode Mamba state index")
	}
	p.ReferenceDescriptors = c.refDescs
	if len(c.mamba) == 0 {
		return nil
	}
	srcSlot, dstSlot := int64(si[0]), int64(di[0])
	for _, m := range c.mamba {
		so, err := slotOffset(fieldRef{"prefill_state_indices", c.i}, srcSlot, m.srcItem, m.srcDelta)
		if err != nil {
			return err
		}
		do, err := slotOffset(fieldRef{"decode_state_indices", c.i}, dstSlot, m.dstItem, m.dstDelta)
		if err != nil {
			return err
		}
		p.Add(Copy{SrcRegion: m.src, DstRegion: m.dst, SrcOff: so, DstOff: do, Len: m.length,
			SrcStride: m.srcStride, DstStride: m.dstStride, Count: m.count})
	}
	return nil
}
