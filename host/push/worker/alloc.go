package worker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
)

// allocator hands out a rank's pages (and aux slots) at random, as a real
// engine's allocator scatters a request over its pool. Allocation is all or
// nothing and waits while the pool is short.
type allocator struct {
	mu   sync.Mutex
	cond chan struct{} // closed and replaced when something is freed
	free []int32
	rng  *rand.Rand
	size int
}

func newAllocator(n int, seed uint64) *allocator {
	a := &allocator{free: make([]int32, n), rng: rand.New(rand.NewPCG(seed, 0x70616765)), cond: make(chan struct{}), size: n}
	for i := range a.free {
		a.free[i] = int32(i)
	}
	return a
}

func (a *allocator) alloc(ctx context.Context, n int) ([]int32, error) {
	if n > a.size {
		return nil, fmt.Errorf("request needs %d pages, the pool has %d", n, a.size)
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
		ch := a.cond
		a.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (a *allocator) release(pages []int32) {
	if len(pages) == 0 {
		return
	}
	a.mu.Lock()
	a.free = append(a.free, pages...)
	close(a.cond)
	a.cond = make(chan struct{})
	a.mu.Unlock()
}
