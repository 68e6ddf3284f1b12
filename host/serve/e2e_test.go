package serve

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
	"github.com/kvhost/kvhost/host/serve/internal/memfdtest"
)

// memMode is how a test engine registers its pool.
type memMode uint8

const (
	memDRAM        memMode = iota // host memory, registered as DRAM
	memVRAM                       // KV by CUDA IPC handle of the stand-in libcudart
	memDRAMAsVRAM                 // host memory with register_as "vram"
	memMemfd                      // host memory in a sealed memfd another process holds
	memMemfdAsVRAM                // memMemfd with register_as "vram"
)

// engine is one in-process engine: its ranks on one sidecar connection.
type engine struct {
	srv   *Server
	c     *client.Client
	w     *fakeengine.Rooms
	ranks []*fakeengine.Rank
}

// newEngine makes tpSize ranks of role over shm and opens them on s.
func newEngine(t *testing.T, s *Server, role, variant string, mem memMode, shape fakeengine.Shape, tpSize int, boot string) *engine {
	t.Helper()
	c := dial(t, s)
	e := &engine{srv: s, c: c, w: fakeengine.Watch(c)}
	for tp := 0; tp < tpSize; tp++ {
		var r *fakeengine.Rank
		var err error
		if mem == memMemfd || mem == memMemfdAsVRAM {
			r, err = newMemfdRank(t, role, shape, tpSize, tp)
		} else {
			r, err = fakeengine.NewRank(shmName(), role, shape, tpSize, tp)
		}
		if err != nil {
			t.Fatal(err)
		}
		r.VRAM = mem == memVRAM
		if mem == memDRAMAsVRAM || mem == memMemfdAsVRAM {
			r.RegisterAs = "vram"
		}
		t.Cleanup(r.Close)
		if err := r.Open(testCtx(t), c, variant, boot); err != nil {
			t.Fatal(err)
		}
		e.ranks = append(e.ranks, r)
	}
	return e
}

// newMemfdRank makes a rank whose pool is a memfd sealed against
// shrinking, growing and further seals (as kvhost.shm's memfd pools are),
// named by a holder process's descriptor (memfdtest.New).
func newMemfdRank(t *testing.T, role string, shape fakeengine.Shape, tpSize, tp int) (*fakeengine.Rank, error) {
	size, err := fakeengine.PoolSize(shape, tpSize, tp)
	if err != nil {
		return nil, err
	}
	m := memfdtest.New(t, int(size), memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK|memfdtest.F_SEAL_GROW|memfdtest.F_SEAL_SEAL)
	return fakeengine.NewRankFD(m.SHM, m.FD, nil, role, shape, tpSize, tp)
}

var shmCount atomic.Int64

// shmName is a fresh POSIX shared-memory name.
func shmName() string { return fmt.Sprintf("/kvt-%d-%d", os.Getpid(), shmCount.Add(1)) }

// pair starts a prefill and a decode sidecar with their engines.
func pair(t *testing.T, variant string, mem memMode, shape fakeengine.Shape, ptp, dtp int) (pre, dec *engine, boot string) {
	t.Helper()
	cuda := func(c *Config) { c.CUDALibrary = standin(t) }
	ps := newTestServer(t, cuda)
	ds := newTestServer(t, cuda)
	pc := dial(t, ps)
	boot, err := pc.StartBootstrap(testCtx(t), "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	pre = newEngine(t, ps, "prefill", variant, mem, shape, ptp, boot)
	dec = newEngine(t, ds, "decode", variant, mem, shape, dtp, "")
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
	pre, dec, boot := pair(t, "nixl", memDRAM, smallShape, 1, 1)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 1, Tokens: 30, Chunk: 2}, {Room: 2, Tokens: 7}})
}

// TestSGLangPushMemfd: engines whose pools are sealed memfds (the form
// that cannot shrink under the sidecar) move KV as shm pools do, every
// byte verified; each sidecar holds descriptors of each memfd exactly
// while it is registered (its own, and the fake plugin's duplicates, one
// per region the plugin registered on it: plugins/fake/README.md, "Peer
// memory mapped").
func TestSGLangPushMemfd(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memMemfd, smallShape, 1, 1)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 51, Tokens: 30, Chunk: 2}, {Room: 52, Tokens: 7}})
	ctx := testCtx(t)
	for _, e := range []*engine{pre, dec} {
		r := e.ranks[0]
		fd := memfdFD(t, r.SHM)
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil {
			t.Fatal(err)
		}
		// The test process holds the memfd once (memfdtest's descriptor);
		// each sidecar, in this process too, once while registered, and
		// its fake plugin once per region it registered there.
		if fds := memfdtest.FDsOfInode(t, st.Dev, st.Ino); len(fds) < 3 {
			t.Fatalf("%s: descriptors %v on its memfd while registered, want the engine's, the sidecar's and the plugin's", r.Role, fds)
		}
		if err := e.c.CloseRank(ctx, r.ID); err != nil {
			t.Fatal(err)
		}
		if err := e.c.DeregisterMemory(ctx, r.Regions); err != nil {
			t.Fatal(err)
		}
		if fds := memfdtest.FDsOfInode(t, st.Dev, st.Ino); len(fds) != 1 || fds[0] != fd {
			t.Fatalf("%s: descriptors %v on its memfd after deregister_memory, want [%d]", r.Role, fds, fd)
		}
	}
}

// TestSGLangPush2to4MemfdAsVRAM: heterogeneous TP over memfd pools
// registered as "vram" (the demo engines' SGLang setup).
func TestSGLangPush2to4MemfdAsVRAM(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memMemfdAsVRAM, smallShape, 2, 4)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 61, Tokens: 33, Chunk: 3}, {Room: 62, Tokens: 5}})
}

// memfdFD is the test process's descriptor of the memfd a holder names
// as shm ("/proc/<holder>/fd/3"): the one on the same file.
func memfdFD(t *testing.T, shm string) int {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(shm, &st); err != nil {
		t.Fatal(err)
	}
	fds := memfdtest.FDsOfInode(t, st.Dev, st.Ino)
	if len(fds) == 0 {
		t.Fatalf("no descriptor of %s in the test process", shm)
	}
	return fds[0]
}

// TestSGLangPush2to4 registers the KV as GPU memory (CUDA IPC handles of
// the stand-in libcudart): SGLang's NIXL connector does not move
// heterogeneous-TP KV straight into host memory (the planner refuses it,
// as SGLang does).
func TestSGLangPush2to4(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memVRAM, smallShape, 2, 4)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 11, Tokens: 33, Chunk: 3}, {Room: 12, Tokens: 5}})
}

func TestSGLangPushMLA(t *testing.T) {
	shape := smallShape
	shape.MLA = true
	pre, dec, boot := pair(t, "nixl", memDRAM, shape, 2, 2)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 21, Tokens: 17, Chunk: 1}})
}

// TestSGLangPush2to4RegisterAsVRAM moves heterogeneous-TP MHA KV between
// two engines whose pools are host memory registered with register_as
// "vram": the fake plugin models GPU memory with host memory, so the
// planner moves the KV as it moves GPU pools (as `kvhost demo` does with
// the fake plugin), and every byte lands in the engines' host memory.
func TestSGLangPush2to4RegisterAsVRAM(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memDRAMAsVRAM, smallShape, 2, 4)
	run(t, pre, dec, boot, []fakeengine.Request{{Room: 31, Tokens: 33, Chunk: 3}, {Room: 32, Tokens: 5}})
}

// TestSGLangPush2to4HostMemoryRefused is the reason register_as exists:
// without it, host-memory pools are DRAM and heterogeneous-TP MHA into
// them is refused when the decode registers with the prefill (as SGLang's
// NIXL connector refuses it); the decode's rooms fail with that reason.
func TestSGLangPush2to4HostMemoryRefused(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memDRAM, smallShape, 2, 4)
	ctx := testCtx(t)
	q := fakeengine.Request{Room: 41, Tokens: 9}
	var wg sync.WaitGroup
	for _, r := range pre.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fakeengine.Prefill(ctx, pre.c, pre.w, r, q) // fails too
		}()
	}
	errs := make([]error, len(dec.ranks))
	for i, r := range dec.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fakeengine.Decode(ctx, dec.c, dec.w, r, boot, q)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "direct-to-host") {
			t.Errorf("decode tp%d of heterogeneous-TP MHA into host memory: %v, want a failure naming direct-to-host", i, err)
		}
	}
}
