package conformance

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
	"golang.org/x/sys/unix"
)

// ABI 1.1 cases: submit_xfer with poll-release, and the event descriptor.
// Both run natively where the agent has the capability and through the
// host's emulation (submit) or its absence (event descriptor) otherwise.

// pollRelease finishes x with PollRelease, polling with short sleeps, within
// the suite's timeout.
func (f *fixture) pollRelease(what string, x *plugin.Xfer) (plugin.Telemetry, error) {
	f.t.Helper()
	deadline := time.Now().Add(f.s.cfg.Timeout)
	sleep := 10 * time.Microsecond
	for {
		done, tel, err := x.PollRelease()
		if err != nil || done {
			return tel, err
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%s: not done after %v", what, f.s.cfg.Timeout)
		}
		time.Sleep(sleep)
		sleep = min(2*sleep, time.Millisecond)
	}
}

// expectFinished checks that a transfer PollRelease ended is closed: Close
// is a no-op, every other use ErrClosed.
func expectFinished(t TB, what string, x *plugin.Xfer) {
	t.Helper()
	if err := x.Close(); err != nil {
		t.Errorf("%s: Close after PollRelease: %v, want nil (a no-op)", what, err)
	}
	_, err := x.Post()
	expectClosed(t, what+": Post after PollRelease", err)
	_, err = x.Poll()
	expectClosed(t, what+": Poll after PollRelease", err)
}

func caseSubmit(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	native := a.Caps().Has(abi.CapSubmit)
	if native == a.Emulated().Has(abi.CapSubmit) {
		t.Errorf("submit: native %v, emulated %v: exactly one must hold", native, a.Emulated().Has(abi.CapSubmit))
	}
	t.Logf("submit %s", map[bool]string{true: "native", false: "emulated (make + post, poll + telemetry + release)"}[native])
	notif := a.Caps().Has(abi.CapNotif) && f.peer.Caps().Has(abi.CapNotif)
	from := a.Name()
	for _, op := range []abi.Op{abi.Write, abi.Read} {
		for _, path := range []string{"prepped", "batch"} {
			for _, strided := range []bool{false, true} {
				what := fmt.Sprintf("submitted %s %s (strided %v)", path, op, strided)
				runs := f.genRuns(8, op, strided)
				var msg []byte
				if notif {
					msg = []byte(what)
				}
				var x *plugin.Xfer
				var err error
				if path == "prepped" {
					p := f.prepRuns(runs)
					x, _, err = a.SubmitPrepped(op, p.local, p.li, p.remote, p.ri, msg)
				} else {
					pairs, entries := f.batchOf(runs)
					x, _, err = a.SubmitBatch(op, pairs, entries, msg)
				}
				if err != nil {
					t.Fatalf("%s: %v", what, err)
				}
				t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
				tel, err := f.pollRelease(what, x)
				if err != nil {
					t.Fatalf("%s: PollRelease: %v", what, err)
				}
				f.apply(op, runs)
				f.verify(what)
				if tel.Descs != uint64(len(runs)) {
					t.Errorf("%s: telemetry counts %d descriptors, want %d", what, tel.Descs, len(runs))
				}
				if a.Caps().Has(abi.CapTelemetry) && tel.Bytes != totalBytes(runs) {
					t.Errorf("%s: telemetry says %d bytes, want %d", what, tel.Bytes, totalBytes(runs))
				}
				expectFinished(t, what, x)
				if notif {
					batches, err := f.peer.Notifs(1, s.cfg.Timeout)
					if err != nil {
						t.Fatalf("%s: get_notifs: %v", what, err)
					}
					expectNotifs(t, what, batches, from, [][]byte{msg})
				}
				f.refillSource(op)
			}
		}
	}
	// All or nothing: a refused submit leaves no transfer and moves nothing.
	runs := f.genRuns(2, abi.Write, false)
	p := f.prepRuns(runs)
	x, done, err := a.SubmitPrepped(abi.Write, p.local, []int32{p.li[0], int32(1 << 20)}, p.remote, p.ri, nil)
	expectCode(t, "submit with an index out of range", err, abi.ErrInvalidParam)
	if x != nil || done {
		t.Errorf("a refused submit returned a transfer (%v, done %v)", x, done)
	}
	pairs, entries := f.batchOf(runs)
	entries[0].RemoteOffset = regionSize
	x, done, err = a.SubmitBatch(abi.Write, pairs, entries, nil)
	if err == nil || x != nil || done {
		t.Errorf("submit of an entry beyond its region: %v, %v, %v: want an error and no transfer", x, done, err)
	}
	f.verify("after refused submits")
	// PollRelease on a transfer made and posted the 1.0 way works too.
	runs = f.genRuns(4, abi.Write, false)
	x = f.makeBatch(abi.Write, runs, nil)
	if _, err := x.Post(); err != nil {
		t.Fatalf("post: %v", err)
	}
	if _, err := f.pollRelease("made, posted, poll-released", x); err != nil {
		t.Fatalf("made, posted, poll-released: %v", err)
	}
	f.apply(abi.Write, runs)
	f.verify("made, posted, poll-released")
	expectFinished(t, "made, posted, poll-released", x)
}

// readable reports whether fd becomes readable within d (poll(2), which
// does not reset it).
func readable(t TB, fd int, d time.Duration) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(d)
	for {
		ms := max(int(time.Until(deadline)/time.Millisecond), 0)
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("poll(2) on the event descriptor: %v", err)
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}

func caseEventFD(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	if a.Emulated().Has(abi.CapEventFD) {
		t.Errorf("the event descriptor is reported emulated (%v): it cannot be", a.Emulated().Names())
	}
	fd, ok := a.EventFD()
	if !a.Caps().Has(abi.CapEventFD) {
		// No descriptor: the host says so and DrainEvents does nothing.
		if ok || fd != -1 {
			t.Errorf("EventFD without the capability: %d, %v; want -1, false", fd, ok)
		}
		if err := a.DrainEvents(); err != nil {
			t.Errorf("DrainEvents without a descriptor: %v", err)
		}
		t.Logf("agent has no event descriptor (caps %v): the host polls", a.Caps().Names())
		return
	}
	if !ok || fd < 0 {
		t.Fatalf("EventFD on an agent with event_fd: %d, %v", fd, ok)
	}
	if fd2, _ := a.EventFD(); fd2 != fd {
		t.Errorf("EventFD again: %d, want the same descriptor %d", fd2, fd)
	}
	if err := a.DrainEvents(); err != nil {
		t.Fatalf("DrainEvents: %v", err)
	}
	if readable(t, fd, settle) {
		t.Errorf("idle agent: the descriptor is readable")
	}
	// A transfer ends: readable, with no poll in between (the plugin
	// progresses on its own once the descriptor was asked for).
	wakeups := 0
	for _, path := range []string{"prepped", "batch"} {
		what := fmt.Sprintf("%s write", path)
		runs := f.genRuns(8, abi.Write, false)
		var x *plugin.Xfer
		var done bool
		var err error
		if path == "prepped" {
			p := f.prepRuns(runs)
			x, done, err = a.SubmitPrepped(abi.Write, p.local, p.li, p.remote, p.ri, nil)
		} else {
			pairs, entries := f.batchOf(runs)
			x, done, err = a.SubmitBatch(abi.Write, pairs, entries, nil)
		}
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
		if done {
			// Done within the call that posted it: the plugin may skip the
			// wakeup (kvplugin.h); the host knows already.
			t.Logf("%s: done within submit_xfer; no wakeup to check for it", what)
			if err := a.DrainEvents(); err != nil {
				t.Fatalf("%s: DrainEvents: %v", what, err)
			}
			if done, _, err := x.PollRelease(); err != nil || !done {
				t.Fatalf("%s: PollRelease after a submit that said done: done %v, err %v", what, done, err)
			}
			f.apply(abi.Write, runs)
			f.verify(what)
			f.refillSource(abi.Write)
			continue
		}
		wakeups++
		if !readable(t, fd, s.cfg.Timeout) {
			t.Fatalf("%s: the descriptor did not become readable within %v, with no poll", what, s.cfg.Timeout)
		}
		if err := a.DrainEvents(); err != nil {
			t.Fatalf("%s: DrainEvents: %v", what, err)
		}
		if readable(t, fd, 0) {
			t.Errorf("%s: readable right after DrainEvents", what)
		}
		done, _, err = x.PollRelease()
		if err != nil || !done {
			t.Fatalf("%s: after the wakeup, PollRelease says done %v, err %v", what, done, err)
		}
		f.apply(abi.Write, runs)
		f.verify(what)
		f.refillSource(abi.Write)
	}
	if wakeups == 0 && s.p.Info().HasParam("delay_us") {
		// Every transfer was done within its submit (the fake moves one
		// in the call): delay one, so that it ends after the call.
		wakeups += delayedWakeup(t, s)
	}
	if wakeups == 0 {
		t.Logf("every transfer was done within submit_xfer (NIXL over UCX cma copies in the post): no transfer wakeup was checked")
	}
	// A notification arrives: readable.
	if a.Caps().Has(abi.CapNotif) && f.peer.Caps().Has(abi.CapNotif) {
		if err := f.peer.SendNotif(a.Name(), []byte("wake up")); err != nil {
			t.Fatalf("send_notif from the peer: %v", err)
		}
		if !readable(t, fd, s.cfg.Timeout) {
			t.Fatalf("a notification did not make the descriptor readable within %v", s.cfg.Timeout)
		}
		if err := a.DrainEvents(); err != nil {
			t.Fatalf("DrainEvents: %v", err)
		}
		ns, err := a.Notifs()
		if err != nil {
			t.Fatalf("get_notifs after the wakeup: %v", err)
		}
		expectNotifs(t, "notification after the wakeup", [][]plugin.Notif{ns}, f.peer.Name(), [][]byte{[]byte("wake up")})
	} else {
		t.Logf("no notifications on these agents: the notification wakeup is not checked")
	}
	if readable(t, fd, settle) {
		t.Errorf("idle again after draining: the descriptor is readable")
	}
}

// delayedWakeup submits a write delayed by delay_us on an agent whose
// descriptor was asked for: it must not be done within the call, and must
// make the descriptor readable with no poll when it ends. Returns the
// wakeups checked (1).
func delayedWakeup(t TB, s *Suite) int {
	f := s.newFixture(t, plugin.Param{Key: "delay_us", Value: "2000"})
	a := f.local.Agent
	fd, ok := a.EventFD()
	if !ok || fd < 0 {
		t.Fatalf("EventFD on an agent with delay_us: %d, %v", fd, ok)
	}
	const what = "write delayed by 2ms"
	runs := f.genRuns(8, abi.Write, false)
	p := f.prepRuns(runs)
	x, done, err := a.SubmitPrepped(abi.Write, p.local, p.li, p.remote, p.ri, nil)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
	if done {
		t.Errorf("%s: done within submit_xfer", what)
	} else if !readable(t, fd, s.cfg.Timeout) {
		t.Fatalf("%s: the descriptor did not become readable within %v, with no poll", what, s.cfg.Timeout)
	}
	if err := a.DrainEvents(); err != nil {
		t.Fatalf("%s: DrainEvents: %v", what, err)
	}
	if readable(t, fd, 0) {
		t.Errorf("%s: readable right after DrainEvents", what)
	}
	if done, _, err = x.PollRelease(); err != nil || !done {
		t.Fatalf("%s: after the wakeup, PollRelease says done %v, err %v", what, done, err)
	}
	f.apply(abi.Write, runs)
	f.verify(what)
	t.Logf("%s: not done within submit_xfer; the descriptor woke with no poll", what)
	return 1
}
