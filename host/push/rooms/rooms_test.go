package rooms

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

func TestMergeRules(t *testing.T) {
	all := []sglang.KVPoll{sglang.KVPollFailed, sglang.KVPollBootstrapping, sglang.KVPollWaitingForInput, sglang.KVPollTransferring, sglang.KVPollSuccess}
	for _, old := range all {
		for _, next := range all {
			got := Merge(old, next)
			switch {
			case old.Terminal():
				if got != old {
					t.Errorf("Merge(%v, %v) = %v, want %v (Success and Failed are final)", old, next, got, old)
				}
			case next == sglang.KVPollFailed:
				if got != sglang.KVPollFailed {
					t.Errorf("Merge(%v, %v) = %v, want Failed (wins over every unfinished status)", old, next, got)
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
}

func TestTableLifecycle(t *testing.T) {
	var mu sync.Mutex
	var changes []Change
	tb := NewTable(func(c Change) { mu.Lock(); changes = append(changes, c); mu.Unlock() })
	if _, ok := tb.Update(7, sglang.KVPollWaitingForInput); ok {
		t.Fatal("Update created a room")
	}
	if !tb.Create(7, sglang.KVPollBootstrapping) || tb.Create(7, sglang.KVPollWaitingForInput) {
		t.Fatal("Create")
	}
	if s, _ := tb.Get(7); s != sglang.KVPollWaitingForInput {
		t.Fatalf("Create on an existing room merges: got %v", s)
	}
	tb.Update(7, sglang.KVPollBootstrapping) // never down
	tb.Update(7, sglang.KVPollTransferring)
	if s, _ := tb.Get(7); s != sglang.KVPollTransferring {
		t.Fatalf("got %v", s)
	}
	if got, ok := tb.Fail(7, "first"); !ok || got != "first" {
		t.Fatalf("Fail = %q, %v", got, ok)
	}
	if got, ok := tb.Fail(7, "second"); !ok || got != "first" {
		t.Fatalf("second Fail = %q, %v: the first reason stays", got, ok)
	}
	tb.Update(7, sglang.KVPollSuccess)
	if s, _ := tb.Get(7); s != sglang.KVPollFailed || tb.Reason(7) != "first" {
		t.Fatalf("got %v %q, want Failed with the first reason", s, tb.Reason(7))
	}
	tb.Remove(7)
	if _, ok := tb.Fail(7, "late"); ok || tb.Len() != 0 {
		t.Fatal("a late failure resurrected a removed room")
	}
	mu.Lock()
	defer mu.Unlock()
	want := []struct {
		from, to sglang.KVPoll
		isNew    bool
	}{
		{sglang.KVPollBootstrapping, sglang.KVPollBootstrapping, true},
		{sglang.KVPollBootstrapping, sglang.KVPollWaitingForInput, false},
		{sglang.KVPollWaitingForInput, sglang.KVPollTransferring, false},
		{sglang.KVPollTransferring, sglang.KVPollFailed, false},
	}
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
	tb.Create(1, sglang.KVPollBootstrapping)
	done := make(chan sglang.KVPoll)
	go func() {
		s, ok, err := tb.Wait(context.Background(), 1, sglang.KVPoll.Terminal)
		if !ok || err != nil {
			t.Error(ok, err)
		}
		done <- s
	}()
	time.Sleep(10 * time.Millisecond)
	tb.Update(1, sglang.KVPollTransferring)
	select {
	case s := <-done:
		t.Fatalf("woke at %v", s)
	case <-time.After(20 * time.Millisecond):
	}
	tb.Update(1, sglang.KVPollSuccess)
	if s := <-done; s != sglang.KVPollSuccess {
		t.Fatalf("got %v", s)
	}
	// Removal wakes a waiter; a cancelled context ends the wait.
	tb.Create(2, sglang.KVPollBootstrapping)
	go func() { time.Sleep(10 * time.Millisecond); tb.Remove(2) }()
	if _, ok, _ := tb.Wait(context.Background(), 2, sglang.KVPoll.Terminal); ok {
		t.Fatal("Wait on a removed room reported it present")
	}
	tb.Create(3, sglang.KVPollBootstrapping)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, _, err := tb.Wait(ctx, 3, sglang.KVPoll.Terminal); err == nil {
		t.Fatal("Wait ignored its context")
	}
}

func TestConcurrentUpdates(t *testing.T) {
	tb := NewTable(nil)
	for r := uint64(0); r < 64; r++ {
		tb.Create(r, sglang.KVPollBootstrapping)
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := uint64(0); r < 64; r++ {
				// Rooms that fail never reach Success here: Success is
				// final, so a failure racing it could lose.
				for _, s := range []sglang.KVPoll{sglang.KVPollWaitingForInput, sglang.KVPollTransferring, sglang.KVPollSuccess} {
					if r%7 == 0 && s == sglang.KVPollSuccess {
						tb.Fail(r, "x")
						continue
					}
					tb.Update(r, s)
				}
			}
		}()
	}
	wg.Wait()
	for r := uint64(0); r < 64; r++ {
		s, _ := tb.Get(r)
		if (r%7 == 0) != (s == sglang.KVPollFailed) || (r%7 != 0 && s != sglang.KVPollSuccess) {
			t.Fatalf("room %d: %v", r, s)
		}
	}
}

// TestSuccessFinal: a room that succeeded does not fail: Fail reports
// nothing failed, no change is reported and no reason recorded.
func TestSuccessFinal(t *testing.T) {
	var changes []Change
	tb := NewTable(func(c Change) { changes = append(changes, c) })
	tb.Create(1, sglang.KVPollBootstrapping)
	tb.Update(1, sglang.KVPollSuccess)
	if got, ok := tb.Fail(1, "rank closed"); ok || got != "" {
		t.Fatalf("Fail on a Success room = %q, %v, want nothing failed", got, ok)
	}
	if s, _ := tb.Get(1); s != sglang.KVPollSuccess || tb.Reason(1) != "" {
		t.Fatalf("room after a late failure: %v %q, want Success", s, tb.Reason(1))
	}
	if n := len(changes); n != 2 || changes[1].To != sglang.KVPollSuccess {
		t.Fatalf("changes %+v, want created then Success", changes)
	}
}
