package conformance

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

func describeAgent(t TB, a *plugin.Agent) {
	if e := a.Emulated(); e != 0 {
		t.Logf("agent caps %v; the host emulates %v", a.Caps().Names(), e.Names())
	}
}

func casePrepped(op abi.Op) func(TB, *Suite) {
	return func(t TB, s *Suite) {
		f := s.newFixture(t)
		describeAgent(t, f.local.Agent)
		runs := f.genRuns(48, op, false)
		x := f.makePrepped(op, runs, nil)
		f.run("prepped "+op.String(), x)
		f.apply(op, runs)
		f.verify("prepped " + op.String())
		f.refillSource(op)
		f.run("prepped "+op.String()+" posted again", x)
		f.apply(op, runs)
		f.verify("prepped " + op.String() + " posted again")
	}
}

func caseBatch(op abi.Op) func(TB, *Suite) {
	return func(t TB, s *Suite) {
		f := s.newFixture(t)
		describeAgent(t, f.local.Agent)
		runs := f.genRuns(48, op, false)
		x := f.makeBatch(op, runs, nil)
		f.run("batch "+op.String(), x)
		f.apply(op, runs)
		f.verify("batch " + op.String())
		f.refillSource(op)
		f.run("batch "+op.String()+" posted again", x)
		f.apply(op, runs)
		f.verify("batch " + op.String() + " posted again")
	}
}

func caseStrided(t TB, s *Suite) {
	f := s.newFixture(t)
	if !f.local.Agent.Caps().Has(abi.CapStrided) {
		t.Logf("agent lacks native strides: the host expands strided descriptors")
	}
	for _, op := range []abi.Op{abi.Write, abi.Read} {
		runs := f.genRuns(12, op, true)
		f.run("strided prepped "+op.String(), f.makePrepped(op, runs, nil))
		f.apply(op, runs)
		f.verify("strided prepped " + op.String())
		f.refillSource(op)
		runs = f.genRuns(12, op, true)
		f.run("strided batch "+op.String(), f.makeBatch(op, runs, nil))
		f.apply(op, runs)
		f.verify("strided batch " + op.String())
		f.refillSource(op)
	}
	// Paired descriptors must agree in length and count (strides may differ).
	a, loc, rem := f.local.Agent, f.local.Registered[0].Addr(), f.rinfo[0]
	l, err := a.PrepLocal(abi.DRAM, []abi.XferDesc{{Addr: loc, Len: 64, Stride: 128, Count: 2}, {Addr: loc + 4096, Len: 64, Stride: 128, Count: 3}, {Addr: loc + 8192, Len: 32, Stride: 128, Count: 2}})
	if err != nil {
		t.Fatalf("prep_dlist (local, strided): %v", err)
	}
	defer closeQuietly(t, "list", l.Close)
	r, err := a.PrepRemote(f.peerName, abi.DRAM, []abi.XferDesc{{Addr: rem.Addr, Len: 64, Stride: 256, Count: 2, DevID: rem.DevID}})
	if err != nil {
		t.Fatalf("prep_dlist (remote, strided): %v", err)
	}
	defer closeQuietly(t, "list", r.Close)
	ok, err := a.MakePreppedXfer(abi.Write, l, []int32{0}, r, []int32{0}, nil)
	if err != nil {
		t.Errorf("strides that differ: %v", err)
	} else {
		f.run("strides that differ", ok)
		for k := uint64(0); k < 2; k++ {
			copy(f.rmodel[0][k*256:k*256+64], f.lmodel[0][k*128:k*128+64])
		}
		ok.Close()
	}
	_, err = a.MakePreppedXfer(abi.Write, l, []int32{1}, r, []int32{0}, nil)
	expectCode(t, "pairing 3 blocks with 2", err, abi.ErrMismatch)
	_, err = a.MakePreppedXfer(abi.Write, l, []int32{2}, r, []int32{0}, nil)
	expectCode(t, "pairing 32-byte blocks with 64-byte blocks", err, abi.ErrMismatch)
	f.verify("after refused strided transfers")
}

// expectXferFails checks that a transfer is refused with code, when it is
// made or at the latest when it runs, and that no byte moved.
func expectXferFails(t TB, f *fixture, what string, code abi.Status, make func() (*plugin.Xfer, error)) {
	t.Helper()
	x, err := make()
	if err == nil {
		err = f.post(x)
		x.Close()
	}
	expectCode(t, what, err, code)
	f.verify("after " + what)
}

func caseXferErrors(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	runs := f.genRuns(4, abi.Write, false)
	p := f.prepRuns(runs)
	nl, nr := int32(p.local.Len()), int32(p.remote.Len())
	for _, tc := range []struct {
		what   string
		li, ri []int32
		code   abi.Status
	}{
		{"local index past the list", []int32{p.li[0], nl}, []int32{p.ri[0], p.ri[1]}, abi.ErrInvalidParam},
		{"remote index past the list", []int32{p.li[0], p.li[1]}, []int32{p.ri[0], nr}, abi.ErrInvalidParam},
		{"negative local index", []int32{-1}, []int32{p.ri[0]}, abi.ErrInvalidParam},
		{"negative remote index", []int32{p.li[0]}, []int32{-7}, abi.ErrInvalidParam},
		{"more local than remote indices", []int32{p.li[0], p.li[1]}, []int32{p.ri[0]}, abi.ErrInvalidParam},
	} {
		expectXferFails(t, f, "prepped transfer with a "+tc.what, tc.code, func() (*plugin.Xfer, error) {
			return a.MakePreppedXfer(abi.Write, p.local, tc.li, p.remote, tc.ri, nil)
		})
	}
	// A list of another kind of side is refused by the host.
	_, err := a.MakePreppedXfer(abi.Write, p.remote, p.ri, p.local, p.li, nil)
	expectCode(t, "prepped transfer with the lists swapped", err, abi.ErrInvalidParam)

	pairs, entries := f.batchOf(runs)
	for _, tc := range []struct {
		what   string
		mutate func(e *abi.BatchEntry)
		code   abi.Status
	}{
		{"pair index past the pairs", func(e *abi.BatchEntry) { e.Pair = uint32(len(pairs)) }, abi.ErrInvalidParam},
		{"local offset past its region", func(e *abi.BatchEntry) { e.LocalOffset = regionSize - e.Len + 1 }, abi.ErrInvalidParam},
		{"remote offset past its region", func(e *abi.BatchEntry) { e.RemoteOffset = regionSize }, abi.ErrInvalidParam},
		{"strided run past its region", func(e *abi.BatchEntry) {
			e.Count, e.LocalStride, e.RemoteStride, e.LocalOffset = 3, regionSize/2, e.Len, 0
		}, abi.ErrInvalidParam},
		{"0-byte entry", func(e *abi.BatchEntry) { e.Len = 0 }, abi.ErrInvalidParam},
		{"entry of 0 blocks", func(e *abi.BatchEntry) { e.Count = 0 }, abi.ErrInvalidParam},
	} {
		bad := append([]abi.BatchEntry(nil), entries...)
		tc.mutate(&bad[len(bad)-1])
		expectXferFails(t, f, "batch transfer with a "+tc.what, tc.code, func() (*plugin.Xfer, error) {
			return a.MakeBatchXfer(abi.Write, pairs, bad, nil)
		})
	}
	// One transfer reaches one peer: regions of two peers are a mismatch.
	second := s.newPeer(t, []int{4096})
	md, err := second.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	secondName, err := a.LoadRemote(md)
	if err != nil {
		t.Fatalf("loading a second peer: %v", err)
	}
	ri := second.Regions()[0]
	var rr2 *plugin.RemoteRegion
	if a.Caps().Has(abi.CapRemoteBlob) && ri.Blob != nil {
		rr2, err = a.ImportRegion(secondName, ri.Blob)
	} else {
		rr2, err = a.ImportRange(secondName, ri.Addr, ri.Len, ri.DevID, ri.Kind)
	}
	if err != nil {
		t.Fatalf("importing a region of a second peer: %v", err)
	}
	twoPeers := []plugin.Pair{pairs[0], {Local: pairs[0].Local, Remote: rr2}}
	expectXferFails(t, f, "batch transfer over regions of two peers", abi.ErrMismatch, func() (*plugin.Xfer, error) {
		return a.MakeBatchXfer(abi.Write, twoPeers, []abi.BatchEntry{entries[0], {Pair: 1, Len: 8, Count: 1}}, nil)
	})
	if err := rr2.Close(); err != nil {
		t.Errorf("remote_region_release: %v", err)
	}
	// The good transfers still work after all that.
	f.run("prepped write after refused transfers", mustXfer(t)(a.MakePreppedXfer(abi.Write, p.local, p.li, p.remote, p.ri, nil)))
	f.apply(abi.Write, runs)
	f.verify("prepped write after refused transfers")
}

func mustXfer(t TB) func(*plugin.Xfer, error) *plugin.Xfer {
	return func(x *plugin.Xfer, err error) *plugin.Xfer {
		t.Helper()
		if err != nil {
			t.Fatalf("making a transfer: %v", err)
		}
		t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
		return x
	}
}

func casePollProgress(t TB, s *Suite) {
	if !s.p.Info().HasParam("delay_us") {
		t.Logf("plugin has no delay_us parameter: IN_PROG, REPOST_ACTIVE and cancellation of an active transfer cannot be forced")
		f := s.newFixture(t)
		runs := f.genRuns(8, abi.Write, false)
		x := f.makePrepped(abi.Write, runs, nil)
		checkNotPosted(t, f.local.Agent, x)
		f.run("transfer", x)
		f.apply(abi.Write, runs)
		f.verify("transfer")
		return
	}
	// The checks of an active transfer need it still in flight when they
	// run. On a loaded machine the caller can stall for longer than the
	// delay; a check that failed only after the delay had passed proves
	// nothing, so the run is repeated with a longer delay. A check that
	// fails within the delay is a failure.
	delay := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		problems, late := pollProgressOnce(t, s, delay)
		if len(problems) == 0 {
			break
		}
		if !late || attempt == 4 {
			for _, p := range problems {
				t.Errorf("%s", p)
			}
			break
		}
		t.Logf("with a %v delay the checks ran late (%s); again with %v", delay, problems[0], 4*delay)
		delay *= 4
	}

	// Released while active: cancelled, and the plugin lets go of it. The
	// delay is long, so a release that waited for the transfer shows.
	const long = 5 * time.Second
	f := s.newFixture(t, plugin.Param{Key: "delay_us", Value: fmt.Sprint(long.Microseconds())})
	y := f.makePrepped(abi.Write, f.genRuns(8, abi.Write, false), nil)
	if done, err := y.Post(); err != nil || done {
		t.Fatalf("post_xfer of a delayed transfer: done %v, %v", done, err)
	}
	start := time.Now()
	if err := y.Close(); err != nil {
		t.Errorf("release_xfer of an active transfer: %v", err)
	}
	if d := time.Since(start); d > long/2 {
		t.Errorf("release_xfer of an active transfer took %v: it waited for the %v transfer instead of cancelling", d, long)
	}
	_, err := y.Poll()
	expectClosed(t, "poll after release", err)
	// Cancelled before its delay ended, the transfer moved nothing.
	f.verify("after cancelling a delayed transfer")
}

// checkNotPosted checks poll and telemetry of a transfer never posted.
func checkNotPosted(t TB, a *plugin.Agent, x *plugin.Xfer) {
	t.Helper()
	_, err := x.Poll()
	expectCode(t, "poll_xfer before post_xfer", err, abi.ErrNotPosted)
	if a.Caps().Has(abi.CapTelemetry) {
		_, err := x.Telemetry()
		expectCode(t, "xfer_telemetry before post_xfer", err, abi.ErrNoTelemetry)
	}
}

// pollProgressOnce posts a transfer delayed by delay and checks how it
// looks while active: IN_PROG, REPOST_ACTIVE, NO_TELEMETRY, Wait's
// deadline; then that it completes with the right bytes. It returns the
// failed checks of the active transfer, and whether the delay had passed
// by the time they ran (then they prove nothing).
func pollProgressOnce(t TB, s *Suite, delay time.Duration) (problems []string, late bool) {
	f := s.newFixture(t, plugin.Param{Key: "delay_us", Value: fmt.Sprint(delay.Microseconds())})
	a := f.local.Agent
	runs := f.genRuns(8, abi.Write, false)
	x := f.makePrepped(abi.Write, runs, nil)
	checkNotPosted(t, a, x)
	posted := time.Now()
	done, err := x.Post()
	if err != nil {
		t.Fatalf("post_xfer: %v", err)
	}
	if done {
		problems = append(problems, fmt.Sprintf("post_xfer of a transfer delayed by %v reported completion", delay))
	}
	if done, err := x.Poll(); err != nil || done {
		problems = append(problems, fmt.Sprintf("poll_xfer right after post_xfer of a delayed transfer: done %v, %v; want IN_PROG", done, err))
	}
	_, err = x.Post()
	if p := codeProblem("post_xfer of an active transfer", err, abi.ErrRepostActive); p != "" {
		problems = append(problems, p)
	}
	if a.Caps().Has(abi.CapTelemetry) {
		_, err := x.Telemetry()
		if p := codeProblem("xfer_telemetry of an active transfer", err, abi.ErrNoTelemetry); p != "" {
			problems = append(problems, p)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	if err := x.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		problems = append(problems, fmt.Sprintf("Wait with a 5 ms deadline on a %v transfer: %v, want DeadlineExceeded", delay, err))
	}
	cancel()
	done, err = x.Poll()
	late = time.Since(posted) >= delay
	if err == nil && done {
		problems = append(problems, fmt.Sprintf("poll_xfer never reported IN_PROG after the checks of a %v transfer", delay))
	}
	ctx, cancel = context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	if err := x.Wait(ctx); err != nil {
		t.Fatalf("waiting for the delayed transfer: %v", err)
	}
	if done, err := x.Poll(); !done || err != nil {
		t.Errorf("poll_xfer after completion: done %v, %v", done, err)
	}
	f.apply(abi.Write, runs)
	f.verify("delayed transfer")
	return problems, late
}

func caseTelemetry(t TB, s *Suite) {
	f := s.newFixture(t)
	if !f.local.Agent.Caps().Has(abi.CapTelemetry) {
		t.Skipf("agent lacks telemetry (caps %v)", f.local.Agent.Caps().Names())
	}
	for _, path := range []string{"prepped", "batch"} {
		for _, strided := range []bool{false, true} {
			runs := f.genRuns(10, abi.Write, strided)
			var x *plugin.Xfer
			if path == "prepped" {
				x = f.makePrepped(abi.Write, runs, nil)
			} else {
				x = f.makeBatch(abi.Write, runs, nil)
			}
			what := fmt.Sprintf("%s transfer (strided %v)", path, strided)
			before := time.Now()
			f.run(what, x)
			after := time.Now()
			tel, err := x.Telemetry()
			if err != nil {
				t.Errorf("%s: xfer_telemetry: %v", what, err)
				continue
			}
			if tel.Bytes != totalBytes(runs) || tel.Descs != uint64(len(runs)) {
				t.Errorf("%s: telemetry says %d bytes in %d descriptors, want %d in %d", what, tel.Bytes, tel.Descs, totalBytes(runs), len(runs))
			}
			if tel.Start.Before(before.Add(-time.Second)) || tel.Start.After(after.Add(time.Second)) {
				t.Errorf("%s: start %v is not between %v and %v", what, tel.Start, before, after)
			}
			if tel.Xfer < 0 || tel.Post < 0 || tel.Xfer > after.Sub(before)+time.Millisecond || tel.Post > tel.Xfer+time.Millisecond {
				t.Errorf("%s: post %v, transfer %v, but it all took %v", what, tel.Post, tel.Xfer, after.Sub(before))
			}
			f.apply(abi.Write, runs)
		}
	}
	f.verify("telemetry transfers")
}

func caseConcurrency(t TB, s *Suite) {
	f := s.newFixture(t)
	const workers, rounds = 8, 20
	all := f.genRuns(workers*4, abi.Write, false)
	xs := make([]*plugin.Xfer, workers)
	for w := range workers {
		runs := all[w*4 : w*4+4]
		if w%2 == 0 {
			xs[w] = f.makePrepped(abi.Write, runs, nil)
		} else {
			xs[w] = f.makeBatch(abi.Write, runs, nil)
		}
	}
	for round := range rounds {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if err := f.post(xs[w]); err != nil {
					t.Errorf("round %d, goroutine %d: %v", round, w, err)
				}
			}()
		}
		// Other calls on the same agent meanwhile.
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if _, err := f.local.Agent.LocalMetadata(); err != nil {
				t.Errorf("local_metadata during transfers: %v", err)
			}
			if f.local.Agent.Caps().Has(abi.CapNotif) {
				if _, err := f.local.Agent.Notifs(); err != nil {
					t.Errorf("get_notifs during transfers: %v", err)
				}
			}
		}()
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
		f.apply(abi.Write, all)
		if round%5 == 4 {
			f.verify(fmt.Sprintf("round %d", round))
			f.refillSource(abi.Write)
		}
	}
}

func caseRemoveRemote(t TB, s *Suite) {
	// A transfer kept in flight by a delay that cancellation cuts short.
	delayed := s.p.Info().HasParam("delay_us")
	var extra []plugin.Param
	if delayed {
		extra = append(extra, plugin.Param{Key: "delay_us", Value: "5000000"})
	} else {
		t.Logf("plugin has no delay_us parameter: cancellation of a transfer in flight is not checked")
	}
	f := s.newFixture(t, extra...)
	a, raw := f.local.Agent, s.p.Raw()
	// Two transfers, so that one may wait behind the other: both kinds of
	// active transfer are cancelled. They are posted newest first, so that
	// a plugin that runs one at a time and cancels in creation order (the
	// fake) meets the waiting one first.
	runs := f.genRuns(8, abi.Write, false)
	xs := []*plugin.Xfer{f.makeBatch(abi.Write, runs[:4], nil), f.makePrepped(abi.Write, runs[4:], nil)}

	// Handles made straight with the plugin, outside the host's
	// bookkeeping, show what remove_remote does to them.
	ri := f.rinfo[0]
	var rawRR abi.RRegion
	var rawLocal, rawRemote abi.DList
	var err error
	switch caps := a.Caps(); {
	case caps.Has(abi.CapRemoteAddr):
		rawRR, err = raw.RemoteRegionImport(a.Handle(), f.peerName, nil, abi.MemDesc{Addr: ri.Addr, Len: ri.Len, DevID: ri.DevID, MemKind: ri.Kind})
	case caps.Has(abi.CapRemoteBlob) && ri.Blob != nil:
		rawRR, err = raw.RemoteRegionImport(a.Handle(), f.peerName, ri.Blob, abi.MemDesc{})
	}
	if err != nil {
		t.Fatalf("remote_region_import (raw): %v", err)
	}
	if a.Caps().Has(abi.CapPrepped) {
		loc := f.local.Registered[0]
		if rawLocal, err = raw.PrepDList(a.Handle(), "", abi.DRAM, []abi.XferDesc{{Addr: loc.Addr(), Len: 64, Count: 1}}); err != nil {
			t.Fatalf("prep_dlist (raw, local): %v", err)
		}
		t.Cleanup(func() {
			closeQuietly(t, "raw local list", func() error { return raw.ReleaseDList(a.Handle(), rawLocal) })
		})
		if rawRemote, err = raw.PrepDList(a.Handle(), f.peerName, abi.DRAM, []abi.XferDesc{{Addr: ri.Addr, Len: 64, Count: 1, DevID: ri.DevID}}); err != nil {
			t.Fatalf("prep_dlist (raw, remote): %v", err)
		}
	}
	if delayed {
		for _, x := range slices.Backward(xs) {
			if done, err := x.Post(); err != nil || done {
				t.Fatalf("post_xfer of a delayed transfer: done %v, %v", done, err)
			}
		}
	}

	if err := a.RemoveRemote(f.peerName); err != nil {
		t.Fatalf("remove_remote: %v", err)
	}
	f.rregions = nil // the host released and closed them with the peer
	for i, x := range xs {
		if delayed {
			ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
			err := x.Wait(ctx)
			cancel()
			expectCode(t, fmt.Sprintf("transfer %d in flight to a removed peer", i), err, abi.ErrCanceled)
			_, again := x.Poll()
			expectCode(t, fmt.Sprintf("polling cancelled transfer %d again", i), again, abi.ErrCanceled)
		}
		_, err = x.Post()
		expectCode(t, fmt.Sprintf("posting transfer %d to a removed peer", i), err, abi.ErrNotFound)
	}
	if rawRemote != 0 {
		_, err := raw.MakePreppedXfer(a.Handle(), abi.Write, rawLocal, []int32{0}, rawRemote, []int32{0})
		expectCode(t, "make_prepped_xfer with a list of a removed peer (raw)", err, abi.ErrNotFound)
		// Dead, but still a handle the caller releases, once.
		if err := raw.ReleaseDList(a.Handle(), rawRemote); err != nil {
			t.Errorf("release_dlist of a removed peer's list (raw): %v; the handle must stay valid until released", err)
		}
		expectCode(t, "release_dlist of it again (raw)", raw.ReleaseDList(a.Handle(), rawRemote), abi.ErrInvalidParam)
	}
	if rawRR != 0 {
		if a.Caps().Has(abi.CapBatch) {
			_, err := raw.MakeBatchXfer(a.Handle(), abi.Write, []abi.RegionPair{{Local: f.local.Registered[0].Handle(), Remote: rawRR}}, []abi.BatchEntry{{Len: 8, Count: 1}})
			expectCode(t, "make_batch_xfer with a region of a removed peer (raw)", err, abi.ErrNotFound)
		}
		if err := raw.RemoteRegionRelease(a.Handle(), rawRR); err != nil {
			t.Errorf("remote_region_release of a removed peer's region (raw): %v; the handle must stay valid until released", err)
		}
		expectCode(t, "remote_region_release of it again (raw)", raw.RemoteRegionRelease(a.Handle(), rawRR), abi.ErrInvalidParam)
	}
	switch caps := a.Caps(); {
	case caps.Has(abi.CapRemoteAddr):
		_, err := a.ImportRange(f.peerName, ri.Addr, 64, ri.DevID, ri.Kind)
		expectCode(t, "import by range from a removed peer", err, abi.ErrNotFound)
	case caps.Has(abi.CapRemoteBlob) && ri.Blob != nil:
		_, err := a.ImportRegion(f.peerName, ri.Blob)
		expectCode(t, "import by blob from a removed peer", err, abi.ErrNotFound)
	}
	// The cancelled transfers moved nothing (their delay had not ended),
	// and their handles are released without error.
	f.verify("after removing the peer of a transfer")
	for i, x := range xs {
		if err := x.Close(); err != nil {
			t.Errorf("release_xfer of transfer %d to a removed peer: %v", i, err)
		}
	}
}

func caseFaultInjection(t TB, s *Suite) {
	if !s.p.Info().HasParam("fail_rate") {
		t.Skipf("plugin has no fail_rate parameter: failures cannot be injected")
	}
	f := s.newFixture(t, plugin.Param{Key: "fail_rate", Value: "1"})
	x := f.makePrepped(abi.Write, f.genRuns(4, abi.Write, false), nil)
	err := f.post(x)
	var pe *plugin.Error
	if !errors.As(err, &pe) {
		t.Fatalf("a transfer with fail_rate=1: %v, want a plugin error", err)
	}
	if pe.Message == "" || pe.Plugin != s.p.Name() {
		t.Errorf("failure %+v lacks the plugin's name or message", pe)
	}
	for range 3 {
		_, again := x.Poll()
		var pe2 *plugin.Error
		if !errors.As(again, &pe2) || pe2.Code != pe.Code || pe2.Message != pe.Message {
			t.Errorf("poll after the failure: %v, want the same failure %v", again, err)
		}
	}
	t.Logf("injected failure: %v", err)
}

func caseBadHandles(t TB, s *Suite) {
	f := s.newFixture(t)
	a, raw := f.local.Agent, s.p.Raw()
	other := s.newLocal(t, []int{4096})
	runs := f.genRuns(2, abi.Write, false)
	x := f.makeBatch(abi.Write, runs, nil)
	f.run("transfer", x)
	f.apply(abi.Write, runs)
	// Another agent's handle is foreign: refused, and the transfer survives.
	_, err := raw.PollXfer(other.Agent.Handle(), x.Handle())
	expectCode(t, "poll_xfer of another agent's transfer", err, abi.ErrInvalidParam)
	expectCode(t, "release_xfer of another agent's transfer", raw.ReleaseXfer(other.Agent.Handle(), x.Handle()), abi.ErrInvalidParam)
	if done, err := x.Poll(); !done || err != nil {
		t.Errorf("the transfer after foreign calls: done %v, %v", done, err)
	}
	h := x.Handle()
	if err := x.Close(); err != nil {
		t.Fatalf("release_xfer: %v", err)
	}
	expectClosed(t, "second Close of a transfer", x.Close())
	_, err = x.Post()
	expectClosed(t, "post after Close", err)
	for _, handle := range []abi.Xfer{h, 0, h + 1<<40} {
		what := fmt.Sprintf("transfer handle %#x", uint64(handle))
		if handle == h {
			what = "a released transfer"
		}
		_, err = raw.PollXfer(a.Handle(), handle)
		expectCode(t, "poll_xfer of "+what, err, abi.ErrInvalidParam)
		_, err = raw.PostXfer(a.Handle(), handle)
		expectCode(t, "post_xfer of "+what, err, abi.ErrInvalidParam)
		expectCode(t, "release_xfer of "+what, raw.ReleaseXfer(a.Handle(), handle), abi.ErrInvalidParam)
		if a.Caps().Has(abi.CapTelemetry) {
			expectCode(t, "xfer_telemetry of "+what, raw.XferTelemetry(a.Handle(), handle), abi.ErrInvalidParam)
		}
	}
	// ABI 1.1: a poll that may release, and submit, with bad handles.
	if a.Caps().Has(abi.CapSubmit) {
		for _, handle := range []abi.Xfer{h, 0, h + 1<<40} {
			_, released, err := raw.PollRelease(a.Handle(), handle)
			expectCode(t, fmt.Sprintf("poll-release of transfer handle %#x", uint64(handle)), err, abi.ErrInvalidParam)
			if released {
				t.Errorf("poll-release of transfer handle %#x says it released it", uint64(handle))
			}
		}
		y := f.makeBatch(abi.Write, runs, nil)
		f.run("transfer for foreign poll-release", y)
		_, released, err := raw.PollRelease(other.Agent.Handle(), y.Handle())
		expectCode(t, "poll-release of another agent's transfer", err, abi.ErrInvalidParam)
		if released {
			t.Errorf("poll-release of another agent's transfer says it released it")
		}
		if done, _, err := y.PollRelease(); !done || err != nil {
			t.Errorf("the transfer after a foreign poll-release: done %v, %v", done, err)
		}
	}
	if a.Caps().Has(abi.CapEventFD) {
		for _, agent := range []abi.Agent{0, a.Handle() + 1<<40} {
			_, err := raw.EventFD(agent)
			expectCode(t, fmt.Sprintf("get_event_fd of agent handle %#x", uint64(agent)), err, abi.ErrInvalidParam)
		}
	}
	rrs := f.importRemote()
	if a.Caps().Has(abi.CapSubmit) && a.Caps().Has(abi.CapBatch) {
		_, _, err = raw.SubmitBatchXfer(a.Handle(), abi.Write, []abi.RegionPair{{Local: other.Registered[0].Handle(), Remote: rrs[0].Handle()}}, []abi.BatchEntry{{Len: 8, Count: 1}})
		expectCode(t, "submit_xfer with another agent's region", err, abi.ErrInvalidParam)
		_, _, err = raw.SubmitBatchXfer(0, abi.Write, []abi.RegionPair{{Local: f.local.Registered[0].Handle(), Remote: rrs[0].Handle()}}, []abi.BatchEntry{{Len: 8, Count: 1}})
		expectCode(t, "submit_xfer with agent handle 0", err, abi.ErrInvalidParam)
	}
	if s.p.Info().Caps&(abi.CapRemoteAddr|abi.CapRemoteBlob) != 0 {
		expectCode(t, "remote_region_release of handle 0", raw.RemoteRegionRelease(a.Handle(), 0), abi.ErrInvalidParam)
		expectCode(t, "remote_region_release with another agent", raw.RemoteRegionRelease(other.Agent.Handle(), rrs[0].Handle()), abi.ErrInvalidParam)
	}
	if a.Caps().Has(abi.CapBatch) {
		_, err = raw.MakeBatchXfer(a.Handle(), abi.Write, []abi.RegionPair{{Local: other.Registered[0].Handle(), Remote: rrs[0].Handle()}}, []abi.BatchEntry{{Len: 8, Count: 1}})
		expectCode(t, "make_batch_xfer with another agent's region", err, abi.ErrInvalidParam)
		_, err = raw.MakeBatchXfer(a.Handle(), abi.Write, []abi.RegionPair{{Local: f.local.Registered[0].Handle(), Remote: 0}}, []abi.BatchEntry{{Len: 8, Count: 1}})
		expectCode(t, "make_batch_xfer with remote region 0", err, abi.ErrInvalidParam)
	}
	if a.Caps().Has(abi.CapPrepped) {
		p := f.prepRuns(runs)
		_, err = raw.MakePreppedXfer(a.Handle(), abi.Write, p.remote.Handle(), p.ri, p.local.Handle(), p.li)
		expectAnyPluginError(t, "make_prepped_xfer with a remote list as the local one", err)
		_, err = raw.MakePreppedXfer(a.Handle(), abi.Write, p.local.Handle(), p.li, 0, p.ri)
		expectCode(t, "make_prepped_xfer with list 0", err, abi.ErrInvalidParam)
		// The host checks this itself; the plugin must too.
		_, err = raw.MakePreppedXfer(a.Handle(), abi.Write, p.local.Handle(), p.li, p.remote.Handle(), p.ri[:1])
		expectCode(t, "make_prepped_xfer with more local than remote indices (raw)", err, abi.ErrInvalidParam)
	}
	f.verify("after calls with bad handles")
}

func caseAgentClose(t TB, s *Suite) {
	var extra []plugin.Param
	if s.p.Info().HasParam("delay_us") {
		// Long, so that the transfer is still in flight when the agent is
		// destroyed; cancellation cuts it short.
		extra = append(extra, plugin.Param{Key: "delay_us", Value: "5000000"})
	}
	f := s.newFixture(t, extra...)
	a := f.local.Agent
	runs := f.genRuns(4, abi.Write, false)
	p := f.prepRuns(runs)
	x, err := a.MakePreppedXfer(abi.Write, p.local, p.li, p.remote, p.ri, nil)
	if err != nil {
		t.Fatalf("%v", err)
	}
	rrs := f.importRemote()
	if _, err := x.Post(); err != nil {
		t.Fatalf("%v", err)
	}
	agentH, xferH := a.Handle(), x.Handle()
	if err := a.Close(); err != nil {
		t.Fatalf("agent_destroy with a transfer in flight: %v", err)
	}
	_, err = x.Poll()
	expectClosed(t, "poll of a transfer of a closed agent", err)
	expectClosed(t, "Close of a transfer of a closed agent", x.Close())
	expectClosed(t, "Close of a list of a closed agent", p.local.Close())
	expectClosed(t, "Close of a remote list of a closed agent", p.remote.Close())
	expectClosed(t, "Close of a remote region of a closed agent", rrs[0].Close())
	expectClosed(t, "Close of a region of a closed agent", f.local.Registered[0].Close())
	_, err = a.LocalMetadata()
	expectClosed(t, "local_metadata of a closed agent", err)
	_, err = a.MakeBatchXfer(abi.Write, nil, nil, nil)
	expectClosed(t, "make_batch_xfer on a closed agent", err)
	_, err = s.p.Raw().PollXfer(agentH, xferH)
	expectCode(t, "poll_xfer with a destroyed agent (raw)", err, abi.ErrInvalidParam)
	// The peer received none of the cancelled transfer's bytes (it was
	// delayed), or all of them if a stall of the caller let the delay end
	// first; never a part.
	if len(extra) > 0 {
		if !f.peerMatches() {
			t.Logf("the transfer completed before its agent was destroyed (the caller stalled for 5 s?)")
			f.apply(abi.Write, runs)
		}
		f.verify("after destroying an agent with a delayed transfer")
	}
}

func casePeerExit(t TB, s *Suite) {
	if s.cfg.Mode != TwoProcess {
		t.Skipf("needs a peer process (two-process mode)")
	}
	s.needDRAM(t)
	// A helper of its own, killed below; the suite's helper lives on.
	h, err := startHelper(s.cfg.Helper(), s.cfg.Plugin, s.cfg.Dirs, 3*s.cfg.Timeout)
	if err != nil {
		t.Fatalf("starting a second helper process: %v", err)
	}
	t.Cleanup(func() { h.Close() })
	local := s.newLocal(t, []int{regionSize})
	a := local.Agent
	peer, err := h.NewAgent(s.agentName("doomed"), s.params(), []int{regionSize})
	if err != nil {
		t.Fatalf("creating an agent in the second helper: %v", err)
	}
	md, err := peer.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	name, err := a.LoadRemote(md)
	if err != nil {
		t.Fatalf("loading the doomed peer: %v", err)
	}
	lmd, err := a.LocalMetadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	if _, err := peer.LoadRemote(lmd); err != nil {
		t.Fatalf("%v", err)
	}
	ri := peer.Regions()[0]
	var rr *plugin.RemoteRegion
	switch caps := a.Caps(); {
	case caps.Has(abi.CapRemoteBlob) && ri.Blob != nil:
		rr, err = a.ImportRegion(name, ri.Blob)
	case caps.Has(abi.CapRemoteAddr):
		rr, err = a.ImportRange(name, ri.Addr, ri.Len, ri.DevID, ri.Kind)
	default:
		t.Skipf("agent cannot name remote regions (caps %v)", caps.Names())
	}
	if err != nil {
		t.Fatalf("importing a region of the doomed peer: %v", err)
	}
	x, err := a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: local.Registered[0], Remote: rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("make_batch_xfer: %v", err)
	}
	t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
	post := func() error {
		done, err := x.Post()
		if err != nil || done {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		defer cancel()
		return x.Wait(ctx)
	}
	if err := post(); err != nil {
		t.Fatalf("a transfer to the live peer: %v", err)
	}

	// The peer process dies: the transfer fails (it must not hang, and
	// must not claim success), and the agent stays usable.
	h.Kill()
	err = post()
	if errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a transfer to a dead peer process did not end within %v", s.cfg.Timeout)
	}
	expectAnyPluginError(t, "a transfer to a dead peer process", err)
	t.Logf("a transfer to a dead peer process ends with: %v", err)
	if a.Caps().Has(abi.CapNotif) {
		t.Logf("send_notif to a dead peer process: %v", a.SendNotif(name, []byte("anyone there?")))
	}
	if err := a.RemoveRemote(name); err != nil {
		t.Errorf("remove_remote of a dead peer: %v", err)
	}
}
