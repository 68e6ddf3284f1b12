package rooms

import (
	"context"
	"sync"
	"testing"
	"time"
)

func TestMergeRules(t *testing.T) {
	all := []Status{Failed, Bootstrapping, WaitingForInput, Transferring, Success}
	for _, old := range all {
		for _, next := range all {
			got := Merge(old, next)
			switch {
			case old == Failed || next == Failed:
				if got != Failed {
					t.Errorf("Merge(%v, %v) = %v, want Failed (terminal, always wins)", old, next, got)
				}
			case next > old:
				if got != next {
					t.Errorf("Merge(%v, %v) = %v, want %v", old, next, got, next)
				}
			default:
				if got != old {
					t.Errorf("Merge(%v, %v) = %v, want %v (never moves down)", old, next, got, old)
				}
			}
		}
	}
	// The reference numbering.
	if Failed != 0 || Bootstrapping != 1 || WaitingForInput != 2 || Transferring != 3 || Success != 4 {
		t.Fatal("KVPoll numbering differs from SGLang's")
	}
	if !Success.Terminal() || !Failed.Terminal() || Transferring.Terminal() {
		t.Fatal("Terminal")
	}
}

func TestTableLifecycle(t *testing.T) {
	var mu sync.Mutex
	var changes []Change
	tb := NewTable(func(c Change) { mu.Lock(); changes = append(changes, c); mu.Unlock() })
	if _, ok := tb.Update(7, WaitingForInput); ok {
		t.Fatal("Update created a room")
	}
	if !tb.Create(7, Bootstrapping) || tb.Create(7, WaitingForInput) {
		t.Fatal("Create")
	}
	if s, _ := tb.Get(7); s != WaitingForInput {
		t.Fatalf("Create on an existing room merges: got %v", s)
	}
	tb.Update(7, Bootstrapping) // never down
	tb.Update(7, Transferring)
	if s, _ := tb.Get(7); s != Transferring {
		t.Fatalf("got %v", s)
	}
	tb.Fail(7, "first")
	tb.Fail(7, "second")
	tb.Update(7, Success)
	if s, _ := tb.Get(7); s != Failed || tb.Reason(7) != "first" {
		t.Fatalf("got %v %q, want Failed with the first reason", s, tb.Reason(7))
	}
	tb.Remove(7)
	if tb.Fail(7, "late") || tb.Len() != 0 {
		t.Fatal("a late failure resurrected a removed room")
	}
	mu.Lock()
	defer mu.Unlock()
	want := []struct {
		from, to Status
		isNew    bool
	}{{Bootstrapping, Bootstrapping, true}, {Bootstrapping, WaitingForInput, false}, {WaitingForInput, Transferring, false}, {Transferring, Failed, false}}
	if len(changes) != len(want) {
		t.Fatalf("changes %+v", changes)
	}
	for i, w := range want {
		c := changes[i]
		if c.From != w.from || c.To != w.to || c.New != w.isNew || c.Room != 7 {
			t.Errorf("change %d = %+v, want %+v", i, c, w)
		}
	}
	if changes[3].Reason != "first" {
		t.Errorf("failure change carries %q", changes[3].Reason)
	}
}

func TestWait(t *testing.T) {
	tb := NewTable(nil)
	tb.Create(1, Bootstrapping)
	done := make(chan Status)
	go func() {
		s, ok, err := tb.Wait(context.Background(), 1, Status.Terminal)
		if !ok || err != nil {
			t.Error(ok, err)
		}
		done <- s
	}()
	time.Sleep(10 * time.Millisecond)
	tb.Update(1, Transferring)
	select {
	case s := <-done:
		t.Fatalf("woke at %v", s)
	case <-time.After(20 * time.Millisecond):
	}
	tb.Update(1, Success)
	if s := <-done; s != Success {
		t.Fatalf("got %v", s)
	}
	// Removal wakes a waiter; a cancelled context ends the wait.
	tb.Create(2, Bootstrapping)
	go func() { time.Sleep(10 * time.Millisecond); tb.Remove(2) }()
	if _, ok, _ := tb.Wait(context.Background(), 2, Status.Terminal); ok {
		t.Fatal("Wait on a removed room reported it present")
	}
	tb.Create(3, Bootstrapping)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, _, err := tb.Wait(ctx, 3, Status.Terminal); err == nil {
		t.Fatal("Wait ignored its context")
	}
}

func TestConcurrentUpdates(t *testing.T) {
	tb := NewTable(nil)
	for r := uint64(0); r < 64; r++ {
		tb.Create(r, Bootstrapping)
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := uint64(0); r < 64; r++ {
				for _, s := range []Status{WaitingForInput, Transferring, Success} {
					tb.Update(r, s)
				}
				if r%7 == 0 {
					tb.Fail(r, "x")
				}
			}
		}()
	}
	wg.Wait()
	for r := uint64(0); r < 64; r++ {
		s, _ := tb.Get(r)
		if (r%7 == 0) != (s == Failed) || (r%7 != 0 && s != Success) {
			t.Fatalf("room %d: %v", r, s)
		}
	}
}
