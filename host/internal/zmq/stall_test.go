package zmq

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// decodeRun plays a decode's control traffic to a prefill's PULL socket:
// requests one at a time, each a message (every tenth a 1 MiB one, like a
// transfer info for a long prompt, the others 2 KiB) that the prefill
// receives and works on for 20 ms. It returns how long the run took.
func decodeRun(t *testing.T, pull *Pull, push *Push, requests int) time.Duration {
	t.Helper()
	ctx := testCtx(t, 2*time.Minute)
	start := time.Now()
	for i := range requests {
		size := 2 << 10
		if i%10 == 9 {
			size = 1 << 20
		}
		want := bytes.Repeat([]byte{byte(i)}, size)
		if err := push.Send(ctx, []byte(fmt.Sprint(i)), want); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		m, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if len(m) != 2 || string(m[0]) != fmt.Sprint(i) || !bytes.Equal(m[1], want) {
			t.Fatalf("request %d arrived changed", i)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// Three peers that each send 33 MiB of a large frame and stop, holding
// the receive budget (and its overdraft) between them, delay a decode's
// control messages by at most a small bound: the run takes at most 3×
// its unattacked time measured in the same test. They held everyone's
// messages until their message timeout: 100 requests took 32 s instead
// of 1.4 s.
func TestStalledLargeFramesDelayNobody(t *testing.T) {
	const requests, attackers, sent = 100, 3, 33 << 20
	pull := newPull(t)
	push := newPush(t, pull.Endpoint())
	decodeRun(t, pull, push, 10) // warm up
	base := decodeRun(t, pull, push, requests)

	var conns []net.Conn
	for range attackers {
		c, _ := rawPeer(t, pull.Addr().String(), typePush)
		conns = append(conns, c)
		var hdr [9]byte
		frameHeader(hdr[:], 0, DefaultMaxMessageSize-1024)
		go func() {
			c.SetDeadline(time.Now().Add(2 * time.Minute))
			c.Write(hdr[:])
			c.Write(make([]byte, sent)) // then nothing more
		}()
	}
	waitFor(t, "the stalled frames to hold the budget", func() bool {
		used, _ := pull.budget.usage()
		return used >= attackers*sent
	})
	attacked := decodeRun(t, pull, push, requests)
	used, peak := pull.budget.usage()
	t.Logf("%d requests: %v unattacked, %v with %d peers stalled in %d MiB frames (budget: %d MiB held now, peak %d MiB)",
		requests, base, attacked, attackers, sent>>20, used>>20, peak>>20)
	if attacked > 3*base {
		t.Fatalf("stalled peers slowed the run from %v to %v, more than 3×", base, attacked)
	}
	for _, c := range conns {
		c.Close()
	}
}

// The two rules behind it: a small message passes a spent budget at once,
// and a peer stalled inside a message that holds the budget another
// message waits for is dropped after contendedTimeout (not the 30 s
// message timeout), after which the waiting message arrives.
func TestStalledHolderGivesWay(t *testing.T) {
	const contended = 300 * time.Millisecond
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()), WithRecvBudget(1<<20), WithMaxMessageSize(4<<20), withContendedTimeout(contended))
	c, _ := rawPeer(t, pull.Addr().String(), typePush)
	var hdr [9]byte
	frameHeader(hdr[:], 0, 4<<20)
	c.Write(hdr[:])
	c.Write(make([]byte, 1<<20+1)) // holds the whole budget, then stalls
	waitFor(t, "the stalled frame to hold the budget", func() bool { used, _ := pull.budget.usage(); return used >= 1<<20 })

	push := newPush(t, pull.Endpoint())
	ctx := testCtx(t, 10*time.Second)
	start := time.Now()
	if err := push.Send(ctx, []byte("small")); err != nil {
		t.Fatal(err)
	}
	if m, err := pull.Recv(ctx); err != nil || string(m[0]) != "small" {
		t.Fatalf("small message: %q %v", m, err)
	}
	if el := time.Since(start); el > contended {
		t.Fatalf("a small message took %v with the budget spent", el)
	}
	big := bytes.Repeat([]byte{7}, 512<<10)
	start = time.Now()
	if err := push.Send(ctx, big); err != nil {
		t.Fatal(err)
	}
	if m, err := pull.Recv(ctx); err != nil || !bytes.Equal(m[0], big) {
		t.Fatalf("large message: %v", err)
	}
	if el := time.Since(start); el < contended/2 || el > 10*contended {
		t.Fatalf("a large message waited %v for the stalled peer, want about %v", el, contended)
	}
	waitFor(t, "the stalled peer to be dropped", func() bool {
		return strings.Contains(logs.String(), "did not finish a message while others waited for the receive budget")
	})
}
