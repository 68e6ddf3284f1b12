// Package nixltest proves behaviour of the nixl plugin that the conformance
// suite (host/conformance) cannot reach through its fake-plugin hooks:
// NIXL's own parameter errors, transfers that are really in flight (UCX over
// TCP only, so completion is asynchronous), cancellation by release_xfer and
// by remove_remote, the progress-thread-off mode, a peer that restarts
// under the same name, which agents get UCX's TCP PUT zcopy turned off, and
// the prefault of registered DRAM (prefault_test.go).
// TestTwoNetnsTCP (netns_test.go, run only when asked) moves KV between
// kvhost workers in two network namespaces over UCX TCP.
//
// It needs the plugin built with `make plugin-nixl NIXL_PREFIX=...` and
// skips, saying so, when lib/kvhost/libkvhost_nixl.so is not there (CI has
// no NIXL). The tests run two agents in this process over UCX on loopback.
package nixltest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
	"golang.org/x/sys/unix"
)

const pluginName = "nixl"

// load opens the nixl plugin, or skips when it was not built.
func load(t *testing.T) *plugin.Plugin {
	t.Helper()
	dirs := plugin.SearchDirs("")
	found := false
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "libkvhost_"+pluginName+".so")); err == nil {
			found = true
		}
	}
	if !found {
		t.Skipf("libkvhost_nixl.so not found in %v: build it with `make plugin-nixl NIXL_PREFIX=...` (needs an installed NIXL)", dirs)
	}
	p, err := plugin.Load(pluginName, dirs)
	if err != nil {
		t.Fatalf("loading the nixl plugin: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// side is an agent with one registered DRAM buffer outside the Go heap.
type side struct {
	a   *plugin.Agent
	buf []byte
	reg *plugin.Region
}

var names sync.Map

// uniqueName returns an agent name unique to this process and run.
func uniqueName(t *testing.T, role string) string {
	for i := 0; ; i++ {
		n := fmt.Sprintf("nixltest-%d-%s-%s-%d", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"), role, i)
		if _, dup := names.LoadOrStore(n, true); !dup {
			return n
		}
	}
}

func newSide(t *testing.T, p *plugin.Plugin, name string, size int, params ...plugin.Param) *side {
	t.Helper()
	a, err := p.NewAgent(name, params...)
	if err != nil {
		t.Fatalf("agent %s: %v", name, err)
	}
	buf, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		a.Close()
		t.Fatalf("mmap: %v", err)
	}
	regs, err := a.Register([]abi.MemDesc{{Addr: addr(buf), Len: uint64(size), MemKind: abi.DRAM}})
	if err != nil {
		a.Close()
		syscall.Munmap(buf)
		t.Fatalf("register: %v", err)
	}
	s := &side{a: a, buf: buf, reg: regs[0]}
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Errorf("closing agent %s: %v", name, err)
		}
		syscall.Munmap(buf)
	})
	return s
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// connect loads the target's metadata into the initiator and returns the
// peer name.
func connect(t *testing.T, init, target *side) string {
	t.Helper()
	md, err := target.a.LocalMetadata()
	if err != nil {
		t.Fatalf("local_metadata: %v", err)
	}
	name, err := init.a.LoadRemote(md)
	if err != nil {
		t.Fatalf("load_remote: %v", err)
	}
	if name != target.a.Name() {
		t.Fatalf("load_remote returned peer %q, want %q", name, target.a.Name())
	}
	return name
}

// fill writes a pattern that differs per seed.
func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

func code(err error) abi.Status {
	var pe *plugin.Error
	if errors.As(err, &pe) {
		return pe.Code
	}
	return 0
}

func expectCode(t *testing.T, what string, err error, want abi.Status) {
	t.Helper()
	if got := code(err); got != want {
		t.Errorf("%s: %v, want code %v", what, err, want)
	}
}

func wait(t *testing.T, x *plugin.Xfer, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := x.Wait(ctx); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func TestAgentParameterErrors(t *testing.T) {
	p := load(t)
	cases := []struct {
		params []plugin.Param
		code   abi.Status
		msg    string // part of the message
	}{
		// NIXL reports the plugins it found; UCX was built.
		{[]plugin.Param{{Key: "backend", Value: "NO_SUCH_BACKEND"}}, abi.ErrNotFound, "available: "},
		{[]plugin.Param{{Key: "sync_mode", Value: "none"}}, abi.ErrInvalidParam, "sync_mode"},
		{[]plugin.Param{{Key: "progress_thread", Value: "sometimes"}}, abi.ErrInvalidParam, "progress_thread"},
		{[]plugin.Param{{Key: "progress_delay_us", Value: "-1"}}, abi.ErrInvalidParam, "progress_delay_us"},
		// Passed through to UCX, which rejects it; NIXL returns only
		// NIXL_ERR_BACKEND (its log on stderr has the reason), so the
		// message names the call and the backend parameters given.
		{[]plugin.Param{{Key: "ucx_error_handling_mode", Value: "bogus"}}, abi.ErrBackend, "createBackend(UCX) with backend params {ucx_error_handling_mode}"},
	}
	for _, c := range cases {
		a, err := p.NewAgent(uniqueName(t, "bad"), c.params...)
		if err == nil {
			a.Close()
			t.Errorf("params %v: accepted", c.params)
			continue
		}
		if c.code != 0 && code(err) != c.code {
			t.Errorf("params %v: %v, want code %v", c.params, err, c.code)
		}
		if code(err) == 0 {
			t.Errorf("params %v: %v is not a plugin error", c.params, err)
		}
		if !strings.Contains(err.Error(), c.msg) {
			t.Errorf("params %v: %q does not mention %q", c.params, err, c.msg)
		}
		t.Logf("params %v: %v", c.params, err)
	}
	// The unknown-backend message lists what NIXL has, which includes UCX.
	_, err := p.NewAgent(uniqueName(t, "bad"), plugin.Param{Key: "backend", Value: "NO_SUCH_BACKEND"})
	if err == nil || !strings.Contains(err.Error(), "UCX") {
		t.Errorf("unknown backend: %v, want the available plugins (UCX) listed", err)
	}
}

// The shim adds CMA_TX_QUOTA=16 to the UCX backend's engine_config unless
// the caller's engine_config sets it (or UCX_CMA_TX_QUOTA /
// UCX_SCOPY_TX_QUOTA in the environment, which this test leaves unset). A
// backend that fails to start names what the shim added, which shows it.
func TestCMATxQuota(t *testing.T) {
	for _, env := range []string{"UCX_CMA_TX_QUOTA", "UCX_SCOPY_TX_QUOTA"} {
		if v, ok := os.LookupEnv(env); ok {
			t.Fatalf("%s=%s is set in the environment: unset it to run this test", env, v)
		}
	}
	p := load(t)
	bad := plugin.Param{Key: "ucx_error_handling_mode", Value: "bogus"}
	for _, c := range []struct {
		params []plugin.Param
		added  bool
	}{
		{[]plugin.Param{bad}, true},
		{[]plugin.Param{bad, {Key: "engine_config", Value: "USE_MT_MUTEX=y"}}, true},
		{[]plugin.Param{bad, {Key: "engine_config", Value: "cma_tx_quota=4"}}, false},
		{[]plugin.Param{bad, {Key: "engine_config", Value: "USE_MT_MUTEX=y,SCOPY_TX_QUOTA=2"}}, false},
	} {
		a, err := p.NewAgent(uniqueName(t, "quota"), c.params...)
		if err == nil {
			a.Close()
			t.Fatalf("params %v: accepted a bogus error handling mode", c.params)
		}
		if got := strings.Contains(err.Error(), "CMA_TX_QUOTA=16"); got != c.added {
			t.Errorf("params %v: %q; the shim added CMA_TX_QUOTA=16: %v, want %v", c.params, err, got, c.added)
		}
	}
	// And a backend the shim gave the quota to moves bytes.
	a, err := p.NewAgent(uniqueName(t, "quota"))
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
}

// tcpOnly makes UCX move data over TCP on loopback only: completion is then
// asynchronous, so transfers are really in flight after post_xfer (with the
// default transports, cma copies inside post_xfer).
var tcpOnly = plugin.Param{Key: "engine_config", Value: "TLS=tcp"}

func TestInFlightTransfers(t *testing.T) {
	p := load(t)
	const size = 256 << 20
	const nblk = 64
	const blk = size / nblk
	init := newSide(t, p, uniqueName(t, "init"), size, tcpOnly)
	target := newSide(t, p, uniqueName(t, "target"), size, tcpOnly)
	peer := connect(t, init, target)

	descs := func(b []byte) []abi.XferDesc {
		d := make([]abi.XferDesc, nblk)
		for i := range d {
			d[i] = abi.XferDesc{Addr: addr(b) + uint64(i*blk), Len: blk, Count: 1}
		}
		return d
	}
	ld, err := init.a.PrepLocal(abi.DRAM, descs(init.buf))
	if err != nil {
		t.Fatalf("prep local: %v", err)
	}
	defer ld.Close()
	rd, err := init.a.PrepRemote(peer, abi.DRAM, descs(target.buf))
	if err != nil {
		t.Fatalf("prep remote: %v", err)
	}
	defer rd.Close()
	idx := make([]int32, nblk)
	for i := range idx {
		idx[i] = int32(i)
	}

	// A 256 MiB WRITE over TCP: in progress after post, REPOST_ACTIVE while
	// active, NO_TELEMETRY before completion, then every byte lands.
	fill(init.buf, 1)
	x, err := init.a.MakePreppedXfer(abi.Write, ld, idx, rd, idx, nil)
	if err != nil {
		t.Fatalf("make_prepped_xfer: %v", err)
	}
	_, err = x.Poll()
	expectCode(t, "poll before post", err, abi.ErrNotPosted)
	done, err := x.Post()
	if err != nil {
		t.Fatalf("post: %v", err)
	}
	if done {
		t.Fatalf("post_xfer of 256 MiB over TCP reported completion inside the call")
	}
	if done, err := x.Poll(); err != nil || done {
		t.Errorf("poll right after post: done %v, %v; want IN_PROG", done, err)
	}
	_, err = x.Post()
	expectCode(t, "post of an active transfer", err, abi.ErrRepostActive)
	_, err = x.Telemetry()
	expectCode(t, "telemetry of an active transfer", err, abi.ErrNoTelemetry)
	wait(t, x, "256 MiB WRITE")
	if !bytes.Equal(init.buf, target.buf) {
		t.Fatalf("WRITE: target bytes differ from the source")
	}
	tm, err := x.Telemetry()
	if err != nil {
		t.Fatalf("telemetry: %v", err)
	}
	if tm.Bytes != size || tm.Descs != nblk || tm.Xfer <= 0 || time.Since(tm.Start) > time.Minute || tm.Start.After(time.Now()) {
		t.Errorf("telemetry %+v: want %d bytes, %d descriptors, a positive duration and a recent start", tm, size, nblk)
	}
	t.Logf("256 MiB over TCP: %+v", tm)

	// Released while active: on return nothing touches the transfer's
	// memory any more. A READ writes local memory, so after the release the
	// local buffer is cleared and must stay clear. (NIXL cannot cancel an
	// active UCX transfer; the plugin waits for it.)
	if err := x.Close(); err != nil {
		t.Fatalf("release_xfer: %v", err)
	}
	fill(target.buf, 2)
	r, err := init.a.MakePreppedXfer(abi.Read, ld, idx, rd, idx, nil)
	if err != nil {
		t.Fatalf("make_prepped_xfer READ: %v", err)
	}
	if done, err := r.Post(); err != nil || done {
		t.Fatalf("post READ: done %v, %v", done, err)
	}
	start := time.Now()
	if err := r.Close(); err != nil {
		t.Errorf("release_xfer of an active transfer: %v", err)
	}
	t.Logf("release_xfer of an active 256 MiB READ took %v", time.Since(start))
	if _, err := r.Poll(); err == nil {
		t.Errorf("poll after release succeeded")
	}
	expectQuiet(t, init.buf, "after release_xfer of an active READ")

	// remove_remote while a batch READ is active: the transfer is
	// cancelled; its handle stays valid, polls report CANCELED and posts
	// NOT_FOUND until it is released (kvplugin.h), and no byte lands after
	// remove_remote returns.
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	y, err := init.a.MakeBatchXfer(abi.Read, []plugin.Pair{{Local: init.reg, Remote: rr}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	if done, err := y.Post(); err != nil || done {
		t.Fatalf("post READ: done %v, %v", done, err)
	}
	if err := init.a.RemoveRemote(peer); err != nil {
		t.Fatalf("remove_remote with a transfer in flight: %v", err)
	}
	expectQuiet(t, init.buf, "after remove_remote with an active READ")
	_, err = y.Poll()
	expectCode(t, "poll of a transfer whose peer was removed", err, abi.ErrCanceled)
	_, err = y.Poll()
	expectCode(t, "second poll", err, abi.ErrCanceled)
	_, err = y.Post()
	expectCode(t, "post of a transfer whose peer was removed", err, abi.ErrNotFound)
	if err := y.Close(); err != nil {
		t.Errorf("release_xfer of a cancelled transfer: %v", err)
	}
	// The peer can be loaded again and used.
	peer = connect(t, init, target)
	rr2, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range after reload: %v", err)
	}
	fill(target.buf, 3)
	z, err := init.a.MakeBatchXfer(abi.Read, []plugin.Pair{{Local: init.reg, Remote: rr2}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, []byte("read done"))
	if err != nil {
		t.Fatalf("make_batch_xfer after reload: %v", err)
	}
	defer z.Close()
	if _, err := z.Post(); err != nil {
		t.Fatalf("post after reload: %v", err)
	}
	wait(t, z, "READ after reload")
	if !bytes.Equal(init.buf, target.buf) {
		t.Fatalf("READ after reload: bytes differ")
	}
}

// expectQuiet clears b and checks that nothing writes into it for a while:
// memory of a released or cancelled transfer must not change any more.
func expectQuiet(t *testing.T, b []byte, what string) {
	t.Helper()
	clear(b)
	time.Sleep(200 * time.Millisecond)
	for i, v := range b {
		if v != 0 {
			t.Errorf("%s: byte %d of the local buffer changed to %#x after the call returned", what, i, v)
			return
		}
	}
}

// With release_wait_ms=0 release_xfer of an active transfer does not wait:
// it reports ERR_REPOST_ACTIVE and the handle stays valid, to be released
// once the transfer is done.
func TestReleaseActiveWithoutWaiting(t *testing.T) {
	p := load(t)
	const size = 256 << 20
	nowait := plugin.Param{Key: "release_wait_ms", Value: "0"}
	init := newSide(t, p, uniqueName(t, "init"), size, tcpOnly, nowait)
	target := newSide(t, p, uniqueName(t, "target"), size, tcpOnly, nowait)
	peer := connect(t, init, target)
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	fill(init.buf, 4)
	x, err := init.a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	if done, err := x.Post(); err != nil || done {
		t.Fatalf("post: done %v, %v", done, err)
	}
	// (host/plugin marks its Xfer closed even when release_xfer fails, so
	// the still-valid plugin handle is freed by agent_destroy at cleanup.)
	err = x.Close()
	expectCode(t, "release_xfer of an active transfer with release_wait_ms=0", err, abi.ErrRepostActive)
	if err != nil && !strings.Contains(err.Error(), "release it again") {
		t.Errorf("the error does not say what to do: %v", err)
	}
}

// With progress_thread=false the host must keep calling get_notifs on every
// agent (connection set-up needs both sides to make progress); then
// transfers and notifications work.
func TestProgressThreadOff(t *testing.T) {
	p := load(t)
	off := plugin.Param{Key: "progress_thread", Value: "false"}
	const size = 4 << 20
	init := newSide(t, p, uniqueName(t, "init"), size, off)
	target := newSide(t, p, uniqueName(t, "target"), size, off)
	peer := connect(t, init, target)

	got := make(chan plugin.Notif, 16)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the target's host: drains notifications every millisecond
		defer wg.Done()
		for {
			ns, err := target.a.Notifs()
			if err != nil {
				t.Errorf("target get_notifs: %v", err)
				return
			}
			for _, n := range ns {
				got <- n
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	defer func() { close(stop); wg.Wait() }()

	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	fill(init.buf, 9)
	x, err := init.a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, []byte("kv ready"))
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	defer x.Close()
	if _, err := x.Post(); err != nil {
		t.Fatalf("post: %v", err)
	}
	wait(t, x, "WRITE without progress threads")
	select {
	case n := <-got:
		if n.From != init.a.Name() || string(n.Msg) != "kv ready" {
			t.Errorf("notification %q from %q, want %q from %q", n.Msg, n.From, "kv ready", init.a.Name())
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the notification attached to the WRITE never arrived")
	}
	if !bytes.Equal(init.buf, target.buf) {
		t.Fatalf("WRITE without progress threads: bytes differ")
	}
}

// A peer that restarts under the same name has new connection info; NIXL
// refuses to load it over the old one, and the error says what to do.
func TestPeerRestart(t *testing.T) {
	p := load(t)
	const size = 1 << 20
	init := newSide(t, p, uniqueName(t, "init"), size)
	name := uniqueName(t, "target")
	first, err := p.NewAgent(name)
	if err != nil {
		t.Fatalf("agent: %v", err)
	}
	md, err := first.LocalMetadata()
	if err != nil {
		t.Fatalf("local_metadata: %v", err)
	}
	if _, err := init.a.LoadRemote(md); err != nil {
		t.Fatalf("load_remote: %v", err)
	}
	if _, err := init.a.LoadRemote(md); err != nil {
		t.Errorf("reloading the same metadata: %v", err)
	}
	if err := first.Close(); err != nil {
		t.Fatalf("closing the first incarnation: %v", err)
	}
	second := newSide(t, p, name, size)
	md2, err := second.a.LocalMetadata()
	if err != nil {
		t.Fatalf("local_metadata: %v", err)
	}
	_, err = init.a.LoadRemote(md2)
	expectCode(t, "loading a restarted peer over the old one", err, abi.ErrNotAllowed)
	if err != nil && !strings.Contains(err.Error(), "remove_remote") {
		t.Errorf("the error does not say to remove_remote first: %v", err)
	}
	if err := init.a.RemoveRemote(name); err != nil {
		t.Fatalf("remove_remote: %v", err)
	}
	peer := connect(t, init, second)
	rr, err := init.a.ImportRange(peer, addr(second.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	fill(init.buf, 5)
	x, err := init.a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	defer x.Close()
	if _, err := x.Post(); err != nil {
		t.Fatalf("post: %v", err)
	}
	wait(t, x, "WRITE to the restarted peer")
	if !bytes.Equal(init.buf, second.buf) {
		t.Fatalf("WRITE to the restarted peer: bytes differ")
	}
}

// NIXL was built without CUDA here: registering VRAM must fail with an
// error naming the descriptor, not crash, and leave nothing registered.
func TestVRAMWithoutCUDA(t *testing.T) {
	p := load(t)
	s := newSide(t, p, uniqueName(t, "vram"), 1<<20)
	if _, err := os.Stat("/dev/nvidia0"); err == nil {
		t.Skip("a GPU is present; this test covers hosts without CUDA")
	}
	buf, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	defer syscall.Munmap(buf)
	_, err = s.a.Register([]abi.MemDesc{{Addr: addr(buf), Len: 4096, DevID: 0, MemKind: abi.VRAM}})
	if err == nil {
		t.Fatalf("registering VRAM without CUDA succeeded")
	}
	if code(err) == 0 || !strings.Contains(err.Error(), "VRAM") {
		t.Errorf("VRAM registration error %v: want a plugin error naming VRAM", err)
	}
	t.Logf("VRAM without CUDA: %v", err)
	// The DRAM region next to it still registers (nothing half-done).
	regs, err := s.a.Register([]abi.MemDesc{{Addr: addr(buf), Len: 4096, MemKind: abi.DRAM}})
	if err != nil {
		t.Fatalf("registering the same range as DRAM afterwards: %v", err)
	}
	if err := s.a.Deregister(regs...); err != nil {
		t.Errorf("deregister: %v", err)
	}
}

// A batch transfer with no entries, like a prepped one with no indices,
// moves nothing and only delivers its notification to the pairs' peer.
func TestNotificationOnlyBatch(t *testing.T) {
	p := load(t)
	const size = 1 << 20
	init := newSide(t, p, uniqueName(t, "init"), size)
	target := newSide(t, p, uniqueName(t, "target"), size)
	peer := connect(t, init, target)
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	fill(init.buf, 7)
	x, err := init.a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}}, nil, []byte("only a note"))
	if err != nil {
		t.Fatalf("make_batch_xfer with no entries: %v", err)
	}
	defer x.Close()
	for round := range 2 {
		if _, err := x.Poll(); round == 0 {
			expectCode(t, "poll before post", err, abi.ErrNotPosted)
		}
		if done, err := x.Post(); err != nil || !done {
			t.Fatalf("post: done %v, %v", done, err)
		}
		var got []plugin.Notif
		deadline := time.Now().Add(10 * time.Second)
		for len(got) == 0 && time.Now().Before(deadline) {
			ns, err := target.a.Notifs()
			if err != nil {
				t.Fatalf("get_notifs: %v", err)
			}
			got = append(got, ns...)
			time.Sleep(time.Millisecond)
		}
		if len(got) != 1 || got[0].From != init.a.Name() || string(got[0].Msg) != "only a note" {
			t.Fatalf("round %d: notifications %+v, want one %q from %s", round, got, "only a note", init.a.Name())
		}
		tm, err := x.Telemetry()
		if err != nil || tm.Bytes != 0 || tm.Descs != 0 {
			t.Errorf("telemetry %+v, %v: want 0 bytes and 0 descriptors", tm, err)
		}
	}
	for i, v := range target.buf {
		if v != 0 {
			t.Fatalf("a transfer without entries moved bytes: target byte %d is %#x", i, v)
		}
	}
}

// TestTCPPutEmulation checks which agents the shim gives TCP_PUT_ENABLE=n
// (UCX's TCP PUT zcopy off, so PUTs over TCP go as active messages; see
// ucx_tcp_put_emulation in nixl_plugin.cc and plugins/nixl/README.md). Each
// agent is made to fail in createBackend (a bad ucx_error_handling_mode),
// whose message lists what the shim added to engine_config. That the
// setting keeps the receiving process alive is TestTwoNetnsTCP's to show.
func TestTCPPutEmulation(t *testing.T) {
	p := load(t)
	for _, k := range []string{"UCX_TLS", "UCX_TCP_PUT_ENABLE"} {
		if v, set := os.LookupEnv(k); set {
			os.Unsetenv(k)
			t.Cleanup(func() { os.Setenv(k, v) })
		}
	}
	bad := plugin.Param{Key: "ucx_error_handling_mode", Value: "bogus"}
	ec := func(v string) plugin.Param { return plugin.Param{Key: "engine_config", Value: v} }
	tpe := func(v string) plugin.Param { return plugin.Param{Key: "tcp_put_emulation", Value: v} }
	cases := []struct {
		name   string
		params []plugin.Param
		env    map[string]string
		added  bool
	}{
		{"UCX's default transports", nil, nil, true},
		{"TLS=tcp", []plugin.Param{ec("TLS=tcp")}, nil, true},
		// engine_config splits at commas (as NIXL does), so a list of
		// transports can only come from UCX_TLS.
		{"env UCX_TLS=self,tcp:aux", nil, map[string]string{"UCX_TLS": "self,tcp:aux"}, true},
		{"env UCX_TLS=^rc,tcp", nil, map[string]string{"UCX_TLS": "^rc,tcp"}, false},
		{"TLS=all", []plugin.Param{ec("TLS=all")}, nil, true},
		{"TLS=^shm", []plugin.Param{ec("TLS=^shm")}, nil, true},
		{"TLS=shm", []plugin.Param{ec("TLS=shm")}, nil, false},
		{"TLS=^tcp", []plugin.Param{ec("TLS=^tcp")}, nil, false},
		{"TLS=shm,tcp_put_emulation=true", []plugin.Param{ec("TLS=shm"), tpe("true")}, nil, true},
		{"tcp_put_emulation=false", []plugin.Param{ec("TLS=tcp"), tpe("false")}, nil, false},
		{"tcp_put_emulation=auto", []plugin.Param{ec("TLS=tcp"), tpe("auto")}, nil, true},
		{"engine_config TCP_PUT_ENABLE=y", []plugin.Param{ec("TLS=tcp,tcp_put_enable=y"), tpe("true")}, nil, false},
		{"env UCX_TLS=shm", nil, map[string]string{"UCX_TLS": "shm"}, false},
		{"env UCX_TLS=tcp over engine_config", []plugin.Param{ec("TLS=shm")}, map[string]string{"UCX_TLS": "tcp"}, true},
		{"env UCX_TCP_PUT_ENABLE=y", []plugin.Param{ec("TLS=tcp"), tpe("true")}, map[string]string{"UCX_TCP_PUT_ENABLE": "y"}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			a, err := p.NewAgent(uniqueName(t, "tcpput"), append(c.params, bad)...)
			if err == nil {
				a.Close()
				t.Fatalf("agent with ucx_error_handling_mode=bogus was created")
			}
			expectCode(t, "createBackend", err, abi.ErrBackend)
			if got := strings.Contains(err.Error(), "TCP_PUT_ENABLE=n in engine_config"); got != c.added {
				t.Errorf("TCP_PUT_ENABLE=n added: %v, want %v (%v)", got, c.added, err)
			}
		})
	}
	_, err := p.NewAgent(uniqueName(t, "tcpput"), tpe("sometimes"))
	expectCode(t, "tcp_put_emulation=sometimes", err, abi.ErrInvalidParam)
	if err == nil || !strings.Contains(err.Error(), "want auto, true or false") {
		t.Errorf("tcp_put_emulation=sometimes: %v, want the accepted values named", err)
	}
	// And UCX takes the setting: an agent over TCP only with it works.
	init := newSide(t, p, uniqueName(t, "init"), 1<<20, tcpOnly)
	target := newSide(t, p, uniqueName(t, "target"), 1<<20, tcpOnly)
	peer := connect(t, init, target)
	fill(init.buf, 9)
	const size = 1 << 20
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	x, err := init.a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}},
		[]abi.BatchEntry{{Pair: 0, Len: size, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	defer x.Close()
	if _, err := x.Post(); err != nil {
		t.Fatalf("post: %v", err)
	}
	wait(t, x, "WRITE over TCP with TCP_PUT_ENABLE=n")
	if !bytes.Equal(init.buf, target.buf) {
		t.Fatalf("WRITE over TCP with TCP_PUT_ENABLE=n: bytes differ")
	}
}

// readable reports whether fd becomes readable within d (poll(2), which
// does not reset it).
func readable(t *testing.T, fd int, d time.Duration) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(d)
	for {
		n, err := unix.Poll(fds, max(int(time.Until(deadline)/time.Millisecond), 0))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			t.Fatalf("poll(2): %v", err)
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}

// cpuTime is the CPU time this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// An idle agent's event thread costs little CPU: once idle, one getNotifs
// per event_notif_max_us (2 ms by default). Measured against the same idle
// second without the thread, in one run.
func TestEventFDIdleCPU(t *testing.T) {
	p := load(t)
	a := newSide(t, p, uniqueName(t, "idle"), 1<<20)
	idle := func() time.Duration {
		c0 := cpuTime(t)
		time.Sleep(time.Second)
		return cpuTime(t) - c0
	}
	without := idle()
	if _, ok := a.a.EventFD(); !ok {
		t.Fatal("EventFD: not ok")
	}
	with := idle()
	t.Logf("process CPU over 1 s idle: %v without the event thread, %v with it (default event_notif_us, event_notif_max_us)", without, with)
	// Measured on a loaded 2-core machine: 9-24 ms a second (500 checks).
	if extra := with - without; extra > 50*time.Millisecond {
		t.Errorf("the idle event thread costs %v of CPU per second (over 5%% of a core)", extra)
	}
}

// The shim's event thread (ABI 1.1 get_event_fd): over TCP a submitted
// transfer is really in flight, and the descriptor becomes readable when it
// ends with no poll from the test, also with NIXL's progress thread off
// (the event thread's polls drive UCX); a notification wakes the target;
// an idle agent's descriptor stays quiet.
func TestEventFDInFlight(t *testing.T) {
	p := load(t)
	for _, prog := range []string{"true", "false"} {
		t.Run("progress_thread="+prog, func(t *testing.T) {
			const size = 64 << 20
			params := []plugin.Param{tcpOnly, {Key: "progress_thread", Value: prog}, {Key: "event_notif_us", Value: "50"}}
			init := newSide(t, p, uniqueName(t, "init"), size, params...)
			target := newSide(t, p, uniqueName(t, "target"), size, params...)
			peer := connect(t, init, target)
			connect(t, target, init)
			fd, ok := init.a.EventFD()
			tfd, tok := target.a.EventFD()
			if !ok || !tok {
				t.Fatalf("EventFD: %d %v, %d %v", fd, ok, tfd, tok)
			}
			if readable(t, fd, 20*time.Millisecond) {
				t.Errorf("idle: readable")
			}
			rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
			if err != nil {
				t.Fatalf("import: %v", err)
			}
			defer rr.Close()
			inFlight := 0
			for round := range 3 {
				fill(init.buf, byte(round+1))
				x, done, err := init.a.SubmitBatch(abi.Write, []plugin.Pair{{Local: init.reg, Remote: rr}},
					[]abi.BatchEntry{{Len: size, Count: 1}}, []byte(fmt.Sprint("done ", round)))
				if err != nil {
					t.Fatalf("submit: %v", err)
				}
				if !done {
					inFlight++
					if !readable(t, fd, 30*time.Second) {
						t.Fatalf("round %d: not readable within 30 s of a submit, with no poll", round)
					}
					if err := init.a.DrainEvents(); err != nil {
						t.Fatal(err)
					}
				}
				done, tel, err := x.PollRelease()
				if err != nil || !done {
					t.Fatalf("round %d: PollRelease after the wakeup: done %v, %v", round, done, err)
				}
				if tel.Bytes != size {
					t.Errorf("round %d: telemetry %d bytes, want %d", round, tel.Bytes, size)
				}
				if !bytes.Equal(init.buf, target.buf) {
					t.Fatalf("round %d: bytes differ", round)
				}
				if !readable(t, tfd, 30*time.Second) {
					t.Fatalf("round %d: the notification did not wake the target", round)
				}
				if err := target.a.DrainEvents(); err != nil {
					t.Fatal(err)
				}
				ns, err := target.a.Notifs()
				if err != nil || len(ns) != 1 || string(ns[0].Msg) != fmt.Sprint("done ", round) {
					t.Fatalf("round %d: notifications %v, %v", round, ns, err)
				}
			}
			if inFlight == 0 {
				t.Fatalf("every 64 MiB transfer over TCP completed inside submit_xfer: the wakeup was never tested")
			}
			if readable(t, fd, 20*time.Millisecond) || readable(t, tfd, 0) {
				t.Errorf("idle again: readable")
			}
		})
	}
	// The notification intervals are bounded.
	_, err := p.NewAgent(uniqueName(t, "bad"), plugin.Param{Key: "event_notif_us", Value: "0"})
	expectCode(t, "event_notif_us=0", err, abi.ErrInvalidParam)
	_, err = p.NewAgent(uniqueName(t, "bad"), plugin.Param{Key: "event_notif_us", Value: "500"}, plugin.Param{Key: "event_notif_max_us", Value: "400"})
	expectCode(t, "event_notif_max_us below event_notif_us", err, abi.ErrInvalidParam)
}
