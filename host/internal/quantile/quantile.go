// Package quantile is kvhost's one place for order statistics. Two
// definitions are kept on purpose, each matching the code whose numbers
// kvhost's are compared with:
//
//   - Percentile is numpy.percentile with its default linear interpolation,
//     as vLLM's NixlKVConnectorStats.reduce computes its p90s (vLLM's
//     vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py); the
//     pull runtime's Stats summary and the demo workers' latency summaries
//     use it.
//   - NearestRank is the nearest-rank quantile of kvhost's direct-NIXL
//     baseline (plugins/nixl/bench_direct.cc), which kvhost bench's rows are
//     set against.
//
// Median is the middle value (the mean of the middle two for an even
// count), as the bench reports the median of its rounds.
package quantile

import (
	"cmp"
	"math"
	"slices"
)

// Percentile is numpy.percentile(values, p) with its default linear
// interpolation; p in [0, 100]. values is not modified. Empty input gives 0.
func Percentile(values []float64, p float64) float64 {
	if len(values) == 0 {
		return 0
	}
	v := slices.Clone(values)
	slices.Sort(v)
	pos := (float64(len(v)) - 1) * p / 100
	lo := math.Floor(pos)
	hi := math.Ceil(pos)
	return v[int(lo)] + (v[int(hi)]-v[int(lo)])*(pos-lo)
}

// NearestRank returns the q-quantile (q in [0, 1]) of values, nearest rank
// as plugins/nixl/bench_direct.cc computes it: index round(q*(n-1)) of the
// sorted values. It sorts values in place. Empty input gives the zero value.
func NearestRank[T cmp.Ordered](values []T, q float64) T {
	if len(values) == 0 {
		var zero T
		return zero
	}
	slices.Sort(values)
	i := int(q*float64(len(values)-1) + 0.5)
	return values[min(i, len(values)-1)]
}

// Median returns the median of values (the mean of the middle two for an
// even count), 0 for none. values is not modified.
func Median(values []float64) float64 {
	if len(values) == 0 {
		return 0
	}
	c := slices.Clone(values)
	slices.Sort(c)
	n := len(c)
	if n%2 == 1 {
		return c[n/2]
	}
	return (c[n/2-1] + c[n/2]) / 2
}
