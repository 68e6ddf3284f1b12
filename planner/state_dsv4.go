package planner

// State indices of DeepSeek V4 compressor state (SGLang's disaggregation/{nixl,mori}/conn.py's
// get_dsv4_c4_state_indices and get_dsv4_c128_state_indices). Each side
// computes its own indices from the request's pool row and sequence length;
// they then travel as the component's state indices.

// DSV4C4StateIndices returns the physical rows of the live C4 compressor
// history: the last seqLen%4+4 token positions, each at
// reqPoolIdx*ringSize + position%ringSize. Prefill and decode may use
// different ring sizes, so rows pair by position. ringSize must be a
// multiple of 4 and at least 8. A negative seqLen counts as 0.
func DSV4C4StateIndices(reqPoolIdx, seqLen, ringSize int) ([]int32, error) {
	if ringSize < 8 || ringSize%4 != 0 {
		return nil, errorf("ring_size", "C4 ring_size must be a multiple of 4 and at least 8, got %d", ringSize)
	}
	seqLen = max(0, seqLen)
	stateLen := seqLen%4 + 4
	first := max(0, seqLen-stateLen)
	out := make([]int32, 0, seqLen-first)
	for pos := first; pos < seqLen; pos++ {
		// SGLang's disaggregation/{nixl,mori}/conn.py computes in int64 and casts to int32 (wrapping).
		out = append(out, int32(int64(reqPoolIdx)*int64(ringSize)+int64(pos%ringSize)))
	}
	return out, nil
}

// DSV4C128StateIndices returns the C128 state row or page of a request:
// none when seqLen is 0 or a multiple of 128 (nothing pending); the pool
// row itself for online C128 state; otherwise the ring page holding token
// seqLen-1, with ringSize/128 pages per request. ringSize must be a
// positive multiple of 128 in the offline case.
func DSV4C128StateIndices(reqPoolIdx, seqLen int, online bool, ringSize int) ([]int32, error) {
	if seqLen == 0 || pyMod(seqLen, 128) == 0 {
		return []int32{}, nil
	}
	if online {
		return []int32{int32(reqPoolIdx)}, nil
	}
	if ringSize <= 0 || ringSize%128 != 0 {
		return nil, errorf("ring_size", "C128 ring_size must be 128-aligned, got %d", ringSize)
	}
	pagesPerReq := ringSize / 128
	page := reqPoolIdx*pagesPerReq + pyMod(seqLen-1, ringSize)/128
	return []int32{int32(page)}, nil
}
