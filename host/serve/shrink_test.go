package serve

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// Engines that shrink the memory they registered (issue 25.3). The
// sidecar maps an engine's shared memory; when the engine truncates the
// object, touching the mapping raises SIGBUS, which killed the sidecar
// (the fake plugin's same-process copy, the vLLM block reorder in Go) and
// every other engine's connection with it. These tests run the sidecar in
// the test process: on code without the containment the test binary dies.

// faultReason reports whether a failure reason says that registered
// memory went away under the sidecar.
func faultReason(reason string) bool {
	return strings.Contains(reason, "not mapped") || strings.Contains(reason, "no longer mapped")
}

// startBootstrap runs a bootstrap server of its own (one per prefill
// engine: a sidecar serves one).
func startBootstrap(t *testing.T) string {
	t.Helper()
	run, err := bootstrap.NewServer().Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		run.Close(ctx)
	})
	return run.Addr()
}

// TestSGLangEngineShrinksMemory: two SGLang engine pairs on one sidecar.
// One prefill engine truncates its shared memory to 0 after it started
// sending a room's first chunk: its room fails with a reason naming the
// region, the sidecar lives on, and the other pair's rooms, run
// meanwhile, verify every byte. Rooms on the same connection before and
// after are unaffected too: the pair whose memory went keeps its
// connection (a new room of the decode, whose memory is intact, opens).
func TestSGLangEngineShrinksMemory(t *testing.T) {
	s := newTestServer(t)
	boot1, boot2 := startBootstrap(t), startBootstrap(t)
	bad := newEngine(t, s, "prefill", "nixl", memDRAM, smallShape, 1, boot1)
	badDec := newEngine(t, s, "decode", "nixl", memDRAM, smallShape, 1, "")
	good := newEngine(t, s, "prefill", "nixl", memDRAM, smallShape, 1, boot2)
	goodDec := newEngine(t, s, "decode", "nixl", memDRAM, smallShape, 1, "")
	ctx := testCtx(t)

	// The bad pair works before.
	run(t, bad, badDec, boot1, []fakeengine.Request{{Room: 1, Tokens: 30, Chunk: 2}})

	// The good pair runs while the bad prefill shrinks its memory.
	var wg sync.WaitGroup
	wg.Go(func() {
		// Rooms in flight together differ modulo the 4 blocks of the pool.
		for b := range 3 {
			var reqs []fakeengine.Request
			for i := range 4 {
				reqs = append(reqs, fakeengine.Request{Room: uint64(100 + 4*b + i), Tokens: 30, Chunk: 2})
			}
			run(t, good, goodDec, boot2, reqs)
		}
	})
	pr, dr := bad.ranks[0], badDec.ranks[0]
	shm, err := os.OpenFile("/dev/shm"+pr.SHM, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer shm.Close()
	// NoBytes: the engine does not touch the memory it shrank (here, in
	// the test process, that would fault the test itself).
	q := fakeengine.Request{Room: 2, Tokens: 30, Chunk: 2, NoBytes: true, AfterChunk: func(i int) {
		if i == 0 {
			if err := shm.Truncate(0); err != nil {
				t.Error(err)
			}
		}
	}}
	decErr := make(chan error, 1)
	go func() { decErr <- fakeengine.Decode(ctx, badDec.c, badDec.w, dr, boot1, q) }()
	err = fakeengine.Prefill(ctx, bad.c, bad.w, pr, q)
	t.Logf("the shrunk prefill's room: %v", err)
	if err == nil || !faultReason(err.Error()) {
		t.Fatalf("the room of the prefill that shrank its memory: %v, want a failure naming the region", err)
	}
	// The plugin names the sidecar's mapping; the sidecar adds the
	// engine's own address, region and shm.
	if !strings.Contains(err.Error(), "registered region [0x") || !strings.Contains(err.Error(), "in this engine's terms") ||
		!strings.Contains(err.Error(), fmt.Sprintf("shm %q", pr.SHM)) {
		t.Fatalf("the failure does not name the region in the engine's terms: %v", err)
	}
	// The decode's room of that request cannot succeed: it fails (the
	// prefill tells it), whatever the reason.
	if err := <-decErr; err == nil {
		t.Fatal("the decode room of the failed request succeeded")
	}
	wg.Wait()

	// The sidecar and the bad engine's connection live on.
	if _, _, err := bad.c.Poll(ctx, pr.ID, []uint64{2}); err != nil {
		t.Fatalf("the shrinking engine's connection after the fault: %v", err)
	}
	run(t, good, goodDec, boot2, []fakeengine.Request{{Room: 200, Tokens: 9}})
}

// TestVLLMEngineFlipsMemory: a vLLM prefill and two decode engines on one
// sidecar, the decodes' blocks twice the prefill's (the sidecar reorders
// received blocks in the engine's memory). One decode engine flips its
// shared memory between 0 and full size while both decodes read request
// after request: its reads fail with a reason naming the region (the
// READ's copy or the reorder, whichever meets the empty object first), the
// sidecar lives on, and every read of the other decode verifies every
// byte. Once the flipping stops, the flipping engine reads again.
// reorderRegion matches a reorder fault's region, whichever of the engine's
// KV regions (K or V, any layer) the reorder was in when it met the empty
// object.
var reorderRegion = regexp.MustCompile(`reorder of block \d+ in KV region \d+ \(kv_caches_base_addr\[\d+\]\)`)

func TestVLLMEngineFlipsMemory(t *testing.T) {
	ctx := testCtx(t)
	s := newTestServer(t)
	w := vsMust(vsOpenT(t, s, "prefill", "P", 1, 0, 32, 4, nil))
	vsEvent(t, w.c)
	go func() { // released events, not looked at
		for range w.c.Events() {
		}
	}()
	goodDec := vsMust(vsOpenT(t, s, "decode", "Dgood", 1, 0, 8, 8, nil))
	badDec := vsMust(vsOpenT(t, s, "decode", "Dbad", 1, 0, 8, 8, nil))

	f, err := os.OpenFile(badDec.shm, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size := int64(badDec.pool.Geometry().Size())
	stop, flipped := make(chan struct{}), make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				flipped <- f.Truncate(size)
				return
			default:
			}
			if err := errors.Join(f.Truncate(0), f.Truncate(size)); err != nil {
				flipped <- err
				return
			}
		}
	}()

	const tokens = 19                                                          // 5 prefill blocks of 4, 3 decode blocks of 8
	goodBlocks, badBlocks := []int32{9, 2, 30, 14, 6}, []int32{1, 3, 5, 7, 11} // prefill blocks
	local := []int32{7, 1, 4}
	read := func(d *vsRank, req string, blocks []int32, seed uint64) client.ReadEvent {
		t.Helper()
		if err := w.pool.Fill(kvpool.Tokens{Request: seed, Pages: blocks, Count: tokens}); err != nil {
			t.Fatal(err)
		}
		params, err := w.c.Hold(ctx, "P", req, blocks)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.c.Read(ctx, d.rank.ID, "d"+req, params, local); err != nil {
			t.Fatal(err)
		}
		r, ok := vsEvent(t, d.c).AsRead()
		if !ok {
			t.Fatal("not a read event")
		}
		return r
	}
	// Both decodes read until the flipping engine saw a few faults (each
	// read meets the empty object with high odds; the bound only stops a
	// run whose flipper never ran).
	faults, copyFaults, reorderFaults := 0, 0, 0
	for i := 0; faults < 20 && i < 400; i++ {
		var wg sync.WaitGroup
		var badRes client.ReadEvent
		wg.Go(func() { badRes = read(badDec, fmt.Sprintf("bad-%d", i), badBlocks, uint64(1000+i)) })
		goodRes := read(goodDec, fmt.Sprintf("good-%d", i), goodBlocks, uint64(i+1))
		wg.Wait()
		if !goodRes.OK {
			t.Fatalf("read %d of the other decode failed: %s", i, goodRes.Reason)
		}
		if err := goodDec.pool.Verify(kvpool.Tokens{Request: uint64(i + 1), Pages: local, Count: tokens}); err != nil {
			t.Fatalf("read %d of the other decode: %v", i, err)
		}
		if badRes.OK {
			continue // the object was full throughout; its bytes are the engine's business
		}
		if !faultReason(badRes.Reason) {
			t.Fatalf("read %d of the flipping decode failed for another reason: %s", i, badRes.Reason)
		}
		if !strings.Contains(badRes.Reason, "in this engine's terms") || !strings.Contains(badRes.Reason, fmt.Sprintf("shm %q", badDec.shm)) {
			t.Fatalf("read %d of the flipping decode: the reason does not name the region in the engine's terms: %s", i, badRes.Reason)
		}
		switch {
		case strings.Contains(badRes.Reason, "reorder") && reorderRegion.MatchString(badRes.Reason):
			reorderFaults++
		case strings.Contains(badRes.Reason, "registered region [0x"):
			copyFaults++
		default:
			t.Fatalf("read %d of the flipping decode: the reason names no region: %s", i, badRes.Reason)
		}
		faults++
	}
	close(stop)
	if err := <-flipped; err != nil {
		t.Fatal(err)
	}
	t.Logf("the flipping decode's reads: %d failed on a fault (%d in the READ's copy, %d in the reorder)", faults, copyFaults, reorderFaults)
	if faults == 0 {
		t.Fatal("no read of the flipping decode met its empty memory")
	}
	// Memory back for good: the flipping engine reads again, every byte.
	if r := read(badDec, "bad-after", badBlocks, 77); !r.OK {
		t.Fatalf("after the flipping: %s", r.Reason)
	}
	if err := badDec.pool.Verify(kvpool.Tokens{Request: 77, Pages: local, Count: tokens}); err != nil {
		t.Fatalf("after the flipping: %v", err)
	}
}
