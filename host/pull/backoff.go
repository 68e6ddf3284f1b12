package pull

import "time"

// backoff is the interval of a polling loop: it doubles while polls find
// nothing, up to max, and drops back to min on progress.
type backoff struct{ min, max, cur time.Duration }

func newBackoff(min, max time.Duration) backoff { return backoff{min: min, max: max, cur: min} }

// after returns how long to sleep after a poll that made progress or not.
func (b *backoff) after(progressed bool) time.Duration {
	if progressed {
		b.cur = b.min
	} else {
		b.cur = min(b.cur*2, b.max)
	}
	return b.cur
}

// reset starts over from min (new work arrived).
func (b *backoff) reset() { b.cur = b.min }
