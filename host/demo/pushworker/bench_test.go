package pushworker

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
)

// benchShape is a Llama-like MHA shape cut to 8 layers so two pools fit
// a small machine: 8 KV heads of 128 bf16 elements, 16-token pages
// (32 KiB per page per region, 512 KiB per page over all layers).
var benchShape = Shape{Layers: 8, KVHeads: 8, HeadBytes: 256, PageSize: 16}

// BenchmarkPush moves b.N requests of 1024 tokens (8-page chunks) from a
// prefill worker to a decode worker in this process through the push
// runtime on the fake plugin, bytes neither filled nor checked (NoBytes),
// and reports the rate beside a same-run baseline: Go's copy of the same
// bytes in the same 32 KiB blocks. desc/req and ref-desc/req compare the
// descriptors kvhost hands the plugin (all prefill ranks, all chunks of a
// request) with SGLang's for the same bytes.
func BenchmarkPush(b *testing.B) {
	for _, c := range []struct {
		name     string
		ptp, dtp int
		mla      bool
		xfer     push.XferMode
		variant  push.Variant
		params   []plugin.Param
	}{
		{name: "tp1to1", ptp: 1, dtp: 1, xfer: push.XferBatch},
		{name: "tp1to1-prepped", ptp: 1, dtp: 1, xfer: push.XferPrepped},
		{name: "tp1to1-status", ptp: 1, dtp: 1, params: []plugin.Param{{Key: "caps_off", Value: "notif"}}},
		{name: "tp1to1-mori", ptp: 1, dtp: 1, variant: push.VariantMORI},
		{name: "tp2to4", ptp: 2, dtp: 4, xfer: push.XferBatch},
		{name: "tp2to4-prepped", ptp: 2, dtp: 4, xfer: push.XferPrepped},
		{name: "tp2to4-mori", ptp: 2, dtp: 4, variant: push.VariantMORI},
	} {
		b.Run(c.name, func(b *testing.B) {
			pl := faketest.Plugin(b)
			addr := startBootstrap(b)
			shape := benchShape
			shape.MLA = c.mla
			wl := Workload{Seed: 3, Requests: b.N, MinTokens: 1024, MaxTokens: 1024, ChunkPages: 8}
			common := func(tp int) Common {
				return Common{Plugin: pl, AgentParams: c.params, Variant: c.variant, Shape: shape, Workload: wl,
					TPSize: tp, Concurrency: 4, NoBytes: true, Logger: discard()}
			}
			ctx := context.Background()
			b.ResetTimer()
			start := time.Now()
			pch := make(chan *Summary, 1)
			go func() {
				s, err := RunPrefill(ctx, PrefillOptions{Common: common(c.ptp), XferMode: c.xfer, BootstrapAddr: addr})
				if err != nil {
					b.Error(err)
				}
				pch <- s
			}()
			ds, err := RunDecode(ctx, DecodeOptions{Common: common(c.dtp), BootstrapAddr: addr})
			ps := <-pch
			elapsed := time.Since(start)
			b.StopTimer()
			if err != nil || ps == nil || ds.OK != b.N || ps.OK != b.N {
				b.Fatalf("decode %v: %+v", err, ds)
			}
			rate := float64(ps.Bytes) / elapsed.Seconds()
			// The machine is shared and noisy: the baseline is measured
			// twice right after the run and averaged.
			base := (copyRate(ps.Bytes, 32<<10) + copyRate(ps.Bytes, 32<<10)) / 2
			b.ReportMetric(rate/1e9, "GB/s")
			b.ReportMetric(base/1e9, "memcpy-GB/s")
			b.ReportMetric(rate/base, "x-memcpy")
			b.ReportMetric(float64(ps.Descriptors)/float64(b.N), "desc/req")
			b.ReportMetric(float64(ps.RefDescriptors)/float64(b.N), "ref-desc/req")
			b.ReportMetric(ds.LatencyP50us, "p50-µs/req")
			b.ReportMetric(ps.XferP50us, "xfer-p50-µs")
		})
	}
}

// copyRate is the rate of Go's copy moving n bytes in blocks of block
// bytes between two buffers (the same-run baseline).
func copyRate(n uint64, block int) float64 {
	const bufLen = 32 << 20
	src, dst := make([]byte, bufLen), make([]byte, bufLen)
	for i := range src {
		src[i] = byte(i)
	}
	start := time.Now()
	var moved uint64
	for off := 0; moved < n; off = (off + block) % (bufLen - block) {
		copy(dst[off:off+block], src[(bufLen-block-off):(bufLen-off)])
		moved += uint64(block)
	}
	return float64(moved) / time.Since(start).Seconds()
}

// planObserver sums the planning time of KV transfers per planned chunk
// (one chunk to one decode rank: what one planner call plans).
type planObserver struct {
	push.NopObserver
	mu     sync.Mutex
	chunks map[planKey]time.Duration
}

type planKey struct {
	room  uint64
	peer  string
	chunk int
}

func (o *planObserver) Transfer(e push.TransferEvent) {
	if e.Kind != push.TransferKV || e.Err != nil {
		return
	}
	o.mu.Lock()
	o.chunks[planKey{e.Room, e.Peer, e.Chunk}] += e.Plan
	o.mu.Unlock()
}

// BenchmarkPushPlan reports the push worker's planning time per chunk and
// decode rank (kvhost_plan_time_seconds, TransferEvent.Plan; the median
// over the run's chunks) on the demo's
// shape (16 layers, 8 KV heads of 128 bf16, 16-token pages, TP 2 -> 4,
// chunks of 8 pages), the runtime's side of planner's BenchmarkKVPlan row
// demo-MHA-16-layers-TP2-to-4-8-pages, whose ref-ns/op is the reference's
// planning for the same request.
func BenchmarkPushPlan(b *testing.B) {
	for _, c := range []struct {
		name   string
		xfer   push.XferMode
		params []plugin.Param
	}{
		{name: "batch", xfer: push.XferBatch},
		{name: "prepped", xfer: push.XferPrepped},
	} {
		b.Run(c.name, func(b *testing.B) {
			pl := faketest.Plugin(b)
			addr := startBootstrap(b)
			shape := Shape{Layers: 16, KVHeads: 8, HeadBytes: 256, PageSize: 16}
			wl := Workload{Seed: 3, Requests: b.N, MinTokens: 1024, MaxTokens: 1024, ChunkPages: 8}
			common := func(tp int) Common {
				return Common{Plugin: pl, AgentParams: c.params, Shape: shape, Workload: wl,
					TPSize: tp, Concurrency: 4, NoBytes: true, Logger: discard()}
			}
			obs := &planObserver{chunks: make(map[planKey]time.Duration)}
			ctx := context.Background()
			b.ResetTimer()
			pch := make(chan *Summary, 1)
			go func() {
				o := PrefillOptions{Common: common(2), XferMode: c.xfer, BootstrapAddr: addr}
				o.Observer = obs
				s, err := RunPrefill(ctx, o)
				if err != nil {
					b.Error(err)
				}
				pch <- s
			}()
			ds, err := RunDecode(ctx, DecodeOptions{Common: common(4), BootstrapAddr: addr})
			ps := <-pch
			b.StopTimer()
			if err != nil || ps == nil || ds.OK != b.N || ps.OK != b.N {
				b.Fatalf("decode %v: %+v", err, ds)
			}
			if len(obs.chunks) == 0 {
				b.Fatal("no KV transfer observed")
			}
			// The median: a worker preempted while planning (a loaded
			// machine) makes a few chunks' times many times longer.
			var times []time.Duration
			for _, d := range obs.chunks {
				times = append(times, d)
			}
			slices.Sort(times)
			b.ReportMetric(float64(times[len(times)/2].Nanoseconds()), "plan-ns/chunk")
			b.ReportMetric(float64(len(obs.chunks))/float64(b.N), "chunks/req")
		})
	}
}
