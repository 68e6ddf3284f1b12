package planner

// Mamba (linear-attention) state: one slot per request, holding per-layer
// tensors such as conv_state [slot, dim/tp, kernel-1] and temporal_state
// [slot, heads/tp, head_dim, state]. The TP-sharded axis is the one after
// the slot, so when prefill and decode attention TP sizes differ the sender
// copies a slice of every tensor instead of the whole slot (SGLang's disaggregation/utils.py's
// compute_mamba_state_slice_blocks / compute_mamba_state_slice_byte_blocks
// and the connectors' _send_mamba_state / _send_mamba_state_slice).

// MambaSliceBlock is one logical slice of a Mamba state slot, in units of
// the TP-sharded dimension: NumDims dims starting at SrcDimStart in the
// prefill slot land at DstDimStart in the decode slot.
type MambaSliceBlock struct {
	SrcDimStart, DstDimStart, NumDims int
}

// MambaSliceInput describes one tensor's slicing between the two TP sizes.
type MambaSliceInput struct {
	SrcDim, DstDim int // dims of the sharded axis per rank (state_dim_per_tensor)
	SrcTPSize      int // prefill attn_tp_size
	DstTPSize      int // decode attn_tp_size
	DstTPRank      int // decode rank within its attention TP group
	LocalTPRank    int // prefill rank within its attention TP group
	// ConvShardGroups are the full (unsharded) dims of the independently
	// head-sharded sub-blocks of a GDN conv_state ([q | k | v]); nil for
	// single-axis tensors. They apply only when they add up to
	// SrcDim*SrcTPSize.
	ConvShardGroups []int
	// For the byte version: bytes per slot on each side and the number of
	// outer rows (Kimi conv state is [K-1, dim]; 1 for the usual layout).
	SrcItemLen, DstItemLen uint64
	OuterCount             int
}

// MambaStateSliceBlocks returns the logical blocks to copy for one tensor
// (SGLang's disaggregation/utils.py's compute_mamba_state_slice_blocks).
//
// Aggregation (prefill TP > decode TP): several prefill ranks each write
// their whole shard into one decode slot, at their writer index. Scatter
// (prefill TP < decode TP): each decode rank takes its sub-range of the
// prefill shard. A conv_state with shard groups is sliced per sub-block in
// both directions, so q, k and v stay grouped on the decode side.
func MambaStateSliceBlocks(in MambaSliceInput) ([]MambaSliceBlock, error) {
	var buf [4]MambaSliceBlock
	blocks, err := appendMambaSliceBlocks(buf[:0], in)
	if err != nil {
		return nil, err
	}
	return append([]MambaSliceBlock(nil), blocks...), nil
}

func appendMambaSliceBlocks(out []MambaSliceBlock, in MambaSliceInput) ([]MambaSliceBlock, error) {
	if in.SrcTPSize <= 0 || in.DstTPSize <= 0 {
		return nil, errorf("tp_size", "attention TP sizes must be positive (prefill %d, decode %d)", in.SrcTPSize, in.DstTPSize)
	}
	if in.SrcDim < 0 || in.DstDim < 0 || in.DstTPRank < 0 || in.LocalTPRank < 0 {
		return nil, errorf("state_dim_per_tensor", "negative dim or rank (src_dim %d, dst_dim %d, dst rank %d, local rank %d)", in.SrcDim, in.DstDim, in.DstTPRank, in.LocalTPRank)
	}
	useSubdims := false
	if in.ConvShardGroups != nil {
		sum := 0
		for _, g := range in.ConvShardGroups {
			if g < 0 {
				return nil, errorf("state_conv_shard_groups", "negative group dim %d", g)
			}
			sum += g
		}
		useSubdims = sum == in.SrcDim*in.SrcTPSize
	}

	if in.SrcTPSize > in.DstTPSize {
		writer := in.LocalTPRank % (in.SrcTPSize / in.DstTPSize)
		if !useSubdims {
			return append(out, MambaSliceBlock{0, writer * in.SrcDim, in.SrcDim}), nil
		}
		srcOff, dstOff := 0, 0
		for _, full := range in.ConvShardGroups {
			srcSub, dstSub := full/in.SrcTPSize, full/in.DstTPSize
			out = append(out, MambaSliceBlock{srcOff, dstOff + writer*srcSub, srcSub})
			srcOff += srcSub
			dstOff += dstSub
		}
		return out, nil
	}

	if !useSubdims {
		if in.SrcDim == 0 {
			return nil, errorf("state_dim_per_tensor", "prefill state dim is 0")
		}
		return append(out, MambaSliceBlock{(in.DstTPRank * in.DstDim) % in.SrcDim, 0, in.DstDim}), nil
	}
	srcOff, dstOff := 0, 0
	for _, full := range in.ConvShardGroups {
		srcSub, dstSub := full/in.SrcTPSize, full/in.DstTPSize
		if srcSub == 0 {
			return nil, errorf("state_conv_shard_groups", "group of %d dims has no dims per prefill rank at TP %d", full, in.SrcTPSize)
		}
		out = append(out, MambaSliceBlock{srcOff + (in.DstTPRank*dstSub)%srcSub, dstOff, dstSub})
		srcOff += srcSub
		dstOff += dstSub
	}
	return out, nil
}

// MambaByteBlock is one physical copy inside a state slot: Len bytes at
// byte SrcOff of the prefill slot go to byte DstOff of the decode slot.
type MambaByteBlock struct {
	SrcOff, DstOff, Len uint64
}

// mambaBytesPerDim returns the bytes per dim of the sharded axis on both
// sides: item_len // (dim * outer_count).
func mambaBytesPerDim(in MambaSliceInput) (src, dst uint64, err error) {
	if in.OuterCount <= 0 {
		return 0, 0, errorf("state_slice_outer_counts", "must be positive, got %d", in.OuterCount)
	}
	if in.SrcDim <= 0 || in.DstDim <= 0 {
		return 0, 0, errorf("state_dim_per_tensor", "dims must be positive (src %d, dst %d)", in.SrcDim, in.DstDim)
	}
	srcDiv, ok1 := mul64(uint64(in.SrcDim), uint64(in.OuterCount))
	dstDiv, ok2 := mul64(uint64(in.DstDim), uint64(in.OuterCount))
	if !ok1 || !ok2 {
		// Such a slot would hold more dims than bytes: nothing to slice.
		return 0, 0, nil
	}
	return in.SrcItemLen / srcDiv, in.DstItemLen / dstDiv, nil
}

// maxMambaOuterRows bounds the block list of MambaStateSliceByteBlocks
// (real states have a handful of rows, e.g. conv kernel - 1).
const maxMambaOuterRows = 1 << 16

// MambaStateSliceByteBlocks converts the logical blocks of one tensor into
// byte blocks of one slot (SGLang's disaggregation/utils.py's
// compute_mamba_state_slice_byte_blocks): one block per logical block per
// outer row, rows outermost. Copy lengths use the prefill bytes per dim.
func MambaStateSliceByteBlocks(in MambaSliceInput) ([]MambaByteBlock, error) {
	srcBPD, dstBPD, err := mambaBytesPerDim(in)
	if err != nil {
		return nil, err
	}
	var buf [4]MambaSliceBlock
	logical, err := appendMambaSliceBlocks(buf[:0], in)
	if err != nil {
		return nil, err
	}
	if in.OuterCount > maxMambaOuterRows {
		return nil, errorf("state_slice_outer_counts", "%d outer rows: at most %d listed block by block (plans stride over them)", in.OuterCount, maxMambaOuterRows)
	}
	out := make([]MambaByteBlock, 0, in.OuterCount*len(logical))
	for row := 0; row < in.OuterCount; row++ {
		srcRow := uint64(row) * uint64(in.SrcDim) * srcBPD
		dstRow := uint64(row) * uint64(in.DstDim) * dstBPD
		for _, b := range logical {
			out = append(out, MambaByteBlock{
				SrcOff: srcRow + uint64(b.SrcDimStart)*srcBPD,
				DstOff: dstRow + uint64(b.DstDimStart)*dstBPD,
				Len:    uint64(b.NumDims) * srcBPD,
			})
		}
	}
	return out, nil
}
