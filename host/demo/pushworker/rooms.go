package pushworker

import (
	"sync"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// RoomCounter calls count once per KVPoll state (by its reference name)
// with the number of rooms the worker holds in that state now.
type RoomCounter func(count func(state string, n int))

// roomPoller is a room a rank holds: a push Sender or Receiver.
type roomPoller interface{ Poll() sglang.KVPoll }

// liveRooms is the set of rooms a worker's ranks hold now. Safe for
// concurrent use.
type liveRooms struct {
	mu  sync.Mutex
	set map[roomPoller]struct{}
}

func newLiveRooms() *liveRooms { return &liveRooms{set: map[roomPoller]struct{}{}} }

// hold adds r until the returned function is called (before r is closed).
func (l *liveRooms) hold(r roomPoller) (release func()) {
	l.mu.Lock()
	l.set[r] = struct{}{}
	l.mu.Unlock()
	return func() {
		l.mu.Lock()
		delete(l.set, r)
		l.mu.Unlock()
	}
}

// count is the worker's RoomCounter. It polls under the lock, so no room
// is polled after its release.
func (l *liveRooms) count(fn func(state string, n int)) {
	var n [sglang.KVPollSuccess + 1]int
	l.mu.Lock()
	for r := range l.set {
		if st := r.Poll(); st >= 0 && st <= sglang.KVPollSuccess {
			n[st]++
		}
	}
	l.mu.Unlock()
	for st := sglang.KVPollFailed; st <= sglang.KVPollSuccess; st++ {
		fn(st.String(), n[st])
	}
}
