package push

import (
	"fmt"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/planner"
)

// batch turns planner copies into one plugin batch transfer: the (local
// region, remote region) pairs the copies use and one entry per copy
// (region-relative offsets and strides pass through unchanged). It is
// reused transfer after transfer by one worker, so building allocates
// nothing once warm.
type batch struct {
	pairs   []plugin.Pair
	entries []abi.BatchEntry
	index   map[pairKey]uint32
	bytes   uint64
	refDesc uint64
	plan    time.Duration // planning the copies the batch holds
}

type pairKey struct {
	l *plugin.Region
	r *plugin.RemoteRegion
}

func (b *batch) reset() {
	b.pairs = b.pairs[:0]
	b.entries = b.entries[:0]
	if b.index == nil {
		b.index = make(map[pairKey]uint32)
	}
	clear(b.index)
	b.bytes, b.refDesc, b.plan = 0, 0, 0
}

func (b *batch) empty() bool { return len(b.entries) == 0 }

// add appends copies [from, to) of p, whose region indices name local[i]
// and remote[j]. The plan must have passed Validate against the same tables
// (see checkTables): this is what keeps every byte inside registered memory.
func (b *batch) add(p *planner.Plan, from, to int, local []*plugin.Region, remote []*plugin.RemoteRegion) error {
	for _, c := range p.Copies[from:to] {
		if int(c.SrcRegion) >= len(local) || int(c.DstRegion) >= len(remote) || c.SrcRegion < 0 || c.DstRegion < 0 {
			return fmt.Errorf("copy between regions %d and %d outside the registered tables (%d local, %d remote)", c.SrcRegion, c.DstRegion, len(local), len(remote))
		}
		k := pairKey{local[c.SrcRegion], remote[c.DstRegion]}
		pi, ok := b.index[k]
		if !ok {
			pi = uint32(len(b.pairs))
			b.pairs = append(b.pairs, plugin.Pair{Local: k.l, Remote: k.r})
			b.index[k] = pi
		}
		count := c.Count
		if count == 0 {
			count = 1
		}
		b.entries = append(b.entries, abi.BatchEntry{
			Pair: pi, LocalOffset: c.SrcOff, RemoteOffset: c.DstOff, Len: c.Len,
			LocalStride: c.SrcStride, RemoteStride: c.DstStride, Count: count,
		})
		b.bytes += c.Len * count
	}
	return nil
}

// checkTables verifies that a plan's region tables are exactly the tables
// the runtime registered (local) and imported from the peer's registration
// (remote), then validates the plan against them. Plans that fail never
// reach a plugin.
func checkTables(p *planner.Plan, local []*plugin.Region, remote []*plugin.RemoteRegion) error {
	if len(p.Src) != len(local) || len(p.Dst) != len(remote) {
		return fmt.Errorf("plan has %d source and %d destination regions, runtime holds %d and %d", len(p.Src), len(p.Dst), len(local), len(remote))
	}
	for i, r := range p.Src {
		if r.Addr != local[i].Addr() || r.Len > local[i].Len() {
			return fmt.Errorf("plan source region %d [%#x, +%d) is not registered region [%#x, +%d)", i, r.Addr, r.Len, local[i].Addr(), local[i].Len())
		}
	}
	for i, r := range p.Dst {
		if r.Addr != remote[i].Addr() || r.Len > remote[i].Len() {
			return fmt.Errorf("plan destination region %d [%#x, +%d) is not the peer's region [%#x, +%d)", i, r.Addr, r.Len, remote[i].Addr(), remote[i].Len())
		}
	}
	if err := p.Validate(); err != nil {
		return fmt.Errorf("plan rejected: %w", err)
	}
	return nil
}
