package push_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// events records the observer's events.
type events struct {
	push.NopObserver
	mu        sync.Mutex
	rooms     map[uint64][]sglang.KVPoll
	transfers []push.TransferEvent
	failures  []push.FailureEvent
	shakes    []push.HandshakeEvent
}

func newEvents() *events { return &events{rooms: map[uint64][]sglang.KVPoll{}} }

func (e *events) Room(ev push.RoomEvent) {
	e.mu.Lock()
	e.rooms[ev.Room] = append(e.rooms[ev.Room], ev.To)
	e.mu.Unlock()
}
func (e *events) Transfer(ev push.TransferEvent) {
	e.mu.Lock()
	e.transfers = append(e.transfers, ev)
	e.mu.Unlock()
}
func (e *events) Failure(ev push.FailureEvent) {
	e.mu.Lock()
	e.failures = append(e.failures, ev)
	e.mu.Unlock()
}
func (e *events) Handshake(ev push.HandshakeEvent) {
	e.mu.Lock()
	e.shakes = append(e.shakes, ev)
	e.mu.Unlock()
}

// TestTransferVariants moves rooms through the API (chunks of two pages,
// aux, Mamba state) for both wire variants and both completion signals,
// checks every byte and the state machine the observers saw.
func TestTransferVariants(t *testing.T) {
	noNotif := []plugin.Param{{Key: "caps_off", Value: "notif"}}
	for _, c := range []struct {
		name    string
		variant push.Variant
		params  []plugin.Param
		xfer    push.XferMode
	}{
		{"nixl-notif", push.VariantNIXL, nil, push.XferBatch},
		{"nixl-status", push.VariantNIXL, noNotif, push.XferBatch},
		{"nixl-prepped", push.VariantNIXL, nil, push.XferPrepped},
		{"mori", push.VariantMORI, nil, push.XferBatch},
	} {
		t.Run(c.name, func(t *testing.T) {
			pe, de := newEvents(), newEvents()
			r := newRig(t, rigOpts{variant: c.variant, pparams: c.params, dparams: c.params, xfer: c.xfer, state: true, pobs: pe, dobs: de})
			ctx := ctxT(t, 20*time.Second)
			for i := 0; i < 6; i++ {
				q := r.prepare(uint64(100+i), 1+3*i, i)
				// Mamba: one slot per request on each side.
				q.pstate = [][]int32{{int32(i)}}
				q.dstate = [][]int32{{int32(stateSlots - 1 - i)}}
				for k := 0; k < 2; k++ {
					b := r.p.stateSlot(k, i)
					for j := range b {
						b[j] = byte(i*31 + k*7 + j)
					}
					clear(r.d.stateSlot(k, stateSlots-1-i))
				}
				if err := r.transfer(ctx, q); err != nil {
					t.Fatal(err)
				}
				for k := 0; k < 2; k++ {
					if !bytes.Equal(r.p.stateSlot(k, i), r.d.stateSlot(k, stateSlots-1-i)) {
						t.Fatalf("room %d: state tensor %d differs", q.room, k)
					}
				}
				q.close()
			}
			if r.pf.Rooms() != 0 || r.pf.Pending() != 0 || r.dec.Rooms() != 0 {
				t.Fatalf("rooms left: prefill %d/%d decode %d", r.pf.Rooms(), r.pf.Pending(), r.dec.Rooms())
			}
			pe.mu.Lock()
			defer pe.mu.Unlock()
			for room, seq := range pe.rooms {
				want := []sglang.KVPoll{sglang.KVPollBootstrapping, sglang.KVPollWaitingForInput, sglang.KVPollTransferring, sglang.KVPollSuccess}
				if !equalStatus(seq, want) {
					t.Errorf("prefill room %d went %v, want %v", room, seq, want)
				}
			}
			var kinds [3]int
			for _, ev := range pe.transfers {
				if ev.Err != nil || (ev.Bytes == 0 && ev.Kind == push.TransferKV) || ev.Descs == 0 {
					t.Errorf("transfer event %+v", ev)
				}
				if ev.Kind == push.TransferKV && ev.Plan <= 0 {
					t.Errorf("KV transfer event without planning time: %+v", ev)
				}
				kinds[ev.Kind]++
			}
			if kinds[push.TransferKV] == 0 {
				t.Errorf("no KV transfer events: %v", kinds)
			}
			sawPeer := false
			for _, h := range pe.shakes {
				sawPeer = sawPeer || (h.Kind == push.HandshakePeer && h.Err == nil)
			}
			if !sawPeer {
				t.Error("no peer registration event")
			}
		})
	}
}

func equalStatus(a, b []sglang.KVPoll) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestBootstrapTimeout: a prefill room that decode never bootstraps fails
// with SGLang's disaggregation/{nixl,mori}/conn.py's reason. The timeout
// passes on a fake clock.
func TestBootstrapTimeout(t *testing.T) {
	const timeout, sweep = 100 * time.Millisecond, 10 * time.Millisecond // sweep: push's sweepPeriod(timeout)
	fk := clock.NewFake(time.Time{})
	r := newRig(t, rigOpts{pset: push.Settings{BootstrapTimeout: timeout}, noDecode: true, clock: fk})
	s, err := r.pf.NewSender(42)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitArmed(t, fk, sweep)
	fk.Advance(timeout + 2*sweep)
	st, err := s.Wait(ctxT(t, 5*time.Second))
	if err != nil || st != sglang.KVPollFailed {
		t.Fatalf("%v %v", st, err)
	}
	if e := s.Failure(); e == nil || !strings.Contains(e.Error(), "in KVPoll.Bootstrapping") {
		t.Fatalf("failure %v", e)
	}
}

// TestWaitingTimeoutAborts: a decode room whose transfer never comes fails
// with SGLang's disaggregation/{nixl,mori}/conn.py's reason and tells prefill with ABORT, which fails the
// prefill room with decode's address and releases it.
//
// The timeout passes on a fake clock; the ranks talk over the in-memory
// transport.
func TestWaitingTimeoutAborts(t *testing.T) {
	const timeout, sweep = 150 * time.Millisecond, 15 * time.Millisecond // sweep: push's sweepPeriod(timeout)
	fk := clock.NewFake(time.Time{})
	r := newRig(t, rigOpts{dset: push.Settings{WaitingTimeout: timeout}, clock: fk, mem: memtransport.New(fk)})
	ctx := ctxT(t, 10*time.Second)
	q := r.prepare(7, 8, 0)
	defer q.close()
	if err := q.rcv.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := q.rcv.SendMetadata(ctx, q.dpages, q.daux, nil, 0); err != nil {
		t.Fatal(err)
	}
	// Prefill never sends.
	waitArmed(t, fk, sweep)
	fk.Advance(timeout + 2*sweep)
	if st, _ := q.rcv.Wait(ctx); st != sglang.KVPollFailed || !strings.Contains(q.rcv.Failure().Error(), "in KVPoll.WaitingForInput") {
		t.Fatalf("decode %v: %v", st, q.rcv.Failure())
	}
	if st, _ := q.s.Wait(ctx); st != sglang.KVPollFailed || !strings.Contains(q.s.Failure().Error(), "Aborted by decode") {
		t.Fatalf("prefill %v: %v", st, q.s.Failure())
	}
	if te := q.s.Failure().(*push.TransferError); !te.Remote {
		t.Fatal("abort from decode not marked remote")
	}
}

// TestTransferSLA: a transfer slower than the SLA fails the room on both
// sides with the SLA reason.
func TestTransferSLA(t *testing.T) {
	slow := []plugin.Param{{Key: "delay_us", Value: "400000"}}
	// The SLA passes on a fake clock, once the transfer is in flight.
	const sla = 50 * time.Millisecond
	fk := clock.NewFake(time.Time{})
	r := newRig(t, rigOpts{pparams: slow, pset: push.Settings{TransferTimeout: sla}, clock: fk})
	ctx := ctxT(t, 10*time.Second)
	q := r.prepare(9, 8, 0)
	defer q.close()
	go func() {
		wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := fk.WaitArmed(wctx, sla); err != nil {
			t.Error("no SLA timer armed:", err)
		}
		fk.Advance(sla)
	}()
	err := r.transfer(ctx, q)
	if err == nil || !strings.Contains(q.s.Failure().Error(), "exceeded SLA 50ms") {
		t.Fatalf("err %v, prefill failure %v", err, q.s.Failure())
	}
	if f := q.rcv.Failure(); f == nil || !strings.Contains(f.Error(), "exceeded SLA") {
		t.Fatalf("decode failure %v", f)
	}
}

// TestAbortFromPrefill: the prefill engine aborts; decode fails with the
// reason.
func TestAbortFromPrefill(t *testing.T) {
	r := newRig(t, rigOpts{})
	ctx := ctxT(t, 10*time.Second)
	q := r.prepare(11, 8, 0)
	defer q.close()
	if err := q.rcv.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := q.rcv.SendMetadata(ctx, q.dpages, q.daux, nil, 0); err != nil {
		t.Fatal(err)
	}
	q.s.WaitReady(ctx)
	q.s.Abort()
	if st, _ := q.rcv.Wait(ctx); st != sglang.KVPollFailed || !strings.Contains(q.rcv.Failure().Error(), "Aborted by AbortReq.") {
		t.Fatalf("decode %v: %v", st, q.rcv.Failure())
	}
	if te := q.rcv.Failure().(*push.TransferError); !te.Remote {
		t.Fatal("prefill's reason not marked remote on decode")
	}
}

// TestHostileMessages: garbage on both PULL sockets while requests run is
// dropped; the requests are unaffected.
func TestHostileMessages(t *testing.T) {
	for _, v := range []push.Variant{push.VariantNIXL, push.VariantMORI} {
		t.Run(v.String(), func(t *testing.T) {
			r := newRig(t, rigOpts{variant: v})
			ctx := ctxT(t, 30*time.Second)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			var rounds [2]chan struct{}
			for i, ep := range []string{r.pf.Endpoint(), r.dec.Endpoint()} {
				rounds[i] = make(chan struct{})
				wg.Add(1)
				go func() {
					defer wg.Done()
					hostile(t, ep, stop, rounds[i])
				}()
			}
			<-rounds[0]
			for i := 0; i < 12; i++ {
				q := r.prepare(uint64(500+i), 1+i, i)
				if err := r.transfer(ctx, q); err != nil {
					t.Fatal(err)
				}
				q.close()
			}
			<-rounds[0]
			<-rounds[1]
			close(stop)
			wg.Wait()
			if r.pf.Dropped() == 0 || r.dec.Dropped() == 0 {
				t.Fatalf("dropped: prefill %d, decode %d", r.pf.Dropped(), r.dec.Dropped())
			}
			t.Logf("dropped prefill %d, decode %d", r.pf.Dropped(), r.dec.Dropped())
		})
	}
}

// hostile sends malformed and misdirected messages to endpoint until stop,
// signalling on round after each full round of them.
func hostile(t *testing.T, endpoint string, stop, round chan struct{}) {
	p, err := zmq.DialPush(endpoint)
	if err != nil {
		t.Error(err)
		return
	}
	defer p.Close()
	msgs := [][][]byte{
		{[]byte("garbage")},
		{[]byte(sglang.NIXLGuard)},
		{[]byte(sglang.MORIGuard)},
		{[]byte(sglang.NIXLGuard), []byte("None"), []byte("1.2.3.4")},
		{[]byte(sglang.NIXLGuard), []byte("12x"), []byte("h"), []byte("1"), []byte("a"), {1, 2, 3}, []byte("0"), []byte("1")},
		{[]byte(sglang.MORIGuard), []byte("None"), []byte("h"), []byte("1"), {0xc1}, {0xff}, nil, nil, []byte("0"), []byte("1"), []byte("0"), []byte("8")},
		{[]byte(sglang.AbortHeader), []byte("500"), []byte("10.0.0.1"), []byte("99999")},
		{[]byte(sglang.AbortHeader), []byte("501"), []byte("10.0.0.9"), []byte("5555")},     // unknown decode: ignored
		{[]byte(sglang.AbortHeader), []byte("502"), []byte("127.0.0.1"), []byte("1")},       // before the room exists, not a peer
		{[]byte(sglang.MORIGuard), []byte("500"), []byte("7"), []byte("0"), []byte("")},     // unknown status code
		{[]byte(sglang.MORIGuard), []byte("999999"), []byte("0"), []byte("0"), []byte("x")}, // failure of an unknown room
		{[]byte(sglang.AuxDataHeader), []byte("500"), []byte("0"), []byte("0"), {0, 0, 0, 9}, []byte("short")},
		{[]byte(sglang.AuxDataHeader), []byte("503"), []byte("7"), []byte("1"), {0, 0, 0, 1}, []byte("x")},
		{[]byte("WATERMARK"), []byte("1")},
		{},
	}
	ctx := context.Background()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		if i > 0 && i%len(msgs) == 0 {
			select {
			case round <- struct{}{}:
			default:
			}
		}
		m := msgs[i%len(msgs)]
		if len(m) == 0 {
			m = [][]byte{{}}
		}
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		p.Send(sctx, m...)
		cancel()
		time.Sleep(200 * time.Microsecond)
	}
}
