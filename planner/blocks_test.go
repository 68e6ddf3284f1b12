package planner

import "github.com/kvhost/kvhost/planner/internal/plantest"

// The byte-range helpers of the planner's tests, shared with planjson's
// through planner/internal/plantest.

type block = plantest.Block

var (
	canonical     = plantest.Canonical
	mergeAdjacent = plantest.MergeAdjacent
)

// planBlocks expands a plan (or one part of it) into blocks.
func planBlocks(p *Plan, part int) []block {
	q := *p
	if part >= 0 && len(p.Parts) > 0 {
		pt := p.Parts[part]
		q.Copies = p.Copies[pt.Start:pt.End]
		q.Parts = nil
	}
	return plantest.Blocks(q.ForEachBlock)
}
