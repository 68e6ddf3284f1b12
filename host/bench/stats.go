package bench

import (
	"math/rand/v2"
	"time"

	"github.com/kvhost/kvhost/host/internal/quantile"
)

// maxSamples bounds the durations a phase keeps per thread for its
// percentiles (reservoir sampling beyond it), so a long row does not grow
// memory without bound; averages stay exact.
const maxSamples = 1 << 16

// phase accumulates the durations of one phase of the iterations (prep,
// post, transfer, latency) of one thread. Units: nanoseconds.
type phase struct {
	sum  int64
	n    int64
	keep []int64 // uniform sample of at most maxSamples durations
	rng  *rand.PCG
}

func (p *phase) add(d time.Duration) {
	p.sum += int64(d)
	p.n++
	if len(p.keep) < maxSamples {
		p.keep = append(p.keep, int64(d))
		return
	}
	if p.rng == nil {
		p.rng = rand.NewPCG(uint64(p.n), 0x6b76686f7374)
	}
	if j := p.rng.Uint64() % uint64(p.n); j < maxSamples {
		p.keep[j] = int64(d)
	}
}

// merge combines the phases of several threads: exact sums, and samples
// concatenated (each thread's sample stands for its own iterations; with
// equal iteration counts per thread, which a row has to within one
// round's spread, the union is representative).
func merge(ps ...*phase) phase {
	var m phase
	for _, p := range ps {
		m.sum += p.sum
		m.n += p.n
		m.keep = append(m.keep, p.keep...)
	}
	return m
}

func (p *phase) avgUs() float64 {
	if p.n == 0 {
		return 0
	}
	return float64(p.sum) / float64(p.n) / 1e3
}

// pctUs returns the q-quantile (0..1) in µs, nearest rank as bench_direct.cc
// computes it: index round(q*(n-1)). It sorts the samples.
func (p *phase) pctUs(q float64) float64 { return float64(p.quantile(q)) / 1e3 }

// quantile returns the q-quantile (0..1) of the samples, nearest rank. It
// sorts them.
func (p *phase) quantile(q float64) int64 { return quantile.NearestRank(p.keep, q) }

// ratioScale stores a ratio in a phase as an integer: parts per million.
const ratioScale = 1e6
