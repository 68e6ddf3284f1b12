package push

import (
	"sync/atomic"

	"github.com/kvhost/kvhost/planner"
)

// PlanCalls counts the KV planner calls of a Prefill's decode peers.
type PlanCalls struct {
	Plans   atomic.Int64 // strided plans (kvPlanner.Plan)
	Indices atomic.Int64 // prepped index plans (kvIndexer.Indices), one per part
}

// CountPlans wraps the KV planners of every decode peer registered on m
// so far and returns the calls they get from now on. Call it after the
// peers registered and before their rooms send (workers read a peer's
// planners after taking m.mu).
func CountPlans(m *Prefill) *PlanCalls {
	n := &PlanCalls{}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.peers {
		if p == nil {
			continue
		}
		p.kv = countingKV{p.kv, n}
		if p.nixl != nil {
			p.nixl = countingIndexer{p.nixl, n}
		}
	}
	return n
}

type countingKV struct {
	kvPlanner
	n *PlanCalls
}

func (c countingKV) Plan(p *planner.Plan, prefillPages, decodePages []int32) error {
	c.n.Plans.Add(1)
	return c.kvPlanner.Plan(p, prefillPages, decodePages)
}

type countingIndexer struct {
	kvIndexer
	n *PlanCalls
}

func (c countingIndexer) Indices(pk *planner.PreppedKV, part int, srcIdx, dstIdx []int32, prefillPages, decodePages []int32) ([]int32, []int32, error) {
	c.n.Indices.Add(1)
	return c.kvIndexer.Indices(pk, part, srcIdx, dstIdx, prefillPages, decodePages)
}
