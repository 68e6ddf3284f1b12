package zmq

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// 8 PUSH peers send 10k messages each to one PULL socket, closing their
// socket and connecting a new one every few hundred messages (connection
// churn, like SGLang recreating sockets after a disconnect). Every message
// must arrive exactly once, within a bounded time, with no deadlock.
func TestChurnEightPeersTenThousandMessages(t *testing.T) {
	const peers, perPeer = 8, 10000
	pull := newPull(t)
	ctx := testCtx(t, 30*time.Second)
	start := time.Now()

	var wg sync.WaitGroup
	errc := make(chan error, peers)
	var reconnects [peers]int
	for p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 7))
			push, err := DialPush(pull.Endpoint(), quiet())
			if err != nil {
				errc <- err
				return
			}
			next := 200 + rng.IntN(1300)
			payload := make([]byte, 64)
			for i := range perPeer {
				if i == next {
					push.Close()
					reconnects[p]++
					if push, err = DialPush(pull.Endpoint(), quiet()); err != nil {
						errc <- err
						return
					}
					next += 200 + rng.IntN(1300)
				}
				var id [8]byte
				binary.BigEndian.PutUint32(id[:4], uint32(p))
				binary.BigEndian.PutUint32(id[4:], uint32(i))
				fillPayload(payload, p, i)
				if err := push.Send(ctx, id[:], payload); err != nil {
					errc <- fmt.Errorf("peer %d message %d: %w", p, i, err)
					return
				}
			}
			push.Close()
		}()
	}

	seen := make([][]bool, peers)
	for p := range seen {
		seen[p] = make([]bool, perPeer)
	}
	for n := 0; n < peers*perPeer; n++ {
		m, err := pull.Recv(ctx)
		if err != nil {
			select {
			case e := <-errc:
				t.Fatalf("sender failed: %v", e)
			default:
			}
			t.Fatalf("after %d messages: %v", n, err)
		}
		if len(m) != 2 || len(m[0]) != 8 || len(m[1]) != 64 {
			t.Fatalf("malformed message %q", m)
		}
		p, i := binary.BigEndian.Uint32(m[0][:4]), binary.BigEndian.Uint32(m[0][4:])
		if p >= peers || i >= perPeer {
			t.Fatalf("message id %d/%d out of range", p, i)
		}
		want := make([]byte, 64)
		fillPayload(want, int(p), int(i))
		if !bytes.Equal(m[1], want) {
			t.Fatalf("peer %d message %d: payload %x, want %x", p, i, m[1], want)
		}
		if seen[p][i] {
			t.Fatalf("peer %d message %d delivered twice", p, i)
		}
		seen[p][i] = true
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	total := 0
	for p, r := range reconnects {
		if r < 5 {
			t.Errorf("peer %d reconnected only %d times: not the churn this test is about", p, r)
		}
		total += r
	}
	// Nothing extra may be queued.
	short, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if m, err := pull.Recv(short); err == nil {
		t.Fatalf("unexpected extra message %q", m)
	}
	t.Logf("%d messages from %d peers with %d reconnects in %v", peers*perPeer, peers, total, time.Since(start))
}

// fillPayload writes bytes derived from (peer, message) so a message
// delivered with another's payload, or corrupted, is caught.
func fillPayload(b []byte, peer, msg int) {
	for k := range b {
		b[k] = byte(peer*131 + msg*7 + k)
	}
}

// The receiving side restarts three times while 8 peers keep sending.
// Nothing deadlocks, every Send returns, and once the listener is back
// every peer's messages arrive again. (Messages the dead listener had
// accepted but not yet handed to Recv are lost with it, as with libzmq.)
func TestChurnReceiverRestarts(t *testing.T) {
	const peers = 8
	pull := newPull(t)
	ep := pull.Endpoint()
	ctx := testCtx(t, 30*time.Second)

	var mu sync.Mutex
	cur := pull
	var wg sync.WaitGroup
	stop := make(chan struct{})
	received := make(chan [][]byte, 1024)
	recvLoop := func(p *Pull) {
		defer wg.Done()
		for {
			m, err := p.Recv(ctx)
			if err != nil {
				return
			}
			received <- m
		}
	}
	wg.Add(1)
	go recvLoop(pull)

	var sendWG sync.WaitGroup
	sent := make([]int, peers)
	pushes := make([]*Push, peers)
	for p := range peers {
		pushes[p] = newPush(t, ep, WithReconnectInterval(5*time.Millisecond, 50*time.Millisecond))
	}
	for p := range peers {
		sendWG.Add(1)
		go func() {
			defer sendWG.Done()
			push := pushes[p]
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				err := push.Send(sctx, []byte{byte(p)}, []byte(fmt.Sprint(i)))
				cancel()
				if err == nil {
					sent[p]++
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	go func() {
		for range received {
		}
	}()

	for range 3 {
		time.Sleep(100 * time.Millisecond)
		mu.Lock()
		cur.Close()
		time.Sleep(50 * time.Millisecond)
		next := relisten(t, ep)
		cur = next
		mu.Unlock()
		wg.Add(1)
		go recvLoop(next)
	}
	time.Sleep(100 * time.Millisecond)
	close(stop)
	sendWG.Wait()

	// After one more restart, every peer's socket must deliver again.
	mu.Lock()
	final := cur
	mu.Unlock()
	final.Close()
	wg.Wait()
	close(received)
	last := relisten(t, ep)
	defer last.Close()
	for p, push := range pushes {
		if err := push.Send(ctx, []byte{byte(p)}, []byte("final")); err != nil {
			t.Fatalf("peer %d after restarts: %v", p, err)
		}
	}
	got := map[byte]bool{}
	for range peers {
		m, err := last.Recv(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if string(m[1]) != "final" {
			t.Fatalf("stale message %q after the last restart", m)
		}
		got[m[0][0]] = true
	}
	if len(got) != peers {
		t.Fatalf("final messages from %d peers, want %d", len(got), peers)
	}
	t.Logf("sent per peer during restarts: %v", sent)
}
