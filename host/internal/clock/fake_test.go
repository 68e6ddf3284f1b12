package clock

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestFakeOrder: Advance fires due timers in deadline order, each with Now
// at its deadline, tickers once per period, and nothing not yet due.
func TestFakeOrder(t *testing.T) {
	f := NewFake(time.Time{})
	var got []time.Duration
	f.AfterFunc(30*time.Millisecond, func() { got = append(got, f.Since(Epoch)) })
	f.AfterFunc(10*time.Millisecond, func() { got = append(got, f.Since(Epoch)) })
	late := f.NewTimer(time.Second)
	tk := f.NewTicker(20 * time.Millisecond)
	defer tk.Stop()
	f.Advance(25 * time.Millisecond)
	if want := []time.Duration{10 * time.Millisecond}; !equal(got, want) {
		t.Fatalf("fired %v, want %v", got, want)
	}
	if tick := <-tk.C(); tick.Sub(Epoch) != 20*time.Millisecond {
		t.Fatalf("tick at %v", tick.Sub(Epoch))
	}
	f.Advance(10 * time.Millisecond)
	if want := []time.Duration{10 * time.Millisecond, 30 * time.Millisecond}; !equal(got, want) || f.Since(Epoch) != 35*time.Millisecond {
		t.Fatalf("fired %v, want %v; now %v", got, want, f.Since(Epoch))
	}
	select {
	case <-late.C():
		t.Fatal("a timer fired early")
	default:
	}
	if !late.Stop() || late.Stop() {
		t.Fatal("Stop of an armed timer")
	}
	f.Advance(time.Hour)
	select {
	case <-late.C():
		t.Fatal("a stopped timer fired")
	default:
	}
}

func equal(a, b []time.Duration) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestFakeContext: a fake timeout ends its context with DeadlineExceeded
// only when the clock reaches it; cancel first gives Canceled.
func TestFakeContext(t *testing.T) {
	f := NewFake(time.Time{})
	ctx, cancel := f.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, ok := ctx.Deadline(); ok {
		t.Fatal("a fake deadline reported as a wall-clock one")
	}
	f.Advance(999 * time.Millisecond)
	if ctx.Err() != nil {
		t.Fatal("ended early:", ctx.Err())
	}
	f.Advance(time.Millisecond)
	<-ctx.Done()
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal(ctx.Err())
	}
	ctx2, cancel2 := f.WithTimeout(context.Background(), time.Second)
	cancel2()
	f.Advance(time.Hour)
	if !errors.Is(ctx2.Err(), context.Canceled) {
		t.Fatal(ctx2.Err())
	}
	ctx3, cancel3 := f.WithTimeout(context.Background(), 0)
	defer cancel3()
	if !errors.Is(ctx3.Err(), context.DeadlineExceeded) {
		t.Fatal(ctx3.Err())
	}
	if f.Pending() != 0 {
		t.Fatalf("%d timers left armed", f.Pending())
	}
}

// TestFakeWaitArmed: a test can wait until another goroutine armed the
// timer it advances past.
func TestFakeWaitArmed(t *testing.T) {
	f := NewFake(time.Time{})
	done := make(chan time.Time)
	go func() { done <- <-f.After(5 * time.Second) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.WaitArmed(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := f.BlockUntil(ctx, 1); err != nil {
		t.Fatal(err)
	}
	f.Advance(5 * time.Second)
	if at := <-done; at.Sub(Epoch) != 5*time.Second {
		t.Fatalf("fired at %v", at.Sub(Epoch))
	}
	short, cancel2 := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel2()
	if err := f.WaitArmed(short, time.Minute); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
}

// TestReal: Or defaults to the wall clock.
func TestReal(t *testing.T) {
	c := Or(nil)
	start := c.Now()
	<-c.After(time.Millisecond)
	if c.Since(start) < time.Millisecond {
		t.Fatal("real clock did not move")
	}
}
