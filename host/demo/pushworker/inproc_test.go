package pushworker

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// startBootstrap serves a bootstrap server until the test ends and returns
// its address.
func startBootstrap(t testing.TB) string {
	t.Helper()
	srv, err := bootstrap.NewServer(bootstrap.WithLogger(discard())).Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A client's unused keep-alive connection makes http.Server.Shutdown
		// wait 5 s; nothing is in flight here.
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		srv.Close(ctx)
	})
	return srv.Addr()
}

type pair struct {
	variant    push.Variant
	completion push.Completion
	xfer       push.XferMode
	shape      Shape
	wl         Workload
	ptp, dtp   int
	ppp, dpp   int
	pparams    []plugin.Param
	dparams    []plugin.Param
	set        push.Settings
	conc       int
	// pready, if set, is called when the prefill worker is ready, with the
	// bootstrap server's address.
	pready func(bootstrapAddr string)
}

func runPair(t *testing.T, c pair) (*Summary, *Summary) {
	t.Helper()
	pl := faketest.Plugin(t)
	addr := startBootstrap(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if c.ppp == 0 {
		c.ppp = 1
	}
	if c.dpp == 0 {
		c.dpp = 1
	}
	if c.conc == 0 {
		c.conc = 8
	}
	common := func(tp, pp int, params []plugin.Param) Common {
		return Common{Plugin: pl, AgentParams: params, Variant: c.variant, Completion: c.completion,
			Shape: c.shape, Workload: c.wl, TPSize: tp, PPSize: pp, Concurrency: c.conc, Settings: c.set, Logger: log}
	}
	type res struct {
		s   *Summary
		err error
	}
	pch := make(chan res, 1)
	go func() {
		pc := common(c.ptp, c.ppp, c.pparams)
		if c.pready != nil {
			pc.OnReady = func(RoomCounter) { c.pready(addr) }
		}
		s, err := RunPrefill(ctx, PrefillOptions{Common: pc, XferMode: c.xfer, BootstrapAddr: addr})
		pch <- res{s, err}
	}()
	ds, derr := RunDecode(ctx, DecodeOptions{Common: common(c.dtp, c.dpp, c.dparams), BootstrapAddr: addr})
	pr := <-pch
	if derr != nil {
		t.Fatalf("decode: %v", derr)
	}
	if pr.err != nil {
		t.Fatalf("prefill: %v", pr.err)
	}
	return pr.s, ds
}

func smallShape() Shape {
	return Shape{Layers: 4, KVHeads: 4, HeadBytes: 32, PageSize: 4}
}

func smallWL() Workload {
	return Workload{Seed: 7, Requests: 24, MinTokens: 1, MaxTokens: 40, ChunkPages: 3}
}

func expectAllOK(t *testing.T, ps, ds *Summary) {
	t.Helper()
	for _, s := range []*Summary{ps, ds} {
		if !s.OKExit() || s.OK != s.Requests {
			t.Fatalf("%s: ok %d of %d, failures %+v, verify errors %d, leaked %d", s.Role, s.OK, s.Requests, s.Failures, s.VerifyErrors, s.Leaked)
		}
	}
	if ds.Bytes == 0 {
		t.Fatalf("decode verified no bytes")
	}
}

func TestInProcTP1(t *testing.T) {
	ps, ds := runPair(t, pair{shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 1})
	expectAllOK(t, ps, ds)
	t.Logf("prefill %+v", *ps)
}

func TestInProcMatrix(t *testing.T) {
	prefixWL := smallWL()
	prefixWL.PrefixRate, prefixWL.FullHitRate = 0.6, 0.5
	mla := smallShape()
	mla.MLA = true
	mixed := smallShape()
	mixed.MemKinds = "mixed"
	noNotif := []plugin.Param{{Key: "caps_off", Value: "notif"}}
	cases := map[string]pair{
		"tp2to4":        {shape: smallShape(), wl: smallWL(), ptp: 2, dtp: 4},
		"tp4to2":        {shape: smallShape(), wl: smallWL(), ptp: 4, dtp: 2},
		"mla2to4":       {shape: mla, wl: smallWL(), ptp: 2, dtp: 4},
		"mla4to2":       {shape: mla, wl: smallWL(), ptp: 4, dtp: 2},
		"pp2to1":        {shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 1, ppp: 2},
		"pp2to2":        {shape: smallShape(), wl: smallWL(), ptp: 2, dtp: 2, ppp: 2, dpp: 2},
		"mixed":         {shape: mixed, wl: smallWL(), ptp: 1, dtp: 1},
		"prefix":        {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4},
		"status":        {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4, pparams: noNotif, dparams: noNotif},
		"status-mixed":  {shape: mixed, wl: smallWL(), ptp: 1, dtp: 1, pparams: noNotif, dparams: noNotif},
		"prepped":       {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4, xfer: push.XferPrepped},
		"prepped-mixed": {shape: mixed, wl: smallWL(), ptp: 1, dtp: 1, xfer: push.XferPrepped},
		// The zero XferMode is auto: strided batches on the fake plugin
		// (native strides). The prepared-list path explicitly, and by auto
		// on an agent without native strides.
		"prepped-mla":     {shape: mla, wl: smallWL(), ptp: 2, dtp: 4, xfer: push.XferPrepped},
		"prepped-pp2to2":  {shape: smallShape(), wl: smallWL(), ptp: 2, dtp: 2, ppp: 2, dpp: 2, xfer: push.XferPrepped},
		"prepped-status":  {shape: mixed, wl: smallWL(), ptp: 1, dtp: 1, pparams: noNotif, dparams: noNotif, xfer: push.XferPrepped},
		"auto-nostrides":  {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4, pparams: []plugin.Param{{Key: "caps_off", Value: "strided"}}},
		"auto-noprepped":  {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4, pparams: []plugin.Param{{Key: "caps_off", Value: "prepped,strided"}}},
		"mori":            {variant: push.VariantMORI, shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 4},
		"mori-tp4to2":     {variant: push.VariantMORI, shape: smallShape(), wl: smallWL(), ptp: 4, dtp: 2},
		"mori-mla":        {variant: push.VariantMORI, shape: mla, wl: smallWL(), ptp: 2, dtp: 4},
		"mori-pp2":        {variant: push.VariantMORI, shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 1, ppp: 2},
		"mori-rdma-aux":   {variant: push.VariantMORI, shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 2, set: push.Settings{MORIAuxRDMA: true}},
		"nixl-status-pp2": {shape: smallShape(), wl: prefixWL, ptp: 2, dtp: 1, ppp: 2, pparams: noNotif, dparams: noNotif},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			ps, ds := runPair(t, c)
			expectAllOK(t, ps, ds)
			// auto: strided batches where the agent has native strides, else
			// prepped lists where it has them (NIXL), else batches.
			want := c.xfer
			if want == push.XferAuto {
				want = push.XferBatch
				if c.variant != push.VariantMORI && slices.Contains(c.pparams, plugin.Param{Key: "caps_off", Value: "strided"}) {
					want = push.XferPrepped
				}
			}
			if ps.XferMode != want.String() {
				t.Fatalf("prefill transfer mode %q, want %q", ps.XferMode, want)
			}
			t.Logf("%s: %d transfers, %d descs (ref %d), %d bytes", name, ps.Transfers, ps.Descriptors, ps.RefDescriptors, ps.Bytes)
		})
	}
}

// SGLang MORI slices the decode list by the prefill stage's start layer,
// so it only supports decode PP 1 under prefill PP > 1; PP 2 -> 2 is
// refused at registration with SGLang's disaggregation/{nixl,mori}/conn.py's reason.
func TestInProcMORIPPEqual(t *testing.T) {
	ps, _ := runPair(t, pair{variant: push.VariantMORI, shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 1, ppp: 2, dpp: 2,
		set: push.Settings{BootstrapTimeout: 2 * time.Second}})
	if ps.OK != 0 && ps.Failed == 0 {
		t.Fatalf("MORI PP 2->2 worked; SGLang's disaggregation/{nixl,mori}/conn.py refuses it")
	}
	for _, f := range ps.Failures {
		if f.Rank == "tp0/pp1" && !strings.Contains(f.Reason, "PP configuration mismatch") {
			t.Fatalf("stage 1 failed for %q", f.Reason)
		}
	}
}

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// TestOnReady: each worker calls OnReady once, before its first request
// finishes, with a room counter naming every KVPoll state; no room is held
// then or after the run.
func TestOnReady(t *testing.T) {
	pl := faketest.Plugin(t)
	addr := startBootstrap(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	type side struct {
		mu       sync.Mutex
		ready    int
		early    bool // a request finished before OnReady
		rooms    RoomCounter
		atReady  map[string]int
		progress int
	}
	held := func(rc RoomCounter) map[string]int {
		m := map[string]int{}
		rc(func(state string, n int) { m[state] += n })
		return m
	}
	common := func(tp int, s *side) Common {
		return Common{Plugin: pl, Shape: smallShape(), Workload: smallWL(), TPSize: tp, Logger: discard(),
			OnReady: func(rc RoomCounter) {
				s.mu.Lock()
				defer s.mu.Unlock()
				s.ready++
				s.early = s.progress > 0
				s.rooms, s.atReady = rc, held(rc)
			},
			Progress: func(int) { s.mu.Lock(); s.progress++; s.mu.Unlock() },
		}
	}
	var ps, ds side
	errc := make(chan error, 1)
	go func() {
		_, err := RunPrefill(ctx, PrefillOptions{Common: common(2, &ps), BootstrapAddr: addr})
		errc <- err
	}()
	if _, err := RunDecode(ctx, DecodeOptions{Common: common(2, &ds), BootstrapAddr: addr}); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"Failed": 0, "Bootstrapping": 0, "WaitingForInput": 0, "Transferring": 0, "Success": 0}
	for name, s := range map[string]*side{"prefill": &ps, "decode": &ds} {
		if s.ready != 1 || s.early || s.progress != smallWL().Requests {
			t.Errorf("%s: OnReady called %d times, after a request: %v, %d requests", name, s.ready, s.early, s.progress)
			continue
		}
		if !maps.Equal(s.atReady, want) || !maps.Equal(held(s.rooms), want) {
			t.Errorf("%s: rooms at ready %v, after the run %v, want %v", name, s.atReady, held(s.rooms), want)
		}
	}
}

func TestLiveRooms(t *testing.T) {
	l := newLiveRooms()
	a, b := fixedRoom(sglang.KVPollTransferring), fixedRoom(sglang.KVPollTransferring)
	releaseA, releaseB := l.hold(&a), l.hold(&b)
	got := map[string]int{}
	l.count(func(state string, n int) { got[state] = n })
	if got["Transferring"] != 2 || len(got) != 5 {
		t.Fatalf("count %v", got)
	}
	releaseA()
	releaseB()
	l.count(func(state string, n int) { got[state] = n })
	if got["Transferring"] != 0 {
		t.Fatalf("count after release %v", got)
	}
}

type fixedRoom sglang.KVPoll

func (f *fixedRoom) Poll() sglang.KVPoll { return sglang.KVPoll(*f) }

// lineCounter counts the report lines written so far.
type lineCounter struct {
	mu    sync.Mutex
	lines []RequestResult
}

func (l *lineCounter) Write(b []byte) (int, error) {
	var r RequestResult
	if err := json.Unmarshal(b, &r); err != nil {
		return 0, err
	}
	l.mu.Lock()
	l.lines = append(l.lines, r)
	l.mu.Unlock()
	return len(b), nil
}

func (l *lineCounter) n() int { l.mu.Lock(); defer l.mu.Unlock(); return len(l.lines) }

// TestReportAsRequestsFinish: each request's report line is written when
// the request finished on every rank (before the progress call counting
// it), not at the end of the run.
func TestReportAsRequestsFinish(t *testing.T) {
	pl := faketest.Plugin(t)
	addr := startBootstrap(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	wl := smallWL()
	wl.AbortRate = 0.25
	var prep, drep lineCounter
	var mu sync.Mutex
	var seen []int // lines written at each decode progress call
	errc := make(chan error, 1)
	go func() {
		_, err := RunPrefill(ctx, PrefillOptions{BootstrapAddr: addr, Common: Common{Plugin: pl, Shape: smallShape(),
			Workload: wl, TPSize: 2, Logger: discard(), Report: &prep}})
		errc <- err
	}()
	ds, err := RunDecode(ctx, DecodeOptions{BootstrapAddr: addr, Common: Common{Plugin: pl, Shape: smallShape(),
		Workload: wl, TPSize: 2, Logger: discard(), Report: &drep,
		Progress: func(done int) {
			mu.Lock()
			seen = append(seen, drep.n()-done)
			mu.Unlock()
		}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if len(seen) != wl.Requests || slices.ContainsFunc(seen, func(d int) bool { return d != 0 }) {
		t.Fatalf("lines written minus requests done at each progress call: %v", seen)
	}
	rooms := map[uint64]bool{}
	failed := 0
	for _, r := range drep.lines {
		rooms[r.Room] = true
		if !r.OK {
			failed++
			if r.Reason == "" {
				t.Errorf("room %d failed without a reason", r.Room)
			}
		}
	}
	if len(rooms) != wl.Requests || failed != ds.Failed || failed == 0 || prep.n() != wl.Requests {
		t.Fatalf("decode lines for %d rooms (%d failed, summary %d), prefill %d lines; want %d each", len(rooms), failed, ds.Failed, prep.n(), wl.Requests)
	}
}
