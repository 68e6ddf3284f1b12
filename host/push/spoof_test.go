package push_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/kvpool"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/host/zmq"
	"github.com/kvhost/kvhost/host/zmq/zmqtest"
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
	deadline := time.Now().Add(3 * time.Second)
	for dec.Dropped()-before < want && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	t.Logf("decode dropped %d of the %d forged messages", dec.Dropped()-before, want)
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

// open runs a request up to the point where the prefill waits for its
// KV: decode sent the metadata, prefill has it, no byte moved.
func (r *rig) open(ctx context.Context, q *request) error {
	if err := q.rcv.Init(ctx); err != nil {
		return err
	}
	if err := q.rcv.SendMetadata(ctx, q.dpages, q.daux, q.dstate, 0); err != nil {
		return err
	}
	if st, err := q.s.WaitReady(ctx); err != nil || st == sglang.KVPollFailed {
		return fmt.Errorf("prefill not ready: %v %v", st, err)
	}
	return nil
}

// complete runs an opened request to the end and verifies decode's bytes.
func (r *rig) complete(ctx context.Context, q *request) error {
	if err := r.p.pool.Fill(kvpool.Tokens{Request: q.room, Pages: q.ppages, Count: q.tokens}); err != nil {
		return err
	}
	if err := r.p.pool.FillAux(q.room, int(q.paux)); err != nil {
		return err
	}
	if err := q.s.Init(len(q.ppages), q.paux); err != nil {
		return err
	}
	if err := q.s.Send(q.ppages, nil); err != nil {
		return err
	}
	ps, err := q.s.Wait(ctx)
	if err != nil {
		return err
	}
	ds, err := q.rcv.Wait(ctx)
	if err != nil {
		return err
	}
	if ps != sglang.KVPollSuccess || ds != sglang.KVPollSuccess {
		return fmt.Errorf("room %d: prefill %v (%v), decode %v (%v)", q.room, ps, q.s.Failure(), ds, q.rcv.Failure())
	}
	if err := r.d.pool.Verify(kvpool.Tokens{Request: q.room, Pages: q.dpages, Count: q.tokens}); err != nil {
		return err
	}
	return r.d.pool.VerifyAux(q.room, int(q.daux))
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
// with the bootstrap server, and an agent that sends notifications.
type fakeRank struct {
	ip    string
	pull  *zmq.Pull
	agent *plugin.Agent
	peer  string // the decode's agent, once loaded
}

// TestSpoofedCompletionFanIn: a TP 2 prefill (rank 0 on 127.0.0.1, rank 1
// on 127.0.0.3) answers a TP 1 decode, so every room expects a part from
// each rank. Rank 0 sends its part honestly; then forged Success statuses
// for both ranks from rank 0's IP (the attacker shares a host with rank 0)
// and from 127.0.0.2, rank 1's notification tags from an agent that is not
// rank 1's, and rank 1's tags from rank 0's own agent complete no room.
// Rank 1's honest part then completes every room.
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
			pl := faketest.Plugin(t)
			srv, err := bootstrap.NewServer(bootstrap.WithLogger(quietLog())).Start("127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				cctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				srv.Close(cctx)
			})
			notifs := c.completion != push.CompletionStatus
			ranks := []*fakeRank{{ip: "127.0.0.1"}, {ip: "127.0.0.3"}}
			for i, fr := range ranks {
				if fr.pull, err = zmq.ListenPull(zmq.TCPEndpoint(fr.ip, 0)); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { fr.pull.Close() })
				if fr.agent, err = pl.NewAgent(fmt.Sprintf("prefill-tp%d", i)); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { fr.agent.Close() })
				err = bootstrap.NewClient(srv.Addr()).Register(ctx, bootstrap.Registration{
					AttnTPSize: 2, AttnTPRank: i, AttnCPSize: 1, AttnDPSize: 1, PPSize: 1, SystemDPSize: 1,
					RankIP: fr.ip, RankPort: fr.pull.Port(), PageSize: rigPageSize, KVCacheDType: "auto"})
				if err != nil {
					t.Fatal(err)
				}
			}
			d := newSide(t, rigPages, false)
			dec, err := push.NewDecode(ctx, push.DecodeConfig{Plugin: pl, Variant: c.variant, Completion: c.completion,
				KV: d.args, Parallel: push.Parallel{TPSize: 1}, Logger: quietLog()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { dec.Close() })
			open := func(room uint64, slot int) *push.Receiver {
				t.Helper()
				rc, err := dec.NewReceiver(srv.Addr(), room)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(rc.Close)
				if err := rc.Init(ctx); err != nil {
					t.Fatal(err)
				}
				if err := rc.SendMetadata(ctx, []int32{int32(2 * slot), int32(2*slot + 1)}, int64(slot%rigAuxSlots), nil, 0); err != nil {
					t.Fatal(err)
				}
				return rc
			}
			// The honest part of rank i for a room: notification tags from
			// its agent, or a Success status from its IP.
			var status []*statusSender
			for _, fr := range ranks {
				status = append(status, dialStatus(t, dec.Endpoint(), fr.ip))
			}
			honest := func(i int, room uint64) {
				t.Helper()
				if !notifs {
					status[i].success(room, i)
					return
				}
				for _, tag := range []string{fmt.Sprintf("%d_kv_0_1_%d", room, i), fmt.Sprintf("%d_aux", room)} {
					if err := ranks[i].agent.SendNotif(ranks[i].peer, []byte(tag)); err != nil {
						t.Fatal(err)
					}
				}
			}
			warm := open(3000, 0)
			if notifs {
				// Each rank loads the decode's metadata from its registration,
				// as a prefill rank does.
				for _, fr := range ranks {
					frames, err := fr.pull.Recv(ctx)
					if err != nil {
						t.Fatal(err)
					}
					m, err := sglang.ParseNIXLToPrefill(frames)
					if err != nil {
						t.Fatal(err)
					}
					reg, ok := m.(*sglang.NIXLRegistration)
					if !ok {
						t.Fatalf("first message to a prefill rank is a %T", m)
					}
					if fr.peer, err = fr.agent.LoadRemote(reg.AgentMetadata); err != nil {
						t.Fatal(err)
					}
				}
			}
			// One honest room first.
			honest(0, 3000)
			honest(1, 3000)
			if st, err := warm.Wait(ctx); err != nil || st != sglang.KVPollSuccess {
				t.Fatalf("honest room: %v %v %v", st, err, warm.Failure())
			}

			var rcvs []*push.Receiver
			for i := range spoofRooms {
				rcvs = append(rcvs, open(uint64(4000+i), 1+i))
			}
			before := dec.Dropped()
			other := dialStatus(t, dec.Endpoint(), "127.0.0.2")
			var tag func(string)
			if notifs {
				tag = evilAgent(t, pl, dec)
			}
			want := int64(0)
			for _, rc := range rcvs {
				room := rc.Room()
				honest(0, room)
				status[0].success(room, 1) // rank 1 lives on another host
				other.success(room, 0)
				other.success(room, 1)
				want += 3
				if notifs {
					status[0].success(room, 0) // rank 0 reports by notification
					tag(fmt.Sprintf("%d_kv_0_1_1", room))
					tag(fmt.Sprintf("%d_aux", room))
					// Rank 0's agent claiming rank 1's chunk.
					if err := ranks[0].agent.SendNotif(ranks[0].peer, []byte(fmt.Sprintf("%d_kv_0_1_1", room))); err != nil {
						t.Fatal(err)
					}
					want += 4
				}
			}
			settle(t, dec, before, want)
			if n := countSuccess(rcvs); n != 0 {
				t.Errorf("%d of %d rooms reached Success with only rank 0's part arrived", n, len(rcvs))
			}
			for _, rc := range rcvs {
				honest(1, rc.Room())
			}
			for _, rc := range rcvs {
				if st, err := rc.Wait(ctx); err != nil || st != sglang.KVPollSuccess {
					t.Fatalf("room %d after rank 1's honest part: %v %v %v", rc.Room(), st, err, rc.Failure())
				}
			}
		})
	}
}
