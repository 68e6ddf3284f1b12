package planner

// DSA kpool-compress tail: DeepSeek sparse attention compresses the index
// K cache in groups of pool_size tokens; the not-yet-compressed tail of a
// request lives in a per-request ring of tail_size slots (pool_size plus
// extra speculative slots, which prefill and decode may size differently).
// A 6-tuple describes the live tail tokens of one request on one side:
//
//	(request row, first segment offset, first segment length,
//	 second segment offset (0), second segment length, ring size)
//
// The transfer re-packs the live tokens from the prefill ring into the
// decode ring segment by segment (SGLang's disaggregation/utils.py's get_dsa_tail_state_indices,
// slice_dsa_tail_dst_ptrs_for_pp and build_dsa_tail_transfer_blocks).

// DSATailPool is what a side's pool says about its tail ring.
type DSATailPool struct {
	KPoolUseCompress bool // kpool_use_compress; false means no tail to send
	PoolSize         int  // index_kpool: tokens per compression group
	TailExtraSlots   int  // tail_extra_slots (speculative decoding)
}

// pyMod is Python's modulo for b > 0: the result has b's sign.
func pyMod(a, b int) int {
	m := a % b
	if m < 0 {
		m += b
	}
	return m
}

// DSATailStateIndices returns the 6-tuple of a request's live tail tokens
// (SGLang's disaggregation/utils.py's get_dsa_tail_state_indices), or nil when the pool does
// not compress or no token is pending.
func DSATailStateIndices(pool DSATailPool, reqPoolIdx, seqLen int) ([]int, error) {
	if !pool.KPoolUseCompress {
		return nil, nil
	}
	poolSize := pool.PoolSize
	tailSize := poolSize + pool.TailExtraSlots
	if poolSize <= 1 || tailSize < poolSize {
		return nil, errorf("index_kpool", "DSA kpool-compress requires pool_size > 1 and tail_size >= pool_size, got pool_size=%d, tail_size=%d", poolSize, tailSize)
	}
	nValid := pyMod(seqLen, poolSize)
	if nValid == 0 {
		return nil, nil
	}
	startPhys := pyMod(seqLen-nValid, tailSize)
	firstN := min(nValid, tailSize-startPhys)
	return []int{reqPoolIdx, startPhys, firstN, 0, nValid - firstN, tailSize}, nil
}

// SliceDSATailDstForPP returns the decode tail buffers (indices into the
// decode list) that pair with a PP stage's tail buffers: both lists are
// [key per layer..., score per layer...]; a stage with layers
// [startLayer, startLayer+n) takes those layers of both halves. Equal list
// lengths pair positionally. hasEnd/endLayer is the stage's end layer when
// known (it only confirms the range).
func SliceDSATailDstForPP(nSrc, nDst, startLayer, endLayer int, hasEnd bool) ([]int, error) {
	if nSrc < 0 || nDst < 0 || nSrc > maxEntries || nDst > maxEntries {
		return nil, errorf("dsa_tail_ptrs", "pointer counts out of range (src %d, dst %d)", nSrc, nDst)
	}
	if nSrc == nDst {
		return rankSeq(nDst), nil
	}
	if nSrc%2 != 0 || nDst%2 != 0 {
		return nil, errorf("dsa_tail_ptrs", "DSA tail pointer lists must contain equal key/score halves, got src=%d, dst=%d", nSrc, nDst)
	}
	srcLayers, dstLayers := nSrc/2, nDst/2
	expectedEnd := startLayer + srcLayers
	if hasEnd && endLayer-startLayer == srcLayers {
		expectedEnd = endLayer
	}
	if startLayer < 0 || expectedEnd > dstLayers {
		return nil, errorf("start_layer", "DSA tail pointer count mismatch: src=%d, dst=%d, prefill_layers=[%d, %d)", nSrc, nDst, startLayer, expectedEnd)
	}
	out := make([]int, 0, 2*(expectedEnd-startLayer))
	for l := startLayer; l < expectedEnd; l++ {
		out = append(out, l)
	}
	for l := startLayer; l < expectedEnd; l++ {
		out = append(out, dstLayers+l)
	}
	return out, nil
}

// DSATailBuffers is one side's DSA tail registration: one ring row of
// ItemLens[i] bytes per request row in tensor i.
type DSATailBuffers struct {
	Ptrs     []uint64
	DataLens []uint64 // region lengths; nil = unknown
	ItemLens []uint64 // bytes per request row (ring size x slot bytes)
}

// PathDSATail is the plan path of PlanDSATail.
const PathDSATail = "dsa-tail"

// PlanDSATail plans the DSA tail remap (SGLang's disaggregation/utils.py's
// build_dsa_tail_transfer_blocks) from prefill tail tensors to the decode
// tensors dstSel selects (SliceDSATailDstForPP; nil selects all, in
// order). Empty index tuples on both sides move nothing; otherwise both
// must be 6-tuples with positive ring sizes, in-ring segments and the same
// live-token count, and every tensor pair the same slot size. Decode item
// lengths default to the prefill's when dst.ItemLens is empty.
func PlanDSATail(src, dst DSATailBuffers, dstSel []int, srcIndices, dstIndices []int) (*Plan, error) {
	s, err := regionTable("prefill.dsa_tail_data_lens", src.Ptrs, src.DataLens, VRAM)
	if err != nil {
		return nil, err
	}
	d, err := regionTable("decode.dsa_tail_data_lens", dst.Ptrs, dst.DataLens, VRAM)
	if err != nil {
		return nil, err
	}
	plan := &Plan{Path: PathDSATail, Src: s, Dst: d}
	if len(srcIndices) == 0 && len(dstIndices) == 0 {
		return plan, nil
	}
	if len(srcIndices) == 0 || len(dstIndices) == 0 {
		return nil, errorf("dsa_tail_indices", "DSA tail slot index missing: src=%v, dst=%v", srcIndices, dstIndices)
	}
	if len(srcIndices) != 6 || len(dstIndices) != 6 {
		return nil, errorf("dsa_tail_indices", "DSA tail slot indices must be 6-tuples, got src=%v, dst=%v", srcIndices, dstIndices)
	}
	if dstSel == nil {
		dstSel = rankSeq(len(dst.Ptrs))
	}
	for _, j := range dstSel {
		if j < 0 || j >= len(dst.Ptrs) {
			return nil, errorf("decode.dsa_tail_ptrs", "selected tail tensor %d out of range (have %d)", j, len(dst.Ptrs))
		}
	}
	// Decode item lengths are looked up per selected tensor; SGLang's disaggregation/{nixl,mori}/conn.py
	// receives them already sliced alongside the pointers.
	dstItems := func(k int) uint64 {
		if len(dst.ItemLens) == 0 {
			return src.ItemLens[k]
		}
		return dst.ItemLens[dstSel[k]]
	}
	if len(dst.ItemLens) != 0 && len(dst.ItemLens) != len(dst.Ptrs) {
		return nil, errorf("decode.dsa_tail_item_lens", "%d item lengths for %d tail tensors", len(dst.ItemLens), len(dst.Ptrs))
	}
	if len(src.Ptrs) != len(dstSel) || len(src.ItemLens) != len(src.Ptrs) {
		return nil, errorf("dsa_tail_ptrs", "DSA tail pointer metadata mismatch: src_ptrs=%d, dst_ptrs=%d, src_item_lens=%d", len(src.Ptrs), len(dstSel), len(src.ItemLens))
	}
	srcTail, dstTail := srcIndices[5], dstIndices[5]
	if srcTail <= 0 || dstTail <= 0 {
		return nil, errorf("dsa_tail_indices", "DSA tail ring sizes must be positive: src=%d, dst=%d", srcTail, dstTail)
	}
	var srcSegs, dstSegs [2][2]int
	ns, err := dsaTailSegments(&srcSegs, srcIndices, srcTail, "source")
	if err != nil {
		return nil, err
	}
	nd, err := dsaTailSegments(&dstSegs, dstIndices, dstTail, "destination")
	if err != nil {
		return nil, err
	}
	srcCount, dstCount := 0, 0
	for _, sg := range srcSegs[:ns] {
		srcCount += sg[1]
	}
	for _, sg := range dstSegs[:nd] {
		dstCount += sg[1]
	}
	if srcCount != dstCount {
		return nil, errorf("dsa_tail_indices", "DSA tail live-token count mismatch: src=%d, dst=%d", srcCount, dstCount)
	}
	srcRow, dstRow := srcIndices[0], dstIndices[0]
	if srcRow < 0 || dstRow < 0 {
		return nil, errorf("dsa_tail_indices", "DSA tail request row indices must be non-negative")
	}

	plan.Copies = make([]Copy, 0, 3*len(src.Ptrs))
	for k := range src.Ptrs {
		srcBytes, dstBytes := src.ItemLens[k], dstItems(k)
		if srcBytes == 0 && dstBytes == 0 {
			continue
		}
		if srcBytes == 0 || srcBytes%uint64(srcTail) != 0 {
			return nil, errorf("prefill.dsa_tail_item_lens", "DSA source tail row size %d is not divisible by %d", srcBytes, srcTail)
		}
		if dstBytes == 0 || dstBytes%uint64(dstTail) != 0 {
			return nil, errorf("decode.dsa_tail_item_lens", "DSA destination tail row size %d is not divisible by %d", dstBytes, dstTail)
		}
		slot := srcBytes / uint64(srcTail)
		if dstSlot := dstBytes / uint64(dstTail); dstSlot != slot {
			return nil, errorf("decode.dsa_tail_item_lens", "DSA tail slot-size mismatch: src=%d, dst=%d", slot, dstSlot)
		}
		// Check that the whole row fits the address arithmetic; the
		// segment offsets below stay inside it.
		srcEnd, err := slotOffset(namedField("dsa_tail_indices"), int64(srcRow), srcBytes, srcBytes)
		if err != nil {
			return nil, err
		}
		dstEnd, err := slotOffset(namedField("dsa_tail_indices"), int64(dstRow), dstBytes, dstBytes)
		if err != nil {
			return nil, err
		}
		srcBase, dstBase := srcEnd-srcBytes, dstEnd-dstBytes
		si, di, sUsed, dUsed := 0, 0, 0, 0
		for si < ns {
			n := min(srcSegs[si][1]-sUsed, dstSegs[di][1]-dUsed)
			plan.ReferenceDescriptors++
			plan.Add(Copy{
				SrcRegion: int32(k), DstRegion: int32(dstSel[k]),
				SrcOff: srcBase + uint64(srcSegs[si][0]+sUsed)*slot,
				DstOff: dstBase + uint64(dstSegs[di][0]+dUsed)*slot,
				Len:    uint64(n) * slot, Count: 1,
			})
			sUsed += n
			dUsed += n
			if sUsed == srcSegs[si][1] {
				si, sUsed = si+1, 0
			}
			if dUsed == dstSegs[di][1] {
				di, dUsed = di+1, 0
			}
		}
	}
	if err := checkPlanBounds(plan, namedField("prefill.dsa_tail_data_lens"), namedField("decode.dsa_tail_data_lens")); err != nil {
		return nil, err
	}
	return plan, nil
}

// dsaTailSegments parses the two (offset, length) segments of a 6-tuple,
// keeping the non-empty ones, and returns how many it kept.
func dsaTailSegments(out *[2][2]int, idx []int, tail int, side string) (int, error) {
	n := 0
	for seg := 1; seg <= 2; seg++ {
		off, cnt := idx[seg*2-1], idx[seg*2]
		if off < 0 || cnt < 0 {
			return 0, errorf("dsa_tail_indices", "DSA tail %s offsets and lengths must be non-negative", side)
		}
		if off > tail-cnt {
			return 0, errorf("dsa_tail_indices", "DSA tail %s segment %d exceeds ring size %d: (%d, %d)", side, seg, tail, off, cnt)
		}
		if cnt > 0 {
			out[n] = [2]int{off, cnt}
			n++
		}
	}
	return n, nil
}
