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
	slices.SortFunc(u.ivs, func(a, b interval) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		}
		return 0
	})
	var total, curS, curE int64
	for i, iv := range u.ivs {
		switch {
		case i == 0:
			curS, curE = iv.start, iv.end
		case iv.start > curE:
			total += curE - curS
			curS, curE = iv.start, iv.end
		case iv.end > curE:
			curE = iv.end
		}
	}
	if len(u.ivs) > 0 {
		total += curE - curS
	}
	return time.Duration(total)
}
