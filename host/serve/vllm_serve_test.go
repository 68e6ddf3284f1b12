package serve

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

var vsShmSeq atomic.Int64

// vsShmPool is a test engine rank's KV cache in POSIX shared memory: the
// engine's own mapping (the pool) and the name the sidecar maps it by.
func vsShmPool(t *testing.T, g kvpool.Geometry) (*kvpool.Pool, string) {
	t.Helper()
	path := filepath.Join("/dev/shm", fmt.Sprintf("kvhost-vllmtest-%d-%d", os.Getpid(), vsShmSeq.Add(1)))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t.Cleanup(func() { os.Remove(path) })
	if err := f.Truncate(int64(g.Size())); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(g.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvpool.Wrap(g, mem)
	if err != nil {
		syscall.Munmap(mem)
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, path
}

// vsModel is the model both test engines serve.
var vsModel = client.VLLMCompat{VLLMVersion: "0.13.0", NixlConnectorVersion: vllm.ConnectorVersion, Model: "kvhost/test",
	DType: "torch.bfloat16", NumKVHeads: 4, HeadSize: 8, NumHiddenLayers: 3, AttnBackendName: "FLASH_ATTN", CacheDType: "auto"}

func vsGeom(tp, rank, blocks, blockSize int) kvpool.Geometry {
	return kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.Interleaved, HeadMajor: true, Layers: 3,
		Pages: blocks, PageSize: blockSize, TotalHeads: 4, TPSize: tp, TPRank: rank, HeadBytes: 16}
}

// vsRank is one test engine rank: its connection, cache and rank.
type vsRank struct {
	c    *client.Client
	pool *kvpool.Pool
	rank client.Rank
	shm  string // the path of the pool's shared-memory object
}

// vsOpen connects a worker of a vLLM engine to srv, shares its KV cache
// and opens its rank.
func vsOpen(t *testing.T, srv *Server, role, engine string, tp, rank, blocks, blockSize int, mod func(*client.VLLMRank)) (*vsRank, error) {
	t.Helper()
	return vsOpenAs(t, srv, "", role, engine, tp, rank, blocks, blockSize, mod)
}

// vsOpenAs is vsOpen with the region's register_as.
func vsOpenAs(t *testing.T, srv *Server, registerAs, role, engine string, tp, rank, blocks, blockSize int, mod func(*client.VLLMRank)) (*vsRank, error) {
	t.Helper()
	ctx := testCtx(t)
	c := dial(t, srv)
	pool, shm := vsShmPool(t, vsGeom(tp, rank, blocks, blockSize))
	regs := pool.Regions()
	if _, err := c.RegisterMemory(ctx, []client.Region{{Kind: "dram", Addr: regs[0].Addr, Length: pool.Geometry().Size(), SHM: shm, RegisterAs: registerAs}}); err != nil {
		t.Fatal(err)
	}
	r := client.VLLMRank{Role: role, EngineID: engine, TPSize: tp, TPRank: rank, RegionLen: regs[0].Len,
		NumBlocks: blocks, BlockSize: blockSize, KVCacheLayout: "HND", TotalKVHeads: 4, Compat: vsModel,
		SideChannelHost: "127.0.0.1"}
	for _, x := range regs {
		r.KVCachesBaseAddr = append(r.KVCachesBaseAddr, x.Addr)
	}
	if mod != nil {
		mod(&r)
	}
	rk, err := c.OpenVLLM(ctx, r)
	return &vsRank{c: c, pool: pool, rank: rk, shm: shm}, err
}

func vsMust(t *testing.T, r *vsRank, err error) *vsRank {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// vsEvent waits for c's next event that is not a room event.
func vsEvent(t *testing.T, c *client.Client) client.Event {
	t.Helper()
	select {
	case e, ok := <-c.Events():
		if !ok {
			t.Fatal("event stream closed")
		}
		return e
	case <-time.After(30 * time.Second):
		t.Fatal("no event within 30 s")
	}
	return client.Event{}
}

func vsReleased(t *testing.T, c *client.Client, engine, req, reason string) {
	t.Helper()
	e := vsEvent(t, c)
	r, ok := e.AsReleased()
	if !ok || r.EngineID != engine || r.RequestID != req || r.Reason != reason {
		t.Fatalf("event %s %+v, want released %s %s %s", e.Name, r, engine, req, reason)
	}
}

func vsNoEvent(t *testing.T, c *client.Client) {
	t.Helper()
	select {
	case e := <-c.Events():
		t.Fatalf("unexpected event %s: %v", e.Name, e.Raw)
	case <-time.After(50 * time.Millisecond):
	}
}

// TestServeVLLMPull: vLLM pull TP 1 → 2 through two sidecars, every
// engine a client of its sidecar with its KV in shared memory; every byte
// is checked in the decode engine's own mapping, and the holder and the
// prefill worker see the request released "notified".
func TestServeVLLMPull(t *testing.T) {
	ctx := testCtx(t)
	ps, ds := newTestServer(t), newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 64, 4, nil))
	if w.rank.Endpoint == "" {
		t.Fatal("a complete TP 1 engine has no side channel in its reply")
	}
	if id, ep, ok := vsEvent(t, w.c).AsEngineReady(); !ok || id != "P" || ep != w.rank.Endpoint {
		t.Fatalf("engine_ready %q %q %v, want %q", id, ep, ok, w.rank.Endpoint)
	}
	sched := dial(t, ps) // the scheduler owns no KV: it only says hello
	blocks := []int32{17, 3, 40, 8, 22}
	const tokens = 18
	if err := w.pool.Fill(kvpool.Tokens{Request: 11, Pages: blocks, Count: tokens}); err != nil {
		t.Fatal(err)
	}
	params, err := sched.Hold(ctx, "P", "req-1", blocks)
	if err != nil {
		t.Fatal(err)
	}
	// Exactly vLLM's request_finished dict, key for key.
	var keys []string
	for _, p := range params.Pairs {
		k, _ := p[0].Str()
		keys = append(keys, k)
	}
	if want := []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
		"remote_host", "remote_port", "tp_size"}; !slices.Equal(keys, want) {
		t.Fatalf("kv_transfer_params keys %v, want %v", keys, want)
	}
	if rb, _ := params.Get("remote_block_ids"); rb.Kind != msgpack.Array || rb.Len() != len(blocks) {
		t.Fatalf("remote_block_ids %v", rb.Kind)
	}

	var dec []*vsRank
	for rank := 0; rank < 2; rank++ {
		dec = append(dec, vsMust(vsOpenT(t, ds, "decode", "D", 2, rank, 32, 4, nil)))
	}
	local := []int32{30, 0, 9, 14, 2}
	for _, d := range dec {
		if err := d.c.Read(ctx, d.rank.ID, "dreq-1", params, local); err != nil {
			t.Fatal(err)
		}
	}
	for i, d := range dec {
		e := vsEvent(t, d.c)
		r, ok := e.AsRead()
		if !ok || !r.OK || r.RequestID != "dreq-1" || r.Rank != d.rank.ID || len(r.InvalidBlocks) != 0 || r.Bytes == 0 || r.Reason != "" {
			t.Fatalf("rank %d: %s %+v", i, e.Name, r)
		}
		if err := d.pool.Verify(kvpool.Tokens{Request: 11, Pages: local, Count: tokens}); err != nil {
			t.Fatalf("decode rank %d: %v", i, err)
		}
	}
	vsReleased(t, w.c, "P", "req-1", "notified")
	vsReleased(t, sched, "P", "req-1", "notified")
	for _, c := range []*client.Client{w.c, sched, dec[0].c, dec[1].c} {
		vsNoEvent(t, c)
	}
}

// vsOpenT adapts vsOpen for vsMust.
func vsOpenT(t *testing.T, srv *Server, role, engine string, tp, rank, blocks, blockSize int, mod func(*client.VLLMRank)) (*testing.T, *vsRank, error) {
	r, err := vsOpen(t, srv, role, engine, tp, rank, blocks, blockSize, mod)
	return t, r, err
}

// TestServeVLLMFailures: reads that cannot pull fail with every block
// invalid; a prefill worker that disconnects releases its engine's holds
// "closed"; a hold nobody reads is released "timeout"; a holder that
// disconnects releases its holds "closed"; another engine's connection
// cannot release.
func TestServeVLLMFailures(t *testing.T) {
	ctx := testCtx(t)
	ps, ds := newTestServer(t), newTestServer(t)
	// A hold nobody reads: released "timeout" to the worker and holder.
	wt := vsMust(vsOpenT(t, ps, "prefill", "T", 1, 0, 16, 4, func(r *client.VLLMRank) { r.AbortTimeout = 300 * time.Millisecond }))
	vsEvent(t, wt.c) // engine_ready
	schedT := dial(t, ps)
	if _, err := schedT.Hold(ctx, "T", "r1", []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	vsReleased(t, wt.c, "T", "r1", "timeout")
	vsReleased(t, schedT, "T", "r1", "timeout")

	w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 16, 4, nil))
	vsEvent(t, w.c) // engine_ready
	sched := dial(t, ps)
	params, err := sched.Hold(ctx, "P", "r1", []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	d := vsMust(vsOpenT(t, ds, "decode", "D", 1, 0, 16, 4, nil))

	failed := func(id string, blocks []int32, what string) {
		t.Helper()
		e := vsEvent(t, d.c)
		r, ok := e.AsRead()
		if !ok || r.OK || r.RequestID != id || r.Reason == "" || !slices.Equal(r.InvalidBlocks, blocks) {
			t.Fatalf("%s: %s %+v", what, e.Name, r)
		}
		t.Logf("%s: %s", what, r.Reason)
	}
	// Params naming an engine the side channel is not.
	wrong := vsSetParam(params, "remote_engine_id", "no-such-engine")
	if err := d.c.Read(ctx, d.rank.ID, "a", wrong, []int32{4, 5}); err != nil {
		t.Fatal(err)
	}
	failed("a", []int32{4, 5}, "unknown engine")
	// A field of the wrong type.
	bad := vsSetParam(params, "remote_port", "not-a-port")
	if err := d.c.Read(ctx, d.rank.ID, "b", bad, []int32{6, 7, 8}); err != nil {
		t.Fatal(err)
	}
	failed("b", []int32{6, 7, 8}, "remote_port of the wrong type")
	// do_remote_prefill false: vLLM's connector does not pull.
	if err := d.c.Read(ctx, d.rank.ID, "c", vsSetParam(params, "do_remote_prefill", false), []int32{9}); err != nil {
		t.Fatal(err)
	}
	failed("c", []int32{9}, "do_remote_prefill false")
	// Not a map at all is the request's fault.
	if _, err := d.c.Call(ctx, "read", map[string]any{"rank": d.rank.ID, "request_id": "x", "kv_transfer_params": "nope",
		"block_ids": client.Pages([]int32{1})}); !client.IsCode(err, CodeBadRequest) {
		t.Fatalf("read with a str for params: %v", err)
	}
	// read on a prefill rank.
	if _, err := w.c.Call(ctx, "read", map[string]any{"rank": w.rank.ID, "request_id": "x", "kv_transfer_params": params,
		"block_ids": client.Pages([]int32{1})}); !client.IsCode(err, CodeBadRequest) {
		t.Fatalf("read on a prefill rank: %v", err)
	}

	// Another engine's connection cannot release P's request.
	if _, err := sched.Hold(ctx, "P", "r2", []int32{3}); err != nil {
		t.Fatal(err)
	}
	if err := d.c.Release(ctx, "P", "r2"); !client.IsCode(err, CodeUnknown) {
		t.Fatalf("engine D released engine P's request: %v", err)
	}
	if err := sched.Release(ctx, "P", "nope"); !client.IsCode(err, CodeUnknown) {
		t.Fatalf("release of an unknown request: %v", err)
	}
	// The prefill worker closes its rank while r1 and r2 are held.
	if err := w.c.CloseRank(ctx, w.rank.ID); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*client.Client{w.c, sched} {
		vsReleased(t, c, "P", "r1", "closed")
		vsReleased(t, c, "P", "r2", "closed")
	}
	if _, err := sched.Hold(ctx, "P", "r3", []int32{3}); !client.IsCode(err, CodeUnknown) {
		t.Fatalf("hold on an engine with no rank: %v", err)
	}
	if err := sched2Release(ctx, t, ps); err != nil {
		t.Fatal(err)
	}
	vsNoEvent(t, d.c)
	vsNoEvent(t, w.c)
}

// sched2Release: release reports "aborted" to the worker and the holder.
func sched2Release(ctx context.Context, t *testing.T, ps *Server) error {
	w2 := vsMust(vsOpenT(t, ps, "prefill", "P2", 1, 0, 16, 4, nil))
	vsEvent(t, w2.c)
	sched2 := dial(t, ps)
	if _, err := sched2.Hold(ctx, "P2", "r4", []int32{5}); err != nil {
		return err
	}
	if err := sched2.Release(ctx, "P2", "r4"); err != nil {
		return err
	}
	vsReleased(t, w2.c, "P2", "r4", "aborted")
	vsReleased(t, sched2, "P2", "r4", "aborted")
	vsNoEvent(t, w2.c)
	return nil
}

// vsSetParam returns params (a map) with one field replaced.
func vsSetParam(params msgpack.Value, key string, v any) msgpack.Value {
	var e msgpack.Encoder
	e.MapHeader(len(params.Pairs))
	for _, p := range params.Pairs {
		k, _ := p[0].Str()
		e.Str(k)
		if k != key {
			e.Value(p[1])
			continue
		}
		encodeValue(&e, v)
	}
	out, err := msgpack.Decode(e.Bytes())
	if err != nil {
		panic(err)
	}
	return out
}

// TestServeVLLMRefusals: open_rank, hold and read refuse what they
// cannot use with the API's codes, and a refused request binds the
// connection to no engine.
func TestServeVLLMRefusals(t *testing.T) {
	ctx := testCtx(t)
	srv := newTestServer(t)
	for _, bad := range []struct {
		name string
		mod  func(*client.VLLMRank)
		code string
	}{
		{"region_len not whole blocks", func(r *client.VLLMRank) { r.RegionLen-- }, CodeGeometry},
		{"a region outside the registered memory", func(r *client.VLLMRank) { r.KVCachesBaseAddr[1] += 1 << 40 }, CodeBadRegion},
		{"a compat factor missing", func(r *client.VLLMRank) { r.Compat.Model = "" }, ""},
		{"layout", func(r *client.VLLMRank) { r.KVCacheLayout = "XYZ" }, CodeBadRequest},
		{"tp_rank outside tp_size", func(r *client.VLLMRank) { r.TPRank = 2 }, CodeBadRequest},
	} {
		vr, err := vsOpen(t, srv, "decode", "X-"+bad.name, 2, 0, 8, 4, bad.mod)
		if bad.code == "" { // an empty model is a valid factor: the open succeeds
			if err != nil {
				t.Fatalf("%s: %v", bad.name, err)
			}
			continue
		}
		if !client.IsCode(err, bad.code) {
			t.Fatalf("%s: %v, want %s", bad.name, err, bad.code)
		}
		// Not bound: the same connection may open a rank of another engine.
		rk, err := vr.c.OpenVLLM(ctx, client.VLLMRank{Role: "decode", EngineID: "Y", TPSize: 1, KVCachesBaseAddr: []uint64{vr.pool.Regions()[0].Addr},
			RegionLen: vr.pool.Regions()[0].Len, NumBlocks: 8, BlockSize: 4, TotalKVHeads: 4, Compat: vsModel})
		if err != nil {
			t.Fatalf("%s: then a good open_rank: %v", bad.name, err)
		}
		if _, err := vr.c.Hold(ctx, "Z", "r", []int32{1}); !client.IsCode(err, CodeUnknown) {
			t.Fatalf("%s: a connection of engine Y held for Z: %v", bad.name, err)
		}
		_ = rk
	}
	c := dial(t, srv)
	if _, err := c.Call(ctx, "hold", map[string]any{"engine_id": "P", "request_id": "r", "block_ids": []byte{1, 2, 3}}); !client.IsCode(err, CodeBadRequest) {
		t.Fatalf("hold with 3 bytes of block ids: %v", err)
	}
	if _, err := c.Call(ctx, "open_rank", map[string]any{"style": "vllm", "role": "decode", "engine_id": "P", "tp_size": 1, "tp_rank": 0,
		"kv_caches_base_addr": []uint64{4096}, "region_len": 4096, "num_blocks": 1, "block_size": 1, "total_kv_heads": 1}); !client.IsCode(err, CodeBadRequest) &&
		!client.IsCode(err, CodeBadRegion) {
		t.Fatalf("open_rank without compat: %v", err)
	}
}

// TestServeVLLMIDBounds: engine and request ids longer than 1 KiB are
// refused: a hold keeps its id until released.
func TestServeVLLMIDBounds(t *testing.T) {
	ctx := testCtx(t)
	srv := newTestServer(t)
	w := vsMust(vsOpenT(t, srv, "prefill", "P", 1, 0, 8, 4, nil))
	vsEvent(t, w.c)
	long := strings.Repeat("x", 1025)
	if _, err := w.c.Hold(ctx, "P", long, []int32{1}); !client.IsCode(err, CodeBadRequest) {
		t.Fatalf("hold with a 1025-byte request id: %v", err)
	}
	if err := w.c.Release(ctx, long, "r"); !client.IsCode(err, CodeBadRequest) {
		t.Fatalf("release with a 1025-byte engine id: %v", err)
	}
	if _, err := w.c.Hold(ctx, "P", strings.Repeat("x", 1024), []int32{1}); err != nil {
		t.Fatalf("hold with a 1024-byte request id: %v", err)
	}
}

// TestServeVLLMBlockSizeRatio: a decode whose blocks hold two prefill
// blocks reads through its sidecar and gets every token in place: the
// HND blocks are reordered in the sidecar's mapping of the engine's
// shared memory (the Cache's host views), which the engine then sees.
func TestServeVLLMBlockSizeRatio(t *testing.T) { testServeVLLMBlockSizeRatio(t, "") }

// TestServeVLLMBlockSizeRatioRegisterAsVRAM: the same with both engines'
// host memory registered as VRAM (register_as "vram", which the fake
// plugin takes): the plugin sees GPU memory, and the decode still
// reorders blocks in its host view of the region, which is host memory
// whatever it is registered as.
func TestServeVLLMBlockSizeRatioRegisterAsVRAM(t *testing.T) { testServeVLLMBlockSizeRatio(t, "vram") }

func testServeVLLMBlockSizeRatio(t *testing.T, registerAs string) {
	ctx := testCtx(t)
	ps, ds := newTestServer(t), newTestServer(t)
	open := func(srv *Server, role, engine string, tp, rank, blocks, blockSize int) (*testing.T, *vsRank, error) {
		r, err := vsOpenAs(t, srv, registerAs, role, engine, tp, rank, blocks, blockSize, nil)
		return t, r, err
	}
	w := vsMust(open(ps, "prefill", "P", 1, 0, 32, 4))
	vsEvent(t, w.c)
	const tokens = 19
	blocks := []int32{9, 2, 30, 14, 6} // 5 blocks of 4 tokens
	if err := w.pool.Fill(kvpool.Tokens{Request: 5, Pages: blocks, Count: tokens}); err != nil {
		t.Fatal(err)
	}
	params, err := w.c.Hold(ctx, "P", "req", blocks)
	if err != nil {
		t.Fatal(err)
	}
	local := []int32{7, 1, 4} // 3 blocks of 8 tokens
	var dec []*vsRank
	for rank := 0; rank < 2; rank++ {
		d := vsMust(open(ds, "decode", "D", 2, rank, 8, 8))
		dec = append(dec, d)
		if err := d.c.Read(ctx, d.rank.ID, "dreq", params, local); err != nil {
			t.Fatal(err)
		}
	}
	for i, d := range dec {
		if r, ok := vsEvent(t, d.c).AsRead(); !ok || !r.OK {
			t.Fatalf("rank %d: %+v", i, r)
		}
		if err := d.pool.Verify(kvpool.Tokens{Request: 5, Pages: local, Count: tokens}); err != nil {
			t.Fatalf("rank %d: %v", i, err)
		}
	}
	vsReleased(t, w.c, "P", "req", "notified")
}

// TestServeVLLMDisconnect: a prefill worker that disconnects releases its
// engine's holds "closed" (to the holder); a holder that disconnects
// releases its holds "closed" (to the workers).
func TestServeVLLMDisconnect(t *testing.T) {
	ctx := testCtx(t)
	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 16, 4, nil))
	vsEvent(t, w.c)
	sched := dial(t, ps)
	if _, err := sched.Hold(ctx, "P", "r1", []int32{3}); err != nil {
		t.Fatal(err)
	}
	w.c.Close()
	vsReleased(t, sched, "P", "r1", "closed")

	w2 := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 16, 4, nil))
	vsEvent(t, w2.c)
	if _, err := sched.Hold(ctx, "P", "r2", []int32{5}); err != nil {
		t.Fatal(err)
	}
	sched.Close()
	vsReleased(t, w2.c, "P", "r2", "closed")
	vsNoEvent(t, w2.c)
}
