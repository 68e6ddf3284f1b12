package clock

import (
	"context"
	"slices"
	"sync"
	"time"
)

// Fake is a Clock that stands still until Advance moves it. Advance fires
// the timers and tickers that come due, one at a time in deadline order
// (ties in the order they were armed), with Now set to each one's
// deadline as it fires; an AfterFunc function runs before Advance goes on.
// WaitArmed and BlockUntil let a test wait (in real time, bounded by its
// context) until the code under test has armed the timer it is about to
// advance past, so that Advance never races the arming.
//
// A context from WithTimeout or WithDeadline ends with
// context.DeadlineExceeded when Advance reaches its deadline; it reports
// only its parent's Deadline(), because its own is not on the wall clock and I/O
// deadlines derived from it (net.Conn.SetDeadline) would be wrong.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	seq     uint64
	pending []*fakeTimer  // armed timers and tickers, unordered
	changed chan struct{} // closed and replaced whenever a timer is armed
}

// Epoch is where NewFake(time.Time{}) starts.
var Epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// NewFake returns a Fake at start (Epoch when zero).
func NewFake(start time.Time) *Fake {
	if start.IsZero() {
		start = Epoch
	}
	return &Fake{now: start, changed: make(chan struct{})}
}

type fakeTimer struct {
	f      *Fake
	c      chan time.Time // nil for AfterFunc
	fn     func()
	when   time.Time
	period time.Duration // tickers
	dur    time.Duration // as armed (for WaitArmed)
	seq    uint64
	active bool
}

func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *Fake) Since(t time.Time) time.Duration { return f.Now().Sub(t) }

func (f *Fake) NewTimer(d time.Duration) Timer {
	t := &fakeTimer{f: f, c: make(chan time.Time, 1)}
	f.arm(t, d, 0)
	return t
}

func (f *Fake) NewTicker(d time.Duration) Ticker {
	if d <= 0 {
		panic("clock: non-positive interval for NewTicker")
	}
	t := &fakeTimer{f: f, c: make(chan time.Time, 1)}
	f.arm(t, d, d)
	return fakeTicker{t}
}

func (f *Fake) After(d time.Duration) <-chan time.Time { return f.NewTimer(d).C() }

func (f *Fake) AfterFunc(d time.Duration, fn func()) Timer {
	t := &fakeTimer{f: f, fn: fn}
	f.arm(t, d, 0)
	return t
}

// arm (re)schedules t to fire after d; it reports whether t was active.
func (f *Fake) arm(t *fakeTimer, d, period time.Duration) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	was := f.disarmLocked(t)
	f.seq++
	t.when, t.period, t.dur, t.seq, t.active = f.now.Add(d), period, d, f.seq, true
	f.pending = append(f.pending, t)
	close(f.changed)
	f.changed = make(chan struct{})
	return was
}

func (f *Fake) disarmLocked(t *fakeTimer) bool {
	if !t.active {
		return false
	}
	t.active = false
	if i := slices.Index(f.pending, t); i >= 0 {
		f.pending = slices.Delete(f.pending, i, i+1)
	}
	return true
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	return t.f.disarmLocked(t)
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	// As with time.Timer (Go 1.23+), no stale value is left to receive.
	if t.c != nil {
		select {
		case <-t.c:
		default:
		}
	}
	return t.f.arm(t, d, 0)
}

type fakeTicker struct{ t *fakeTimer }

func (k fakeTicker) C() <-chan time.Time { return k.t.c }
func (k fakeTicker) Stop()               { k.t.Stop() }
func (k fakeTicker) Reset(d time.Duration) {
	if d <= 0 {
		panic("clock: non-positive interval for Ticker.Reset")
	}
	k.t.f.arm(k.t, d, d)
}

// Advance moves the clock d forward, firing every timer that comes due on
// the way, in deadline order.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	target := f.now.Add(d)
	f.mu.Unlock()
	f.AdvanceTo(target)
}

// AdvanceTo moves the clock forward to t (never back), firing every timer
// that comes due on the way, in deadline order.
func (f *Fake) AdvanceTo(target time.Time) {
	for {
		f.mu.Lock()
		var next *fakeTimer
		for _, t := range f.pending {
			if !t.when.After(target) && (next == nil || t.when.Before(next.when) || t.when.Equal(next.when) && t.seq < next.seq) {
				next = t
			}
		}
		if next == nil {
			if target.After(f.now) {
				f.now = target
			}
			f.mu.Unlock()
			return
		}
		if next.when.After(f.now) {
			f.now = next.when
		}
		now := f.now
		if next.period > 0 {
			f.seq++
			next.when, next.seq = next.when.Add(next.period), f.seq
		} else {
			f.disarmLocked(next)
		}
		fn, c := next.fn, next.c
		f.mu.Unlock()
		if fn != nil {
			fn()
			continue
		}
		select {
		case c <- now:
		default: // a tick the reader missed, as with time.Ticker
		}
	}
}

// Pending returns how many timers and tickers are armed.
func (f *Fake) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pending)
}

// BlockUntil waits until at least n timers and tickers are armed, or ctx
// ends (its error is returned).
func (f *Fake) BlockUntil(ctx context.Context, n int) error {
	return f.waitFor(ctx, func() bool { return len(f.pending) >= n })
}

// WaitArmed waits until a timer or ticker armed for d (as passed to
// NewTimer, NewTicker, AfterFunc, Reset or a WithTimeout) is pending, or
// ctx ends (its error is returned).
func (f *Fake) WaitArmed(ctx context.Context, d time.Duration) error {
	return f.waitFor(ctx, func() bool {
		return slices.ContainsFunc(f.pending, func(t *fakeTimer) bool { return t.dur == d })
	})
}

func (f *Fake) waitFor(ctx context.Context, cond func() bool) error {
	for {
		f.mu.Lock()
		ok, changed := cond(), f.changed
		f.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WithTimeout is WithDeadline(parent, Now()+d).
func (f *Fake) WithTimeout(parent context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(parent)
	c := &fakeCtx{Context: ctx}
	if d <= 0 {
		c.expire(cancel)
		return c, cancel
	}
	c.timer = f.AfterFunc(d, func() { c.expire(cancel) })
	return c, func() { c.timer.Stop(); cancel() }
}

// WithDeadline returns a context that ends with context.DeadlineExceeded
// once the clock reaches deadline.
func (f *Fake) WithDeadline(parent context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	return f.WithTimeout(parent, deadline.Sub(f.Now()))
}

type fakeCtx struct {
	context.Context
	timer Timer
	mu    sync.Mutex
	err   error
}

func (c *fakeCtx) expire(cancel context.CancelFunc) {
	c.mu.Lock()
	if c.Context.Err() == nil {
		c.err = context.DeadlineExceeded
	}
	c.mu.Unlock()
	cancel()
}

// Deadline reports the parent's (wall-clock) deadline only: see Fake.
func (c *fakeCtx) Deadline() (time.Time, bool) { return c.Context.Deadline() }

func (c *fakeCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return c.err
	}
	return c.Context.Err()
}

func (c *fakeCtx) Value(key any) any { return c.Context.Value(key) }
