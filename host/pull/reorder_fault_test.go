package pull

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/host/demo/kvpool"
)

// shmPool is g's pool of one rank in a shared-memory file, mapped
// MAP_SHARED as the sidecar maps an engine's memory, and the file.
func (g geom) shmPool(t *testing.T, rank int) (*kvpool.Pool, *os.File) {
	t.Helper()
	kg := kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.Interleaved, HeadMajor: g.hnd, Layers: g.layers,
		Pages: g.blocks, PageSize: g.blockSize, TotalHeads: g.heads, TPSize: g.tp, TPRank: rank, HeadBytes: g.headBytes}
	f, err := os.CreateTemp("/dev/shm", "kvhost-pull-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); os.Remove(f.Name()) })
	if err := f.Truncate(int64(kg.Size())); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(kg.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvpool.Wrap(kg, mem)
	if err != nil {
		syscall.Munmap(mem)
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, f
}

// TestReorderOfShrunkMemoryFailsTheLoad (issue 25.3): a decode engine
// whose blocks hold two prefill blocks shrinks its shared memory to 0
// after the READ landed and before the blocks are reordered in its
// memory: the load fails with a reason naming the region (the reorder
// faulted and took the process with it), and once the memory is back the
// next load verifies.
func TestReorderOfShrunkMemoryFailsTheLoad(t *testing.T) {
	pg := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 1, blockSize: 8, blocks: 64}
	dg := pg
	dg.blockSize, dg.blocks = 16, 32
	ps := newPrefillSide(t, pg, "prefill", nil)
	pool, f := dg.shmPool(t, 0)
	rx, err := NewReceiver(ReceiverConfig{EngineID: "decode", TPSize: 1, Agent: newAgent(t, "d0"),
		Cache: cacheOf(pool, LayoutHND), TotalKVHeads: pg.heads, CompatHash: testHash, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	size := int64(pool.Geometry().Size())
	hook := func() {
		if err := f.Truncate(0); err != nil {
			t.Error(err)
		}
	}
	testHookBeforeReorder.Store(&hook)
	defer testHookBeforeReorder.Store(nil)

	load := func(id string, seed uint64) LoadResult {
		const tokens = 40 // 5 prefill blocks, 3 decode blocks
		pblocks := []int32{3, 9, 4, 20, 7}
		params := ps.hold(t, id, seed, pblocks, tokens)
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{5, 0, 11}, Params: params}))
		if res.Err == nil {
			res.Err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{5, 0, 11}, Count: tokens})
		}
		return res
	}
	res := load("shrunk", 1)
	t.Logf("the load into shrunk memory: %v", res.Err)
	if res.Err == nil || !strings.Contains(res.Err.Error(), "no longer mapped") ||
		!strings.Contains(res.Err.Error(), "KV region 0 (kv_caches_base_addr[0])") || len(res.InvalidBlocks) != 3 {
		t.Fatalf("the load into shrunk memory: %v (invalid blocks %v), want a failure naming the region", res.Err, res.InvalidBlocks)
	}
	testHookBeforeReorder.Store(nil)
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if res := load("after", 2); res.Err != nil {
		t.Fatal(fmt.Errorf("after the memory came back: %w", res.Err))
	}
}
