package planner

// Context-parallel (CP) page filtering on the prefill side: with attention
// CP, every CP rank holds the whole request's page list but sends only its
// contiguous share of it (SGLang's disaggregation/utils.py's _get_cp_rank_page_bounds and
// filter_kv_indices_for_cp_rank).

// CPRankPageBounds returns the half-open page range [start, end) that CP
// rank cpRank of cpSize owns among totalPages pages: an even split, the
// first totalPages%cpSize ranks taking one extra page.
func CPRankPageBounds(totalPages, cpRank, cpSize int) (start, end int, err error) {
	if cpSize <= 0 {
		return 0, 0, errorf("attn_cp_size", "must be positive, got %d", cpSize)
	}
	if cpRank < 0 || cpRank >= cpSize {
		return 0, 0, errorf("attn_cp_rank", "%d out of range for attn_cp_size %d", cpRank, cpSize)
	}
	if totalPages < 0 {
		return 0, 0, errorf("total_pages", "negative page count %d", totalPages)
	}
	base, rem := totalPages/cpSize, totalPages%cpSize
	start = cpRank*base + min(cpRank, rem)
	n := base
	if cpRank < rem {
		n++
	}
	return start, start + n, nil
}

// IndexSlice is a chunk's position in the request's page list: pages
// [Start, Stop) of it. It mirrors SGLang's disaggregation/utils.py's index_slice.
type IndexSlice struct {
	Start, Stop int
}

// FilterKVIndicesForCPRank keeps the part of one chunk that this CP rank
// owns. kvIndices are the chunk's pages, chunk its position in the
// request's page list and totalPages the request's page count. It returns a
// sub-slice of kvIndices (no copy) and its position. With cpSize <= 1 the
// chunk is returned unchanged. A chunk outside the rank's share comes back
// empty, positioned at chunk.Start.
func FilterKVIndicesForCPRank(kvIndices []int32, chunk IndexSlice, totalPages, cpRank, cpSize int) ([]int32, IndexSlice, error) {
	if cpSize <= 1 {
		return kvIndices, chunk, nil
	}
	if chunk.Start < 0 || chunk.Stop < 0 {
		return nil, IndexSlice{}, errorf("index_slice", "negative bounds [%d, %d)", chunk.Start, chunk.Stop)
	}
	rankStart, rankEnd, err := CPRankPageBounds(totalPages, cpRank, cpSize)
	if err != nil {
		return nil, IndexSlice{}, err
	}
	first := max(rankStart, chunk.Start) - chunk.Start
	last := min(rankEnd, chunk.Stop) - chunk.Start
	if last <= first {
		return kvIndices[:0], IndexSlice{Start: chunk.Start, Stop: chunk.Start}, nil
	}
	// Python slicing clamps to the list; the reported position does not.
	lo, hi := pyRange(len(kvIndices), first, last)
	return kvIndices[lo:hi], IndexSlice{Start: chunk.Start + first, Stop: chunk.Start + last}, nil
}
