package pull

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

// TestReduce checks the summary against numpy's values for the same data
// (computed with the reference's formulas).
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
			t.Errorf("summary JSON lacks the reference key %q: %s", key, b)
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

func TestPercentile(t *testing.T) {
	for _, c := range []struct {
		v    []float64
		q    float64
		want float64
	}{
		{nil, 90, 0},
		{[]float64{5}, 90, 5},
		{[]float64{3, 1, 2}, 50, 2},
		{[]float64{1, 2, 3, 4}, 99, 3.97},
		{[]float64{4, 3, 2, 1}, 0, 1},
		{[]float64{4, 3, 2, 1}, 100, 4},
	} {
		in := append([]float64(nil), c.v...)
		if got := Percentile(c.v, c.q); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("Percentile(%v, %v) = %v, want %v", c.v, c.q, got, c.want)
		}
		if !reflect.DeepEqual(in, c.v) {
			t.Errorf("Percentile sorted its input")
		}
	}
}

// TestMetricSpecs: the reference's names, kinds and buckets.
func TestMetricSpecs(t *testing.T) {
	specs := MetricSpecs()
	byName := map[string]MetricSpec{}
	for _, s := range specs {
		byName[s.Name] = s
		if s.Reference != "vllm:"+s.Name {
			t.Errorf("%s: reference name %s", s.Name, s.Reference)
		}
	}
	times := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	want := map[string][]float64{
		"nixl_xfer_time_seconds": times[1:],
		"nixl_post_time_seconds": times,
		"nixl_bytes_transferred": {2048, 8192, 32768, 131072, 524288, 2097152, 8388608, 33554432, 134217728, 536870912,
			2147483648, 8589934592},
		"nixl_num_descriptors":          {10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000},
		"nixl_num_failed_transfers":     nil,
		"nixl_num_failed_notifications": nil,
	}
	if len(specs) != len(want) {
		t.Fatalf("%d specs", len(specs))
	}
	for name, buckets := range want {
		s, ok := byName[name]
		if !ok {
			t.Fatalf("no %s", name)
		}
		if (buckets == nil) != (s.Kind == Counter) || !reflect.DeepEqual(s.Buckets, buckets) {
			t.Errorf("%s: %s %v", name, s.Kind, s.Buckets)
		}
	}
	specs[0].Buckets[0] = 99
	if MetricSpecs()[0].Buckets[0] == 99 {
		t.Fatal("MetricSpecs shares its slices")
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
