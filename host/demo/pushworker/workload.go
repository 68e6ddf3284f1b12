// Package pushworker runs demo-grade kvhost prefill and decode workers: a
// synthetic KV pool (package kvpool) per rank in host memory, a
// deterministic synthetic workload that both sides derive from one seed,
// the push runtime (package push) in between, and a byte-exact check on
// decode that does not use the planner. `kvhost prefill` and `kvhost
// decode` are thin wrappers around RunPrefill and RunDecode; `kvhost demo`
// can run both in one process or start them as processes and aggregate
// their JSON summaries.
package pushworker

import (
	"errors"
	"fmt"
	"math/rand/v2"
)

// Workload is the synthetic request stream. Both sides build the same
// request list from it (room ids, lengths, chunking, prefix hits, aborts);
// each side allocates its own pages.
type Workload struct {
	Seed     uint64
	Requests int
	// RoomBase is added to every room id, so runs against a long-lived peer
	// do not reuse rooms. 0 derives it from the seed.
	RoomBase uint64
	// Prompt lengths in tokens, uniform in [MinTokens, MaxTokens].
	MinTokens, MaxTokens int
	// ChunkPages is the chunked-prefill chunk size in pages (0: one chunk).
	ChunkPages int
	// PrefixRate is the fraction of requests whose decode side already
	// holds a page-aligned prefix (decode radix cache hit); FullHitRate the
	// fraction of those whose whole prompt is cached (no KV moves, only
	// aux).
	PrefixRate  float64
	FullHitRate float64
	// AbortRate is the fraction of requests decode aborts right after
	// sending its metadata (prefill must stop and release them).
	AbortRate float64
}

// Request is one synthetic request.
type Request struct {
	Index  int
	Room   uint64
	Tokens int
	// Prefix tokens decode already holds (a multiple of the page size).
	Prefix int
	Abort  bool
}

// Check reports the first unusable field.
func (w Workload) Check(pageSize int) error {
	switch {
	case w.Requests < 0:
		return fmt.Errorf("workload: %d requests", w.Requests)
	case w.MinTokens < 1 || w.MaxTokens < w.MinTokens:
		return fmt.Errorf("workload: token range [%d, %d]", w.MinTokens, w.MaxTokens)
	case w.ChunkPages < 0:
		return fmt.Errorf("workload: chunk of %d pages", w.ChunkPages)
	case pageSize < 1:
		return errors.New("workload: page size must be positive")
	}
	for _, r := range []float64{w.PrefixRate, w.FullHitRate, w.AbortRate} {
		if r < 0 || r > 1 {
			return fmt.Errorf("workload: rate %v outside [0, 1]", r)
		}
	}
	return nil
}

// List returns the requests, the same on every side for the same workload
// and page size.
func (w Workload) List(pageSize int) []Request {
	rng := rand.New(rand.NewPCG(w.Seed, 0x6b76686f7374))
	base := w.RoomBase
	if base == 0 {
		base = (w.Seed*0x9e3779b97f4a7c15)>>24 | 1
	}
	out := make([]Request, w.Requests)
	for i := range out {
		r := Request{Index: i, Room: base + uint64(i)}
		r.Tokens = w.MinTokens + rng.IntN(w.MaxTokens-w.MinTokens+1)
		prefix := rng.Float64() < w.PrefixRate
		full := rng.Float64() < w.FullHitRate
		cut := rng.IntN(r.Tokens + 1)
		r.Abort = rng.Float64() < w.AbortRate
		if prefix {
			if full && r.Tokens%pageSize == 0 {
				r.Prefix = r.Tokens
			} else {
				r.Prefix = cut / pageSize * pageSize
				if r.Prefix >= r.Tokens { // keep at least one token to send
					r.Prefix = (r.Tokens - 1) / pageSize * pageSize
				}
			}
		}
		out[i] = r
	}
	return out
}

// pages returns how many pages n tokens occupy.
func pagesFor(n, pageSize int) int { return (n + pageSize - 1) / pageSize }
