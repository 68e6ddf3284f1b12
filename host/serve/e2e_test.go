package serve

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// engine is one in-process engine: its ranks on one sidecar connection.
type engine struct {
	srv   *Server
	c     *client.Client
	w     *fakeengine.Rooms
	ranks []*fakeengine.Rank
}

// newEngine makes tpSize ranks of role over shm and opens them on s.
func newEngine(t *testing.T, s *Server, role, variant string, vram bool, shape fakeengine.Shape, tpSize int, boot string) *engine {
	t.Helper()
	c := dial(t, s)
	e := &engine{srv: s, c: c, w: fakeengine.Watch(c)}
	for tp := 0; tp < tpSize; tp++ {
		r, err := fakeengine.NewRank(shmName(), role, shape, tpSize, tp)
		if err != nil {
			t.Fatal(err)
		}
		r.VRAM = vram
		t.Cleanup(r.Close)
		if err := r.Open(testCtx(t), c, variant, boot); err != nil {
			t.Fatal(err)
		}
		e.ranks = append(e.ranks, r)
	}
	return e
}

var shmCount atomic.Int64

// shmName is a fresh POSIX shared-memory name.
func shmName() string { return fmt.Sprintf("/kvt-%d-%d", os.Getpid(), shmCount.Add(1)) }

// pair starts a prefill and a decode sidecar with their engines.
func pair(t *testing.T, variant string, vram bool, shape fakeengine.Shape, ptp, dtp int) (pre, dec *engine, boot string) {
	t.Helper()
	cuda := func(c *Config) { c.CUDALibrary = standin(t) }
	ps := newTestServer(t, cuda)
	ds := newTestServer(t, cuda)
	pc := dial(t, ps)
	boot, err := pc.StartBootstrap(testCtx(t), "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	pre = newEngine(t, ps, "prefill", variant, vram, shape, ptp, boot)
	dec = newEngine(t, ds, "decode", variant, vram, shape, dtp, "")
	return pre, dec, boot
}

// run moves every request through every rank of both engines and
// verifies every byte on decode.
func run(t *testing.T, pre, dec *engine, boot string, reqs []fakeengine.Request) {
	t.Helper()
	ctx := testCtx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for _, q := range reqs {
		for _, r := range pre.ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := fakeengine.Prefill(ctx, pre.c, pre.w, r, q); err != nil {
					errs <- fmt.Errorf("prefill tp%d: %w", r.TP, err)
				}
			}()
		}
		for _, r := range dec.ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := fakeengine.Decode(ctx, dec.c, dec.w, r, boot, q); err != nil {
					errs <- fmt.Errorf("decode tp%d: %w", r.TP, err)
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

var smallShape = fakeengine.Shape{Layers: 2, KVHeads: 4, HeadBytes: 16, PageSize: 4, Pages: 64, AuxItems: 8}

func TestSGLangPush1to1(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", false, smallShape, 1, 1)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 1, Tokens: 30, Chunk: 2}, {Room: 2, Tokens: 7}})
}

// TestSGLangPush2to4 registers the KV as GPU memory (CUDA IPC handles of
// the stand-in libcudart): SGLang's NIXL connector does not move
// heterogeneous-TP KV straight into host memory (the planner refuses it,
// as SGLang does).
func TestSGLangPush2to4(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", true, smallShape, 2, 4)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 11, Tokens: 33, Chunk: 3}, {Room: 12, Tokens: 5}})
}

func TestSGLangPushMLA(t *testing.T) {
	shape := smallShape
	shape.MLA = true
	pre, dec, boot := pair(t, "nixl", false, shape, 2, 2)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 21, Tokens: 17, Chunk: 1}})
}
