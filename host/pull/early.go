package pull

import (
	"container/heap"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
)

// Early notifications. An engine may hand a request's kv_transfer_params
// to its decode before the prefill's hold is processed (the vLLM adapter
// pipelines hold, issue 24), and a decode that reads at once can notify
// first. vLLM's own NIXL worker keeps such notifications
// (consumer_notification_counts_by_req outlives _reqs_to_send); so does
// the Sender: a READ notification naming no held request is kept, and
// Hold applies the kept notifications of its request, which is released
// "notified" at once when they were all of them. Peers may name ids that
// never come, so what is kept is bounded in ids (MaxEarlyRequests), in
// notifications per id (MaxNotifiers per hosted rank, each agent once), in
// bytes (maxEarlyBytes) and in time (the hold: abort timeout or lease);
// past a bound a notification is dropped as before, and nothing kept is
// evicted for it.
//
// Heartbeats need no keeping: a heartbeat moves a deadline to now +
// lease*2/3, and a hold made later starts with now + lease.

// MaxEarlyRequests bounds the request ids whose early notifications a
// Sender keeps at once.
const MaxEarlyRequests = 1 << 16

// maxEarlyBytes bounds the bytes of the early notifications kept at once
// (ids and agent names plus earlyNotifOverhead each).
const maxEarlyBytes = 16 << 20

// earlyNotifOverhead is what one kept notification costs beyond its id
// and agent name (struct, slice and map slots), counted in maxEarlyBytes.
const earlyNotifOverhead = 64

// earlyReq is the notifications kept for one request not held yet.
type earlyReq struct {
	seq    uint64
	notifs []earlyNotif
	bytes  int
}

type earlyNotif struct {
	rank      int // hosted rank (index into Sender.ranks)
	from      string
	consumers int
}

// keepEarlyLocked keeps a READ notification for request id, not held, and
// reports whether it did; why says otherwise.
func (s *Sender) keepEarlyLocked(i int, n plugin.Notif, id string, consumers int, now time.Time) (kept bool, why string) {
	e := s.early[id]
	cost := len(n.From) + earlyNotifOverhead
	if e == nil {
		cost += len(id)
	}
	switch {
	case e == nil && len(s.early) >= s.earlyMax:
		return false, "too many requests with early notifications"
	case s.earlyBytes+cost > s.earlyMaxBytes:
		return false, "early notifications use their bytes"
	}
	if e != nil {
		onRank := 0
		for _, en := range e.notifs {
			if en.rank != i {
				continue
			}
			if en.from == n.From {
				return false, "agent already notified this request"
			}
			onRank++
		}
		if onRank >= MaxNotifiers {
			return false, "too many notifying agents"
		}
	} else {
		s.seq++
		e = &earlyReq{seq: s.seq}
		s.early[id] = e
		heap.Push(&s.earlyExpiries, expiry{id: id, seq: e.seq, at: now.Add(s.hold)})
		s.wakeLocked()
	}
	e.notifs = append(e.notifs, earlyNotif{rank: i, from: n.From, consumers: consumers})
	e.bytes += cost
	s.earlyBytes += cost
	s.counts.EarlyKept++
	return true, ""
}

// takeEarlyLocked applies to h, just held, the notifications kept for
// its request and reports whether every hosted rank is done.
func (s *Sender) takeEarlyLocked(id string, h *heldReq) bool {
	e := s.early[id]
	if e == nil {
		return false
	}
	s.dropEarlyLocked(id, e)
	for _, en := range e.notifs {
		if why, _ := s.countLocked(en.rank, en.from, en.consumers, h); why == "" {
			s.counts.EarlyApplied++
		}
	}
	return h.ranksDone == len(s.ranks)
}

func (s *Sender) dropEarlyLocked(id string, e *earlyReq) {
	delete(s.early, id)
	s.earlyBytes -= e.bytes
}

// expireEarlyLocked drops the early notifications kept past their time:
// their request was never held.
func (s *Sender) expireEarlyLocked(now time.Time) {
	for len(s.earlyExpiries) > 0 && !now.Before(s.earlyExpiries[0].at) {
		x := heap.Pop(&s.earlyExpiries).(expiry)
		e, ok := s.early[x.id]
		if !ok || e.seq != x.seq {
			continue
		}
		s.dropEarlyLocked(x.id, e)
		s.counts.EarlyExpired += len(e.notifs)
		s.log.Error("potentially invalid KV blocks for an unrecognized request were read by a decode worker; it was not held when they came, nor in time after",
			"request_id", x.id, "notifications", len(e.notifs))
		for range e.notifs {
			s.obs.BadNotification(NotifUnknown)
		}
	}
}
