package serve

import (
	"context"
	"encoding/binary"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// TestLimits: ranks, regions and rooms per connection are bounded; a
// refusal is `limit` and leaves the connection's state as it was.
func TestLimits(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.Limits = Limits{Ranks: 1, Regions: 2, Rooms: 1} })
	c := dial(t, s)
	ctx := testCtx(t)
	if l := c.Hello().Limits; l.Ranks != 1 || l.Regions != 2 || l.Rooms != 1 {
		t.Fatalf("hello limits %+v", l)
	}
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Open(ctx, c, "nixl", ""); err != nil {
		t.Fatal(err)
	}
	shm := shmFile(t, 1<<16)
	if _, err := c.RegisterMemory(ctx, []client.Region{{Kind: "dram", Addr: 1 << 40, Length: 4096, SHM: shm}, {Kind: "dram", Addr: 1<<40 + 8192, Length: 4096, SHM: shm}}); !client.IsCode(err, CodeLimit) {
		t.Fatalf("third region: %v", err)
	}
	if _, err := c.OpenSGLang(ctx, r.Args("nixl", "")); !client.IsCode(err, CodeLimit) {
		t.Fatalf("second rank: %v", err)
	}
	if err := c.ReceiverCreate(ctx, r.ID, 1, "127.0.0.1:1", -1); err != nil {
		t.Fatal(err)
	}
	if err := c.ReceiverCreate(ctx, r.ID, 2, "127.0.0.1:1", -1); !client.IsCode(err, CodeLimit) {
		t.Fatalf("second room: %v", err)
	}
	if err := c.CloseRoom(ctx, r.ID, 1); err != nil {
		t.Fatal(err)
	}
	if err := c.ReceiverCreate(ctx, r.ID, 2, "127.0.0.1:1", -1); err != nil {
		t.Fatalf("a room after one closed: %v", err)
	}
}

// TestStuckEngineDropped: an engine that sends requests but never reads
// its replies is dropped once its queue is full; its session is torn down
// and another engine on the same sidecar is not affected.
func TestStuckEngineDropped(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.EventQueue = 8 })
	good := dial(t, s)
	ctx := testCtx(t)
	stuck := dialRaw(t, s)
	wantOK(t, stuck.call(req("op", "hello", "seq", 1, "version", []int{1, 0})))
	// Its own rank, so poll answers with a large reply.
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	regs := r.MemRegions()
	f := []any{}
	for _, x := range regs {
		f = append(f, Fields{{"kind", x.Kind}, {"addr", x.Addr}, {"length", x.Length}, {"shm", x.SHM}})
	}
	wantOK(t, stuck.call(req("op", "register_memory", "seq", 2, "regions", f)))
	a := r.Args("nixl", "")
	v := stuck.call(req("op", "open_rank", "seq", 3, "style", "sglang", "role", "decode",
		"kv_data_ptrs", a.KVDataPtrs, "kv_data_lens", a.KVDataLens, "kv_item_lens", a.KVItemLens,
		"aux_data_ptrs", a.AuxDataPtrs, "aux_data_lens", a.AuxDataLens, "aux_item_lens", a.AuxItemLens,
		"page_size", a.PageSize, "kv_head_num", a.KVHeadNum, "total_kv_head_num", a.TotalKVHeadNum, "tp_size", 1, "tp_rank", 0))
	wantOK(t, v)
	rv, _ := v.Get("rank")
	rank, _ := rv.Uint()
	rooms := make([]byte, 8*(1<<16))
	for i := 0; i < 1<<16; i++ {
		binary.LittleEndian.PutUint64(rooms[8*i:], uint64(i))
	}
	poll := req("op", "poll", "seq", 4, "rank", rank, "rooms", rooms)
	// Never read: the kernel's buffers fill, then the sidecar's queue.
	deadline := time.Now().Add(20 * time.Second)
	for s.Sessions() == 2 {
		if time.Now().After(deadline) {
			t.Fatal("the stuck engine was not dropped")
		}
		stuck.r.SetWriteDeadline(time.Now().Add(time.Second))
		if err := stuck.r.Send(poll); err != nil {
			break // the sidecar closed the connection
		}
	}
	waitFor(t, "stuck session torn down", func() bool { return s.Sessions() == 1 })
	// The other engine still works.
	if _, err := good.Call(ctx, "deregister_memory", map[string]any{"regions": []uint64{}}); err != nil {
		t.Fatalf("the other engine after the drop: %v", err)
	}
	// The stuck one's connection ends after what was buffered.
	stuck.r.SetReadDeadline(time.Now().Add(20 * time.Second))
	for {
		if _, err := stuck.r.Recv(); err != nil {
			if strings.Contains(err.Error(), "timeout") {
				t.Fatal("the stuck engine's connection was not closed")
			}
			break
		}
	}
}

// TestShutdownFailsRooms: closing the sidecar fails its rooms with
// "sidecar shutting down", sends those events before the connection
// closes, and the peer's rooms fail too (told with ABORT).
func TestShutdownFailsRooms(t *testing.T) {
	pre, dec, boot := pair(t, "nixl", memDRAM, smallShape, 1, 1)
	ctx := testCtx(t)
	pr, dr := pre.ranks[0], dec.ranks[0]
	const room = 42
	if err := pre.c.SenderCreate(ctx, pr.ID, room); err != nil {
		t.Fatal(err)
	}
	if err := dec.c.ReceiverCreate(ctx, dr.ID, room, boot, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := dec.w.Wait(ctx, dr.ID, room, client.StateWaitingForInput); err != nil {
		t.Fatal(err)
	}
	if err := dec.c.ReceiverInit(ctx, dr.ID, room, []int32{1, 2}, 0, nil, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := pre.w.Wait(ctx, pr.ID, room, client.StateWaitingForInput); err != nil {
		t.Fatal(err)
	}
	// Shut the decode sidecar down.
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := dec.srv.Close(sctx); err != nil {
		t.Fatal(err)
	}
	e, err := dec.w.Wait(ctx, dr.ID, room, client.StateSuccess)
	if err != nil {
		t.Fatal(err)
	}
	if e.State != client.StateFailed || e.Reason != "sidecar shutting down" || e.Local {
		t.Fatalf("decode room at shutdown: %+v", e)
	}
	e, err = pre.w.Wait(ctx, pr.ID, room, client.StateSuccess)
	if err != nil {
		t.Fatal(err)
	}
	// SGLang's ABORT carries no reason: prefill hears "Aborted by decode".
	if e.State != client.StateFailed || !strings.Contains(e.Reason, "Aborted by decode") {
		t.Fatalf("prefill room after its decode sidecar stopped: state %d reason %q", e.State, e.Reason)
	}
	<-dec.c.Done()
	if _, err := dec.c.Call(ctx, "poll", map[string]any{"rank": dr.ID, "rooms": []byte{}}); !client.IsCode(err, client.CodeDisconnected) {
		t.Fatalf("after shutdown: %v", err)
	}
}

// blockOp, registered for tests only, holds its session until the test
// sends on blockRelease: a session busy with a long request.
var blockRelease = make(chan struct{})

func init() {
	registerOp("test_block", func(s *session, r *request) (Fields, error) {
		select {
		case <-blockRelease:
		case <-time.After(20 * time.Second):
		}
		return Fields{}, nil
	})
}

// TestRequestBytesBound: while a connection's session is busy, the
// requests waiting for it are bounded in bytes: the excess is answered
// `limit` at once, the rest is answered once the session is free, and
// the counts return to zero.
func TestRequestBytesBound(t *testing.T) {
	const maxMsg = 4096
	s := newTestServer(t, func(c *Config) { c.MaxMessage = maxMsg })
	p := dialRaw(t, s)
	wantOK(t, p.call(req("op", "hello", "seq", 1, "version", []int{1, 0})))
	if err := p.r.Send(req("op", "test_block", "seq", 2)); err != nil {
		t.Fatal(err)
	}
	// 3000-byte requests: the first two fit in 2 max_message, the rest
	// are refused at once while the session is busy.
	pad := make([]byte, 3000)
	for i := 0; i < 6; i++ {
		if err := p.r.Send(req("op", "deregister_memory", "seq", 10+i, "regions", []uint64{}, "pad", pad)); err != nil {
			t.Fatal(err)
		}
	}
	var limited, ok int
	p.r.SetReadDeadline(time.Now().Add(20 * time.Second))
	for limited < 4 {
		m, err := p.r.Recv()
		if err != nil {
			t.Fatal(err)
		}
		v, _ := msgpack.Decode(m[0])
		code, _ := v.Get("code")
		if c, _ := code.Str(); c != CodeLimit {
			t.Fatalf("while the session is busy: %v", v)
		}
		limited++
	}
	blockRelease <- struct{}{}
	for ok < 3 {
		m, err := p.r.Recv()
		if err != nil {
			t.Fatal(err)
		}
		v, _ := msgpack.Decode(m[0])
		wantOK(t, v)
		ok++
	}
	// The session uncounts a request after answering it.
	waitFor(t, "no bytes counted as queued", func() bool { return s.queued.Load() == 0 })
}

// TestOpenRankDoesNotBlock: an SGLang prefill rank whose bootstrap server
// never answers is opened on its own goroutine: the connection's other
// requests are answered meanwhile, and its regions stay busy until the
// open gives up (bad: the plugin would use unmapped memory).
func TestOpenRankDoesNotBlock(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.OpenTimeout = 3 * time.Second })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	c := dial(t, s)
	ctx := testCtx(t)
	r, err := fakeengine.NewRank(shmName(), "prefill", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ids, err := c.RegisterMemory(ctx, r.MemRegions())
	if err != nil {
		t.Fatal(err)
	}
	open := c.Start(ctx, "open_rank", map[string]any{"style": "sglang", "role": "prefill", "bootstrap_addr": ln.Addr().String(),
		"kv_data_ptrs": r.Args("", "").KVDataPtrs, "kv_data_lens": r.Args("", "").KVDataLens, "kv_item_lens": r.Args("", "").KVItemLens,
		"page_size": smallShape.PageSize, "kv_head_num": smallShape.KVHeads})
	start := time.Now()
	if err := c.DeregisterMemory(ctx, ids); !client.IsCode(err, CodeBusy) {
		t.Fatalf("deregistering the regions of a rank being opened: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("a request waited %v behind open_rank", d)
	}
	if _, err := open.Wait(ctx); !client.IsCode(err, CodeBackend) || !strings.Contains(err.Error(), "bootstrap") {
		t.Fatalf("open_rank against a silent bootstrap server: %v", err)
	}
	if err := c.DeregisterMemory(ctx, ids); err != nil {
		t.Fatalf("regions after the open gave up: %v", err)
	}
}
