package serve

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// percentile returns the p-th percentile of ds in microseconds.
func percentile(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p / 100 * float64(len(s)-1))
	return float64(s[i]) / float64(time.Microsecond)
}

// BenchmarkControl measures the control round trip over ipc:// (client
// request to sidecar reply, in this process) of the two hot requests:
// sender_send (one page per chunk of a room whose decode is real) and
// receiver_init (on rooms made WaitingForInput beforehand), and reports
// p50 and p99 per request in microseconds.
func BenchmarkControl(b *testing.B) {
	shape := fakeengine.Shape{Layers: 2, KVHeads: 4, HeadBytes: 16, PageSize: 4, Pages: 64, AuxItems: 8}
	b.Run("sender_send", func(b *testing.B) {
		pre, dec, boot := benchPair(b, shape)
		ctx := context.Background()
		pr, dr := pre.ranks[0], dec.ranks[0]
		const room = 1
		n := b.N
		if err := pre.c.SenderCreate(ctx, pr.ID, room); err != nil {
			b.Fatal(err)
		}
		if err := dec.c.ReceiverCreate(ctx, dr.ID, room, boot, -1); err != nil {
			b.Fatal(err)
		}
		if _, err := dec.w.Wait(ctx, dr.ID, room, client.StateWaitingForInput); err != nil {
			b.Fatal(err)
		}
		if err := dec.c.ReceiverInit(ctx, dr.ID, room, make([]int32, n), 0, nil, 0); err != nil {
			b.Fatal(err)
		}
		if _, err := pre.w.Wait(ctx, pr.ID, room, client.StateWaitingForInput); err != nil {
			b.Fatal(err)
		}
		if err := pre.c.SenderInit(ctx, pr.ID, room, n, 0); err != nil {
			b.Fatal(err)
		}
		lat := make([]time.Duration, 0, n)
		page := []int32{0}
		b.ResetTimer()
		for i := 0; i < n; i++ {
			t0 := time.Now()
			if err := pre.c.SenderSend(ctx, pr.ID, room, page, nil); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		b.StopTimer()
		if e, err := dec.w.Wait(ctx, dr.ID, room, client.StateSuccess); err != nil || e.State != client.StateSuccess {
			b.Fatalf("room: %+v %v", e, err)
		}
		b.ReportMetric(percentile(lat, 50), "p50-µs")
		b.ReportMetric(percentile(lat, 99), "p99-µs")
	})
	b.Run("receiver_init", func(b *testing.B) {
		_, dec, boot := benchPair(b, shape)
		ctx := context.Background()
		dr := dec.ranks[0]
		pages := []int32{0, 1, 2, 3}
		lat := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		// ns/op includes receiver_create, the wait for WaitingForInput
		// and close_room; p50/p99 time receiver_init alone. (StopTimer
		// would stop the world around every request.)
		for i := 0; i < b.N; i++ {
			room := uint64(1000 + i)
			if err := dec.c.ReceiverCreate(ctx, dr.ID, room, boot, -1); err != nil {
				b.Fatal(err)
			}
			if _, err := dec.w.Wait(ctx, dr.ID, room, client.StateWaitingForInput); err != nil {
				b.Fatal(err)
			}
			t0 := time.Now()
			if err := dec.c.ReceiverInit(ctx, dr.ID, room, pages, 0, nil, 0); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
			dec.c.CloseRoom(ctx, dr.ID, room)
			dec.w.Forget(dr.ID, room)
		}
		b.StopTimer()
		b.ReportMetric(percentile(lat, 50), "p50-µs")
		b.ReportMetric(percentile(lat, 99), "p99-µs")
	})
}

// benchPair is pair for benchmarks: two in-process sidecars with one
// rank each over host memory.
func benchPair(b *testing.B, shape fakeengine.Shape) (pre, dec *benchEngine, boot string) {
	b.Helper()
	ps, ds := newTestServer(b), newTestServer(b)
	ctx := context.Background()
	admin := dial(b, ps)
	boot, err := admin.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		b.Fatal(err)
	}
	return newBenchEngine(b, ps, "prefill", shape, boot), newBenchEngine(b, ds, "decode", shape, ""), boot
}

type benchEngine struct {
	c     *client.Client
	w     *fakeengine.Rooms
	ranks []*fakeengine.Rank
}

func newBenchEngine(b *testing.B, s *Server, role string, shape fakeengine.Shape, boot string) *benchEngine {
	b.Helper()
	c := dial(b, s)
	e := &benchEngine{c: c, w: fakeengine.Watch(c)}
	r, err := fakeengine.NewRank(shmName(), role, shape, 1, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.Close)
	if err := r.Open(context.Background(), c, "nixl", boot); err != nil {
		b.Fatal(err)
	}
	e.ranks = append(e.ranks, r)
	return e
}

// throughputShape is the benchmark shape: 32 layers, 64-page
// requests (8 KV heads of 64 bf16 elements, 16-token pages: 16 KiB per
// page per region, 64 MiB per request over K and V of every layer).
var throughputShape = pushworker.Shape{Layers: 32, KVHeads: 8, HeadBytes: 128, PageSize: 16, MemKinds: "dram"}

const throughputPages = 64

// BenchmarkThroughput moves b.N requests of 64 pages (32 layers) one at a
// time, in 8-page chunks, bytes neither filled nor checked, through two
// sidecars (engines in this process driving in-process sidecars over
// ipc://) and through today's in-process push worker (host/demo/pushworker)
// on the same shape and plugin, each three times, alternating, and reports
// both rates (best of three: the machine is shared and noisy) and sidecar/in-process.
func BenchmarkThroughput(b *testing.B) {
	sh := throughputShape
	shape := fakeengine.Shape{Layers: sh.Layers, KVHeads: sh.KVHeads, HeadBytes: sh.HeadBytes, PageSize: sh.PageSize, Pages: throughputPages, AuxItems: 4}
	pre, dec, boot := benchPair(b, shape)
	reqBytes := float64(throughputPages) * float64(sh.PageSize*sh.KVHeads*sh.HeadBytes) * float64(2*sh.Layers)
	n := b.N
	room := uint64(1 << 40)
	sidecar := func() float64 {
		// Each side works through the requests in order, one at a time,
		// as the in-process worker's ranks do with Concurrency 1.
		ctx := context.Background()
		reqs := make([]fakeengine.Request, n)
		for i := range reqs {
			room++
			reqs[i] = fakeengine.Request{Room: room, Tokens: throughputPages * sh.PageSize, Chunk: 8, NoBytes: true}
		}
		start := time.Now()
		var wg sync.WaitGroup
		var perr error
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, q := range reqs {
				if perr = fakeengine.Prefill(ctx, pre.c, pre.w, pre.ranks[0], q); perr != nil {
					return
				}
			}
		}()
		for _, q := range reqs {
			if err := fakeengine.Decode(ctx, dec.c, dec.w, dec.ranks[0], boot, q); err != nil {
				b.Fatal(err)
			}
		}
		wg.Wait()
		if perr != nil {
			b.Fatal(perr)
		}
		return reqBytes * float64(n) / time.Since(start).Seconds()
	}
	pl := faketest.Plugin(b)
	inproc := func() float64 {
		admin := dial(b, newTestServer(b))
		addr, err := admin.StartBootstrap(context.Background(), "127.0.0.1", 0)
		if err != nil {
			b.Fatal(err)
		}
		wl := pushworker.Workload{Seed: uint64(time.Now().UnixNano()), Requests: n, MinTokens: throughputPages * sh.PageSize,
			MaxTokens: throughputPages * sh.PageSize, ChunkPages: 8}
		common := pushworker.Common{Plugin: pl, Shape: sh, Workload: wl, TPSize: 1, Concurrency: 1, NoBytes: true,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
		ctx := context.Background()
		start := time.Now()
		pch := make(chan error, 1)
		go func() {
			_, err := pushworker.RunPrefill(ctx, pushworker.PrefillOptions{Common: common, BootstrapAddr: addr})
			pch <- err
		}()
		ds, err := pushworker.RunDecode(ctx, pushworker.DecodeOptions{Common: common, BootstrapAddr: addr})
		if perr := <-pch; err != nil || perr != nil || ds.OK != n {
			b.Fatalf("in-process worker: %v %v %+v", err, perr, ds)
		}
		return reqBytes * float64(n) / time.Since(start).Seconds()
	}
	b.ResetTimer()
	var side, in float64
	for range 3 {
		in = max(in, inproc())
		side = max(side, sidecar())
	}
	b.StopTimer()
	b.ReportMetric(side/1e9, "sidecar-GB/s")
	b.ReportMetric(in/1e9, "inproc-GB/s")
	b.ReportMetric(side/in, "sidecar/inproc")
}
