package pullworker

import (
	"context"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
)

func testLog() *slog.Logger {
	level := slog.LevelError + 4 // quiet: failures are asserted on, not read in logs
	if os.Getenv("KVHOST_TEST_LOG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// smallModel is a Llama-like shape shrunk for tests.
var smallModel = Model{Name: "kvhost/test-llama", VLLMVersion: "0.13.0", DType: "bfloat16", CacheDType: "auto",
	Layers: 2, KVHeads: 4, HeadDim: 16}

func engine(tp, blockSize int, layout string) Engine {
	return Engine{TPSize: tp, BlockSize: blockSize, NumBlocks: 96, Layout: layout}
}

var smallWork = Workload{Seed: 11, Requests: 16, MinTokens: 1, MaxTokens: 150, PartialHitRate: 0.35, FullHitRate: 0.2}

type e2eCase struct {
	name            string
	model           Model
	prefill, decode Engine
	work            Workload
	decodeParams    []string
	abort           time.Duration
}

// runE2E runs the prefill as a child process and the decode here, and
// returns both summaries.
func runE2E(t *testing.T, c e2eCase) (PrefillSummary, *DecodeSummary) {
	t.Helper()
	abort := c.abort
	if abort == 0 {
		abort = time.Minute
	}
	pc := startChild(t, "prefill", childSpec{Model: c.model, Engine: c.prefill, EngineID: "prefill-" + c.name,
		AbortTimeout: abort, Workload: c.work})
	var ready struct{ API string }
	pc.line(t, &ready)
	params, err := plugin.ParseParams(c.decodeParams)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	ds, err := RunDecode(ctx, DecodeConfig{Plugin: faketest.Plugin(t), AgentParams: params, Model: c.model, Engine: c.decode,
		EngineID: "decode-" + c.name, PrefillURL: "http://" + ready.API, Workload: c.work, Concurrency: 4, Logger: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	var ps PrefillSummary
	pc.line(t, &ps)
	return ps, ds
}

// checkClean asserts a run where every request verified and the prefill
// freed every request on notification.
func checkClean(t *testing.T, c e2eCase, ps PrefillSummary, ds *DecodeSummary) {
	t.Helper()
	if ds.OK != c.work.Requests || ds.Failed != 0 {
		t.Fatalf("decode: %d ok, %d failed: %+v", ds.OK, ds.Failed, ds.FailedRequests)
	}
	if ds.PartialHits == 0 || ds.FullHits == 0 {
		t.Fatalf("the workload needs partial (%d) and full (%d) prefix hits", ds.PartialHits, ds.FullHits)
	}
	nranks := len(ds.Ranks)
	if ds.NotifyOnly != ds.FullHits*nranks || ds.Reads != (c.work.Requests-ds.FullHits)*nranks {
		t.Fatalf("decode: %d reads and %d notify-only loads for %d requests (%d full hits) on %d ranks",
			ds.Reads, ds.NotifyOnly, c.work.Requests, ds.FullHits, nranks)
	}
	if ds.Bytes == 0 || ds.VerifiedBytes < ds.Bytes/2 || ds.DescriptorsPerRead == 0 || ds.InvalidBlocks != 0 {
		t.Fatalf("decode summary %+v", ds)
	}
	if ds.Stats.NumSuccessfulTransfers != ds.Reads || ds.Stats.NumFailedTransfers != 0 || ds.Stats.NumFailedNotifications != 0 {
		t.Fatalf("decode stats %+v", ds.Stats)
	}
	if !ps.Done || ps.RequestsServed != c.work.Requests || ps.ReleasedNotified != c.work.Requests || ps.ReleasedExpired != 0 ||
		ps.UnknownNotifications != 0 || ps.MalformedNotifications != 0 || ps.StillHeld != 0 || ps.FilledBytes == 0 {
		t.Fatalf("prefill summary %+v", ps)
	}
	for _, rp := range ds.Peers {
		if len(rp.Peers) != 1 {
			t.Fatalf("rank %d: %d handshakes", rp.TPRank, len(rp.Peers))
		}
	}
}

// TestTwoProcess runs prefill and decode as two processes on the fake
// plugin for every pairing the issue names, with partial and full prefix
// hits, every byte of every request verified on every decode rank.
func TestTwoProcess(t *testing.T) {
	mla := smallModel
	mla.MLA, mla.KVHeads, mla.HeadDim = true, 1, 36
	bf := smallModel
	bf.BlocksFirst = true
	kv2 := smallModel
	kv2.KVHeads = 2
	cases := []e2eCase{
		{name: "equal-tp", model: smallModel, prefill: engine(2, 16, "HND"), decode: engine(2, 16, "HND")},
		{name: "decode-tp-2x", model: smallModel, prefill: engine(2, 16, "HND"), decode: engine(4, 16, "HND")},
		{name: "mla", model: mla, prefill: engine(1, 16, "HND"), decode: engine(2, 16, "HND")},
		{name: "block-size-2x", model: smallModel, prefill: engine(1, 8, "HND"), decode: engine(1, 16, "HND")},
		{name: "block-size-2x-nhd", model: smallModel, prefill: engine(1, 8, "NHD"), decode: engine(1, 16, "NHD")},
		{name: "blocks-first", model: bf, prefill: engine(1, 16, "HND"), decode: engine(2, 16, "HND")},
		{name: "replicated-kv", model: kv2, prefill: engine(2, 16, "HND"), decode: engine(4, 16, "HND")},
		{name: "emulated-prepped", model: smallModel, prefill: engine(1, 16, "HND"), decode: engine(2, 16, "HND"),
			decodeParams: []string{"caps_off=prepped,telemetry"}},
	}
	for _, c := range cases {
		if c.work.Requests == 0 {
			c.work = smallWork
		}
		t.Run(c.name, func(t *testing.T) {
			ps, ds := runE2E(t, c)
			checkClean(t, c, ps, ds)
			t.Logf("%d requests, %d reads, %.1f descriptors/read, %d bytes read, %.3f GB/s, transfer p50 %.3f ms",
				ds.Requests, ds.Reads, ds.DescriptorsPerRead, ds.Bytes, ds.GBps, ds.TransferMs.P50)
		})
	}
}

// TestTwoProcessReadFailures: READs the decode's plugin fails leave their
// requests failed with blocks reported invalid; the prefill, never
// notified for them, frees exactly those on expiry and the rest on
// notification.
func TestTwoProcessReadFailures(t *testing.T) {
	c := e2eCase{name: "read-failures", model: smallModel, prefill: engine(1, 16, "HND"), decode: engine(2, 16, "HND"),
		work: smallWork, decodeParams: []string{"fail_rate=0.3", "fail_seed=7"}, abort: time.Second}
	ps, ds := runE2E(t, c)
	if ds.Failed == 0 || ds.OK == 0 || ds.OK+ds.Failed != c.work.Requests {
		t.Fatalf("want some failed and some verified requests: %d ok, %d failed", ds.OK, ds.Failed)
	}
	var failed []string
	for _, f := range ds.FailedRequests {
		if !strings.Contains(f.Error, "READ failed") || !strings.Contains(f.Error, "injected failure") {
			t.Fatalf("%s: %s", f.ID, f.Error)
		}
		failed = append(failed, f.ID)
	}
	if ds.InvalidBlocks == 0 || ds.InvalidBlockReports == 0 || ds.Stats.NumFailedTransfers == 0 {
		t.Fatalf("no invalid blocks reported: %+v", ds)
	}
	if !ps.Done || ps.ReleasedNotified != ds.OK || !reflect.DeepEqual(ps.ExpiredRequests, failed) {
		t.Fatalf("prefill freed %d on notification and %v on expiry; decode verified %d and failed %v",
			ps.ReleasedNotified, ps.ExpiredRequests, ds.OK, failed)
	}
}

// TestThreeProcessDecodeEngine: one decode engine served by two processes
// (ranks 0-1 here, 2-3 in a child), both asking the prefill for every
// request; the prefill frees each once all four ranks notified.
func TestThreeProcessDecodeEngine(t *testing.T) {
	c := e2eCase{name: "split-decode", model: smallModel, prefill: engine(2, 16, "HND"), decode: engine(4, 16, "HND"), work: smallWork}
	pc := startChild(t, "prefill", childSpec{Model: c.model, Engine: c.prefill, EngineID: "prefill", AbortTimeout: time.Minute, Workload: c.work})
	var ready struct{ API string }
	pc.line(t, &ready)
	dc := startChild(t, "decode", childSpec{Model: c.model, Engine: c.decode, EngineID: "decode", Workload: c.work,
		Ranks: []int{2, 3}, PrefillURL: "http://" + ready.API})
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	ds, err := RunDecode(ctx, DecodeConfig{Plugin: faketest.Plugin(t), Model: c.model, Engine: c.decode, Ranks: []int{0, 1},
		EngineID: "decode", PrefillURL: "http://" + ready.API, Workload: c.work, Concurrency: 4, Logger: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	var other DecodeSummary
	dc.line(t, &other)
	var ps PrefillSummary
	pc.line(t, &ps)
	for _, s := range []*DecodeSummary{ds, &other} {
		if s.OK != c.work.Requests || s.Failed != 0 {
			t.Fatalf("ranks %v: %d ok, %v", s.Ranks, s.OK, s.FailedRequests)
		}
	}
	if !ps.Done || ps.RequestsServed != c.work.Requests || ps.ReleasedNotified != c.work.Requests || ps.UnknownNotifications != 0 {
		t.Fatalf("prefill %+v", ps)
	}
}

// TestDecodeMismatchedModel: a decode whose model differs fails every
// request at the handshake with both hashes, and the prefill frees them on
// expiry.
func TestDecodeMismatchedModel(t *testing.T) {
	other := smallModel
	other.Name = "kvhost/another-model"
	work := smallWork
	work.Requests, work.FullHitRate = 4, 0
	pc := startChild(t, "prefill", childSpec{Model: smallModel, Engine: engine(1, 16, "HND"), EngineID: "prefill",
		AbortTimeout: 500 * time.Millisecond, Workload: work})
	var ready struct{ API string }
	pc.line(t, &ready)
	ds, err := RunDecode(t.Context(), DecodeConfig{Plugin: faketest.Plugin(t), Model: other, Engine: engine(1, 16, "HND"),
		EngineID: "decode", PrefillURL: "http://" + ready.API, Workload: work, Logger: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	if ds.Failed != work.Requests {
		t.Fatalf("%d of %d failed", ds.Failed, work.Requests)
	}
	for _, f := range ds.FailedRequests {
		if !strings.Contains(f.Error, "compatibility hash mismatch") || !strings.Contains(f.Error, other.CompatHash()) ||
			!strings.Contains(f.Error, smallModel.CompatHash()) {
			t.Fatalf("%s: %s", f.ID, f.Error)
		}
	}
	var ps PrefillSummary
	pc.line(t, &ps)
	if !ps.Done || ps.ReleasedExpired != work.Requests {
		t.Fatalf("prefill %+v", ps)
	}
}

func TestWorkloadDeterministic(t *testing.T) {
	a, b := smallWork.Generate(), smallWork.Generate()
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same workload, different requests")
	}
	w := smallWork
	w.Seed++
	if reflect.DeepEqual(a, w.Generate()) {
		t.Fatal("another seed, same requests")
	}
	for _, r := range a {
		if r.Tokens < smallWork.MinTokens || r.Tokens > smallWork.MaxTokens {
			t.Fatalf("%+v", r)
		}
		for _, bs := range []int{1, 8, 16} {
			h, n := r.HitBlocks(bs), r.Blocks(bs)
			switch r.Hit {
			case HitNone:
				if h != 0 {
					t.Fatalf("%+v: %d hit blocks", r, h)
				}
			case HitFull:
				if h != n {
					t.Fatalf("%+v: %d of %d blocks hit", r, h, n)
				}
			case HitPartial:
				if n > 1 && (h < 1 || h >= n) || n == 1 && h != 0 {
					t.Fatalf("%+v: %d of %d blocks hit", r, h, n)
				}
			}
		}
	}
	if err := (Workload{Requests: 1, MinTokens: 5, MaxTokens: 4}).Validate(); err == nil {
		t.Fatal("an empty token range was accepted")
	}
	if err := (Workload{Requests: 1, MinTokens: 1, MaxTokens: 4, PartialHitRate: 0.7, FullHitRate: 0.4}).Validate(); err == nil {
		t.Fatal("hit rates above 1 were accepted")
	}
}

// TestPrefillAPI: the API refuses what it cannot serve, answers repeated
// asks for one request with the same params, and says when a request was
// already released.
func TestPrefillAPI(t *testing.T) {
	work := Workload{Seed: 3, Requests: 2, MinTokens: 10, MaxTokens: 20}
	reqs := work.Generate()
	ready := 0
	pf, err := StartPrefill(PrefillConfig{Plugin: faketest.Plugin(t), Model: smallModel, Engine: engine(1, 16, "HND"), EngineID: "p",
		SideChannel: "tcp://127.0.0.1:0", APIAddr: "127.0.0.1:0", AbortTimeout: 200 * time.Millisecond, Workload: work, Logger: testLog(),
		OnReady: func() { ready++ }})
	if err != nil {
		t.Fatal(err)
	}
	defer pf.Close()
	if ready != 1 {
		t.Fatalf("OnReady called %d times by the time StartPrefill returned", ready)
	}
	c := newPrefillClient("http://"+pf.APIAddr(), 0)
	if err := c.waitHealthy(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []struct {
		id     string
		tokens int
		want   string
	}{
		{"stranger", 10, "not in this worker's workload"},
		{reqs[0].ID, reqs[0].Tokens + 1, "tokens in this worker's workload"},
		{reqs[0].ID, 0, "num_tokens 0"},
		{"", 3, "request_id is empty"},
	} {
		if _, err := c.prefill(t.Context(), bad.id, bad.tokens); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q/%d: %v", bad.id, bad.tokens, err)
		}
	}
	p1, err := c.prefill(t.Context(), reqs[0].ID, reqs[0].Tokens)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := c.prefill(t.Context(), reqs[0].ID, reqs[0].Tokens)
	if err != nil || !reflect.DeepEqual(p1, p2) {
		t.Fatalf("second ask: %+v %v; first %+v", p2, err, p1)
	}
	if p1.RemoteRequestID != "prefill-"+reqs[0].ID || p1.RemoteEngineID != "p" || len(p1.RemoteBlockIDs) != reqs[0].Blocks(16) {
		t.Fatalf("%+v", p1)
	}
	time.Sleep(400 * time.Millisecond) // expired
	if _, err := c.prefill(t.Context(), reqs[0].ID, reqs[0].Tokens); err == nil || !strings.Contains(err.Error(), "already released (expired)") {
		t.Fatalf("after expiry: %v", err)
	}
	if s := pf.Summary(); s.ReleasedExpired != 1 || s.RequestsServed != 1 || s.Done ||
		!reflect.DeepEqual(s.ExpiredRequests, []string{reqs[0].ID}) {
		t.Fatalf("%+v", s)
	}
}

// TestPrefillKilled: when the prefill process dies mid-run, the decode
// finishes promptly, every remaining request failed with the reason, none
// hanging.
func TestPrefillKilled(t *testing.T) {
	work := smallWork
	work.Requests, work.FullHitRate = 40, 0
	pc := startChild(t, "prefill", childSpec{Model: smallModel, Engine: engine(1, 16, "HND"), EngineID: "prefill",
		AbortTimeout: time.Minute, Workload: work})
	var ready struct{ API string }
	pc.line(t, &ready)
	var once sync.Once
	var readyCalls, earlyProgress atomic.Int32
	start := time.Now()
	ds, err := RunDecode(t.Context(), DecodeConfig{Plugin: faketest.Plugin(t), Model: smallModel, Engine: engine(2, 16, "HND"),
		EngineID: "decode", PrefillURL: "http://" + ready.API, Workload: work, Concurrency: 2, ConnectTimeout: time.Second,
		Logger: testLog(), OnReady: func() { readyCalls.Add(1) }, Progress: func(done, _ int) {
			if readyCalls.Load() == 0 {
				earlyProgress.Add(1)
			}
			if done == 4 {
				once.Do(func() { pc.cmd.Process.Kill() })
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if readyCalls.Load() != 1 || earlyProgress.Load() != 0 {
		t.Errorf("OnReady called %d times, %d requests finished before it", readyCalls.Load(), earlyProgress.Load())
	}
	took := time.Since(start)
	if ds.OK < 4 || ds.Failed == 0 || ds.OK+ds.Failed != work.Requests {
		t.Fatalf("%d ok, %d failed of %d", ds.OK, ds.Failed, work.Requests)
	}
	if took > 30*time.Second {
		t.Fatalf("the decode took %v to give up on a dead prefill", took)
	}
	for _, f := range ds.FailedRequests {
		if !strings.Contains(f.Error, "unreachable") && !strings.Contains(f.Error, "READ failed") &&
			!strings.Contains(f.Error, "no answer from the prefill worker") {
			t.Fatalf("%s: %s", f.ID, f.Error)
		}
	}
	t.Logf("prefill killed after 4 requests: %d ok, %d failed in %v", ds.OK, ds.Failed, took.Round(time.Millisecond))
}
