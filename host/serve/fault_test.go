package serve

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
	"github.com/kvhost/kvhost/host/serve/client"
)

// rawPeer is a DEALER that sends whatever bytes a test wants.
type rawPeer struct {
	t *testing.T
	r *zmqtest.Raw
}

func dialRaw(t *testing.T, s *Server) *rawPeer {
	return &rawPeer{t: t, r: zmqtest.DialRaw(t, s.Endpoint(), "DEALER")}
}

// call sends frames and returns the decoded reply.
func (p *rawPeer) call(frames ...[]byte) msgpack.Value {
	p.t.Helper()
	if err := p.r.Send(frames...); err != nil {
		p.t.Fatal(err)
	}
	p.r.SetReadDeadline(time.Now().Add(10 * time.Second))
	m, err := p.r.Recv()
	if err != nil {
		p.t.Fatal(err)
	}
	if len(m) != 1 {
		p.t.Fatalf("reply of %d frames", len(m))
	}
	v, err := msgpack.Decode(m[0])
	if err != nil {
		p.t.Fatal(err)
	}
	return v
}

// req encodes a request map from alternating keys and values.
func req(kv ...any) []byte {
	var f Fields
	for i := 0; i < len(kv); i += 2 {
		f = append(f, Field{kv[i].(string), kv[i+1]})
	}
	var e msgpack.Encoder
	encodeValue(&e, f)
	return e.Bytes()
}

func wantError(t *testing.T, v msgpack.Value, code, inMessage string, seq any) {
	t.Helper()
	okv, _ := v.Get("ok")
	if b, _ := okv.Bool(); b {
		t.Fatalf("want %s, got ok", code)
	}
	c, _ := v.Get("code")
	m, _ := v.Get("message")
	cs, _ := c.Str()
	ms, _ := m.Str()
	if cs != code || !strings.Contains(ms, inMessage) {
		t.Fatalf("want %s naming %q, got %s: %s", code, inMessage, cs, ms)
	}
	sv, _ := v.Get("seq")
	switch seq {
	case nil:
		if sv.Kind != msgpack.Nil {
			t.Fatalf("seq %v, want nil", sv)
		}
	default:
		n, _ := sv.Uint()
		if n != uint64(seq.(int)) {
			t.Fatalf("seq %d, want %v", n, seq)
		}
	}
}

func wantOK(t *testing.T, v msgpack.Value) {
	t.Helper()
	okv, _ := v.Get("ok")
	if b, _ := okv.Bool(); !b {
		m, _ := v.Get("message")
		ms, _ := m.Str()
		t.Fatalf("want ok, got %s", ms)
	}
}

// TestMalformed: every malformed or out-of-order message gets an error
// reply naming the problem, and the connection keeps working.
func TestMalformed(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.MaxMessage = 4096 })
	p := dialRaw(t, s)
	hello := req("op", "hello", "seq", 100, "version", []int{1, 0})
	cases := []struct {
		name   string
		frames [][]byte
		code   string
		msg    string
		seq    any
	}{
		{"not msgpack", [][]byte{{0xc1, 0x00}}, CodeBadRequest, "not a msgpack message", nil},
		{"not a map", [][]byte{req()[:0:0], {0x93, 1, 2, 3}}[1:], CodeBadRequest, "msgpack map", nil},
		{"no seq", [][]byte{req("op", "hello")}, CodeBadRequest, `"seq"`, nil},
		{"seq wrong type", [][]byte{req("op", "hello", "seq", "x")}, CodeBadRequest, `"seq"`, nil},
		{"no op", [][]byte{req("seq", 1)}, CodeBadRequest, `"op"`, 1},
		{"before hello", [][]byte{req("op", "register_memory", "seq", 2)}, CodeNoHello, "before hello", 2},
		{"unknown op before hello", [][]byte{req("op", "fly", "seq", 3)}, CodeNoHello, `"fly"`, 3},
		{"two frames", [][]byte{{}, hello}, CodeBadRequest, "2 frames", nil},
		{"oversized", [][]byte{bytes.Repeat([]byte{0x90}, 8192)}, CodeTooLarge, "max_message", nil},
		{"bad version", [][]byte{req("op", "hello", "seq", 4, "version", []int{2, 0})}, CodeVersion, "2.0", 4},
		{"version wrong type", [][]byte{req("op", "hello", "seq", 5, "version", "1.0")}, CodeBadRequest, `"version"`, 5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p.t = t
			wantError(t, p.call(c.frames...), c.code, c.msg, c.seq)
		})
	}
	p.t = t
	wantOK(t, p.call(hello))
	after := []struct {
		name  string
		frame []byte
		code  string
		msg   string
	}{
		{"second hello", hello, CodeOutOfOrder, "already"},
		{"regions wrong type", req("op", "register_memory", "seq", 6, "regions", "x"), CodeBadRequest, `"regions"`},
		{"region field missing", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "dram"}, {"addr", 4096}}}), CodeBadRequest, `regions[0].length`},
		{"region negative", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "dram"}, {"addr", -1}}}), CodeBadRequest, `regions[0].addr`},
		{"region kind", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "hbm"}, {"addr", 4096}, {"length", 1}}}), CodeBadRequest, `regions[0].kind`},
		{"register_as value", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "dram"}, {"addr", 4096}, {"length", 1}, {"shm", "/x"}, {"register_as", "hbm"}}}), CodeBadRequest, `regions[0].register_as`},
		{"register_as type", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "dram"}, {"addr", 4096}, {"length", 1}, {"shm", "/x"}, {"register_as", 1}}}), CodeBadRequest, `regions[0].register_as`},
		{"register_as dram for vram", req("op", "register_memory", "seq", 6, "regions", []any{Fields{{"kind", "vram"}, {"addr", 4096}, {"length", 1}, {"cuda_ipc", make([]byte, 64)}, {"register_as", "dram"}}}), CodeBadRequest, `regions[0].register_as`},
		{"rank missing", req("op", "sender_create", "seq", 6, "room", 1), CodeBadRequest, `"rank"`},
		{"unknown rank", req("op", "sender_create", "seq", 6, "rank", 99, "room", 1), CodeUnknown, "rank 99"},
		{"bad style", req("op", "open_rank", "seq", 6, "style", "trt", "role", "prefill"), CodeUnsupported, `"trt"`},
		{"bad role", req("op", "open_rank", "seq", 6, "style", "sglang", "role", "both"), CodeBadRequest, `"role"`},
		{"pages not int32", req("op", "poll", "seq", 6, "rank", 1, "rooms", []byte{1, 2, 3}), CodeUnknown, "rank 1"},
	}
	for _, c := range after {
		t.Run(c.name, func(t *testing.T) {
			p.t = t
			wantError(t, p.call(c.frame), c.code, c.msg, 6-boolInt(c.name == "second hello")*(6-100))
		})
	}
	p.t = t
	// Still working: a request that succeeds.
	wantOK(t, p.call(req("op", "deregister_memory", "seq", 7, "regions", []uint64{})))
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// shmFile creates a POSIX shared-memory object of n bytes, removed when
// the test ends.
func shmFile(t *testing.T, n int64) string {
	t.Helper()
	name := shmName()
	f, err := os.OpenFile("/dev/shm"+name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(n); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove("/dev/shm" + name) })
	return name
}

// TestBadRegion: unknown names, short objects and overlaps are refused
// whole, with bad_region naming the problem; nothing is registered.
func TestBadRegion(t *testing.T) {
	s := newTestServer(t)
	c := dial(t, s)
	ctx := testCtx(t)
	shm := shmFile(t, 1<<16)
	dram := func(addr, length, off uint64, name string) client.Region {
		return client.Region{Kind: "dram", Addr: addr, Length: length, Offset: off, SHM: name}
	}
	cases := []struct {
		name    string
		regions []client.Region
		msg     string
	}{
		{"unknown name", []client.Region{dram(1<<20, 4096, 0, "/kvt-no-such-object")}, "no such"},
		{"short", []client.Region{dram(1<<20, 1<<16, 4096, shm)}, "past the end"},
		{"overlap in request", []client.Region{dram(1<<20, 8192, 0, shm), dram(1<<20+4096, 4096, 0, shm)}, "overlap"},
		{"outside /dev/shm", []client.Region{dram(1<<20, 4096, 0, "/etc/passwd")}, ""},
		{"vram without cuda", []client.Region{{Kind: "vram", Addr: 1 << 30, Length: 4096, CUDAIPC: make([]byte, 64)}}, ""},
	}
	for _, x := range cases {
		t.Run(x.name, func(t *testing.T) {
			_, err := c.RegisterMemory(ctx, x.regions)
			var e *client.Error
			if !asClientError(err, &e) || (e.Code != CodeBadRegion && e.Code != CodeUnsupported) || !strings.Contains(e.Message, x.msg) {
				t.Fatalf("got %v", err)
			}
		})
	}
	ids, err := c.RegisterMemory(ctx, []client.Region{dram(1<<20, 8192, 0, shm)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.RegisterMemory(ctx, []client.Region{dram(1<<20+4096, 4096, 0, shm)})
	if !client.IsCode(err, CodeBadRegion) || !strings.Contains(err.Error(), "overlap") {
		t.Fatalf("overlap with a registered region: %v", err)
	}
	if err := c.DeregisterMemory(ctx, ids); err != nil {
		t.Fatal(err)
	}
	if err := c.DeregisterMemory(ctx, ids); !client.IsCode(err, CodeUnknown) {
		t.Fatalf("deregister twice: %v", err)
	}
}

func asClientError(err error, e **client.Error) bool {
	x, ok := err.(*client.Error)
	*e = x
	return ok
}

// TestForeign: a connection cannot see another's ranks, rooms or regions.
func TestForeign(t *testing.T) {
	ps := newTestServer(t)
	pc := dial(t, ps)
	boot, err := pc.StartBootstrap(testCtx(t), "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	a := newEngine(t, ps, "prefill", "nixl", memDRAM, smallShape, 1, boot)
	ctx := testCtx(t)
	rk := a.ranks[0]
	if err := a.c.SenderCreate(ctx, rk.ID, 5); err != nil {
		t.Fatal(err)
	}
	b := dial(t, ps)
	checks := []struct {
		name string
		err  error
	}{
		{"sender_create", b.SenderCreate(ctx, rk.ID, 6)},
		{"sender_init", b.SenderInit(ctx, rk.ID, 5, 1, 0)},
		{"abort", b.Abort(ctx, rk.ID, 5)},
		{"close_room", b.CloseRoom(ctx, rk.ID, 5)},
		{"close_rank", b.CloseRank(ctx, rk.ID)},
		{"deregister", b.DeregisterMemory(ctx, rk.Regions)},
	}
	for _, x := range checks {
		if !client.IsCode(x.err, CodeUnknown) {
			t.Errorf("%s of another connection's object: %v", x.name, x.err)
		}
	}
	if _, _, err := b.Poll(ctx, rk.ID, []uint64{5}); !client.IsCode(err, CodeUnknown) {
		t.Errorf("poll: %v", err)
	}
	// a's room is untouched.
	st, _, err := a.c.Poll(ctx, rk.ID, []uint64{5, 6})
	if err != nil || st[0] != client.StateBootstrapping || st[1] != client.StateUnknown {
		t.Fatalf("a's rooms after b's attempts: %v %v", st, err)
	}
	// Out-of-range values are bad_request naming the field.
	if err := a.c.SenderInit(ctx, rk.ID, 5, 1, 1<<20); !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "aux_index") {
		t.Fatalf("sender_init with an aux slot outside the aux buffer: %v", err)
	}
	if err := a.c.SenderInit(ctx, rk.ID, 5, 2, 0); err != nil {
		t.Fatal(err)
	}
	if err := a.c.SenderSend(ctx, rk.ID, 5, []int32{int32(smallShape.Pages)}, nil); !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "outside") {
		t.Fatalf("sender_send of a page outside the pool: %v", err)
	}
	// a's region is in use: busy.
	if err := a.c.DeregisterMemory(ctx, rk.Regions); !client.IsCode(err, CodeBusy) {
		t.Fatalf("deregister a region a rank uses: %v", err)
	}
	_ = fmt.Sprint
}
