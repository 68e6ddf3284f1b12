// Package span measures how long work was in flight: the length of the
// union of time intervals (transfers from post to completion), so that a
// rate over it counts overlapping transfers once and idle gaps not at all.
package span

import (
	"slices"
	"time"
)

// Union collects intervals and measures their union. The zero value is
// empty and ready; it is not safe for concurrent use.
type Union struct {
	ivs []interval
}

type interval struct{ start, end int64 } // Unix ns

// Add adds [start, end); an empty or inverted interval adds nothing.
func (u *Union) Add(start, end time.Time) {
	s, e := start.UnixNano(), end.UnixNano()
	if e <= s {
		return
	}
	u.ivs = append(u.ivs, interval{s, e})
}

// Len returns the number of intervals added.
func (u *Union) Len() int { return len(u.ivs) }

// Total returns the length of the union of the intervals added.
func (u *Union) Total() time.Duration {
	var total int64
	for _, iv := range u.Merged() {
		total += iv[1] - iv[0]
	}
	return time.Duration(total)
}

// Merged returns the union as disjoint [start, end) intervals in Unix ns,
// in order: what a process reports so that another can measure the union
// of several processes' intervals (AddNs).
func (u *Union) Merged() [][2]int64 {
	slices.SortFunc(u.ivs, func(a, b interval) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		}
		return 0
	})
	var out [][2]int64
	for _, iv := range u.ivs {
		if n := len(out); n > 0 && iv.start <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], iv.end)
			continue
		}
		out = append(out, [2]int64{iv.start, iv.end})
	}
	return out
}

// AddNs adds [start, end) given in Unix ns (Merged's form).
func (u *Union) AddNs(start, end int64) {
	if end > start {
		u.ivs = append(u.ivs, interval{start, end})
	}
}

// Running measures the union of intervals as they are added, in constant
// memory, for a counter that grows while transfers complete (a sidecar's
// kvhost_transfer_busy_seconds_total): an interval adds only its part
// after the latest end added so far. That is the exact union when
// intervals come in order of their ends, as transfers do when each is
// added at its completion; one that ends earlier than an interval added
// before it adds nothing (a lower bound, off by at most the jitter of the
// completion order). The zero value is empty and ready; it is not safe
// for concurrent use.
type Running struct {
	end   int64 // Unix ns: the latest end added
	total int64 // ns
}

// Add adds [start, end) and returns how much it grew the union; an empty
// or inverted interval adds nothing.
func (r *Running) Add(start, end time.Time) time.Duration {
	s, e := start.UnixNano(), end.UnixNano()
	if e <= s || e <= r.end {
		return 0
	}
	grew := e - max(s, r.end)
	r.total += grew
	r.end = e
	return time.Duration(grew)
}

// Total returns the union measured so far.
func (r *Running) Total() time.Duration { return time.Duration(r.total) }
