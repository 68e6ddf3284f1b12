package push

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

func tag(t *testing.T, s string) sglang.Notif {
	t.Helper()
	n, err := sglang.ParseNotif([]byte(s))
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}

// TestArrivals replays notification sequences through the tracker and
// checks TransferStatus.is_done after every step. "1:tag" is a tag from
// the room's second sender (prefill rank), a plain tag from the first.
func TestArrivals(t *testing.T) {
	cases := []struct {
		name    string
		senders int
		state   bool
		tags    []string
		doneAt  int // index of the tag after which done() turns true; -1 never
	}{
		{"one sender, three chunks", 1, false, []string{"5_kv_0_0_0", "5_kv_1_0_0", "5_kv_2_1_0", "5_aux"}, 3},
		{"aux first, last chunk early", 1, false, []string{"5_aux", "5_kv_2_1_0", "5_kv_0_0_0", "5_kv_1_0_0"}, 3},
		{"missing chunk", 1, false, []string{"5_kv_0_0_0", "5_kv_2_1_0", "5_aux"}, -1},
		{"two senders (PP or TP fan-in)", 2, false, []string{"5_kv_0_1_0", "5_aux", "1:5_kv_0_0_1", "1:5_kv_1_1_1", "1:5_aux"}, 4},
		{"two senders, one missing", 2, false, []string{"5_kv_0_1_0", "5_aux", "1:5_kv_0_0_1", "1:5_aux"}, -1},
		{"two senders, aux from one only", 2, false, []string{"5_kv_0_1_0", "5_aux", "1:5_kv_0_0_1", "1:5_kv_1_1_1", "5_aux"}, -1},
		// The rank a tag names does not make another sender.
		{"one sender naming two ranks", 2, false, []string{"5_kv_0_1_0", "5_kv_0_1_1", "5_aux", "5_aux"}, -1},
		{"full prefix hit", 1, false, []string{"5_aux_nokv_0"}, 0},
		// Aux must come from both stages (SGLang's disaggregation/{nixl,mori}/conn.py takes any one).
		{"prefix hit on one stage", 2, false, []string{"1:5_aux_nokv_1", "5_kv_0_1_0", "5_aux"}, 2},
		{"state expected", 1, true, []string{"5_kv_0_1_0", "5_aux", "5_state_0_0"}, 2},
		{"state missing", 1, true, []string{"5_kv_0_1_0", "5_aux"}, -1},
		{"mixed-kind parts", 1, false, []string{"5_kv_0_1_0_part_0_2", "5_aux", "5_kv_0_1_0_part_1_2"}, 2},
		{"duplicate part", 1, false, []string{"5_kv_0_1_0_part_0_2", "5_kv_0_1_0_part_0_2", "5_aux"}, -1},
		{"duplicate chunk", 1, false, []string{"5_kv_0_0_0", "5_kv_0_0_0", "5_kv_2_1_0", "5_aux"}, -1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := arrivals{senders: c.senders, expectsState: c.state}
			got := -1
			for i, s := range c.tags {
				from := 0
				if f, rest, ok := strings.Cut(s, ":"); ok {
					from, _ = strconv.Atoi(f)
					s = rest
				}
				if err := a.apply(tag(t, s), from, c.senders); err != nil {
					t.Fatalf("%q: %v", s, err)
				}
				if a.done() && got < 0 {
					got = i
				}
			}
			if got != c.doneAt {
				t.Fatalf("done after tag %d, want %d", got, c.doneAt)
			}
		})
	}
}

func TestArrivalsRejects(t *testing.T) {
	a := arrivals{senders: 1}
	if err := a.apply(tag(t, "5_kv_0_0_0_part_0_2"), 0, 1); err != nil {
		t.Fatal(err)
	}
	if err := a.apply(tag(t, "5_kv_0_0_0_part_1_3"), 0, 1); err == nil {
		t.Fatal("a part count that changed was accepted")
	}
	if err := a.apply(sglang.Notif{Kind: sglang.NotifKV, Chunk: maxChunkID}, 0, 1); err == nil {
		t.Fatal("a huge chunk id was accepted")
	}
	if err := a.apply(sglang.Notif{Kind: sglang.NotifKV}, 1, 1); err == nil {
		t.Fatal("a sender past the room's prefill ranks was accepted")
	}
	if err := a.apply(sglang.Notif{Kind: sglang.NotifStaging}, 0, 1); err == nil {
		t.Fatal("staging was accepted")
	}
	// Memory stays bounded whatever a peer sends.
	b := arrivals{senders: 1}
	var err error
	for i := 0; i < 2*maxChunkSet && err == nil; i++ {
		err = b.apply(sglang.Notif{Kind: sglang.NotifKV, Chunk: i}, 0, 1)
	}
	if err == nil || len(b.receivedKV[0]) > maxChunkSet {
		t.Fatalf("chunks not bounded: %d kept, err %v", len(b.receivedKV[0]), err)
	}
}
