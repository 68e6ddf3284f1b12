// Package clock is the time source of kvhost's runtimes (push, pull): every
// time read, timer, ticker and timeout of their control logic goes through
// a Clock, so that a test can replace the wall clock with a Fake it
// advances by hand and check a 5-minute timeout without waiting for it
// (as hashicorp/raft injects its Transport and etcd's raft is driven by
// Tick).
//
// Real is the wall clock (package time); Fake is a manual clock whose
// timers fire, in deadline order, only when a test calls Advance.
package clock

import (
	"context"
	"time"
)

// Clock is what the runtimes need of time.
type Clock interface {
	// Now is the current time.
	Now() time.Time
	// Since is Now().Sub(t).
	Since(t time.Time) time.Duration
	// NewTimer sends the time on the timer's channel after d.
	NewTimer(d time.Duration) Timer
	// NewTicker sends the time on the ticker's channel every d (d > 0);
	// like time.Ticker, ticks a slow reader misses are dropped.
	NewTicker(d time.Duration) Ticker
	// After is NewTimer(d).C().
	After(d time.Duration) <-chan time.Time
	// AfterFunc calls fn after d (in its own goroutine on Real; before
	// Advance returns on Fake).
	AfterFunc(d time.Duration, fn func()) Timer
	// WithTimeout is context.WithTimeout on this clock: the context ends
	// with context.DeadlineExceeded once d has passed on it.
	WithTimeout(parent context.Context, d time.Duration) (context.Context, context.CancelFunc)
	// WithDeadline is context.WithDeadline on this clock.
	WithDeadline(parent context.Context, deadline time.Time) (context.Context, context.CancelFunc)
}

// Timer is a time.Timer of a Clock.
type Timer interface {
	// C is the channel the time is sent on (nil for an AfterFunc timer).
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did.
	Stop() bool
	// Reset re-arms the timer to fire after d; it reports whether the
	// timer was active.
	Reset(d time.Duration) bool
}

// Ticker is a time.Ticker of a Clock.
type Ticker interface {
	C() <-chan time.Time
	Stop()
	Reset(d time.Duration)
}

// Real is the wall clock: package time.
type Real struct{}

// Or returns c, or Real when c is nil (the default of a config field).
func Or(c Clock) Clock {
	if c == nil {
		return Real{}
	}
	return c
}

func (Real) Now() time.Time                         { return time.Now() }
func (Real) Since(t time.Time) time.Duration        { return time.Since(t) }
func (Real) NewTimer(d time.Duration) Timer         { return realTimer{time.NewTimer(d)} }
func (Real) NewTicker(d time.Duration) Ticker       { return realTicker{time.NewTicker(d)} }
func (Real) After(d time.Duration) <-chan time.Time { return time.After(d) }
func (Real) AfterFunc(d time.Duration, fn func()) Timer {
	return realTimer{time.AfterFunc(d, fn)}
}
func (Real) WithTimeout(parent context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, d)
}
func (Real) WithDeadline(parent context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	return context.WithDeadline(parent, deadline)
}

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time        { return t.t.C }
func (t realTimer) Stop() bool                 { return t.t.Stop() }
func (t realTimer) Reset(d time.Duration) bool { return t.t.Reset(d) }

type realTicker struct{ t *time.Ticker }

func (t realTicker) C() <-chan time.Time   { return t.t.C }
func (t realTicker) Stop()                 { t.t.Stop() }
func (t realTicker) Reset(d time.Duration) { t.t.Reset(d) }
