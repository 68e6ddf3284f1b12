package serve

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// workerCommon is today's kvhost push worker (what `kvhost prefill` and
// `kvhost decode` run) on smallShape over host memory.
func workerCommon(t *testing.T, wl pushworker.Workload) pushworker.Common {
	return pushworker.Common{
		Plugin: faketest.Plugin(t), TPSize: 1, Concurrency: 4, Workload: wl,
		Shape: pushworker.Shape{Layers: smallShape.Layers, KVHeads: smallShape.KVHeads, HeadBytes: smallShape.HeadBytes,
			PageSize: smallShape.PageSize, MemKinds: "dram"},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// TestInteropWorkerToSidecar: a kvhost prefill worker (not a sidecar)
// pushes into an engine behind a sidecar; every byte verified in the
// engine's memory. The wire is the one the workers speak.
func TestInteropWorkerToSidecar(t *testing.T) {
	ds := newTestServer(t)
	ps := newTestServer(t) // hosts only the bootstrap server
	admin := dial(t, ps)
	ctx := testCtx(t)
	boot, err := admin.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	wl := pushworker.Workload{Seed: 5, Requests: 4, MinTokens: 5, MaxTokens: 60, ChunkPages: 3}
	errs := make(chan error, 1)
	go func() {
		s, err := pushworker.RunPrefill(ctx, pushworker.PrefillOptions{Common: workerCommon(t, wl), BootstrapAddr: boot})
		if err == nil && s.OK != wl.Requests {
			t.Errorf("prefill worker: %+v", s)
		}
		errs <- err
	}()
	dec := newEngine(t, ds, "decode", "nixl", memDRAM, smallShape, 1, "")
	for _, q := range wl.List(smallShape.PageSize) {
		if err := fakeengine.Decode(ctx, dec.c, dec.w, dec.ranks[0], boot, fakeengine.Request{Room: q.Room, Tokens: q.Tokens}); err != nil {
			t.Fatalf("request %d: %v", q.Index, err)
		}
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
}

// TestInteropSidecarToWorker: an engine behind a sidecar pushes into a
// kvhost decode worker, which checks every byte.
func TestInteropSidecarToWorker(t *testing.T) {
	ps := newTestServer(t)
	admin := dial(t, ps)
	ctx := testCtx(t)
	boot, err := admin.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	pre := newEngine(t, ps, "prefill", "nixl", memDRAM, smallShape, 1, boot)
	wl := pushworker.Workload{Seed: 6, Requests: 4, MinTokens: 5, MaxTokens: 60}
	errs := make(chan error, 1)
	go func() {
		s, err := pushworker.RunDecode(context.WithoutCancel(ctx), pushworker.DecodeOptions{Common: workerCommon(t, wl), BootstrapAddr: boot})
		if err == nil && (s.OK != wl.Requests || !s.Checked) {
			t.Errorf("decode worker: %+v", s)
		}
		errs <- err
	}()
	for _, q := range wl.List(smallShape.PageSize) {
		if err := fakeengine.Prefill(ctx, pre.c, pre.w, pre.ranks[0], fakeengine.Request{Room: q.Room, Tokens: q.Tokens, Chunk: 2}); err != nil {
			t.Fatalf("request %d: %v", q.Index, err)
		}
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
}
