package conformance

import (
	"bytes"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// needNotif skips the case unless both the local agent and the peer can
// exchange notifications.
func needNotif(t TB, f *fixture) {
	t.Helper()
	if !f.local.Agent.Caps().Has(abi.CapNotif) || !f.peer.Caps().Has(abi.CapNotif) {
		t.Skipf("agents lack notif (local %v, peer %v)", f.local.Agent.Caps().Names(), f.peer.Caps().Names())
	}
}

// settle is how long the suite waits for notifications that should NOT
// arrive (duplicates) before it concludes they did not.
const settle = 50 * time.Millisecond

func caseNotifAttached(t TB, s *Suite) {
	f := s.newFixture(t)
	if !f.local.Agent.Caps().Has(abi.CapNotif) {
		notifRefused(t, f)
		return
	}
	needNotif(t, f)
	from := f.local.Agent.Name()
	for _, op := range []abi.Op{abi.Write, abi.Read} {
		for _, path := range []string{"prepped", "batch"} {
			for _, msg := range [][]byte{[]byte(fmt.Sprintf("kv-done:%s:%s", path, op)), {}} {
				what := fmt.Sprintf("%s %s with a %d-byte notification", path, op, len(msg))
				runs := f.genRuns(6, op, false)
				var x *plugin.Xfer
				if path == "prepped" {
					x = f.makePrepped(op, runs, msg)
				} else {
					x = f.makeBatch(op, runs, msg)
				}
				f.run(what, x)
				batches, err := f.peer.Notifs(1, s.cfg.Timeout)
				if err != nil {
					t.Fatalf("%s: get_notifs: %v", what, err)
				}
				f.apply(op, runs)
				// The notification comes after every byte landed.
				f.verify(what)
				expectNotifs(t, what, batches, from, [][]byte{msg})
				// Posted again, the transfer notifies again.
				f.refillSource(op)
				f.run(what+" posted again", x)
				batches, err = f.peer.Notifs(1, s.cfg.Timeout)
				if err != nil {
					t.Fatalf("%s: get_notifs: %v", what, err)
				}
				f.apply(op, runs)
				f.verify(what + " posted again")
				expectNotifs(t, what+" posted again", batches, from, [][]byte{msg})
			}
		}
	}
	// Zero indices: the transfer moves nothing and only delivers its
	// notification.
	p := f.prepRuns(f.genRuns(2, abi.Write, false))
	for _, op := range []abi.Op{abi.Write, abi.Read} {
		what := fmt.Sprintf("notification-only prepped %s", op)
		msg := []byte(what)
		x, err := f.local.Agent.MakePreppedXfer(op, p.local, []int32{}, p.remote, []int32{}, msg)
		if err != nil {
			t.Fatalf("%s: make_prepped_xfer with no indices: %v", what, err)
		}
		t.Cleanup(func() { closeQuietly(t, "transfer", x.Close) })
		f.run(what, x)
		batches, err := f.peer.Notifs(1, s.cfg.Timeout)
		if err != nil {
			t.Fatalf("%s: get_notifs: %v", what, err)
		}
		expectNotifs(t, what, batches, from, [][]byte{msg})
		f.verify(what)
	}
	// A transfer without a notification sends none, and none was sent twice.
	runs := f.genRuns(3, abi.Write, false)
	f.run("write without notification", f.makeBatch(abi.Write, runs, nil))
	batches, err := f.peer.Notifs(1, settle)
	if err != nil {
		t.Fatalf("%v", err)
	}
	expectNotifs(t, "after a transfer without notification", batches, from, nil)
}

// notifRefused checks an agent without notifications (MORI-IO as SGLang
// runs it: completion is seen by polling only): get_notifs, send_notif and
// transfers that ask for a notification are refused with NOT_SUPPORTED
// before anything moves, and the same transfers without one complete.
func notifRefused(t TB, f *fixture) {
	a := f.local.Agent
	_, err := a.Notifs()
	expectCode(t, "get_notifs", err, abi.ErrNotSupported)
	expectCode(t, "send_notif", a.SendNotif(f.peerName, []byte("x")), abi.ErrNotSupported)
	runs := f.genRuns(3, abi.Write, false)
	p := f.prepRuns(runs)
	_, err = a.MakePreppedXfer(abi.Write, p.local, p.li, p.remote, p.ri, []byte("kv-done"))
	expectCode(t, "make_prepped_xfer with a notification", err, abi.ErrNotSupported)
	pairs, entries := f.batchOf(runs)
	_, err = a.MakeBatchXfer(abi.Write, pairs, entries, []byte{})
	expectCode(t, "make_batch_xfer with an empty notification", err, abi.ErrNotSupported)
	f.verify("after the refused transfers") // nothing moved
	f.run("prepped transfer without a notification", f.makePrepped(abi.Write, runs, nil))
	f.apply(abi.Write, runs)
	f.verify("prepped transfer without a notification")
}

func caseNotifStandalone(t TB, s *Suite) {
	f := s.newFixture(t)
	needNotif(t, f)
	a := f.local.Agent
	msgs := [][]byte{[]byte("hello"), {}, {0, 1, 2, 255, 0}, bytes.Repeat([]byte("kv"), 1000)}
	for _, m := range msgs {
		if err := a.SendNotif(f.peerName, m); err != nil {
			t.Fatalf("send_notif of %d bytes: %v", len(m), err)
		}
	}
	batches, err := f.peer.Notifs(len(msgs), s.cfg.Timeout)
	if err != nil {
		t.Fatalf("%v", err)
	}
	if more, err := f.peer.Notifs(1, settle); err == nil {
		batches = append(batches, more...)
	}
	expectNotifs(t, "local to peer", batches, a.Name(), msgs)

	for _, m := range msgs {
		if err := f.peer.SendNotif(a.Name(), m); err != nil {
			t.Fatalf("peer send_notif of %d bytes: %v", len(m), err)
		}
	}
	got, err := peerproc.DrainNotifs(a, len(msgs), s.cfg.Timeout)
	if err != nil {
		t.Fatalf("%v", err)
	}
	expectNotifs(t, "peer to local", got, f.peer.Name(), msgs)
	expectCode(t, "send_notif to a peer never loaded", a.SendNotif("conf-no-such-peer", []byte("x")), abi.ErrNotFound)
}

func caseNotifGrouping(t TB, s *Suite) {
	f := s.newFixture(t)
	needNotif(t, f)
	// A second sender that knows the peer.
	second := s.newLocal(t, []int{4096})
	md, err := f.peer.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	if _, err := second.Agent.LoadRemote(md); err != nil {
		t.Fatalf("%v", err)
	}
	senders := []*plugin.Agent{f.local.Agent, second.Agent}
	const perSender = 4
	for attempt := 1; ; attempt++ {
		for i := range perSender {
			for _, a := range senders { // interleaved
				if err := a.SendNotif(f.peerName, []byte(fmt.Sprintf("%s#%d", a.Name(), i))); err != nil {
					t.Fatalf("send_notif: %v", err)
				}
			}
		}
		time.Sleep(settle) // let every notification arrive before the peer drains
		batches, err := f.peer.Notifs(len(senders)*perSender, s.cfg.Timeout)
		if err != nil {
			t.Fatalf("%v", err)
		}
		next := map[string]int{}
		for bi, batch := range batches {
			done := map[string]bool{}
			for k, n := range batch {
				if k > 0 && batch[k-1].From != n.From {
					done[batch[k-1].From] = true
				}
				if done[n.From] {
					t.Errorf("batch %d: records of %s are not adjacent: %s", bi, n.From, describeNotifs(batch))
					break
				}
				if want := fmt.Sprintf("%s#%d", n.From, next[n.From]); string(n.Msg) != want {
					t.Errorf("batch %d: %q from %s, want %q (each sender's order must hold)", bi, n.Msg, n.From, want)
				}
				next[n.From]++
			}
		}
		for _, a := range senders {
			if next[a.Name()] != perSender {
				t.Errorf("%d notifications from %s arrived, want %d", next[a.Name()], a.Name(), perSender)
			}
		}
		if t.Failed() || len(batches) == 1 {
			return
		}
		if attempt == 3 {
			t.Logf("notifications kept arriving in several batches; grouping was only checked within each")
			return
		}
	}
}

func caseNotifBuffer(t TB, s *Suite) {
	f := s.newFixture(t)
	needNotif(t, f)
	a := f.local.Agent
	big := make([]byte, 48<<10) // larger than the host's first 4 KiB buffer
	peerproc.Fill(big, 42)
	msgs := [][]byte{big}
	for i := range 300 { // about 30 KiB of small records: several get_notifs rounds
		msgs = append(msgs, []byte(fmt.Sprintf("small notification %03d %s", i, bytes.Repeat([]byte{'.'}, i%64))))
	}
	msgs = append(msgs, big[:20000])
	for _, m := range msgs {
		if err := f.peer.SendNotif(a.Name(), m); err != nil {
			t.Fatalf("peer send_notif of %d bytes: %v", len(m), err)
		}
	}
	got, err := peerproc.DrainNotifs(a, len(msgs), s.cfg.Timeout)
	if err != nil {
		t.Fatalf("%v", err)
	}
	expectNotifs(t, "large and many notifications", got, f.peer.Name(), msgs)
}
