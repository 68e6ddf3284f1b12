package pullworker

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
)

// Workload is the deterministic request stream both workers derive from
// the same seed.
type Workload struct {
	Seed     uint64
	Requests int
	// MinTokens and MaxTokens bound the prompt lengths (uniform).
	MinTokens, MaxTokens int
	// PartialHitRate is the share of requests whose first blocks are
	// already in the decode's prefix cache (a random number of them, at
	// least one, not all); FullHitRate the share holding every block, for
	// which the decode only notifies the prefill.
	PartialHitRate, FullHitRate float64
}

// Hit is a request's prefix-cache outcome on the decode.
type Hit uint8

// Prefix-cache outcomes.
const (
	HitNone Hit = iota
	HitPartial
	HitFull
)

func (h Hit) String() string {
	switch h {
	case HitPartial:
		return "partial"
	case HitFull:
		return "full"
	}
	return "none"
}

// Request is one request of the workload.
type Request struct {
	ID     string
	Tokens int
	Hit    Hit
	draw   uint32 // picks the partial hit length
}

// Validate reports the first unusable field.
func (w Workload) Validate() error {
	switch {
	case w.Requests < 0:
		return fmt.Errorf("requests %d must not be negative", w.Requests)
	case w.MinTokens <= 0 || w.MaxTokens < w.MinTokens:
		return fmt.Errorf("token range [%d, %d] is empty or not positive", w.MinTokens, w.MaxTokens)
	case w.PartialHitRate < 0 || w.FullHitRate < 0 || w.PartialHitRate+w.FullHitRate > 1:
		return fmt.Errorf("prefix hit rates %g (partial) and %g (full) must be in [0, 1] together", w.PartialHitRate, w.FullHitRate)
	}
	return nil
}

// Generate returns the workload's requests, the same for the same fields.
func (w Workload) Generate() []Request {
	rng := rand.New(rand.NewPCG(w.Seed, 0x6b7668_6f7374))
	out := make([]Request, w.Requests)
	for i := range out {
		r := Request{
			ID:     fmt.Sprintf("req-%d-%06d", w.Seed, i),
			Tokens: w.MinTokens + rng.IntN(w.MaxTokens-w.MinTokens+1),
			draw:   rng.Uint32(),
		}
		switch u := rng.Float64(); {
		case u < w.FullHitRate:
			r.Hit = HitFull
		case u < w.FullHitRate+w.PartialHitRate:
			r.Hit = HitPartial
		}
		out[i] = r
	}
	return out
}

// Blocks is how many blocks of blockSize tokens the request spans.
func (r Request) Blocks(blockSize int) int { return (r.Tokens + blockSize - 1) / blockSize }

// HitBlocks is how many of the request's first blocks the decode already
// holds: none, all, or for a partial hit between 1 and all but one (0 when
// the request has a single block).
func (r Request) HitBlocks(blockSize int) int {
	n := r.Blocks(blockSize)
	switch r.Hit {
	case HitFull:
		return n
	case HitPartial:
		if n < 2 {
			return 0
		}
		return 1 + int(r.draw%uint32(n-1))
	}
	return 0
}

// KVSeed is the request identity the KV bytes derive from: a hash of the
// id, so both workers agree without sharing state.
func KVSeed(id string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(id))
	return h.Sum64()
}

// sortedCopy returns ids sorted (for stable summaries).
func sortedCopy(ids []string) []string {
	out := slices.Clone(ids)
	slices.Sort(out)
	return out
}
