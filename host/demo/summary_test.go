package demo

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
)

// The summary reports the rate over the time transfers were in flight
// apart from the end-to-end rate (which includes filling and checking the
// synthetic KV), for both styles.
func TestSummaryTransferRate(t *testing.T) {
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	s := &Summary{Style: "sglang", Requests: 4, MemcpyGBps: 12.9}
	s.addPush(&pushworker.Summary{Bytes: 2e9, Transfers: 8, DurationSec: 10, TransferSec: 0.5}, nil)
	s.finish()
	if !near(s.GBps, 0.2) || !near(s.TransferGBps, 4) || s.TransferSeconds != 0.5 {
		t.Fatalf("push: end to end %v GB/s, transfer %v GB/s over %v s; want 0.2, 4 over 0.5", s.GBps, s.TransferGBps, s.TransferSeconds)
	}
	var b bytes.Buffer
	if err := s.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"transfer rate 4.00 GB/s over 0.500 s", "end to end    0.20 GB/s over 10.00 s", "raw memcpy on this machine: 12.90 GB/s"} {
		if !strings.Contains(out, want) {
			t.Errorf("text lacks %q:\n%s", want, out)
		}
	}

	// vllm: decode processes pull at once; their bytes add up over the
	// longest in-flight time.
	p := &Summary{Style: "vllm", Requests: 2}
	p.addPull(nil, []*pullworker.DecodeSummary{
		{Bytes: 1e9, Reads: 1, Seconds: 4, TransferSeconds: 0.25},
		{Bytes: 1e9, Reads: 1, Seconds: 5, TransferSeconds: 0.5},
	})
	p.finish()
	if !near(p.GBps, 0.4) || !near(p.TransferGBps, 4) {
		t.Fatalf("pull: end to end %v GB/s, transfer %v GB/s; want 0.4, 4", p.GBps, p.TransferGBps)
	}
}

// vllm: decode ranks that report their in-flight intervals are measured
// over the union of them all (the time any rank's READ was in flight), as
// a sidecar hosting every rank measures it; not over the longest rank's.
func TestSummaryPullInFlightUnion(t *testing.T) {
	ms := func(n int64) int64 { return 1_000_000_000_000 + n*1_000_000 }
	p := &Summary{Style: "vllm", Requests: 2}
	p.addPull(nil, []*pullworker.DecodeSummary{
		{Bytes: 1e9, Reads: 1, Seconds: 4, TransferSeconds: 0.25, InFlight: [][2]int64{{ms(0), ms(250)}}},
		{Bytes: 1e9, Reads: 1, Seconds: 5, TransferSeconds: 0.5, InFlight: [][2]int64{{ms(100), ms(350)}, {ms(400), ms(650)}}},
	})
	p.finish()
	if math.Abs(p.TransferSeconds-0.6) > 1e-9 || math.Abs(p.TransferGBps-2e9/0.6/1e9) > 1e-9 {
		t.Fatalf("transfer %v s, %v GB/s; want the union 0.6 s", p.TransferSeconds, p.TransferGBps)
	}
}
