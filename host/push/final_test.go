package push_test

import (
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// TestSuccessIsFinal: rooms that succeeded stay Success when their ranks
// close afterwards (the engine's close_rank, its exit, the sidecar's
// shutdown), on both sides: no Failed change is reported, no failure is
// sent to the peer, and Failure stays nil. Unfinished rooms still fail.
func TestSuccessIsFinal(t *testing.T) {
	pe, de := newEvents(), newEvents()
	r := newRig(t, rigOpts{pobs: pe, dobs: de})
	ctx := ctxT(t, 20*time.Second)
	done := r.prepare(7, 8, 0)
	if err := r.transfer(ctx, done); err != nil {
		t.Fatal(err)
	}
	open := r.prepare(8, 8, 1) // still Bootstrapping when the ranks close
	// The decode rank first: its close must not fail the prefill's room
	// either (a failure it sent would reach the prefill's table).
	r.dec.Close()
	r.pf.Close()
	for _, c := range []struct {
		side string
		got  sglang.KVPoll
		err  error
	}{{"prefill", done.s.Poll(), done.s.Failure()}, {"decode", done.rcv.Poll(), done.rcv.Failure()}} {
		if c.got != sglang.KVPollSuccess || c.err != nil {
			t.Errorf("%s room after its rank closed: %v (%v), want Success", c.side, c.got, c.err)
		}
	}
	if open.s.Poll() != sglang.KVPollFailed || open.rcv.Poll() != sglang.KVPollFailed {
		t.Errorf("unfinished room after close: prefill %v decode %v, want Failed", open.s.Poll(), open.rcv.Poll())
	}
	for side, e := range map[string]*events{"prefill": pe, "decode": de} {
		e.mu.Lock()
		seq := e.rooms[7]
		fails := 0
		for _, f := range e.failures {
			if f.Room == 7 {
				fails++
			}
		}
		e.mu.Unlock()
		if len(seq) == 0 || seq[len(seq)-1] != sglang.KVPollSuccess || fails != 0 {
			t.Errorf("%s room 7 went %v with %d failure events, want to end Success without failures", side, seq, fails)
		}
	}
}
