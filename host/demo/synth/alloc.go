package synth

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
)

// Allocator hands out the pages (vLLM: blocks) of one rank's pool, or any
// other numbered slots, at random, as a real engine's allocator scatters a
// request over its cache, so transfers meet non-contiguous page lists.
// Allocation is all or nothing and waits while too few are free. Safe for
// concurrent use.
type Allocator struct {
	mu      sync.Mutex
	free    []int32
	size    int
	rng     *rand.Rand    // under mu
	changed chan struct{} // closed and replaced whenever slots come back
}

// NewAllocator returns an allocator of slots 0..n-1, all free, whose
// choices follow seed.
func NewAllocator(n int, seed uint64) *Allocator {
	a := &Allocator{free: make([]int32, n), size: n, rng: rand.New(rand.NewPCG(seed, 0x70616765)), changed: make(chan struct{})}
	for i := range a.free {
		a.free[i] = int32(i)
	}
	return a
}

// Get returns n distinct random free slots, waiting for them until ctx
// ends. Asking for more than the pool holds is an error at once.
func (a *Allocator) Get(ctx context.Context, n int) ([]int32, error) {
	if n > a.size {
		return nil, fmt.Errorf("%d pages needed, the pool has %d", n, a.size)
	}
	for {
		a.mu.Lock()
		if len(a.free) >= n {
			out := make([]int32, n)
			for i := range out {
				j := a.rng.IntN(len(a.free))
				out[i] = a.free[j]
				a.free[j] = a.free[len(a.free)-1]
				a.free = a.free[:len(a.free)-1]
			}
			a.mu.Unlock()
			return out, nil
		}
		ch := a.changed
		a.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for %d free pages: %w", n, ctx.Err())
		}
	}
}

// Put returns slots Get handed out.
func (a *Allocator) Put(ids []int32) {
	if len(ids) == 0 {
		return
	}
	a.mu.Lock()
	a.free = append(a.free, ids...)
	close(a.changed)
	a.changed = make(chan struct{})
	a.mu.Unlock()
}

// Free returns the number of free slots.
func (a *Allocator) Free() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.free)
}
