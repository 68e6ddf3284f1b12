package serve

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// resources counts what a leak would grow: open fds, mappings of shared
// memory (/proc/self/maps lines naming /dev/shm: the engines' regions;
// the Go heap's own mappings grow and shrink with the heap) and
// goroutines.
type resources struct{ fds, maps, goroutines int }

func measure(t *testing.T) resources {
	t.Helper()
	// Idle keep-alive connections of the bootstrap clients (decode's
	// bootstrap and heartbeat requests use net/http's shared transport)
	// are a pool, not a leak.
	http.DefaultTransport.(*http.Transport).CloseIdleConnections()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return resources{len(fds), strings.Count(string(maps), "/dev/shm/"), runtime.NumGoroutine()}
}

// backToBaseline waits (up to 20 s) until the counts are back to base.
func backToBaseline(t *testing.T, base resources) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		now := measure(t)
		if now.fds <= base.fds && now.maps <= base.maps && now.goroutines <= base.goroutines {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			t.Fatalf("leak: now %+v, baseline %+v\n%s", now, base, buf[:n])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestEngineKilled: a prefill engine process dies with rooms in flight.
// Its sidecar fails them with "engine disconnected" and tells decode, so
// the decode engine's rooms fail with that reason; its ranks, agents and
// mappings are released (fds, maps and goroutines back to baseline once
// the decode engine leaves too).
func TestEngineKilled(t *testing.T) {
	_, engine := binaries(t)
	ps := newTestServer(t)
	ds := newTestServer(t)
	admin := dial(t, ps)
	boot, err := admin.StartBootstrap(testCtx(t), "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	base := measure(t)

	pre := start(t, "prefill engine", engine, "-control", ps.Endpoint(), "-role", "prefill", "-tp", "1", "-rooms", "7,8", "-bootstrap", boot, "-hold")
	pre.expect("CREATED")
	dc, err := client.Dial(ctx, ds.Endpoint(), client.Options{Name: "decode"})
	if err != nil {
		t.Fatal(err)
	}
	w := fakeengine.Watch(dc)
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Open(ctx, dc, "nixl", ""); err != nil {
		t.Fatal(err)
	}
	for _, room := range []uint64{7, 8} {
		if err := dc.ReceiverCreate(ctx, r.ID, room, boot, -1); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Wait(ctx, r.ID, room, client.StateWaitingForInput); err != nil {
			t.Fatal(err)
		}
		q := fakeengine.Request{Room: room, Tokens: 16}
		if err := dc.ReceiverInit(ctx, r.ID, room, fakeengine.DecodePages(r, q), 0, nil, 0); err != nil {
			t.Fatal(err)
		}
	}
	pre.expect("INFLIGHT")
	if ps.Sessions() != 2 {
		t.Fatalf("prefill sidecar has %d sessions, want 2", ps.Sessions())
	}
	pre.cmd.Process.Kill()
	for _, room := range []uint64{7, 8} {
		e, err := w.Wait(ctx, r.ID, room, client.StateSuccess)
		if err != nil {
			t.Fatal(err)
		}
		if e.State != client.StateFailed || !strings.Contains(e.Reason, "engine disconnected") {
			t.Fatalf("decode room %d: state %d reason %q, want Failed with the prefill engine's disconnect", room, e.State, e.Reason)
		}
	}
	waitFor(t, "prefill session torn down", func() bool { return ps.Sessions() == 1 })
	for _, room := range []uint64{7, 8} {
		dc.CloseRoom(ctx, r.ID, room)
	}
	dc.Close()
	r.Close() // the decode engine's own mapping
	waitFor(t, "decode session torn down", func() bool { return ds.Sessions() == 0 })
	backToBaseline(t, base)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSidecarRestart: the decode sidecar (a kvhost serve process) is
// killed with a room in flight. The engine's client fails the request in
// flight and reports the room Failed ("sidecar connection lost"); the
// engine reconnects to a restarted sidecar, sees another session,
// registers again and moves KV.
func TestSidecarRestart(t *testing.T) {
	kvhost, _ := binaries(t)
	ps := newTestServer(t)
	admin := dial(t, ps)
	boot, err := admin.StartBootstrap(testCtx(t), "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	pre := newEngine(t, ps, "prefill", "nixl", memDRAM, smallShape, 1, boot)
	sock := filepath.Join(t.TempDir(), "d.sock")
	side, ep := sidecar(t, kvhost, sock)
	ctx := testCtx(t)

	c, err := client.Dial(ctx, ep, client.Options{Name: "decode"})
	if err != nil {
		t.Fatal(err)
	}
	session := c.Hello().Session
	w := fakeengine.Watch(c)
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Open(ctx, c, "nixl", ""); err != nil {
		t.Fatal(err)
	}
	// A room that never completes: its prefill never sends.
	if err := c.ReceiverCreate(ctx, r.ID, 99, "127.0.0.1:1", -1); err != nil {
		t.Fatal(err)
	}
	side.cmd.Process.Kill()
	side.wait()
	e, err := w.Wait(ctx, r.ID, 99, client.StateSuccess)
	if err != nil {
		t.Fatal(err)
	}
	if e.State != client.StateFailed || e.Reason != client.ReasonConnectionLost {
		t.Fatalf("room after the sidecar died: %+v", e)
	}
	if _, err := c.Call(ctx, "poll", map[string]any{"rank": r.ID, "rooms": []byte{}}); !client.IsCode(err, client.CodeDisconnected) {
		t.Fatalf("request after the sidecar died: %v", err)
	}
	<-c.Done()
	c.Close()

	_, ep = sidecar(t, kvhost, sock)
	c, err = client.Dial(ctx, ep, client.Options{Name: "decode"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Hello().Session == session {
		t.Fatal("a restarted sidecar has the old session id")
	}
	w = fakeengine.Watch(c)
	if err := r.Open(ctx, c, "nixl", ""); err != nil {
		t.Fatal(err)
	}
	q := fakeengine.Request{Room: 100, Tokens: 21, Chunk: 2}
	errs := make(chan error, 1)
	go func() { errs <- fakeengine.Prefill(ctx, pre.c, pre.w, pre.ranks[0], q) }()
	if err := fakeengine.Decode(ctx, c, w, r, boot, q); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	_ = fmt.Sprint
	_ = context.Background
}
