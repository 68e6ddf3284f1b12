package push_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// Issue 19 item 5: a decode rank accepts a room's completion only from the
// prefill ranks the room was sent to, and Success only once every expected
// part arrived. On one machine, 127.0.0.2 and 127.0.0.3 stand for other
// hosts (Linux routes all of 127.0.0.0/8 to lo).

// spoofRooms is how many rooms each attack goes after.
const spoofRooms = 10

// statusSender is a raw PUSH connection to a decode's PULL socket from a
// chosen source IP.
type statusSender struct {
	t   *testing.T
	raw *zmqtest.Raw
}

func dialStatus(t *testing.T, endpoint, fromIP string) *statusSender {
	t.Helper()
	return &statusSender{t: t, raw: zmqtest.DialRawFrom(t, endpoint, "PUSH", fromIP)}
}

func (s *statusSender) send(m sglang.Message) {
	s.t.Helper()
	f, err := m.Frames()
	if err != nil {
		s.t.Fatal(err)
	}
	if err := s.raw.Send(f...); err != nil {
		s.t.Fatal(err)
	}
}

func (s *statusSender) success(room uint64, rank int) {
	s.t.Helper()
	s.send(&sglang.MORIStatus{Room: room, Status: sglang.KVPollSuccess, PrefillUniqueRank: rank})
}

// settle waits until the decode dropped at least want more messages than
// before (what the fix refuses), or 3 s passed (the code before the fix
// drops none of them), then a little longer for anything still in flight.
func settle(t *testing.T, dec *push.Decode, before, want int64) {
	t.Helper()
	waitDropped(dec, before, want, 3*time.Second)
	time.Sleep(50 * time.Millisecond)
	t.Logf("decode dropped %d of the %d forged messages", dec.Dropped()-before, want)
}

// waitDropped waits until the decode dropped want messages more than
// before, or timeout passed, and returns how many it dropped.
func waitDropped(dec *push.Decode, before, want int64, timeout time.Duration) int64 {
	deadline := time.Now().Add(timeout)
	for dec.Dropped()-before < want && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	return dec.Dropped() - before
}

// countSuccess counts the receivers in Success.
func countSuccess(rs []*push.Receiver) int {
	n := 0
	for _, r := range rs {
		if r.Poll() == sglang.KVPollSuccess {
			n++
		}
	}
	return n
}

// evilAgent is an agent of the test's that knows the decode's metadata (as
// any prefill rank the decode registered with does) and sends it
// notifications of its own making.
func evilAgent(t *testing.T, pl *plugin.Plugin, dec *push.Decode) (send func(tag string)) {
	t.Helper()
	a, err := pl.NewAgent("evil-prefill")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	md, err := dec.Agent().LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	peer, err := a.LoadRemote(md)
	if err != nil {
		t.Fatal(err)
	}
	return func(tag string) {
		t.Helper()
		if err := a.SendNotif(peer, []byte(tag)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSpoofedCompletion: with a real prefill rank on 127.0.0.1 that holds
// every room's KV back, forged Success statuses and aux bytes from another
// host (127.0.0.2), and in automatic completion mode also Success statuses
// from the prefill's own IP and notification tags from an agent that is
// not the prefill's, complete no room and write no aux byte; afterwards
// every room completes honestly with every byte verified.
func TestSpoofedCompletion(t *testing.T) {
	for _, c := range []struct {
		name       string
		variant    push.Variant
		completion push.Completion
	}{
		{"nixl-status", push.VariantNIXL, push.CompletionStatus},
		{"mori-status", push.VariantMORI, push.CompletionStatus},
		{"nixl-auto", push.VariantNIXL, push.CompletionAuto},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{variant: c.variant, completion: c.completion})
			ctx := ctxT(t, 60*time.Second)
			notifs := c.completion == push.CompletionAuto
			// One honest room first: the prefill rank's agent becomes known
			// as the sender of its notifications.
			w := r.prepare(1000, 6, 0)
			if err := r.open(ctx, w); err != nil {
				t.Fatal(err)
			}
			if err := r.complete(ctx, w); err != nil {
				t.Fatal(err)
			}
			w.close()

			var qs []*request
			var rcvs []*push.Receiver
			for i := range spoofRooms {
				q := r.prepare(uint64(2000+i), 5+i, 1+i)
				if err := r.open(ctx, q); err != nil {
					t.Fatal(err)
				}
				qs, rcvs = append(qs, q), append(rcvs, q.rcv)
			}
			auxBefore := append([]byte(nil), r.d.args.Aux[0].Mem...)
			before := r.dec.Dropped()
			other := dialStatus(t, r.dec.Endpoint(), "127.0.0.2")
			var same *statusSender
			var tag func(string)
			if notifs {
				same = dialStatus(t, r.dec.Endpoint(), "127.0.0.1")
				tag = evilAgent(t, r.pl, r.dec)
			}
			want := int64(0)
			for _, q := range qs {
				other.success(q.room, 0)
				other.send(&sglang.AuxData{Room: q.room, BufferIndex: 0, AuxIndex: q.daux, Data: bytes.Repeat([]byte{0xEE}, rigAuxLen)})
				want += 2
				if notifs {
					same.success(q.room, 0)
					tag(fmt.Sprintf("%d_kv_0_1_0", q.room))
					tag(fmt.Sprintf("%d_aux", q.room))
					want += 3
				}
			}
			settle(t, r.dec, before, want)
			if n := countSuccess(rcvs); n != 0 {
				t.Errorf("%d of %d rooms reached Success from forged messages before any byte moved", n, len(rcvs))
			}
			if !bytes.Equal(auxBefore, r.d.args.Aux[0].Mem) {
				t.Errorf("forged AUX_DATA from another host changed the decode's aux buffer")
			}
			for _, q := range qs {
				if err := r.complete(ctx, q); err != nil {
					t.Fatalf("honest room after the attack: %v", err)
				}
				q.close()
			}
		})
	}
}

// fakeRank is a prefill rank driven by the test: a PULL socket registered
// with the bootstrap server, an agent that sends notifications, and a
// connection to the decode's PULL socket from the rank's IP.
type fakeRank struct {
	ip     string
	pull   *zmq.Pull
	agent  *plugin.Agent
	peer   string // the decode's agent, once loaded
	status *statusSender
}

// fanIn is a TP 2 prefill of fake ranks (rank 0 on 127.0.0.1, rank 1 on
// 127.0.0.3) and a TP 1 decode rank, so every room expects a part from
// each prefill rank.
type fanIn struct {
	t      *testing.T
	ctx    context.Context
	pl     *plugin.Plugin
	srv    *bootstrap.Running
	dec    *push.Decode
	ranks  []*fakeRank
	notifs bool // the decode tracks notifications, and the ranks use them
}

func newFanIn(t *testing.T, ctx context.Context, variant push.Variant, completion push.Completion, set push.Settings) *fanIn {
	t.Helper()
	f := &fanIn{t: t, ctx: ctx, pl: faketest.Plugin(t), notifs: completion != push.CompletionStatus}
	var err error
	if f.srv, err = bootstrap.NewServer(bootstrap.WithLogger(quietLog())).Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		f.srv.Close(cctx)
	})
	f.ranks = []*fakeRank{{ip: "127.0.0.1"}, {ip: "127.0.0.3"}}
	for i, fr := range f.ranks {
		if fr.pull, err = zmq.ListenPull(zmq.TCPEndpoint(fr.ip, 0)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { fr.pull.Close() })
		f.newAgent(i, "")
		err = bootstrap.NewClient(f.srv.Addr()).Register(ctx, bootstrap.Registration{
			AttnTPSize: 2, AttnTPRank: i, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
			RankIP: fr.ip, RankPort: fr.pull.Port(), PageSize: rigPageSize, KVCacheDType: "auto"})
		if err != nil {
			t.Fatal(err)
		}
	}
	d := newSide(t, rigPages, false)
	if f.dec, err = push.NewDecode(ctx, push.DecodeConfig{Plugin: f.pl, Variant: variant, Completion: completion,
		KV: d.args, Parallel: push.Parallel{TPSize: 1}, Settings: set, Logger: quietLog()}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.dec.Close() })
	for _, fr := range f.ranks {
		fr.status = dialStatus(t, f.dec.Endpoint(), fr.ip)
	}
	return f
}

// newAgent gives rank i a new agent (a restarted prefill rank's).
func (f *fanIn) newAgent(i int, suffix string) {
	f.t.Helper()
	a, err := f.pl.NewAgent(fmt.Sprintf("prefill-tp%d%s", i, suffix))
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { a.Close() })
	f.ranks[i].agent, f.ranks[i].peer = a, ""
}

// open opens a room on the decode and sends its metadata (decode pages
// 2*slot and 2*slot+1).
func (f *fanIn) open(room uint64, slot int) *push.Receiver {
	f.t.Helper()
	rc, err := f.dec.NewReceiver(f.srv.Addr(), room)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(rc.Close)
	if err := rc.Init(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	if err := rc.SendMetadata(f.ctx, []int32{int32(2 * slot), int32(2*slot + 1)}, int64(slot%rigAuxSlots), nil, 0); err != nil {
		f.t.Fatal(err)
	}
	return rc
}

// loadDecode makes each rank load the decode's metadata from the next
// registration it received, as a prefill rank does (messages before it,
// transfer infos of earlier rooms, are skipped).
func (f *fanIn) loadDecode() {
	f.t.Helper()
	if !f.notifs {
		return
	}
	for _, fr := range f.ranks {
		for {
			frames, err := fr.pull.Recv(f.ctx)
			if err != nil {
				f.t.Fatal(err)
			}
			m, err := sglang.ParseNIXLToPrefill(frames)
			if err != nil {
				f.t.Fatal(err)
			}
			if reg, ok := m.(*sglang.NIXLRegistration); ok {
				if fr.peer, err = fr.agent.LoadRemote(reg.AgentMetadata); err != nil {
					f.t.Fatal(err)
				}
				break
			}
		}
	}
}

// notify sends a notification tag from rank i's agent.
func (f *fanIn) notify(i int, tag string) {
	f.t.Helper()
	if err := f.ranks[i].agent.SendNotif(f.ranks[i].peer, []byte(tag)); err != nil {
		f.t.Fatal(err)
	}
}

// honest sends rank i's part of a room: notification tags from its
// agent, or a Success status from its IP.
func (f *fanIn) honest(i int, room uint64) {
	f.t.Helper()
	if !f.notifs {
		f.ranks[i].status.success(room, i)
		return
	}
	f.notify(i, fmt.Sprintf("%d_kv_0_1_%d", room, i))
	f.notify(i, fmt.Sprintf("%d_aux", room))
}

// warm runs one room with both ranks' honest parts.
func (f *fanIn) warm(room uint64) {
	f.t.Helper()
	rc := f.open(room, 0)
	f.loadDecode()
	f.honest(0, room)
	f.honest(1, room)
	if st, err := rc.Wait(f.ctx); err != nil || st != sglang.KVPollSuccess {
		f.t.Fatalf("honest room %d: %v %v %v", room, st, err, rc.Failure())
	}
}

// TestSpoofedCompletionFanIn: rank 0 sends its part honestly; then forged
// Success statuses for both ranks from rank 0's IP (the attacker shares a
// host with rank 0) and from 127.0.0.2, rank 1's notification tags from an
// agent that is not rank 1's, and rank 1's tags from rank 0's own agent
// complete no room. Rank 1's honest part then completes every room.
func TestSpoofedCompletionFanIn(t *testing.T) {
	for _, c := range []struct {
		name       string
		variant    push.Variant
		completion push.Completion
	}{
		{"nixl-status", push.VariantNIXL, push.CompletionStatus},
		{"mori-status", push.VariantMORI, push.CompletionStatus},
		{"nixl-auto", push.VariantNIXL, push.CompletionAuto},
		{"nixl-notif", push.VariantNIXL, push.CompletionNotif},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := ctxT(t, 60*time.Second)
			f := newFanIn(t, ctx, c.variant, c.completion, push.Settings{})
			f.warm(3000)
			var rcvs []*push.Receiver
			for i := range spoofRooms {
				rcvs = append(rcvs, f.open(uint64(4000+i), 1+i))
			}
			before := f.dec.Dropped()
			other := dialStatus(t, f.dec.Endpoint(), "127.0.0.2")
			var tag func(string)
			if f.notifs {
				tag = evilAgent(t, f.pl, f.dec)
			}
			want := int64(0)
			for _, rc := range rcvs {
				room := rc.Room()
				f.honest(0, room)
				f.ranks[0].status.success(room, 1) // rank 1 lives on another host
				other.success(room, 0)
				other.success(room, 1)
				want += 3
				if f.notifs {
					f.ranks[0].status.success(room, 0) // rank 0 reports by notification
					tag(fmt.Sprintf("%d_kv_0_1_1", room))
					tag(fmt.Sprintf("%d_aux", room))
					f.notify(0, fmt.Sprintf("%d_kv_0_1_1", room)) // rank 0's agent claiming rank 1's chunk
					want += 4
				}
			}
			settle(t, f.dec, before, want)
			if n := countSuccess(rcvs); n != 0 {
				t.Errorf("%d of %d rooms reached Success with only rank 0's part arrived", n, len(rcvs))
			}
			for _, rc := range rcvs {
				f.honest(1, rc.Room())
			}
			for _, rc := range rcvs {
				if st, err := rc.Wait(ctx); err != nil || st != sglang.KVPollSuccess {
					t.Fatalf("room %d after rank 1's honest part: %v %v %v", rc.Room(), st, err, rc.Failure())
				}
			}
		})
	}
}

// TestRestartedPrefillAgent: a prefill rank's agent is known only as long
// as the decode is registered with the rank. When the heartbeat declares
// the deployment dead and a restarted rank 0 (a new agent) answers again,
// the decode registers anew and the new agent's notifications count; the
// old agent's do not.
func TestRestartedPrefillAgent(t *testing.T) {
	ctx := ctxT(t, 60*time.Second)
	f := newFanIn(t, ctx, push.VariantNIXL, push.CompletionNotif,
		push.Settings{HeartbeatInterval: 50 * time.Millisecond, HeartbeatMaxFailures: 2})
	f.warm(5000)
	// The bootstrap server goes away until the heartbeat gives up.
	addr := f.srv.Addr()
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	f.srv.Close(cctx)
	cancel()
	dead := f.open(5001, 1)
	if st, err := dead.Wait(ctx); err != nil || st != sglang.KVPollFailed {
		t.Fatalf("room of a dead prefill: %v %v", st, err)
	}
	var err error
	if f.srv, err = bootstrap.NewServer(bootstrap.WithLogger(quietLog())).Start(addr); err != nil {
		t.Fatal(err)
	}
	for i, fr := range f.ranks {
		err = bootstrap.NewClient(addr).Register(ctx, bootstrap.Registration{
			AttnTPSize: 2, AttnTPRank: i, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
			RankIP: fr.ip, RankPort: fr.pull.Port(), PageSize: rigPageSize, KVCacheDType: "auto"})
		if err != nil {
			t.Fatal(err)
		}
	}
	old := f.ranks[0]
	oldAgent, oldPeer := old.agent, old.peer
	f.newAgent(0, "-restarted")
	rc := f.open(5002, 2)
	f.loadDecode()
	f.honest(0, 5002)
	f.honest(1, 5002)
	if st, err := rc.Wait(ctx); err != nil || st != sglang.KVPollSuccess {
		t.Fatalf("room after the restart: %v %v %v", st, err, rc.Failure())
	}
	// The old agent is no rank's agent any more.
	rc = f.open(5003, 3)
	before := f.dec.Dropped()
	for _, tag := range []string{"5003_kv_0_1_0", "5003_aux"} {
		if err := oldAgent.SendNotif(oldPeer, []byte(tag)); err != nil {
			t.Fatal(err)
		}
	}
	if got := waitDropped(f.dec, before, 2, 20*time.Second); got != 2 {
		t.Fatalf("%d of the old agent's 2 notifications refused", got)
	}
	f.honest(0, 5003)
	f.honest(1, 5003)
	if st, err := rc.Wait(ctx); err != nil || st != sglang.KVPollSuccess {
		t.Fatalf("second room after the restart: %v %v %v", st, err, rc.Failure())
	}
}

// TestBadNotificationNamesItsSender: a room failed by a notification that
// contradicts the tracker (a chunk id out of range) says which prefill
// rank and agent sent it: since issue 19 the sender is the agent, not the
// rank a tag names, and the tracker's own errors no longer carry it.
func TestBadNotificationNamesItsSender(t *testing.T) {
	ctx := ctxT(t, 60*time.Second)
	f := newFanIn(t, ctx, push.VariantNIXL, push.CompletionNotif, push.Settings{})
	f.warm(6000)
	rc := f.open(6001, 1)
	f.notify(1, fmt.Sprintf("%d_kv_%d_1_1", rc.Room(), 1<<30))
	if st, err := rc.Wait(ctx); err != nil || st != sglang.KVPollFailed {
		t.Fatalf("room after a chunk id out of range: %v %v", st, err)
	}
	reason := fmt.Sprint(rc.Failure())
	for _, want := range []string{"prefill-tp1", fmt.Sprintf("%s:%d", f.ranks[1].ip, f.ranks[1].pull.Port())} {
		if !strings.Contains(reason, want) {
			t.Errorf("failure %q does not name the sender (%s)", reason, want)
		}
	}
}
