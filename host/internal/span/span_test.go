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
