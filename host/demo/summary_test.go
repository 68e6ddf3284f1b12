package demo

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/schedstat"
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

// Separate processes: the workers' own measures add up; one that reported
// none leaves the whole unreported (null), saying why, not a part passed
// off as the whole.
func TestSummaryWorkerCPU(t *testing.T) {
	a := &schedstat.Usage{RunSeconds: 1.5, WaitSeconds: 0.5, Timeslices: 10, Threads: 3}
	b := &schedstat.Usage{RunSeconds: 0.5, WaitSeconds: 1.5, Timeslices: 20, Threads: 2}
	s := &Summary{Style: "sglang", Requests: 1}
	s.sumWorkerCPU([]*schedstat.Usage{a, b}, " (the bootstrap server's not counted)")
	if s.CPURunSeconds == nil || *s.CPURunSeconds != 2 || *s.CPUWaitSeconds != 2 || *s.CPUWaitPerRun != 1 {
		t.Fatalf("sum: %+v", s)
	}
	var out bytes.Buffer
	s.WriteText(&out)
	if want := "threads ran 2.00 s and waited 2.00 s for a core (wait/run 1.00): the 2 worker processes' threads"; !strings.Contains(out.String(), want) {
		t.Errorf("text lacks %q:\n%s", want, out.String())
	}
	js, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"cpu_run_seconds":2,"cpu_wait_seconds":2,"cpu_wait_per_run":1`) {
		t.Errorf("JSON: %s", js)
	}

	s.sumWorkerCPU([]*schedstat.Usage{a, nil}, "")
	if s.CPURunSeconds != nil || s.CPUWaitSeconds != nil || s.CPUWaitPerRun != nil || !strings.Contains(s.CPUScope, "not measured") {
		t.Fatalf("one worker unreported: %+v", s)
	}
	if js, _ := json.Marshal(s); !strings.Contains(string(js), `"cpu_run_seconds":null,"cpu_wait_seconds":null`) {
		t.Errorf("JSON of an unmeasured run: %s", js)
	}
	out.Reset()
	s.WriteText(&out)
	if !strings.Contains(out.String(), "CPU           not measured: 1 of 2 worker processes reported theirs") {
		t.Errorf("text of an unmeasured run:\n%s", out.String())
	}
}
