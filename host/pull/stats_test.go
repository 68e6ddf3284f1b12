package pull

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"testing"
	"time"
)

// TestReduce checks the summary against numpy's values for the same data
// (computed with vLLM's kv_connector/v1/nixl_connector.py's formulas).
func TestReduce(t *testing.T) {
	var s Stats
	if got := s.Reduce(); got != (Summary{}) || !s.IsEmpty() {
		t.Fatalf("empty: %+v", got)
	}
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	for i, x := range []float64{1, 2, 3, 4, 10} {
		s.RecordTransfer(TransferStat{Xfer: ms(x), Post: ms(float64(i+1) / 10), Bytes: uint64(i+1) << 20, Descs: uint64(10 * (i + 1))})
	}
	s.Transfers[4].Descs = 51
	s.RecordFailedTransfer()
	s.RecordFailedNotification()
	s.RecordFailedNotification()
	want := Summary{NumSuccessfulTransfers: 5, AvgXferMs: 4, P90XferMs: 7.6, AvgPostMs: 0.3, P90PostMs: 0.46,
		AvgMBPerTransfer: 3, ThroughputMBs: 750, AvgDescriptors: 30.2, NumFailedTransfers: 1, NumFailedNotifications: 2}
	if got := s.Reduce(); got != want {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
	b, _ := json.Marshal(want)
	for _, key := range []string{"Num successful transfers", "Avg xfer time (ms)", "P90 xfer time (ms)", "Avg post time (ms)",
		"P90 post time (ms)", "Avg MB per transfer", "Throughput (MB/s)", "Avg number of descriptors"} {
		if !bytes.Contains(b, []byte(`"`+key+`"`)) {
			t.Errorf("summary JSON lacks vLLM's kv_connector/v1/nixl_connector.py key %q: %s", key, b)
		}
	}

	var agg Stats
	agg.Aggregate(s.CloneAndReset())
	agg.Aggregate(Stats{FailedTransfers: 2})
	if !s.IsEmpty() || len(agg.Transfers) != 5 || agg.FailedTransfers != 3 || agg.FailedNotifications != 2 {
		t.Fatalf("after CloneAndReset and Aggregate: %+v / %+v", s, agg)
	}
	if (&Stats{FailedTransfers: 1}).IsEmpty() {
		t.Fatal("failures alone count as not empty")
	}
}

// TestReorderBlock builds what a READ leaves in a decode block (bsr
// prefill-shaped chunks, by the definition in reorder.go, written here
// independently per element) and checks that reorderBlock yields the
// decode layout.
func TestReorderBlock(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, c := range []struct {
		parts, heads, bd, bsr, d int
		hnd                      bool
	}{
		{1, 4, 16, 2, 8, true}, {1, 1, 8, 4, 3, true}, {2, 2, 16, 2, 4, true}, {2, 3, 12, 3, 2, false},
		{2, 1, 4, 4, 5, true}, {1, 2, 8, 2, 4, false}, {2, 4, 32, 8, 2, true},
	} {
		partLen := c.heads * c.bd * c.d
		n := c.parts * partLen
		want := make([]byte, n)
		for i := range want {
			want[i] = byte(rng.Uint32())
		}
		bp := c.bd / c.bsr
		// offset of (head h, token t) in a part of bs tokens
		at := func(h, t, bs int) int {
			if c.hnd {
				return (h*bs + t) * c.d
			}
			return (t*c.heads + h) * c.d
		}
		got := make([]byte, n)
		for ch := 0; ch < c.bsr; ch++ {
			for p := 0; p < c.parts; p++ {
				for h := 0; h < c.heads; h++ {
					for tk := 0; tk < bp; tk++ {
						src := p*partLen + at(h, ch*bp+tk, c.bd)
						dst := ch*(n/c.bsr) + p*(partLen/c.bsr) + at(h, tk, bp)
						copy(got[dst:dst+c.d], want[src:src+c.d])
					}
				}
			}
		}
		reorderBlock(got, make([]byte, n), c.parts, c.heads, c.bd, c.bsr, c.hnd)
		if !bytes.Equal(got, want) {
			t.Errorf("%+v: reordered block differs", c)
		}
	}
}
