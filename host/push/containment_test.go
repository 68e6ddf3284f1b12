package push_test

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// evilPeer is a decode rank under the test's control: a fake agent with
// one registered buffer, which speaks the wire by hand.
type evilPeer struct {
	t     *testing.T
	r     *rig
	mem   []byte
	base  uint64
	agent interface{ Name() string }
	md    []byte
	pull  *zmq.Pull
	push  *zmq.Push
}

func newEvil(t *testing.T, r *rig) *evilPeer {
	mem, err := syscall.Mmap(-1, 0, 1<<16, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	a, err := r.pl.NewAgent("evil-decode")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	// KV in the first half (VRAM), aux in the second (DRAM).
	half := uint64(len(mem) / 2)
	if _, err := a.Register([]abi.MemDesc{{Addr: base, Len: half, MemKind: abi.VRAM}, {Addr: base + half, Len: half, MemKind: abi.DRAM}}); err != nil {
		t.Fatal(err)
	}
	md, err := a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	pull, err := zmq.ListenPull("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pull.Close() })
	p, _ := zmq.DialPush(r.pf.Endpoint())
	t.Cleanup(func() { p.Close() })
	return &evilPeer{t: t, r: r, mem: mem, base: base, agent: a, md: md, pull: pull, push: p}
}

func (e *evilPeer) send(m sglang.Message, extra ...[]byte) {
	e.t.Helper()
	f, err := m.Frames()
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.push.Send(ctx, append(f, extra...)...); err != nil {
		e.t.Fatal(err)
	}
}

// registration claims 4 KV regions of slots x item bytes each, laid out
// from off in the evil buffer, and one aux buffer.
func (e *evilPeer) registration(off uint64, slots uint64) *sglang.NIXLRegistration {
	item := e.r.p.args.KV[0].ItemLen
	reg := &sglang.NIXLRegistration{Endpoint: "127.0.0.1", Port: e.pull.Port(), AgentName: e.agent.Name(), AgentMetadata: e.md,
		DecodeTPSize: 1, KVItemLen: item, NumSlots: slots}
	for i := uint64(0); i < 4; i++ {
		reg.KVPtrs = append(reg.KVPtrs, e.base+off+i*slots*item)
		reg.KVItemLens = append(reg.KVItemLens, item)
		reg.KVMemKinds = append(reg.KVMemKinds, sglang.VRAM)
	}
	reg.AuxPtrs = []uint64{e.base + uint64(len(e.mem)/2) + off}
	return reg
}

// TestContainment: whatever a decode peer sends, the prefill rank writes
// only into memory the peer registered and reads only its own KV: plans
// that leave either are refused before they reach the plugin, and the room
// fails with the reason.
// Both ways KV reaches the plugin: strided batches and indices into
// prepared lists.
func TestContainment(t *testing.T) {
	for _, x := range []push.XferMode{push.XferBatch, push.XferPrepped} {
		t.Run(x.String(), func(t *testing.T) { testContainment(t, x) })
	}
}

func testContainment(t *testing.T, xfer push.XferMode) {
	r := newRig(t, rigOpts{noDecode: true, xfer: xfer})
	e := newEvil(t, r)
	ctx := ctxT(t, 20*time.Second)
	const slots = 8
	// A registration claiming memory the peer's agent never registered is
	// refused (the remote regions cannot be imported).
	bad := e.registration(uint64(len(e.mem)/2-1024), slots)
	bad.AgentName = e.agent.Name()
	e.send(bad)
	// A valid registration: 4 regions of 8 pages plus an aux buffer of
	// 64 bytes (kvhost's extension frames give its length).
	good := e.registration(0, slots)
	ext := [][]byte{[]byte("kvhost.lens.v1"), {64, 0, 0, 0, 0, 0, 0, 0}, nil}
	time.Sleep(50 * time.Millisecond)
	e.send(good, ext...)

	run := func(room uint64, dst []int32, dstAux int64, src []int32, prefillAux int64) error {
		s, err := r.pf.NewSender(room)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		e.send(&sglang.NIXLTransferInfo{Room: room, Endpoint: "127.0.0.1", Port: e.pull.Port(), AgentName: e.agent.Name(),
			DstKVIndices: dst, DstAuxIndex: dstAux, RequiredDstInfoNum: 1, DecodePrefixLenSet: true})
		if st, _ := s.WaitReady(ctx); st != sglang.KVPollWaitingForInput {
			t.Fatalf("room %d: %v %v", room, st, s.Failure())
		}
		if err := s.Init(len(src), prefillAux); err != nil {
			t.Fatal(err)
		}
		if err := s.Send(src, nil); err != nil {
			t.Fatal(err)
		}
		if st, _ := s.Wait(ctx); st == sglang.KVPollSuccess {
			return nil
		}
		return s.Failure()
	}
	r.p.pool.Fill(kvpool.Tokens{Request: 1, Pages: []int32{0, 1, 2}, Count: 3 * rigPageSize})
	// In bounds: succeeds and writes.
	if err := run(1, []int32{5, 6, 7}, 0, []int32{0, 1, 2}, 0); err != nil {
		t.Fatalf("in-bounds transfer: %v", err)
	}
	written := append([]byte(nil), e.mem...)
	nonzero := 0
	for _, b := range written {
		if b != 0 {
			nonzero++
		}
	}
	if nonzero == 0 {
		t.Fatal("the in-bounds transfer wrote nothing")
	}
	for _, c := range []struct {
		name     string
		dst, src []int32
		dstAux   int64
		srcAux   int64
		reason   string
	}{
		{"decode page past its regions", []int32{5, 8}, []int32{0, 1}, 0, 0, "decode_pages"},
		{"negative decode page", []int32{-1}, []int32{0}, 0, 0, "decode_pages"},
		{"decode aux slot past its buffer", []int32{1}, []int32{0}, 2, 0, "dst_aux_index"},
		{"prefill page past its own pool", []int32{1}, []int32{rigPages}, 0, 0, "prefill_pages"},
		{"prefill aux slot past its own buffer", []int32{1}, []int32{0}, 0, rigAuxSlots, "prefill_aux_index"},
		{"fewer decode pages than sent", []int32{1}, []int32{0, 1}, 0, 0, "page indices"},
	} {
		err := run(uint64(100+len(c.name)), c.dst, c.dstAux, c.src, c.srcAux)
		if err == nil || !strings.Contains(err.Error(), c.reason) {
			t.Errorf("%s: %v (want a failure naming %s)", c.name, err, c.reason)
		}
	}
	for i := range e.mem {
		if e.mem[i] != written[i] {
			t.Fatalf("byte %d of the peer's memory changed after refused transfers", i)
		}
	}
	if r.pf.Rooms() != 0 {
		t.Fatalf("%d rooms left", r.pf.Rooms())
	}
	r.pf.Close() // while the peer still listens for the failure statuses
}
