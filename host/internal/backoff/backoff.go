// Package backoff is the one doubling interval of kvhost's polling and
// retry loops: the completion engine's polling fallback (host/plugin),
// handshake and accept retries (host/push, host/internal/zmq) and the demo
// workers' HTTP polls. It holds no clock: callers sleep or wait for the
// durations it returns however they wait.
package backoff

import "time"

// Backoff is the interval of a polling or retry loop: it doubles while
// polls find nothing, up to max, and drops back to min on progress. The
// zero value is not ready: use New. Not safe for concurrent use.
type Backoff struct{ min, max, cur time.Duration }

// New returns a Backoff at min that never exceeds max.
func New(min, max time.Duration) Backoff { return Backoff{min: min, max: max, cur: min} }

// After returns how long to sleep after a poll that made progress or not:
// min after progress, else twice the last interval (at most max).
func (b *Backoff) After(progressed bool) time.Duration {
	if progressed {
		b.cur = b.min
	} else {
		b.cur = min(b.cur*2, b.max)
	}
	return b.cur
}

// Next returns the current interval and doubles it for the next call (at
// most max): min, 2×min, 4×min, ... for a retry loop that waits before
// each new attempt.
func (b *Backoff) Next() time.Duration {
	d := b.cur
	b.cur = min(b.cur*2, b.max)
	return d
}

// Reset starts over from min (new work arrived).
func (b *Backoff) Reset() { b.cur = b.min }
