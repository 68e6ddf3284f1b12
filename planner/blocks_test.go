package planner

import "slices"

// The byte-range helpers of the planner's tests (planjson's tests keep
// their own copy).

// block is one plain (src, dst, len) byte range move.
type block struct{ Src, Dst, Len uint64 }

// canonical sorts blocks and merges those adjacent on both sides, so two
// descriptions of the same byte moves compare equal however they are cut.
func canonical(in []block) []block {
	bs := slices.Clone(in)
	slices.SortFunc(bs, func(a, b block) int {
		if a.Src != b.Src {
			if a.Src < b.Src {
				return -1
			}
			return 1
		}
		switch {
		case a.Dst < b.Dst:
			return -1
		case a.Dst > b.Dst:
			return 1
		}
		return 0
	})
	var out []block
	for _, b := range bs {
		if n := len(out); n > 0 && out[n-1].Src+out[n-1].Len == b.Src && out[n-1].Dst+out[n-1].Len == b.Dst {
			out[n-1].Len += b.Len
			continue
		}
		out = append(out, b)
	}
	return out
}

// planBlocks expands a plan (or one part of it) into blocks.
func planBlocks(p *Plan, part int) []block {
	q := *p
	if part >= 0 && len(p.Parts) > 0 {
		pt := p.Parts[part]
		q.Copies = p.Copies[pt.Start:pt.End]
		q.Parts = nil
	}
	var out []block
	q.ForEachBlock(func(s, d, l uint64) bool {
		out = append(out, block{s, d, l})
		return true
	})
	return out
}
