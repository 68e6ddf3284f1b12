package push

import (
	"fmt"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// Limits on what one room's notifications may make a decode worker keep, so
// a faulty or hostile peer cannot grow memory without bound.
const (
	maxChunkID  = 1 << 20 // chunk ids are small counters in SGLang's disaggregation/{nixl,mori}/conn.py
	maxParts    = 64      // memory-kind segments of one chunk
	maxSenders  = 1 << 12 // ranks on one side of a room (the prefill's bound on required_dst_info_num)
	maxChunkSet = 1 << 16 // chunks remembered per prefill rank
)

// arrivals is what a decode rank has received for one room through
// transfer notifications: SGLang NIXL's TransferStatus, with the same
// completion rule (is_done), counted per sender. A sender is one of the
// room's data-sending prefill ranks, identified by the agent its
// notifications come from (Decode.senderSlot), not by the rank a tag
// names: SGLang's disaggregation/{nixl,mori}/conn.py keys its maps by the tag's "pp_rank" field, which
// any agent can write. Not safe for concurrent use; the receiver guards
// it.
type arrivals struct {
	senders    int                      // prefill ranks that send the room data
	receivedKV map[int]map[int]struct{} // sender -> chunk ids received
	expectedKV map[int]int              // sender -> chunk count (set by the last chunk or aux nokv)
	// auxFrom holds the senders that sent aux. SGLang marks aux received
	// on the first one; kvhost waits for every sender, because every
	// prefill rank that sends KV also writes the aux slot, and a late
	// write from a slower rank (another PP stage) must not land after the
	// room completed and the slot went to another request.
	auxFrom       map[int]struct{}
	receivedState map[int]struct{} // senders whose state arrived
	expectsState  bool
	parts         map[[2]int]*partSet // (sender, chunk) of mixed-kind chunks
}

type partSet struct {
	n    int
	seen uint64 // bit i: part i arrived (n <= 64)
	cnt  int
}

// apply records one notification from sender (an index below limit, the
// number of the room's prefill ranks). An error means the notification
// contradicts what arrived before; the caller fails the room.
func (a *arrivals) apply(n sglang.Notif, sender, limit int) error {
	if sender < 0 || sender >= limit {
		return fmt.Errorf("sender %d of %d", sender, limit)
	}
	switch n.Kind {
	case sglang.NotifKV:
		if n.NumParts > 1 {
			return a.part(n, sender)
		}
		return a.kv(n.Chunk, n.Last, sender)
	case sglang.NotifAux:
		if a.auxFrom == nil {
			a.auxFrom = make(map[int]struct{})
		}
		a.auxFrom[sender] = struct{}{}
		if n.NoKV {
			if a.expectedKV == nil {
				a.expectedKV = make(map[int]int)
			}
			a.expectedKV[sender] = 0
		}
	case sglang.NotifState:
		if a.receivedState == nil {
			a.receivedState = make(map[int]struct{})
		}
		a.receivedState[sender] = struct{}{}
	default:
		return fmt.Errorf("notification kind %v is not supported (staging)", n.Kind)
	}
	return nil
}

func (a *arrivals) kv(chunk int, last bool, sender int) error {
	if chunk < 0 || chunk >= maxChunkID {
		return fmt.Errorf("chunk id %d out of range", chunk)
	}
	if a.receivedKV == nil {
		a.receivedKV = make(map[int]map[int]struct{})
	}
	set := a.receivedKV[sender]
	if set == nil {
		set = make(map[int]struct{})
		a.receivedKV[sender] = set
	}
	if _, ok := set[chunk]; !ok && len(set) >= maxChunkSet {
		return fmt.Errorf("more than %d chunks from one prefill rank", maxChunkSet)
	}
	set[chunk] = struct{}{}
	if last {
		if a.expectedKV == nil {
			a.expectedKV = make(map[int]int)
		}
		a.expectedKV[sender] = chunk + 1
	}
	return nil
}

// part tracks one memory-kind segment of a chunk; the chunk counts once
// every part arrived (_track_kv_part_arrival).
func (a *arrivals) part(n sglang.Notif, sender int) error {
	if n.NumParts > maxParts || n.Part < 0 || n.Part >= n.NumParts {
		return fmt.Errorf("KV part %d of %d out of range (chunk %d)", n.Part, n.NumParts, n.Chunk)
	}
	if a.parts == nil {
		a.parts = make(map[[2]int]*partSet)
	}
	key := [2]int{sender, n.Chunk}
	ps := a.parts[key]
	if ps == nil {
		if len(a.parts) >= maxChunkSet {
			return fmt.Errorf("more than %d chunks with missing parts", maxChunkSet)
		}
		ps = &partSet{n: n.NumParts}
		a.parts[key] = ps
	}
	if ps.n != n.NumParts {
		return fmt.Errorf("KV part count mismatch for chunk %d: got %d, expected %d", n.Chunk, n.NumParts, ps.n)
	}
	if bit := uint64(1) << uint(n.Part); ps.seen&bit == 0 {
		ps.seen |= bit
		ps.cnt++
	}
	if ps.cnt < ps.n {
		return nil
	}
	delete(a.parts, key)
	return a.kv(n.Chunk, n.Last, sender)
}

// done is TransferStatus.is_done, with every sender counted: each sent
// aux, its last chunk (or aux nokv), every chunk before it, and its state
// when the room expects state.
func (a *arrivals) done() bool {
	n := max(a.senders, 1)
	if len(a.auxFrom) < n || len(a.expectedKV) < n {
		return false
	}
	if a.expectsState && len(a.receivedState) < n {
		return false
	}
	for s, want := range a.expectedKV {
		if len(a.receivedKV[s]) != want {
			return false
		}
	}
	return true
}
