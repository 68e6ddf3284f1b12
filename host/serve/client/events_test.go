package client

import (
	"testing"
	"time"
)

// TestEventQueueOrder: events reach the channel in push order whether
// they go straight onto it or through pump (a consumer that falls behind
// by more than the channel's buffer), and the channel closes after the
// last one.
func TestEventQueueOrder(t *testing.T) {
	q := newEventQueue()
	defer close(q.quit)
	const n = 20 * eventBuffer
	go func() {
		for i := range n {
			q.push(Event{Room: uint64(i)})
			if i%1000 == 999 {
				time.Sleep(time.Millisecond) // let the consumer catch up: the direct path again
			}
		}
		q.close()
	}()
	for i := range n {
		if i%(eventBuffer+7) == 0 {
			time.Sleep(time.Millisecond) // fall behind: pump's path
		}
		select {
		case e, ok := <-q.out:
			if !ok || e.Room != uint64(i) {
				t.Fatalf("event %d: got room %d (open %v)", i, e.Room, ok)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("event %d: none", i)
		}
	}
	select {
	case e, ok := <-q.out:
		if ok {
			t.Fatalf("after the last: %+v", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("channel not closed")
	}
}
