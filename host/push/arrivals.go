package push

import (
	"fmt"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// Limits on what one room's notifications may make a decode worker keep, so
// a faulty or hostile peer cannot grow memory without bound.
const (
	maxChunkID  = 1 << 20 // chunk ids are small counters in the reference
	maxParts    = 64      // memory-kind segments of one chunk
	maxSenders  = 1 << 12 // distinct prefill ranks answering one room
	maxChunkSet = 1 << 16 // chunks remembered per prefill rank
)

// arrivals is what a decode rank has received for one room through
// transfer notifications: SGLang NIXL's TransferStatus, with the same
// completion rule (is_done). Keys named pp are the sender id that the
// prefill rank puts in its tags (the reference's "pp_rank" field). Not safe
// for concurrent use; the decode manager guards it.
type arrivals struct {
	receivedKV  map[int]map[int]struct{} // sender -> chunk ids received
	expectedKV  map[int]int              // sender -> chunk count (set by the last chunk or aux nokv)
	numExpected int                      // senders expected; 0 until known
	// auxFrom holds the agents that sent aux. SGLang marks aux received on
	// the first one; kvhost waits for one per expected sender, because
	// every prefill rank that sends KV also writes the aux slot, and a late
	// write from a slower rank (another PP stage) must not land after the
	// room completed and the slot went to another request.
	auxFrom       map[string]struct{}
	receivedState map[int]struct{} // senders whose state arrived
	expectsState  bool
	parts         map[[2]int]*partSet // (sender, chunk) of mixed-kind chunks
}

type partSet struct {
	n    int
	seen uint64 // bit i: part i arrived (n <= 64)
	cnt  int
}

// apply records one notification from agent from. responses is the number
// of prefill ranks that answer this room (required_prefill_response_num).
// An error means the notification contradicts what arrived before; the
// caller fails the room.
func (a *arrivals) apply(n sglang.Notif, from string, responses int) error {
	switch n.Kind {
	case sglang.NotifKV:
		if n.NumParts > 1 {
			return a.part(n, responses)
		}
		return a.kv(n.Chunk, n.Last, n.PPRank, responses)
	case sglang.NotifAux:
		if a.auxFrom == nil {
			a.auxFrom = make(map[string]struct{})
		}
		if _, ok := a.auxFrom[from]; !ok && len(a.auxFrom) >= maxSenders {
			return fmt.Errorf("more than %d prefill ranks sent aux", maxSenders)
		}
		a.auxFrom[from] = struct{}{}
		if n.NoKV {
			if err := a.checkSender(n.PPRank); err != nil {
				return err
			}
			if a.expectedKV == nil {
				a.expectedKV = make(map[int]int)
			}
			a.expectedKV[n.PPRank] = 0
		}
		a.learnExpected(responses)
	case sglang.NotifState:
		if err := a.checkSender(n.PPRank); err != nil {
			return err
		}
		if a.receivedState == nil {
			a.receivedState = make(map[int]struct{})
		}
		a.receivedState[n.PPRank] = struct{}{}
	default:
		return fmt.Errorf("notification kind %v is not supported (staging)", n.Kind)
	}
	return nil
}

func (a *arrivals) learnExpected(responses int) {
	if a.numExpected == 0 {
		a.numExpected = max(responses, 1)
	}
}

func (a *arrivals) checkSender(pp int) error {
	if pp < 0 {
		return fmt.Errorf("negative sender rank %d", pp)
	}
	if len(a.receivedKV) >= maxSenders || len(a.expectedKV) >= maxSenders {
		if _, ok := a.receivedKV[pp]; !ok {
			if _, ok := a.expectedKV[pp]; !ok {
				return fmt.Errorf("more than %d prefill ranks sent to one room", maxSenders)
			}
		}
	}
	return nil
}

func (a *arrivals) kv(chunk int, last bool, pp, responses int) error {
	if chunk < 0 || chunk >= maxChunkID {
		return fmt.Errorf("chunk id %d out of range", chunk)
	}
	if err := a.checkSender(pp); err != nil {
		return err
	}
	if a.receivedKV == nil {
		a.receivedKV = make(map[int]map[int]struct{})
	}
	set := a.receivedKV[pp]
	if set == nil {
		set = make(map[int]struct{})
		a.receivedKV[pp] = set
	}
	if len(set) >= maxChunkSet {
		return fmt.Errorf("more than %d chunks from prefill rank %d", maxChunkSet, pp)
	}
	set[chunk] = struct{}{}
	if last {
		if a.expectedKV == nil {
			a.expectedKV = make(map[int]int)
		}
		a.expectedKV[pp] = chunk + 1
		a.learnExpected(responses)
	}
	return nil
}

// part tracks one memory-kind segment of a chunk; the chunk counts once
// every part arrived (_track_kv_part_arrival).
func (a *arrivals) part(n sglang.Notif, responses int) error {
	if n.NumParts > maxParts || n.Part < 0 || n.Part >= n.NumParts {
		return fmt.Errorf("KV part %d of %d out of range (chunk %d, prefill rank %d)", n.Part, n.NumParts, n.Chunk, n.PPRank)
	}
	if a.parts == nil {
		a.parts = make(map[[2]int]*partSet)
	}
	key := [2]int{n.PPRank, n.Chunk}
	ps := a.parts[key]
	if ps == nil {
		if len(a.parts) >= maxChunkSet {
			return fmt.Errorf("more than %d chunks with missing parts", maxChunkSet)
		}
		ps = &partSet{n: n.NumParts}
		a.parts[key] = ps
	}
	if ps.n != n.NumParts {
		return fmt.Errorf("KV part count mismatch for chunk %d of prefill rank %d: got %d, expected %d", n.Chunk, n.PPRank, n.NumParts, ps.n)
	}
	if bit := uint64(1) << uint(n.Part); ps.seen&bit == 0 {
		ps.seen |= bit
		ps.cnt++
	}
	if ps.cnt < ps.n {
		return nil
	}
	delete(a.parts, key)
	return a.kv(n.Chunk, n.Last, n.PPRank, responses)
}

// done is TransferStatus.is_done, with aux counted per sender.
func (a *arrivals) done() bool {
	if a.numExpected == 0 || len(a.auxFrom) < a.numExpected {
		return false
	}
	if a.expectsState && len(a.receivedState) < a.numExpected {
		return false
	}
	if len(a.expectedKV) < a.numExpected {
		return false
	}
	for pp, want := range a.expectedKV {
		if len(a.receivedKV[pp]) != want {
			return false
		}
	}
	return true
}
