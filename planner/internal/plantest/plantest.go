// Package plantest holds the byte-range helpers that the tests of planner
// and planner/planjson share: plans compare as the plain byte moves they
// describe, however they are cut.
package plantest

import (
	"cmp"
	"slices"
)

// Block is one plain (src, dst, len) byte range move.
type Block struct{ Src, Dst, Len uint64 }

// Blocks collects the blocks forEach yields (a planner.Plan's
// ForEachBlock), in order.
func Blocks(forEach func(fn func(src, dst, length uint64) bool) bool) []Block {
	var out []Block
	forEach(func(s, d, l uint64) bool {
		out = append(out, Block{Src: s, Dst: d, Len: l})
		return true
	})
	return out
}

// Canonical sorts blocks and merges those adjacent on both sides, so two
// descriptions of the same byte moves compare equal however they are cut.
func Canonical(in []Block) []Block {
	bs := slices.Clone(in)
	slices.SortFunc(bs, func(a, b Block) int {
		return cmp.Or(cmp.Compare(a.Src, b.Src), cmp.Compare(a.Dst, b.Dst))
	})
	return MergeAdjacent(bs)
}

// MergeAdjacent merges consecutive blocks that continue each other on both
// sides, keeping order.
func MergeAdjacent(bs []Block) []Block {
	var out []Block
	for _, b := range bs {
		if n := len(out); n > 0 && out[n-1].Src+out[n-1].Len == b.Src && out[n-1].Dst+out[n-1].Len == b.Dst {
			out[n-1].Len += b.Len
			continue
		}
		out = append(out, b)
	}
	return out
}
