package plugin

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"golang.org/x/sys/unix"
)

// ABI 1.1 on the fake plugin: submit, poll-release and the event
// descriptor, natively and emulated (caps_off=submit, and the fake built
// as an ABI 1.0 plugin).

// readable reports whether fd becomes readable within d.
func readable(t testing.TB, fd int, d time.Duration) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(d)
	for {
		ms := int(time.Until(deadline) / time.Millisecond)
		if ms < 0 {
			ms = 0
		}
		n, err := unix.Poll(fds, ms)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}

// finish polls x with PollRelease until it ends (10 s at most).
func finish(t testing.TB, x *Xfer) (bool, Telemetry, error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		done, tel, err := x.PollRelease()
		if done || err != nil {
			return done, tel, err
		}
		time.Sleep(20 * time.Microsecond)
	}
	t.Fatal("transfer did not end within 10 s")
	return false, Telemetry{}, nil
}

// checkFinished checks that a transfer PollRelease ended is closed: Close
// is a no-op, everything else ErrClosed.
func checkFinished(t *testing.T, x *Xfer) {
	t.Helper()
	if err := x.Close(); err != nil {
		t.Errorf("Close after PollRelease: %v, want nil", err)
	}
	if err := x.Close(); err != nil {
		t.Errorf("second Close after PollRelease: %v, want nil", err)
	}
	if _, err := x.Poll(); !errors.Is(err, ErrClosed) {
		t.Errorf("Poll after PollRelease: %v, want ErrClosed", err)
	}
	if _, _, err := x.PollRelease(); !errors.Is(err, ErrClosed) {
		t.Errorf("PollRelease after PollRelease: %v, want ErrClosed", err)
	}
	if _, err := x.Post(); !errors.Is(err, ErrClosed) {
		t.Errorf("Post after PollRelease: %v, want ErrClosed", err)
	}
}

// submitRoundTrip submits a prepped and a batch write from a to b and
// finishes both with PollRelease, checking bytes and telemetry.
func submitRoundTrip(t *testing.T, p *Plugin, params ...Param) {
	a := newSide(t, p, "a", []int{64 << 10}, params...)
	b := newSide(t, p, "b", []int{64 << 10})
	peer := connect(t, a, b)
	l, err := a.a.PrepLocal(abi.DRAM, []abi.XferDesc{{Addr: addr(a.bufs[0]), Len: 4096, Count: 1}, {Addr: addr(a.bufs[0]) + 8192, Len: 100, Stride: 200, Count: 3}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.a.PrepRemote(peer, abi.DRAM, []abi.XferDesc{{Addr: addr(b.bufs[0]) + 4096, Len: 4096, Count: 1}, {Addr: addr(b.bufs[0]) + 16384, Len: 100, Stride: 300, Count: 3}})
	if err != nil {
		t.Fatal(err)
	}
	fill(a.bufs[0], 3)
	x, _, err := a.a.SubmitPrepped(abi.Write, l, []int32{0, 1}, r, []int32{0, 1}, []byte("prepped"))
	if err != nil {
		t.Fatal(err)
	}
	done, tel, err := finish(t, x)
	if err != nil || !done {
		t.Fatalf("prepped: done %v err %v", done, err)
	}
	if !bytes.Equal(b.bufs[0][4096:8192], a.bufs[0][:4096]) {
		t.Error("prepped: bytes did not land")
	}
	for k := range 3 {
		if !bytes.Equal(b.bufs[0][16384+300*k:16384+300*k+100], a.bufs[0][8192+200*k:8192+200*k+100]) {
			t.Errorf("prepped: strided block %d did not land", k)
		}
	}
	if tel.Descs != 2 {
		t.Errorf("prepped: telemetry descs %d, want 2", tel.Descs)
	}
	if a.a.Caps().Has(abi.CapTelemetry) && (tel.Bytes != 4096+300 || tel.Start.IsZero()) {
		t.Errorf("prepped: telemetry %+v, want 4396 bytes and a start", tel)
	}
	checkFinished(t, x)
	if err := l.Close(); err != nil {
		t.Errorf("closing the local list after PollRelease: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Errorf("closing the remote list after PollRelease: %v", err)
	}

	rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 64<<10, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	fill(a.bufs[0], 9)
	x, _, err = a.a.SubmitBatch(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{LocalOffset: 100, RemoteOffset: 30000, Len: 1000, Count: 1}}, []byte("batch"))
	if err != nil {
		t.Fatal(err)
	}
	done, tel, err = finish(t, x)
	if err != nil || !done {
		t.Fatalf("batch: done %v err %v", done, err)
	}
	if !bytes.Equal(b.bufs[0][30000:31000], a.bufs[0][100:1100]) {
		t.Error("batch: bytes did not land")
	}
	if tel.Descs != 1 || (a.a.Caps().Has(abi.CapTelemetry) && tel.Bytes != 1000) {
		t.Errorf("batch: telemetry %+v", tel)
	}
	checkFinished(t, x)
	// The notifications arrived, in order.
	var got []string
	deadline := time.Now().Add(10 * time.Second)
	for len(got) < 2 && time.Now().Before(deadline) {
		ns, err := b.a.Notifs()
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range ns {
			got = append(got, string(n.Msg))
		}
		time.Sleep(time.Millisecond)
	}
	if strings.Join(got, ",") != "prepped,batch" {
		t.Errorf("notifications %q, want prepped, batch", got)
	}
	if err := rr.Close(); err != nil {
		t.Errorf("releasing the remote region after PollRelease: %v", err)
	}
}

func TestFakeSubmitPollRelease(t *testing.T) {
	p := openFake(t)
	for _, tc := range []struct {
		caps_off string
		native   bool
	}{
		{"", true},
		{"submit", false},
		{"prepped", true},         // emulated lists, native submit (batch form)
		{"batch", true},           // emulated batch: lists + submitted prepped transfer
		{"submit,strided", false}, // expansion + emulated submit
		{"telemetry", true},       // no telemetry: Descs only
	} {
		t.Run("caps_off="+tc.caps_off, func(t *testing.T) {
			var params []Param
			if tc.caps_off != "" {
				params = []Param{{"caps_off", tc.caps_off}}
			}
			probe, err := p.NewAgent(uniqueName("probe"), params...)
			if err != nil {
				t.Fatal(err)
			}
			if got := probe.Caps().Has(abi.CapSubmit); got != tc.native {
				t.Errorf("native submit %v, want %v", got, tc.native)
			}
			if got := probe.Emulated().Has(abi.CapSubmit); got == tc.native {
				t.Errorf("emulated %v, want submit emulated %v", probe.Emulated().Names(), !tc.native)
			}
			probe.Close()
			submitRoundTrip(t, p, params...)
		})
	}
}

// A failed transfer ends PollRelease with its failure and is released.
func TestFakePollReleaseFailure(t *testing.T) {
	p := openFake(t)
	for _, off := range []string{"", "submit"} {
		t.Run("caps_off="+off, func(t *testing.T) {
			params := []Param{{"fail_rate", "1"}}
			if off != "" {
				params = append(params, Param{"caps_off", off})
			}
			a := newSide(t, p, "a", []int{64 << 10}, params...)
			b := newSide(t, p, "b", []int{64 << 10})
			peer := connect(t, a, b)
			rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 64<<10, 0, abi.DRAM)
			if err != nil {
				t.Fatal(err)
			}
			x, _, err := a.a.SubmitBatch(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 1000, Count: 1}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			done, _, err := finish(t, x)
			if done || !errors.Is(err, ErrBackend) || !strings.Contains(err.Error(), "injected failure") {
				t.Fatalf("done %v err %v, want the injected failure", done, err)
			}
			checkFinished(t, x)
			if err := rr.Close(); err != nil {
				t.Errorf("releasing the remote region: %v", err)
			}
		})
	}
}

// Submit is all or nothing: a refused transfer leaves nothing behind.
func TestFakeSubmitRefusedLeavesNothing(t *testing.T) {
	p := openFake(t)
	for _, off := range []string{"", "submit"} {
		t.Run("caps_off="+off, func(t *testing.T) {
			var params []Param
			if off != "" {
				params = []Param{{"caps_off", off}}
			}
			a := newSide(t, p, "a", []int{64 << 10}, params...)
			b := newSide(t, p, "b", []int{64 << 10})
			peer := connect(t, a, b)
			rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 64<<10, 0, abi.DRAM)
			if err != nil {
				t.Fatal(err)
			}
			x, done, err := a.a.SubmitBatch(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{RemoteOffset: 64 << 10, Len: 8, Count: 1}}, nil)
			if x != nil || done || !errors.Is(err, ErrInvalidParam) {
				t.Fatalf("out-of-region submit: %v %v %v, want ErrInvalidParam", x, done, err)
			}
			// Nothing uses the region or the remote region any more.
			if err := rr.Close(); err != nil {
				t.Errorf("releasing the remote region: %v", err)
			}
			if err := a.regions[0].Close(); err != nil {
				t.Errorf("deregistering: %v", err)
			}
		})
	}
}

func TestFakeEventFD(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "a", []int{1 << 20})
	b := newSide(t, p, "b", []int{1 << 20})
	peer := connect(t, a, b)
	connect(t, b, a)
	fd, ok := a.a.EventFD()
	if !ok || fd < 0 {
		t.Fatalf("EventFD = %d, %v on a fake agent", fd, ok)
	}
	if fd2, _ := a.a.EventFD(); fd2 != fd {
		t.Errorf("EventFD again = %d, want %d", fd2, fd)
	}
	bfd, ok := b.a.EventFD()
	if !ok || bfd == fd {
		t.Fatalf("b's EventFD = %d, %v (a's is %d)", bfd, ok, fd)
	}
	if readable(t, fd, 20*time.Millisecond) {
		t.Error("idle: readable")
	}
	rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 1<<20, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	// Once the descriptor was asked for, the fake moves a transfer of one
	// slice in the call that submits it: done when the submit returns,
	// and no wakeup for it (kvp_get_event_fd_args: the caller knows).
	for i := range 20 {
		x, done, err := a.a.SubmitBatch(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 256 << 10, Count: 1}}, []byte(fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		if !done {
			t.Fatalf("transfer %d: not done when submit_xfer returned", i)
		}
		if readable(t, fd, 0) {
			t.Errorf("transfer %d: readable after a submit that said done", i)
		}
		done, _, err = x.PollRelease()
		if err != nil || !done {
			t.Fatalf("transfer %d after the submit said done: done %v err %v", i, done, err)
		}
		// The notification wakes b.
		if !readable(t, bfd, 10*time.Second) {
			t.Fatalf("notification %d: b not readable", i)
		}
		if err := b.a.DrainEvents(); err != nil {
			t.Fatal(err)
		}
		ns, err := b.a.Notifs()
		if err != nil || len(ns) != 1 || string(ns[0].Msg) != fmt.Sprint(i) {
			t.Fatalf("notification %d after the wakeup: %v %v", i, ns, err)
		}
	}
	if err := a.a.DrainEvents(); err != nil {
		t.Errorf("DrainEvents with nothing pending: %v", err)
	}
	if readable(t, fd, 20*time.Millisecond) {
		t.Error("idle after the transfers: readable")
	}
	if err := rr.Close(); err != nil {
		t.Fatal(err)
	}
	// With delay_us a worker ends the transfer after the submit returned:
	// completed without a single poll, the descriptor is enough.
	c := newSide(t, p, "c", []int{1 << 20}, Param{"delay_us", "500"})
	cpeer := connect(t, c, b)
	connect(t, b, c)
	cfd, ok := c.a.EventFD()
	if !ok || cfd < 0 {
		t.Fatalf("c's EventFD = %d, %v", cfd, ok)
	}
	crr, err := c.a.ImportRange(cpeer, addr(b.bufs[0]), 1<<20, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		x, done, err := c.a.SubmitBatch(abi.Write, []Pair{{c.regions[0], crr}}, []abi.BatchEntry{{Len: 256 << 10, Count: 1}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			t.Fatalf("delayed transfer %d: done when submit_xfer returned", i)
		}
		if !readable(t, cfd, 10*time.Second) {
			t.Fatalf("delayed transfer %d: not readable within 10 s without polls", i)
		}
		if err := c.a.DrainEvents(); err != nil {
			t.Fatal(err)
		}
		done, _, err = x.PollRelease()
		if err != nil || !done {
			t.Fatalf("delayed transfer %d after the wakeup: done %v err %v", i, done, err)
		}
		if readable(t, cfd, 0) {
			t.Errorf("delayed transfer %d: readable after DrainEvents", i)
		}
	}
	if err := crr.Close(); err != nil {
		t.Fatal(err)
	}
	// The plugin closes the descriptor with the agent; DrainEvents then
	// reports the closed agent rather than touching the descriptor.
	if err := a.a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.a.DrainEvents(); !errors.Is(err, ErrClosed) {
		t.Errorf("DrainEvents after Close: %v, want ErrClosed", err)
	}
}

func TestFakeEventFDSwitchedOff(t *testing.T) {
	p := openFake(t)
	a, err := p.NewAgent(uniqueName("a"), Param{"caps_off", "event_fd"})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if fd, ok := a.EventFD(); ok || fd != -1 {
		t.Errorf("EventFD with caps_off=event_fd: %d, %v", fd, ok)
	}
	if err := a.DrainEvents(); err != nil {
		t.Errorf("DrainEvents without a descriptor: %v", err)
	}
	if a.Emulated().Has(abi.CapEventFD) {
		t.Errorf("the event descriptor is reported emulated: %v", a.Emulated().Names())
	}
}

// PollRelease of a finished transfer allocates nothing, natively and
// emulated.
func TestFakePollReleaseAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector; run without -race")
	}
	p := openFake(t)
	for _, off := range []string{"", "submit", "batch"} {
		t.Run("caps_off="+off, func(t *testing.T) {
			var params []Param
			if off != "" {
				params = []Param{{"caps_off", off}}
			}
			a := newSide(t, p, "a", []int{1 << 20}, params...)
			b := newSide(t, p, "b", []int{1 << 20})
			peer := connect(t, a, b)
			rr, err := a.a.ImportRange(peer, addr(b.bufs[0]), 1<<20, 0, abi.DRAM)
			if err != nil {
				t.Fatal(err)
			}
			pairs := []Pair{{a.regions[0], rr}}
			entries := []abi.BatchEntry{{Len: 64, Count: 1}}
			const runs = 50
			xs := make([]*Xfer, 0, runs+1)
			for range runs + 1 {
				x, _, err := a.a.SubmitBatch(abi.Write, pairs, entries, nil)
				if err != nil {
					t.Fatal(err)
				}
				for { // until done, without releasing
					done, err := x.Poll()
					if err != nil {
						t.Fatal(err)
					}
					if done {
						break
					}
				}
				xs = append(xs, x)
			}
			i := 0
			if allocs := testing.AllocsPerRun(runs, func() {
				done, _, err := xs[i].PollRelease()
				i++
				if err != nil || !done {
					t.Fatal(done, err)
				}
			}); allocs != 0 {
				t.Errorf("PollRelease allocates %v times", allocs)
			}
			if off != "batch" {
				if allocs := testing.AllocsPerRun(20, func() {
					x, _, err := a.a.SubmitBatch(abi.Write, pairs, entries, nil)
					if err != nil {
						t.Fatal(err)
					}
					if _, _, err := finish(t, x); err != nil {
						t.Fatal(err)
					}
				}); allocs > makeAllocs {
					t.Errorf("SubmitBatch + PollRelease allocate %v times, want at most %d", allocs, makeAllocs)
				}
			}
		})
	}
}

// buildFakeABI10 compiles the fake plugin as an ABI 1.0 plugin
// (KVP_FAKE_ABI_MINOR=0) into dir.
func buildFakeABI10(t *testing.T, dir string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatalf("gcc is needed to build the ABI 1.0 fake plugin: %v", err)
	}
	cwd, _ := os.Getwd()
	root := moduleRoot(cwd)
	if root == "" {
		t.Fatalf("no kvhost module above %s", cwd)
	}
	out := filepath.Join(dir, FileName("fakeabi10"))
	args := []string{"-std=c11", "-O1", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
		"-DKVP_FAKE_ABI_MINOR=0", "-I" + filepath.Join(root, "abi"), "-I" + filepath.Join(root, "plugins", "common"),
		"-o", out, filepath.Join(root, "plugins", "fake", "fake.c"), filepath.Join(root, "plugins", "common", "kvp_util.c")}
	if msg, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", strings.Join(args, " "), err, msg)
	}
	return out
}

// An ABI 1.0 plugin (the fake built with KVP_FAKE_ABI_MINOR=0: a 1.0
// table, no 1.1 capabilities, poll ignoring the 1.1 fields) loads and
// works: the host emulates submit and poll-release and reports no event
// descriptor.
func TestABI10PluginIsEmulated(t *testing.T) {
	path := buildFakeABI10(t, t.TempDir())
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if info := p.Info(); info.ABIMajor != 1 || info.ABIMinor != 0 || info.Caps&(abi.CapSubmit|abi.CapEventFD) != 0 {
		t.Fatalf("ABI 1.0 fake: ABI %d.%d caps %v", info.ABIMajor, info.ABIMinor, info.Caps.Names())
	}
	if p.api.SubmitXfer != 0 || p.api.GetEventFD != 0 {
		t.Errorf("the 1.0 table's missing functions are not 0: %#x %#x", p.api.SubmitXfer, p.api.GetEventFD)
	}
	probe, err := p.NewAgent(uniqueName("probe"))
	if err != nil {
		t.Fatal(err)
	}
	if !probe.Emulated().Has(abi.CapSubmit) || probe.Caps().Has(abi.CapSubmit) {
		t.Errorf("caps %v emulated %v: want submit emulated", probe.Caps().Names(), probe.Emulated().Names())
	}
	if fd, ok := probe.EventFD(); ok || fd != -1 {
		t.Errorf("EventFD on a 1.0 plugin: %d %v", fd, ok)
	}
	if err := probe.DrainEvents(); err != nil {
		t.Errorf("DrainEvents on a 1.0 plugin: %v", err)
	}
	probe.Close()
	submitRoundTrip(t, p)
}
