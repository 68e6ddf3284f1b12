package pullworker

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
)

// TestSoak is the heavy run, off unless KVHOST_SOAK=1: a prefill process
// (TP 2) and this process decoding (TP 4) with KVHOST_SOAK_CONCURRENCY
// requests in flight (default 1000) over KVHOST_SOAK_REQUESTS requests
// (default 5000), prefix hits included, every byte verified; then the same
// with injected READ failures and dropped notifications, where every
// failed or unnotified request must be freed on expiry and nothing leak.
//
//	KVHOST_SOAK=1 go test ./host/demo/pullworker -run Soak -v -timeout 20m
func TestSoak(t *testing.T) {
	if os.Getenv("KVHOST_SOAK") != "1" {
		t.Skip("set KVHOST_SOAK=1 for the soak run")
	}
	requests := envInt(t, "KVHOST_SOAK_REQUESTS", 5000)
	conc := envInt(t, "KVHOST_SOAK_CONCURRENCY", 1000)
	work := Workload{Seed: 77, Requests: requests, MinTokens: 1, MaxTokens: 64, PartialHitRate: 0.2, FullHitRate: 0.1}
	blocks := conc*4 + 256 // 64 tokens are at most 4 blocks of 16
	for _, c := range []struct {
		name   string
		params []string
		abort  time.Duration
	}{
		{name: "clean"},
		{name: "faults", params: []string{"fail_rate=0.02", "drop_notif_rate=0.02", "fail_seed=3"}, abort: 2 * time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			abort := c.abort
			if abort == 0 {
				abort = 5 * time.Minute
			}
			e := Engine{TPSize: 2, BlockSize: 16, NumBlocks: blocks, Layout: "HND"}
			pc := startChild(t, "prefill", childSpec{Model: smallModel, Engine: e, EngineID: "soak-prefill", AbortTimeout: abort, Workload: work})
			var ready struct{ API string }
			pc.line(t, &ready)
			params := parseParams(t, c.params)
			ctx, cancel := context.WithTimeout(t.Context(), 15*time.Minute)
			defer cancel()
			start := time.Now()
			ds, err := RunDecode(ctx, DecodeConfig{Plugin: faketest.Plugin(t), AgentParams: params, Model: smallModel,
				Engine: Engine{TPSize: 4, BlockSize: 16, NumBlocks: blocks, Layout: "HND"}, EngineID: "soak-decode",
				PrefillURL: "http://" + ready.API, Workload: work, Concurrency: conc, ReadTimeout: time.Minute, Logger: testLog()})
			if err != nil {
				t.Fatal(err)
			}
			var ps PrefillSummary
			pc.line(t, &ps)
			t.Logf("%s: %d requests (%d in flight) in %v: %d ok, %d failed; %d reads, %d notify-only, %.1f MB, %.3f GB/s; "+
				"transfer p50/p99 %.3f/%.3f ms, request p50/p99 %.1f/%.1f ms; prefill: %d notified, %d expired, %d unknown notifications",
				c.name, ds.Requests, conc, time.Since(start).Round(time.Millisecond), ds.OK, ds.Failed, ds.Reads, ds.NotifyOnly,
				float64(ds.Bytes)/1e6, ds.GBps, ds.TransferMs.P50, ds.TransferMs.P99, ds.RequestMs.P50, ds.RequestMs.P99,
				ps.ReleasedNotified, ps.ReleasedExpired, ps.UnknownNotifications)
			if !ps.Done || ps.StillHeld != 0 || ps.ReleasedNotified+ps.ReleasedExpired != requests {
				t.Fatalf("prefill did not free every request: %+v", ps)
			}
			if c.params == nil {
				if ds.OK != requests || ps.ReleasedExpired != 0 {
					t.Fatalf("clean run: %d ok of %d, %d expired; first failures %v", ds.OK, requests, ps.ReleasedExpired, first(ds.FailedRequests, 5))
				}
				return
			}
			if ds.Failed == 0 || ps.ReleasedExpired < ds.Failed || ds.OK+ds.Failed != requests {
				t.Fatalf("faults: %d ok, %d failed, %d expired", ds.OK, ds.Failed, ps.ReleasedExpired)
			}
		})
	}
}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q", name, v)
	}
	return n
}

func first(f []FailedRequest, n int) []FailedRequest { return f[:min(n, len(f))] }

func parseParams(t *testing.T, kvs []string) []plugin.Param {
	t.Helper()
	p, err := plugin.ParseParams(kvs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
