package plugin

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// These tests use the fake plugin (make plugin-fake) for what only a real
// plugin shows: the host's bookkeeping around emulation, handle lifetimes,
// concurrency and allocations. The plugin's own behaviour is the
// conformance suite's business (host/conformance).

func openFake(tb testing.TB) *Plugin {
	tb.Helper()
	p, err := Load("fake", SearchDirs(""))
	if err != nil {
		tb.Fatalf("%v (build the fake plugin with `make plugin-fake`)", err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}

// side is an agent with mmap'd, registered buffers.
type side struct {
	a       *Agent
	bufs    [][]byte
	regions []*Region
}

var agentSeq struct {
	sync.Mutex
	n int
}

func uniqueName(role string) string {
	agentSeq.Lock()
	defer agentSeq.Unlock()
	agentSeq.n++
	return fmt.Sprintf("plugintest-%s-%d-%d", role, syscall.Getpid(), agentSeq.n)
}

func mmap(tb testing.TB, size int) []byte {
	tb.Helper()
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { syscall.Munmap(b) }) // runs after the agent's cleanup
	return b
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func newSide(tb testing.TB, p *Plugin, role string, sizes []int, params ...Param) *side {
	tb.Helper()
	s := &side{}
	var descs []abi.MemDesc
	for _, size := range sizes {
		b := mmap(tb, size)
		s.bufs = append(s.bufs, b)
		descs = append(descs, abi.MemDesc{Addr: addr(b), Len: uint64(size), MemKind: abi.DRAM})
	}
	a, err := p.NewAgent(uniqueName(role), params...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { a.Close() })
	s.a = a
	if s.regions, err = a.Register(descs); err != nil {
		tb.Fatal(err)
	}
	return s
}

// connect makes from load to's metadata and returns to's name.
func connect(tb testing.TB, from, to *side) string {
	tb.Helper()
	md, err := to.a.LocalMetadata()
	if err != nil {
		tb.Fatal(err)
	}
	name, err := from.a.LoadRemote(md)
	if err != nil {
		tb.Fatal(err)
	}
	return name
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed ^ byte(i>>8)
	}
}

func wait(tb testing.TB, x *Xfer) {
	tb.Helper()
	done, err := x.Post()
	if err == nil && !done {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err = x.Wait(ctx)
	}
	if err != nil {
		tb.Fatal(err)
	}
}

func TestFakeEmulatedListsHoldTheirRegions(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{64 << 10}, Param{"caps_off", "prepped"})
	b := newSide(t, p, "b", []int{64 << 10})
	peer := connect(t, a, b)
	if !a.a.Emulated().Has(abi.CapPrepped) {
		t.Fatalf("caps_off=prepped: emulated %v", a.a.Emulated().Names())
	}
	l, err := a.a.PrepLocal(abi.DRAM, []abi.XferDesc{{Addr: addr(a.bufs[0]) + 100, Len: 1000, Count: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if !l.Emulated() || l.Handle() != 0 {
		t.Errorf("list on an agent without prepped: emulated %v handle %d", l.Emulated(), l.Handle())
	}
	err = a.regions[0].Close()
	if !errors.Is(err, ErrNotAllowed) {
		t.Errorf("deregistering a region an emulated list uses: %v, want ErrNotAllowed", err)
	}
	blob, err := b.regions[0].Export()
	if err != nil {
		t.Fatal(err)
	}
	rr, err := a.a.ImportRegion(peer, blob)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.a.PrepRemote(peer, abi.DRAM, []abi.XferDesc{{Addr: addr(b.bufs[0]) + 5000, Len: 1000, Count: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if err := rr.Close(); !errors.Is(err, ErrNotAllowed) {
		t.Errorf("releasing a remote region an emulated list uses: %v, want ErrNotAllowed", err)
	}
	fill(a.bufs[0], 1)
	x, err := a.a.MakePreppedXfer(abi.Write, l, []int32{0}, r, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, x)
	if !bytes.Equal(b.bufs[0][5000:6000], a.bufs[0][100:1100]) {
		t.Errorf("bytes did not land")
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.regions[0].Close(); err != nil {
		t.Errorf("deregistering after the list closed: %v", err)
	}
	if err := rr.Close(); err != nil {
		t.Errorf("releasing after the list closed: %v", err)
	}
}

func TestFakeEmulatedRemoteListWithoutAddressImport(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{64 << 10}, Param{"caps_off", "prepped,remote_addr"})
	b := newSide(t, p, "b", []int{64 << 10, 64 << 10})
	peer := connect(t, a, b)
	descs := []abi.XferDesc{{Addr: addr(b.bufs[1]) + 10, Len: 100, Count: 1}}
	_, err := a.a.PrepRemote(peer, abi.DRAM, descs)
	var pe *Error
	if !errors.As(err, &pe) || pe.Code != abi.ErrNotFound || !pe.Host || !strings.Contains(pe.Message, "ImportRegion") {
		t.Fatalf("remote list with nothing imported and no remote_addr: %v", err)
	}
	for _, r := range b.regions {
		blob, err := r.Export()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.a.ImportRegion(peer, blob); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.a.PrepRemote(peer, abi.DRAM, descs); err != nil {
		t.Errorf("remote list over imported regions: %v", err)
	}
}

func TestFakeEmulatedRemoteListSplitsMergedImports(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{64 << 10}, Param{"caps_off", "prepped"})
	// b registers two adjacent halves of one mapping separately.
	buf := mmap(t, 128<<10)
	ba, err := p.NewAgent(uniqueName("b"))
	if err != nil {
		t.Fatal(err)
	}
	defer ba.Close()
	if _, err := ba.Register([]abi.MemDesc{{Addr: addr(buf), Len: 64 << 10}, {Addr: addr(buf) + 64<<10, Len: 64 << 10}}); err != nil {
		t.Fatal(err)
	}
	b := &side{a: ba}
	peer := connect(t, a, b)
	// Two touching descriptors, one on each side of the boundary: merged,
	// they cross two registrations, which the plugin refuses; the host
	// then imports them apart.
	r, err := a.a.PrepRemote(peer, abi.DRAM, []abi.XferDesc{
		{Addr: addr(buf) + 60<<10, Len: 4 << 10, Count: 1},
		{Addr: addr(buf) + 64<<10, Len: 4 << 10, Count: 1},
	})
	if err != nil {
		t.Fatalf("remote list across two registrations: %v", err)
	}
	if n := len(r.emu.owned); n != 2 {
		t.Errorf("the list imported %d ranges, want 2", n)
	}
	l, err := a.a.PrepLocal(abi.DRAM, []abi.XferDesc{{Addr: addr(a.bufs[0]), Len: 8 << 10, Count: 1}, {Addr: addr(a.bufs[0]) + 8<<10, Len: 4 << 10, Count: 1}, {Addr: addr(a.bufs[0]) + 20<<10, Len: 4 << 10, Count: 1}})
	if err != nil {
		t.Fatal(err)
	}
	fill(a.bufs[0], 3)
	x, err := a.a.MakePreppedXfer(abi.Write, l, []int32{1, 2}, r, []int32{0, 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, x)
	if !bytes.Equal(buf[60<<10:64<<10], a.bufs[0][8<<10:12<<10]) || !bytes.Equal(buf[64<<10:68<<10], a.bufs[0][20<<10:24<<10]) {
		t.Errorf("bytes did not land")
	}
	// A length mismatch is caught by the host, as a native plugin would.
	_, err = a.a.MakePreppedXfer(abi.Write, l, []int32{0}, r, []int32{0}, nil)
	if !errors.Is(err, ErrMismatch) {
		t.Errorf("8 KiB against 4 KiB: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Errorf("closing the list and its imports: %v", err)
	}
}

func TestFakeEmulatedRemoteListImportsPerPeerBuffer(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{4096}, Param{"caps_off", "prepped"})
	b := newSide(t, p, "b", []int{64 << 10, 64 << 10, 64 << 10})
	peer := connect(t, a, b)
	var descs []abi.XferDesc
	for k := range 20 { // 20 separate descriptors in each of b's 3 buffers
		for _, buf := range b.bufs {
			descs = append(descs, abi.XferDesc{Addr: addr(buf) + uint64(k)*3000, Len: 100, Count: 1})
		}
	}
	r, err := a.a.PrepRemote(peer, abi.DRAM, descs)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if n := len(r.emu.owned); n != 3 {
		t.Errorf("60 descriptors in 3 peer buffers took %d imports, want 3", n)
	}
	base := map[uint64]uint64{}
	for _, rr := range r.emu.owned {
		base[uint64(rr.h)] = rr.desc.Addr
	}
	for i, d := range r.emu.descs {
		if got := base[r.emu.handles[d.ref]] + d.off; got != descs[i].Addr {
			t.Fatalf("descriptor %d resolves to %#x, want %#x", i, got, descs[i].Addr)
		}
	}
}

func TestFakeHandlesAfterClose(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{4096})
	b := newSide(t, p, "b", []int{4096})
	peer := connect(t, a, b)
	rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 4096, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	x, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, x)
	if err := rr.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
	if !errors.Is(err, ErrClosed) {
		t.Errorf("batch with a released remote region: %v", err)
	}
	_, err = a.a.MakeBatchXfer(abi.Write, []Pair{{b.regions[0], rr}}, nil, nil)
	if !errors.Is(err, ErrInvalidParam) {
		t.Errorf("batch with another agent's region: %v", err)
	}
	if err := a.a.Close(); err != nil {
		t.Fatal(err)
	}
	for what, err := range map[string]error{
		"poll":       second(x.Poll()),
		"post":       second(x.Post()),
		"telemetry":  second(x.Telemetry()),
		"close xfer": x.Close(),
		"deregister": a.regions[0].Close(),
		"export":     second(a.regions[0].Export()),
		"metadata":   second(a.a.LocalMetadata()),
		"notifs":     second(a.a.Notifs()),
		"send":       a.a.SendNotif(peer, nil),
		"prep":       second(a.a.PrepLocal(abi.DRAM, nil)),
		"import":     second(a.a.ImportRange(peer, addr(b.bufs[0]), 1, 0, abi.DRAM)),
		"remove":     a.a.RemoveRemote(peer),
		"close":      a.a.Close(),
	} {
		if !errors.Is(err, ErrClosed) {
			t.Errorf("%s after the agent closed: %v, want ErrClosed", what, err)
		}
	}
}

func second[T any](_ T, err error) error { return err }

func TestFakeConcurrentUseAndClose(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{1 << 20})
	b := newSide(t, p, "b", []int{1 << 20})
	peer := connect(t, a, b)
	rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 1<<20, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e := []abi.BatchEntry{{LocalOffset: uint64(g) << 16, RemoteOffset: uint64(g) << 16, Len: 1 << 16, Count: 1}}
			for {
				select {
				case <-stop:
					return
				default:
				}
				x, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, e, nil)
				if errors.Is(err, ErrClosed) {
					return
				}
				if err != nil {
					t.Errorf("goroutine %d: %v", g, err)
					return
				}
				done, err := x.Post()
				for err == nil && !done {
					done, err = x.Poll()
				}
				cerr := x.Close()
				if err != nil && !errors.Is(err, ErrClosed) || cerr != nil && !errors.Is(cerr, ErrClosed) {
					t.Errorf("goroutine %d: %v / %v", g, err, cerr)
					return
				}
			}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	if err := a.a.Close(); err != nil { // while the goroutines post
		t.Errorf("closing the agent under load: %v", err)
	}
	close(stop)
	wg.Wait()
}

func TestFakeWaitHonoursContext(t *testing.T) {
	p := openFake(t)
	// A transfer far longer than any stall of a loaded machine: Wait must
	// return because of the context, not because the transfer ended.
	const delay = 30 * time.Second
	a := newSide(t, p, "a", []int{4096}, Param{"delay_us", fmt.Sprint(delay.Microseconds())})
	b := newSide(t, p, "b", []int{4096})
	peer := connect(t, a, b)
	rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 4096, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	x, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	start := time.Now()
	if err := x.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Wait: %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > delay/3 {
		t.Errorf("Wait returned %v after it began, the context was cancelled after 20ms", d)
	}
	if err := x.Close(); err != nil {
		t.Errorf("closing (cancelling) the transfer: %v", err)
	}
}

// The hot paths allocate nothing per descriptor: making a transfer costs the
// same few allocations for 10 descriptors as for 10000, and posting and
// polling allocate nothing at all.
func TestFakeHotPathAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector; run without -race")
	}
	p := openFake(t)
	for _, params := range [][]Param{nil, {{"caps_off", "prepped"}}, {{"caps_off", "strided"}}} {
		t.Run(fmt.Sprint(params), func(t *testing.T) {
			a := newSide(t, p, "a", []int{1 << 20}, params...)
			b := newSide(t, p, "b", []int{1 << 20})
			peer := connect(t, a, b)
			rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 1<<20, 0, abi.DRAM)
			if err != nil {
				t.Fatal(err)
			}
			perMake := map[int]float64{}
			for _, n := range []int{10, 10000} {
				var ld, rd []abi.XferDesc
				var idx []int32
				var entries []abi.BatchEntry
				for i := range n {
					off := uint64(i) * 64
					ld = append(ld, abi.XferDesc{Addr: addr(a.bufs[0]) + off, Len: 32, Count: 1})
					rd = append(rd, abi.XferDesc{Addr: addr(b.bufs[0]) + off, Len: 32, Count: 1})
					idx = append(idx, int32(i))
					entries = append(entries, abi.BatchEntry{LocalOffset: off, RemoteOffset: off, Len: 32, Count: 1})
				}
				l, err := a.a.PrepLocal(abi.DRAM, ld)
				if err != nil {
					t.Fatal(err)
				}
				r, err := a.a.PrepRemote(peer, abi.DRAM, rd)
				if err != nil {
					t.Fatal(err)
				}
				pairs := []Pair{{a.regions[0], rr}}
				prepped := testing.AllocsPerRun(20, func() {
					x, err := a.a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil)
					if err != nil {
						t.Fatal(err)
					}
					x.Close()
				})
				batch := testing.AllocsPerRun(20, func() {
					x, err := a.a.MakeBatchXfer(abi.Write, pairs, entries, nil)
					if err != nil {
						t.Fatal(err)
					}
					x.Close()
				})
				perMake[n] = prepped + batch
				x, err := a.a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil)
				if err != nil {
					t.Fatal(err)
				}
				wait(t, x)
				if allocs := testing.AllocsPerRun(100, func() {
					if done, err := x.Poll(); err != nil || !done {
						t.Fatal(done, err)
					}
				}); allocs != 0 {
					t.Errorf("Poll allocates %v times", allocs)
				}
				if allocs := testing.AllocsPerRun(20, func() {
					done, err := x.Post()
					for err == nil && !done {
						done, err = x.Poll()
					}
					if err != nil {
						t.Fatal(err)
					}
				}); allocs != 0 {
					t.Errorf("Post+Poll allocates %v times", allocs)
				}
				if allocs := testing.AllocsPerRun(100, func() {
					if _, err := x.Telemetry(); err != nil {
						t.Fatal(err)
					}
				}); allocs != 0 {
					t.Errorf("Telemetry allocates %v times", allocs)
				}
				x.Close()
				l.Close()
				r.Close()
			}
			if want := float64(2 * makeAllocs); perMake[10000] != perMake[10] || perMake[10] > want {
				t.Errorf("making a prepped and a batch transfer allocates %v times with 10 descriptors and %v with 10000, want at most %v", perMake[10], perMake[10000], want)
			}
		})
	}
}

// Notifs in an idle polling loop (nothing arrived) allocates nothing, and
// receiving costs a few allocations however many records arrive.
func TestFakeNotifsAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector; run without -race")
	}
	p := openFake(t)
	a := newSide(t, p, "a", []int{4096})
	b := newSide(t, p, "b", []int{4096})
	peer := connect(t, b, a) // b sends to a
	if allocs := testing.AllocsPerRun(200, func() {
		if got, err := a.a.Notifs(); err != nil || got != nil {
			t.Fatal(got, err)
		}
	}); allocs != 0 {
		t.Errorf("Notifs with nothing queued allocates %v times, want 0", allocs)
	}
	msg := []byte("kv-done:room-17")
	send := testing.AllocsPerRun(100, func() {
		if err := b.a.SendNotif(peer, msg); err != nil {
			t.Fatal(err)
		}
	})
	if got, err := a.a.Notifs(); err != nil || len(got) != 101 { // AllocsPerRun runs once more to warm up
		t.Fatalf("draining: %d notifications, %v", len(got), err)
	}
	for _, n := range []int{1, 64} {
		allocs := testing.AllocsPerRun(20, func() {
			for range n {
				if err := b.a.SendNotif(peer, msg); err != nil {
					t.Fatal(err)
				}
			}
			got, err := a.a.Notifs()
			if err != nil || len(got) != n || got[n-1].From != b.a.Name() || string(got[n-1].Msg) != string(msg) {
				t.Fatalf("%d notifications: %d, %v", n, len(got), err)
			}
		})
		// The result slice and the message block; the sender's name is
		// kept from the first call.
		if recv := allocs - float64(n)*send; recv > 2 {
			t.Errorf("receiving %d notifications in one Notifs allocates %v times, want at most 2", n, recv)
		}
	}
}

// procCounts returns this process's open file descriptors and OS threads.
func procCounts(t *testing.T) (fds, threads int) {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("no /proc/self/fd: %v", err)
	}
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatalf("no /proc/self/status: %v", err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			threads, _ = strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return len(ents), threads
}

// TestFakeAgentLifecycleLeaksNothing runs agents through their whole life
// (transfers with notifications, a peer removed with transfers in flight,
// handles left for Close to release) and checks that the process holds no
// more file descriptors or threads afterwards: each fake agent has three
// descriptors and at least two threads, so a leaked agent shows.
func TestFakeAgentLifecycleLeaksNothing(t *testing.T) {
	p := openFake(t)
	cycle := func() {
		a, err := p.NewAgent(uniqueName("leak-a"), Param{"delay_us", "1000"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := p.NewAgent(uniqueName("leak-b"), Param{"workers", "2"})
		if err != nil {
			t.Fatal(err)
		}
		abuf, bbuf := mmap(t, 8192), mmap(t, 8192)
		ar, err := a.Register([]abi.MemDesc{{Addr: addr(abuf), Len: 8192, MemKind: abi.DRAM}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Register([]abi.MemDesc{{Addr: addr(bbuf), Len: 8192, MemKind: abi.DRAM}}); err != nil {
			t.Fatal(err)
		}
		md, err := b.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		peer, err := a.LoadRemote(md)
		if err != nil {
			t.Fatal(err)
		}
		rr, err := a.ImportRange(peer, addr(bbuf), 8192, 0, abi.DRAM)
		if err != nil {
			t.Fatal(err)
		}
		x, err := a.MakeBatchXfer(abi.Write, []Pair{{ar[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, []byte("done"))
		if err != nil {
			t.Fatal(err)
		}
		wait(t, x)
		if _, err := x.Post(); err != nil { // left in flight
			t.Fatal(err)
		}
		if err := a.RemoveRemote(peer); err != nil {
			t.Fatal(err)
		}
		// x, the region and the remote region are left to the agents' Close.
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
	}
	cycle() // the first cycle may start lazily created state
	fds0, threads0 := procCounts(t)
	const cycles = 20
	for range cycles {
		cycle()
	}
	fds1, threads1 := procCounts(t)
	if fds1 > fds0 {
		t.Errorf("%d agent pairs later the process has %d file descriptors, before %d", cycles, fds1, fds0)
	}
	// Go's runtime may start a few threads of its own meanwhile; a leak
	// would be at least 4 threads per cycle.
	if threads1 > threads0+cycles {
		t.Errorf("%d agent pairs later the process has %d threads, before %d", cycles, threads1, threads0)
	}
}
