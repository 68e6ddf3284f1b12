package serve

import (
	"context"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/faketest"
)

// TestServeVLLMNoLeak: a pull through two sidecars, a hold released by a
// rank closing, reads in flight when the decode rank closes, then both
// sidecars stop: goroutines, file descriptors and the sidecars' mappings
// of the engines' shared memory are back to what they were.
func TestServeVLLMNoLeak(t *testing.T) {
	faketest.Plugin(t) // loaded before the baseline
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	maps := func() int {
		b, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(string(b), "kvhost-vllmtest-")
	}
	runtime.GC()
	g0, f0, m0 := runtime.NumGoroutine(), fds(), maps()

	t.Run("run", func(t *testing.T) {
		ctx := testCtx(t)
		ps, ds := newTestServer(t), newTestServer(t)
		w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 16, 4, nil))
		vsEvent(t, w.c)
		sched := dial(t, ps)
		blocks := []int32{3, 9}
		if err := w.pool.Fill(kvpool.Tokens{Request: 1, Pages: blocks, Count: 8}); err != nil {
			t.Fatal(err)
		}
		params, err := sched.Hold(ctx, "P", "r", blocks)
		if err != nil {
			t.Fatal(err)
		}
		d := vsMust(vsOpenT(t, ds, "decode", "D", 1, 0, 16, 4, nil))
		if err := d.c.Read(ctx, d.rank.ID, "dr", params, []int32{1, 2}); err != nil {
			t.Fatal(err)
		}
		if r, ok := vsEvent(t, d.c).AsRead(); !ok || !r.OK {
			t.Fatalf("%+v", r)
		}
		vsReleased(t, sched, "P", "r", "notified")
		if _, err := sched.Hold(ctx, "P", "r2", blocks); err != nil {
			t.Fatal(err)
		}
		// Reads from an engine whose side channel never answers, in
		// flight at close_rank.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		mute := vsSetParam(vsSetParam(params, "remote_port", ln.Addr().(*net.TCPAddr).Port), "remote_engine_id", "mute")
		for _, id := range []string{"x1", "x2"} {
			if err := d.c.Read(ctx, d.rank.ID, id, mute, []int32{4}); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.c.CloseRank(ctx, d.rank.ID); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if r, ok := vsEvent(t, d.c).AsRead(); !ok || r.OK || r.Reason != "rank closed" {
				t.Fatalf("%+v", r)
			}
		}
		for _, s := range []*Server{ps, ds} {
			cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			s.Close(cctx)
			cancel()
		}
		vsReleased(t, sched, "P", "r2", "closed")
		for _, s := range []*Server{ps, ds} {
			if v, ok := s.ext["vllm"]; ok {
				h := v.(*vllmHub)
				h.mu.Lock()
				n, b := len(h.engines), len(h.watched)
				h.mu.Unlock()
				if n != 0 || b != 0 {
					t.Fatalf("after Close: %d engines, %d watched connections", n, b)
				}
			}
		}
	})
	// The subtest's cleanups closed the clients and unmapped the pools.
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		g, f, m := runtime.NumGoroutine(), fds(), maps()
		if g <= g0+2 && f <= f0 && m <= m0 {
			break
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("goroutines %d (baseline %d), fds %d (%d), shm mappings %d (%d)\n%s", g, g0, f, f0, m, m0, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(50 * time.Millisecond)
	}
}
