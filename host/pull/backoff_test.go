package pull

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := newBackoff(10*time.Microsecond, 50*time.Microsecond)
	var got []time.Duration
	for _, progressed := range []bool{false, false, false, false, true, false} {
		got = append(got, b.after(progressed))
	}
	want := []time.Duration{20, 40, 50, 50, 10, 20}
	for i := range want {
		if got[i] != want[i]*time.Microsecond {
			t.Fatalf("intervals %v, want %v µs", got, want)
		}
	}
	b.reset()
	if d := b.after(false); d != 20*time.Microsecond {
		t.Fatalf("after reset: %v", d)
	}
}
