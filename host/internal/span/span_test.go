package span

import (
	"testing"
	"time"
)

func TestUnion(t *testing.T) {
	base := time.Unix(1000, 0)
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	var u Union
	if u.Total() != 0 {
		t.Fatal("empty union not 0")
	}
	u.Add(at(10), at(20)) // [10,20)
	u.Add(at(0), at(5))   // [0,5)
	u.Add(at(15), at(30)) // overlaps: [10,30)
	u.Add(at(12), at(14)) // inside
	u.Add(at(30), at(31)) // touches: [10,31)
	u.Add(at(40), at(40)) // empty
	u.Add(at(50), at(45)) // inverted
	if got, want := u.Total(), 26*time.Millisecond; got != want {
		t.Fatalf("union %v, want %v", got, want)
	}
	if u.Len() != 5 {
		t.Fatalf("%d intervals, want 5", u.Len())
	}
}

// Running is Union's exact total for intervals added in order of their
// ends, and never more than it otherwise.
func TestRunning(t *testing.T) {
	base := time.Unix(1000, 0)
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	ordered := [][2]int{{0, 5}, {10, 20}, {12, 21}, {15, 30}, {30, 31}, {40, 40}, {33, 35}}
	var r Running
	var u Union
	var grew time.Duration
	for _, iv := range ordered {
		grew += r.Add(at(iv[0]), at(iv[1]))
		u.Add(at(iv[0]), at(iv[1]))
	}
	if r.Total() != u.Total() || grew != r.Total() || r.Total() != 28*time.Millisecond {
		t.Fatalf("running %v (grew %v), union %v, want 28ms", r.Total(), grew, u.Total())
	}
	// Out of end order: [0,5) after [10,20) is under the running end.
	var late Running
	late.Add(at(10), at(20))
	if g := late.Add(at(0), at(5)); g != 0 || late.Total() != 10*time.Millisecond {
		t.Fatalf("late interval grew %v, total %v; want 0 and 10ms", g, late.Total())
	}
	if g := late.Add(at(50), at(45)); g != 0 {
		t.Fatalf("inverted interval grew %v", g)
	}
}

// Merged is the union as disjoint intervals; adding them to another
// Union (another process's) measures the union of both.
func TestMerged(t *testing.T) {
	base := time.Unix(1000, 0)
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	var a, b Union
	a.Add(at(10), at(20))
	a.Add(at(0), at(5))
	a.Add(at(15), at(30))
	a.Add(at(30), at(31)) // touches: merged
	got := a.Merged()
	ns := func(ms int) int64 { return at(ms).UnixNano() }
	want := [][2]int64{{ns(0), ns(5)}, {ns(10), ns(31)}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("merged %v, want %v", got, want)
	}
	b.Add(at(4), at(12)) // bridges a's gap [5, 10)
	for _, iv := range got {
		b.AddNs(iv[0], iv[1])
	}
	b.AddNs(ns(50), ns(40)) // inverted: nothing
	if b.Total() != 31*time.Millisecond {
		t.Fatalf("union of both %v, want 31ms", b.Total())
	}
}
