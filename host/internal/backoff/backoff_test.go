package backoff

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := New(10*time.Microsecond, 50*time.Microsecond)
	var got []time.Duration
	for _, progressed := range []bool{false, false, false, false, true, false} {
		got = append(got, b.After(progressed))
	}
	want := []time.Duration{20, 40, 50, 50, 10, 20}
	for i := range want {
		if got[i] != want[i]*time.Microsecond {
			t.Fatalf("intervals %v, want %v µs", got, want)
		}
	}
	b.Reset()
	if d := b.After(false); d != 20*time.Microsecond {
		t.Fatalf("after reset: %v", d)
	}
}

func TestNext(t *testing.T) {
	b := New(5*time.Millisecond, 30*time.Millisecond)
	var got []time.Duration
	for range 6 {
		got = append(got, b.Next())
	}
	want := []time.Duration{5, 10, 20, 30, 30, 30}
	for i := range want {
		if got[i] != want[i]*time.Millisecond {
			t.Fatalf("intervals %v, want %v ms", got, want)
		}
	}
	b.Reset()
	if d := b.Next(); d != 5*time.Millisecond {
		t.Fatalf("after reset: %v", d)
	}
}
