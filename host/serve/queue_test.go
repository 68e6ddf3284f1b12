package serve

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// peers returns the connection ids of s's sessions.
func peers(s *Server) map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]bool{}
	for k := range s.sessions {
		out[k] = true
	}
	return out
}

// newPeer returns the connection id of the one session not in before.
func newPeer(t *testing.T, s *Server, before map[string]bool) []byte {
	t.Helper()
	for k := range peers(s) {
		if !before[k] {
			return []byte(k)
		}
	}
	t.Fatal("no new session")
	return nil
}

// TestRepliesDoNotGrow: an error reply quotes at most a short prefix of
// what the engine sent, however large: an unknown op of 1 MiB, a field
// value of 1 MiB the message names.
func TestRepliesDoNotGrow(t *testing.T) {
	s := newTestServer(t)
	p := dialRaw(t, s)
	huge := strings.Repeat("\x01", 1<<20) // %q writes each as 4 bytes
	for i, c := range []struct {
		name string
		req  []byte
		code string
	}{
		{"unknown op before hello", req("op", huge, "seq", 0), CodeNoHello},
		{"hello", req("op", "hello", "seq", 1, "version", []int{1, 0}), ""},
		{"unknown op", req("op", huge, "seq", 2), CodeUnknownOp},
		{"a value quoted", req("op", "open_rank", "seq", 3, "style", huge, "role", "decode"), CodeUnsupported},
		{"a value quoted in a field check", req("op", "open_rank", "seq", 4, "style", "sglang", "role", huge), CodeBadRequest},
	} {
		if err := p.r.Send(c.req); err != nil {
			t.Fatal(err)
		}
		p.r.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, err := p.r.Recv()
		if err != nil {
			t.Fatal(err)
		}
		v, err := msgpack.Decode(m[0])
		if err != nil {
			t.Fatal(err)
		}
		if c.code == "" {
			wantOK(t, v)
			continue
		}
		wantError(t, v, c.code, "", i)
		if n := len(m[0]); n > 2*maxMessage {
			t.Errorf("%s: a reply of %d bytes to a request of %d", c.name, n, len(c.req))
		}
	}
}

// TestPollRoomsBounded: a poll names at most as many rooms as a
// connection may open; more is bad_request, refused before anything
// is allocated for them.
func TestPollRoomsBounded(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.Limits.Rooms = 16 })
	c := dial(t, s)
	ctx := testCtx(t)
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Open(ctx, c, "nixl", ""); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Poll(ctx, r.ID, make([]uint64, 16)); err != nil {
		t.Fatalf("poll of 16 rooms: %v", err)
	}
	_, _, err = c.Poll(ctx, r.ID, make([]uint64, 17))
	if !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), `"rooms"`) {
		t.Fatalf("poll of 17 rooms with a limit of 16: %v", err)
	}
}

// TestNonReaderBoundedInBytes: a connection that sends requests and never
// reads is dropped once the bytes waiting for it pass EventQueueBytes,
// however many messages that is; the sidecar never holds more than that
// for it, and another engine is not affected.
func TestNonReaderBoundedInBytes(t *testing.T) {
	const bound = 256 << 10
	s := newTestServer(t, func(c *Config) { c.EventQueue = 1 << 22; c.EventQueueBytes = bound })
	good := dial(t, s)
	before := peers(s)
	stuck := dialRaw(t, s)
	wantOK(t, stuck.call(req("op", "hello", "seq", 1, "version", []int{1, 0})))
	peer := newPeer(t, s, before)
	bad := req("op", strings.Repeat("x", 4<<10), "seq", 2)
	var most int64
	sent := 0
	for ; s.Sessions() == 2; sent++ {
		if sent == 1<<17 {
			t.Fatalf("not dropped after %d requests (%d bytes queued at most)", sent, most)
		}
		stuck.r.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if err := stuck.r.Send(bad); err != nil {
			break // the sidecar closed the connection
		}
		if _, b := s.router.Queued(peer); b > most {
			most = b
		}
		if most > bound {
			t.Fatalf("%d bytes queued for a connection bounded to %d", most, bound)
		}
	}
	waitFor(t, "the stuck session torn down", func() bool { return s.Sessions() == 1 })
	if _, err := good.Call(testCtx(t), "deregister_memory", map[string]any{"regions": []uint64{}}); err != nil {
		t.Fatalf("the other engine after the drop: %v", err)
	}
	t.Logf("dropped after %d requests; at most %d bytes queued", sent, most)
}

// TestBurstKeepsReader: a vLLM scheduler's connection holds more
// requests than the old event queue (16384), then pauses reading (an
// engine busy in its loop) while the engine's prefill worker leaves: the
// sidecar releases every hold "closed" to it at once. Once it reads
// again it gets every released event and stays connected and usable.
func TestBurstKeepsReader(t *testing.T) {
	const holds = 24000
	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 16, 4, nil))
	vsEvent(t, w.c) // engine_ready
	sched := dialRaw(t, ps)
	wantOK(t, sched.call(req("op", "hello", "seq", 0, "version", []int{1, 0})))
	recv := func(what string) msgpack.Value {
		t.Helper()
		sched.r.SetReadDeadline(time.Now().Add(20 * time.Second))
		m, err := sched.r.Recv()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		v, err := msgpack.Decode(m[0])
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	const window = 256
	for i := 0; i < holds; i += window {
		end := min(i+window, holds)
		for j := i; j < end; j++ {
			if err := sched.r.Send(req("op", "hold", "seq", j+1, "engine_id", "P", "request_id", fmt.Sprint("r", j),
				"block_ids", client.Pages([]int32{int32(j % 16)}))); err != nil {
				t.Fatal(err)
			}
		}
		for j := i; j < end; j++ {
			wantOK(t, recv("hold reply"))
		}
	}
	// The worker leaves while the scheduler does not read; its session is
	// gone once every release was queued.
	w.c.Close()
	waitFor(t, "the worker's session torn down", func() bool { return ps.Sessions() <= 1 })
	// Every hold is released once; a request after them is answered.
	if err := sched.r.Send(req("op", "release", "seq", holds+1, "engine_id", "P", "request_id", "r0")); err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for {
		v := recv(fmt.Sprintf("after %d released events of %d (the connection was dropped)", len(seen), holds))
		ev, ok := v.Get("event")
		if !ok {
			wantError(t, v, CodeUnknown, "", holds+1)
			break
		}
		id, _ := v.Get("request_id")
		reason, _ := v.Get("reason")
		name, _ := ev.Str()
		ids, _ := id.Str()
		rs, _ := reason.Str()
		if name != "released" || rs != "closed" {
			t.Fatalf("event %s %q reason %q, want released closed", name, ids, rs)
		}
		seen[ids]++
	}
	if len(seen) != holds {
		t.Fatalf("%d requests released, want %d", len(seen), holds)
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("request %s released %d times", id, n)
		}
	}
}

// TestEventQueueHoldsBursts: the reply and event queue's bounds hold the
// largest burst the limits allow one connection (a failure per room, a
// released per held request with ids of the longest, a read per read in
// flight), by default and when the limits are raised.
func TestEventQueueHoldsBursts(t *testing.T) {
	for _, rooms := range []int{0, 1 << 20} {
		c := Config{Limits: Limits{Rooms: rooms}}
		c.defaults()
		msgs := c.Limits.Rooms + vllmMaxHolds + vllmMaxReads
		bytes := int64(c.Limits.Rooms)*int64(len(encodeEvent("room", Fields{{"rank", uint64(1 << 63)}, {"room", uint64(1 << 63)},
			{"state", 0}, {"reason", strings.Repeat("x", maxReason)}}))) +
			int64(vllmMaxHolds)*int64(len(encodeEvent("released", Fields{{"engine_id", strings.Repeat("e", vllmMaxID)},
				{"request_id", strings.Repeat("r", vllmMaxID)}, {"reason", vllmReleasedNotified}})))
		if c.EventQueue < msgs || c.EventQueueBytes < bytes {
			t.Errorf("rooms %d: queue of %d messages, %d bytes; a burst is %d messages, %d bytes",
				c.Limits.Rooms, c.EventQueue, c.EventQueueBytes, msgs, bytes)
		}
	}
}
