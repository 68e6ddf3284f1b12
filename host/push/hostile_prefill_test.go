package push_test

import (
	"context"
	"fmt"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// rawPusher sends hand-made messages to a rank's PULL socket.
type rawPusher struct {
	t *testing.T
	p *zmq.Push
}

func dialRaw(t *testing.T, endpoint string) *rawPusher {
	t.Helper()
	p, err := zmq.DialPush(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return &rawPusher{t: t, p: p}
}

func (r *rawPusher) frames(f [][]byte) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.p.Send(ctx, f...); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rawPusher) send(m sglang.Message, extra ...[]byte) {
	r.t.Helper()
	f, err := m.Frames()
	if err != nil {
		r.t.Fatal(err)
	}
	r.frames(append(f, extra...))
}

// barrier returns once the rank handled everything sent on r before it:
// it sends a malformed message (the control loop handles one connection's
// messages in order) and waits until the rank counted one more drop. Only
// for messages that the rank does not count as dropped.
func (r *rawPusher) barrier(ctx context.Context, dropped func() int64) {
	r.t.Helper()
	before := dropped()
	r.frames([][]byte{[]byte("kvhost-test-barrier")})
	for dropped() <= before {
		if ctx.Err() != nil {
			r.t.Fatalf("the rank did not handle the barrier message: %v", ctx.Err())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// infoFrames returns a NIXL transfer info's frames with pages page
// indices; withRoom and withPeer give copies for another room or agent
// name that share the page frame.
type infoFrames [][]byte

func newInfoFrames(t *testing.T, pages int, endpoint string, port int) infoFrames {
	t.Helper()
	idx := make([]int32, pages)
	for i := range idx {
		idx[i] = int32(i)
	}
	f, err := (&sglang.NIXLTransferInfo{Room: 4242424242, Endpoint: endpoint, Port: port, AgentName: "kvhost-test-agent-name",
		DstKVIndices: idx, RequiredDstInfoNum: 1, DecodePrefixLenSet: true}).Frames()
	if err != nil {
		t.Fatal(err)
	}
	if string(f[1]) != "4242424242" || string(f[4]) != "kvhost-test-agent-name" {
		t.Fatalf("transfer info layout: room %q agent %q", f[1], f[4])
	}
	return f
}

func (f infoFrames) with(room uint64, peer string) [][]byte {
	g := slices.Clone([][]byte(f))
	g[1] = []byte(strconv.FormatUint(room, 10))
	g[4] = []byte(peer)
	return g
}

// waitFor polls cond until it holds or ctx ends.
func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		if ctx.Err() != nil {
			t.Fatalf("%s: %v", what, ctx.Err())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestPendingInfoBudget: transfer infos for rooms the prefill does not
// hold are bounded in bytes, per agent and in total; an info over the
// bound is dropped, its room fails with the reason as soon as the engine
// opens it, and rooms of the registered decode still work. Expired infos
// give their budget back.
func TestPendingInfoBudget(t *testing.T) {
	const pages = 16 << 10 // 64 KiB of indices per info
	cases := []struct {
		name           string
		total, perPeer int64
		// accepted: how many ghost infos fit (each costs 64 KiB plus a
		// little overhead).
		accepted int
	}{
		{"per-peer", 1 << 20, 256 << 10, 3},
		{"total", 256 << 10, 1 << 20, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{pset: push.Settings{MaxPendingInfoBytes: c.total, MaxPendingInfoBytesPerPeer: c.perPeer}})
			ctx := ctxT(t, 30*time.Second)
			raw := dialRaw(t, r.pf.Endpoint())
			f := newInfoFrames(t, pages, "127.0.0.1", 1)
			const sent = 10
			d0 := r.pf.Dropped()
			for i := 0; i < sent; i++ {
				raw.frames(f.with(uint64(9000+i), fmt.Sprintf("ghost-%d", i%2)))
			}
			// Every room is pending, with its info or with the reason it
			// was dropped.
			waitFor(t, ctx, "infos handled", func() bool { return r.pf.Pending() == sent })
			if kept := sent - int(r.pf.Dropped()-d0); kept != c.accepted {
				t.Fatalf("%d of %d ghost infos kept, want %d", kept, sent, c.accepted)
			}
			if b := r.pf.PendingInfoBytes(); b > min(c.total, c.perPeer) || b < int64(c.accepted*pages*4) {
				t.Fatalf("pending infos hold %d bytes (limits %d total, %d per peer)", b, c.total, c.perPeer)
			}
			// The engine opens a room whose info was dropped: it fails at
			// once, with the reason.
			s, err := r.pf.NewSender(uint64(9000 + sent - 1))
			if err != nil {
				t.Fatal(err)
			}
			if st := s.Poll(); st != sglang.KVPollFailed || !strings.Contains(s.Failure().Error(), "dropped") {
				t.Fatalf("room with a dropped info: %v %v", st, s.Failure())
			}
			s.Close()
			// The registered decode's rooms are unaffected.
			for i := 0; i < 4; i++ {
				q := r.prepare(uint64(100+i), 1+3*i, i)
				if err := r.transfer(ctx, q); err != nil {
					t.Fatal(err)
				}
				q.close()
			}
		})
	}
	// Unclaimed infos expire with the bootstrap timeout (on a fake clock)
	// and give their bytes back.
	t.Run("expiry", func(t *testing.T) {
		const timeout, sweep = 200 * time.Millisecond, 20 * time.Millisecond // sweep: push's sweepPeriod(timeout)
		fk := clock.NewFake(time.Time{})
		r := newRig(t, rigOpts{pset: push.Settings{BootstrapTimeout: timeout}, clock: fk})
		ctx := ctxT(t, 30*time.Second)
		raw := dialRaw(t, r.pf.Endpoint())
		f := newInfoFrames(t, pages, "127.0.0.1", 1)
		for i := 0; i < 3; i++ {
			raw.frames(f.with(uint64(9000+i), "ghost"))
		}
		waitFor(t, ctx, "infos arrive", func() bool { return r.pf.Pending() == 3 })
		waitArmed(t, fk, sweep)
		fk.Advance(timeout + 2*sweep)
		waitFor(t, ctx, "pending infos expire", func() bool { return r.pf.Pending() == 0 && r.pf.PendingInfoBytes() == 0 })
	})
}

// TestPendingInfoFlood: 200 transfer infos of 4 MiB of page indices each
// (30 under the race detector), for rooms the prefill never had, from
// several agent names (one of them the registered decode's), must not
// make the process keep more than 128 MB once their garbage is collected,
// nor grow it by more than 512 MB meanwhile (issue 12: it grew from 20 MB
// to 1.25 GB and stayed), with the default limits.
func TestPendingInfoFlood(t *testing.T) {
	r := newRig(t, rigOpts{})
	ctx := ctxT(t, 120*time.Second)
	// The decode registers with its first room: its name gets a budget of
	// its own.
	q := r.prepare(6, 9, 0)
	if err := r.transfer(ctx, q); err != nil {
		t.Fatal(err)
	}
	q.close()
	f := newInfoFrames(t, 1<<20, "127.0.0.1", 1)
	heap0 := int64(heapInuse())
	rss0 := int64(rssBytes(t))
	raw := dialRaw(t, r.pf.Endpoint())
	names := []string{r.dec.Agent().Name(), "ghost-a", "ghost-b", "ghost-c", "ghost-d"}
	start := time.Now()
	// The race detector makes parsing 4 MiB of indices some 30 times
	// slower: fewer infos then, still far past the limits.
	n := 200
	if raceEnabled {
		n = 30
	}
	for i := 0; i < n; i++ {
		raw.frames(f.with(uint64(1<<40+i), names[i%len(names)]))
	}
	waitFor(t, ctx, "infos handled", func() bool { return r.pf.Pending() == n })
	took := time.Since(start)
	rss, held := int64(rssBytes(t)), r.pf.PendingInfoBytes()
	heap := int64(heapInuse())
	t.Logf("%d infos of 4 MiB in %v: RSS %d -> %d MB (+%d MB), live heap +%d MB, pending infos %d (%d MB), dropped %d",
		n, took, rss0>>20, rss>>20, (rss-rss0)>>20, (heap-heap0)>>20, r.pf.Pending(), held>>20, r.pf.Dropped())
	if held > push.DefaultMaxPendingInfoBytes {
		t.Errorf("pending infos hold %d bytes, over the default limit %d", held, push.DefaultMaxPendingInfoBytes)
	}
	if heap-heap0 > 96<<20 {
		t.Errorf("live heap grew by %d MB", (heap-heap0)>>20)
	}
	// The race detector's shadow memory scales RSS; the byte and heap
	// bounds above hold with it too. The peak depends on when the GC ran:
	// parsed infos are garbage at once, and on a loaded machine the GC's
	// pacing (GOGC=100) let them pile up to +307 MB before it caught up
	// (here alone: +80 to +160 MB). So the peak's bound is loose, and what
	// the prefill keeps (issue 12's 1.25 GB stayed) is bounded once the
	// garbage is collected and returned.
	if !raceEnabled && rss-rss0 > 512<<20 {
		t.Errorf("RSS grew by %d MB under the flood (bound 512 MB)", (rss-rss0)>>20)
	}
	debug.FreeOSMemory()
	if kept := int64(rssBytes(t)); !raceEnabled && kept-rss0 > 128<<20 {
		t.Errorf("RSS kept %d MB more after the flood, its garbage collected (bound 128 MB)", (kept-rss0)>>20)
	} else {
		t.Logf("RSS after the garbage is collected: +%d MB", (kept-rss0)>>20)
	}
	// The decode still works.
	q = r.prepare(7, 9, 0)
	if err := r.transfer(ctx, q); err != nil {
		t.Fatal(err)
	}
	q.close()
}

// TestRefusedRegistrationLeavesPeers: registrations that are refused or
// ignored (metadata naming the registered decode's agent under another
// name, a hostile agent that calls itself like the decode, a replay of the
// decode's own metadata) leave the registered decode exactly as it was:
// every one of its rooms succeeds while they arrive.
func TestRefusedRegistrationLeavesPeers(t *testing.T) {
	for _, v := range []push.Variant{push.VariantNIXL, push.VariantMORI} {
		t.Run(v.String(), func(t *testing.T) {
			r := newRig(t, rigOpts{variant: v})
			ctx := ctxT(t, 60*time.Second)
			victim := r.dec.Agent().Name()
			victimMD, err := r.dec.Agent().LocalMetadata()
			if err != nil {
				t.Fatal(err)
			}
			// An agent that calls itself like the decode, with memory of
			// its own.
			evil, err := r.pl.NewAgent(victim)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { evil.Close() })
			mem, err := syscall.Mmap(-1, 0, 1<<16, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { syscall.Munmap(mem) })
			base := uint64(uintptr(unsafe.Pointer(&mem[0])))
			if _, err := evil.Register([]abi.MemDesc{{Addr: base, Len: uint64(len(mem)), MemKind: abi.VRAM}}); err != nil {
				t.Fatal(err)
			}
			evilMD, err := evil.LocalMetadata()
			if err != nil {
				t.Fatal(err)
			}
			evilPull, err := zmq.ListenPull("tcp://127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { evilPull.Close() })
			item := r.p.args.KV[0].ItemLen
			hostile := func(i int) sglang.Message {
				md, claim := victimMD, fmt.Sprintf("hostile-%d", i)
				switch i % 3 {
				case 1:
					md = evilMD // metadata naming the decode, another agent's
				case 2:
					md, claim = evilMD, victim // claims the decode's name
				}
				if v == push.VariantMORI {
					return &sglang.MORIRegistration{Endpoint: "127.0.0.1", Port: evilPull.Port(), EngineDesc: sglang.WrapEngineDesc(md, claim, 0),
						DecodeTPSize: 1, KVItemLen: item}
				}
				return &sglang.NIXLRegistration{Endpoint: "127.0.0.1", Port: evilPull.Port(), AgentName: claim, AgentMetadata: md,
					DecodeTPSize: 1, KVItemLen: item, KVPtrs: []uint64{base}, KVItemLens: []uint64{item}, NumSlots: 4}
			}
			raw := dialRaw(t, r.pf.Endpoint())
			const rooms = 24
			failed := 0
			for i := 0; i < rooms; i++ {
				q := r.prepare(uint64(300+i), 1+i%12, i%8)
				if i > 0 {
					// The decode registered with its first room; now a
					// hostile registration arrives before each room.
					raw.send(hostile(i))
					raw.barrier(ctx, r.pf.Dropped)
				}
				if err := r.transfer(ctx, q); err != nil {
					failed++
					t.Logf("room %d (after hostile registration %d): %v", q.room, i%3, err)
				}
				q.close()
			}
			if failed > 0 {
				t.Fatalf("%d of the decode's %d rooms failed while hostile registrations were refused", failed, rooms)
			}
			peers := r.pf.Peers()
			if len(peers) != 1 || peers[0] != victim {
				t.Fatalf("registered peers %v, want just %s", peers, victim)
			}
		})
	}
}

// TestAbortAfterClose: an ABORT for a room the engine already closed is
// dropped: it is not kept as pending, and a later room with the same id is
// not failed by it.
func TestAbortAfterClose(t *testing.T) {
	r := newRig(t, rigOpts{})
	ctx := ctxT(t, 20*time.Second)
	q := r.prepare(77, 8, 0)
	if err := r.transfer(ctx, q); err != nil {
		t.Fatal(err)
	}
	q.close()
	raw := dialRaw(t, r.pf.Endpoint())
	port := r.dec.Endpoint()[strings.LastIndexByte(r.dec.Endpoint(), ':')+1:]
	dport, _ := strconv.Atoi(port)
	raw.send(&sglang.Abort{Room: 77, Endpoint: "127.0.0.1", Port: dport})
	raw.barrier(ctx, r.pf.Dropped)
	if n := r.pf.Pending(); n != 0 {
		t.Fatalf("the late ABORT left %d pending rooms", n)
	}
	s, err := r.pf.NewSender(77)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := s.Poll(); st != sglang.KVPollBootstrapping {
		t.Fatalf("a new room with the id of a closed one is %v (%v)", st, s.Failure())
	}
	// An ABORT before the engine opens a room still fails it at once.
	raw.send(&sglang.Abort{Room: 78, Endpoint: "127.0.0.1", Port: dport})
	raw.barrier(ctx, r.pf.Dropped)
	s2, err := r.pf.NewSender(78)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if st := s2.Poll(); st != sglang.KVPollFailed || !strings.Contains(s2.Failure().Error(), "Aborted by decode") {
		t.Fatalf("early ABORT: %v %v", st, s2.Failure())
	}
}

// auxPeer is a stock SGLang NIXL decode as the prefill sees it: a fake
// agent whose aux buffer holds slots slots of the rig's item length,
// registered as its own region, and a registration without kvhost's
// length frames.
type auxPeer struct {
	agent *plugin.Agent
	kv    []byte
	aux   []byte
	pull  *zmq.Pull
}

func newAuxPeer(t *testing.T, r *rig, name string, slots int) *auxPeer {
	t.Helper()
	a, err := r.pl.NewAgent(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	kvLen := 4 * rigPages * int(r.p.args.KV[0].ItemLen)
	mem, err := syscall.Mmap(-1, 0, kvLen+slots*rigAuxLen, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	p := &auxPeer{agent: a, kv: mem[:kvLen], aux: mem[kvLen:]}
	addr := func(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }
	if _, err := a.Register([]abi.MemDesc{{Addr: addr(p.kv), Len: uint64(len(p.kv)), MemKind: abi.VRAM},
		{Addr: addr(p.aux), Len: uint64(len(p.aux)), MemKind: abi.DRAM}}); err != nil {
		t.Fatal(err)
	}
	if p.pull, err = zmq.ListenPull("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.pull.Close() })
	return p
}

func (p *auxPeer) registration(t *testing.T, r *rig) *sglang.NIXLRegistration {
	md, err := p.agent.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	item := r.p.args.KV[0].ItemLen
	base := uint64(uintptr(unsafe.Pointer(&p.kv[0])))
	reg := &sglang.NIXLRegistration{Endpoint: "127.0.0.1", Port: p.pull.Port(), AgentName: p.agent.Name(), AgentMetadata: md,
		DecodeTPSize: 1, KVItemLen: item, NumSlots: rigPages,
		AuxPtrs: []uint64{uint64(uintptr(unsafe.Pointer(&p.aux[0])))}}
	for i := uint64(0); i < 4; i++ {
		reg.KVPtrs = append(reg.KVPtrs, base+i*rigPages*item)
		reg.KVItemLens = append(reg.KVItemLens, item)
		reg.KVMemKinds = append(reg.KVMemKinds, sglang.VRAM)
	}
	return reg
}

// TestAuxSlotsWithoutLengths: an SGLang decode (no kvhost length frames)
// whose aux buffers hold fewer (8) or more (64) slots than the prefill's
// (16) gets aux in every slot it has, as SGLang's prefill writes at
// ptr + item_len * index; a slot past the memory it registered fails the
// room with the plugin's reason and writes nothing.
func TestAuxSlotsWithoutLengths(t *testing.T) {
	for _, c := range []struct {
		slots  int
		params []plugin.Param
	}{
		{8, nil}, {64, nil},
		{8, []plugin.Param{{Key: "caps_off", Value: "notif"}}}, // completion by status
		{64, []plugin.Param{{Key: "caps_off", Value: "notif"}}},
	} {
		slots := c.slots
		t.Run(fmt.Sprintf("%d-slots-%d", slots, len(c.params)), func(t *testing.T) {
			r := newRig(t, rigOpts{noDecode: true, pparams: c.params})
			ctx := ctxT(t, 60*time.Second)
			p := newAuxPeer(t, r, fmt.Sprintf("sglang-decode-%d-%d", slots, len(c.params)), slots)
			raw := dialRaw(t, r.pf.Endpoint())
			raw.send(p.registration(t, r))
			raw.barrier(ctx, r.pf.Dropped)
			var mu sync.Mutex
			run := func(room uint64, dstAux int64) error {
				mu.Lock()
				defer mu.Unlock()
				s, err := r.pf.NewSender(room)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				raw.send(&sglang.NIXLTransferInfo{Room: room, Endpoint: "127.0.0.1", Port: p.pull.Port(), AgentName: p.agent.Name(),
					DstKVIndices: []int32{int32(room % rigPages)}, DstAuxIndex: dstAux, RequiredDstInfoNum: 1, DecodePrefixLenSet: true})
				if st, _ := s.WaitReady(ctx); st != sglang.KVPollWaitingForInput {
					return fmt.Errorf("not ready: %v %v", st, s.Failure())
				}
				paux := int(room % rigAuxSlots)
				if err := r.p.pool.FillAux(room, paux); err != nil {
					t.Fatal(err)
				}
				if err := r.p.pool.Fill(kvpool.Tokens{Request: room, Pages: []int32{int32(room % rigPages)}, Count: rigPageSize}); err != nil {
					t.Fatal(err)
				}
				if err := s.Init(1, int64(paux)); err != nil {
					t.Fatal(err)
				}
				if err := s.Send([]int32{int32(room % rigPages)}, nil); err != nil {
					t.Fatal(err)
				}
				if st, _ := s.Wait(ctx); st != sglang.KVPollSuccess {
					return s.Failure()
				}
				src := r.p.args.Aux[0].Mem[paux*rigAuxLen : (paux+1)*rigAuxLen]
				dst := p.aux[int(dstAux)*rigAuxLen : (int(dstAux)+1)*rigAuxLen]
				if string(src) != string(dst) {
					return fmt.Errorf("aux slot %d holds other bytes than prefill slot %d", dstAux, paux)
				}
				return nil
			}
			bad := 0
			for slot := 0; slot < slots; slot++ {
				if err := run(uint64(1000+slot), int64(slot)); err != nil {
					bad++
					if bad < 4 {
						t.Errorf("aux slot %d of %d: %v", slot, slots, err)
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%d of %d aux slots failed", bad, slots)
			}
			// Past the peer's aux memory: refused by the plugin, the room
			// fails and no byte of the peer's memory changes.
			before := slices.Clone(p.aux)
			err := run(2000, int64(slots))
			if err == nil || !strings.Contains(err.Error(), "aux") {
				t.Fatalf("slot %d past a %d-slot buffer: %v", slots, slots, err)
			}
			if string(before) != string(p.aux) {
				t.Fatal("the refused aux slot changed the peer's memory")
			}
			t.Logf("past the buffer: %v", err)
		})
	}
}
