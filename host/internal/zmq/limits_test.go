package zmq

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog"
)

// The default message limit carries the largest messages SGLang sends
// (a NIXL registration for 10k regions at 1 KiB of agent metadata each, a
// transfer info with a million int32 page indices) and a message of
// exactly the limit; one byte more is refused by its header and the peer
// dropped.
func TestDefaultMessageLimit(t *testing.T) {
	if DefaultMaxMessageSize != 64<<20 {
		t.Fatalf("DefaultMaxMessageSize = %d", DefaultMaxMessageSize)
	}
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()))
	push := newPush(t, pull.Endpoint())
	ctx := testCtx(t, 30*time.Second)
	pattern := func(n, seed int) []byte {
		b := make([]byte, n)
		for i := range min(n, 251) {
			b[i] = byte(i*7 + seed)
		}
		for done := 251; done < n; done *= 2 { // cheap under -race
			copy(b[done:], b[:done])
		}
		return b
	}
	nixlRegistration := [][]byte{[]byte("NixlMsgGuard"), []byte("None"), []byte("127.0.0.1"), []byte("5555"),
		[]byte("agent"), pattern(10000*1024, 1), pattern(10000*8, 2)}
	transferInfo := [][]byte{[]byte("NixlMsgGuard"), []byte("42"), []byte("127.0.0.1"), []byte("5555"),
		[]byte("agent"), pattern(4<<20, 3), []byte("7"), []byte("1"), {}, []byte("0")}
	atLimit := [][]byte{pattern(DefaultMaxMessageSize-1000, 4), pattern(1000, 5)}
	for i, m := range [][][]byte{nixlRegistration, transferInfo, atLimit} {
		if err := push.Send(ctx, m...); err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		got, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if !equalFrames(got, m) {
			t.Fatalf("message %d arrived changed", i)
		}
	}

	c, _ := rawPeer(t, pull.Addr().String(), typePush)
	var hdr [9]byte
	frameHeader(hdr[:], 0, DefaultMaxMessageSize+1)
	c.Write(hdr[:])
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("over the limit: %v, want the connection closed", err)
	}
	waitFor(t, "the refusal to be logged", func() bool { return strings.Contains(logs.String(), "message larger than 67108864") })
}

// A socket keeps at most WithMaxConns connections past their handshake,
// and as many more in their handshake. With every slot held by active
// peers of its own source, a new connection is refused after its
// handshake, before our READY (so it cannot have sent anything), and
// logged (rate-limited); the socket keeps serving those it has, and a
// slot that frees up is used again. Past the handshake slots, a
// connection is closed at once, without a greeting.
func TestMaxConns(t *testing.T) {
	const limit = 4
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()), WithMaxConns(limit), withEvictIdle(time.Hour))
	addr := pull.Addr().String()

	var held []net.Conn
	for i := range limit {
		c, _ := rawPeer(t, addr, typePush)
		c.Write(encodeMessage([][]byte{[]byte(fmt.Sprint("held ", i))}))
		held = append(held, c)
	}
	for range limit {
		if _, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil {
			t.Fatal(err)
		}
	}

	const extra = 30
	for i := range extra {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write(greeting())
		c.Write(encodeCommand("READY", readyMetadata(typePush)))
		// Refused: the greeting, then closed without READY.
		if _, err := io.ReadFull(c, make([]byte, greetingSize)); err != nil {
			t.Fatalf("connection %d over the limit: greeting: %v", i, err)
		}
		if n, err := io.Copy(io.Discard, c); err != nil || n > 0 {
			t.Fatalf("connection %d over the limit got %d bytes after the greeting (%v), want it closed", i, n, err)
		}
		c.Close()
	}
	waitFor(t, "the refusal to be logged", func() bool { return strings.Contains(logs.String(), "connection limit reached") })
	if n := strings.Count(logs.String(), "connection limit reached"); n > ratelog.Burst {
		t.Fatalf("%d refusal log lines for %d refusals; want at most %d (rate-limited)", n, extra, ratelog.Burst)
	}

	// The connections it has are still served.
	held[0].Write(encodeMessage([][]byte{[]byte("still served")}))
	if m, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil || string(m[0]) != "still served" {
		t.Fatalf("held connection: %q %v", m, err)
	}

	// Handshake slots: silent TCP clients take them; the next connection
	// is closed without a greeting.
	var silent []net.Conn
	for range limit {
		s, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		silent = append(silent, s)
		s.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(s, make([]byte, greetingSize)); err != nil {
			t.Fatal(err) // the greeting shows the handshake has begun
		}
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if n, err := io.ReadFull(c, make([]byte, greetingSize)); err == nil || n > 0 {
		t.Fatalf("connection past the handshake slots got %d bytes (%v), want it closed", n, err)
	}
	c.Close()

	// A slot that frees up is used again.
	for _, s := range silent {
		s.Close()
	}
	held[1].Close()
	push := newPush(t, pull.Endpoint(), WithReconnectInterval(10*time.Millisecond, 50*time.Millisecond))
	if err := push.Send(testCtx(t, 10*time.Second), []byte("new")); err != nil {
		t.Fatal(err)
	}
	if m, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil || string(m[0]) != "new" {
		t.Fatalf("after a slot freed: %q %v", m, err)
	}
}

// payloadFor is message i of peer p: its id, then size bytes derived from
// both.
func payloadFor(p, i, size int) [][]byte {
	var id [8]byte
	binary.BigEndian.PutUint32(id[:4], uint32(p))
	binary.BigEndian.PutUint32(id[4:], uint32(i))
	body := make([]byte, size)
	for j := range body {
		body[j] = byte(p*31 + i*7 + j)
	}
	return [][]byte{id[:], body}
}

// Senders faster than Recv: the socket stops reading once its receive
// budget is spent (the senders block) instead of buffering without bound
// or dropping, and everything arrives, in order per peer, once Recv runs.
// Peers that each hold part of a message larger than what is left of the
// budget do not deadlock.
func TestRecvBudgetBackPressure(t *testing.T) {
	const (
		budget  = 1 << 20
		maxMsg  = 512 << 10
		peers   = 4
		perPeer = 48
	)
	sizes := []int{300 << 10, 500 << 10, 20 << 10, 100} // large ones span many reads
	pull := newPull(t, WithRecvBudget(budget), WithMaxMessageSize(maxMsg))
	ctx := testCtx(t, 60*time.Second)

	var sent [peers]int
	var mu sync.Mutex
	var wg sync.WaitGroup
	errc := make(chan error, peers)
	for p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			push, err := DialPush(pull.Endpoint(), quiet())
			if err != nil {
				errc <- err
				return
			}
			defer push.Close()
			for i := range perPeer {
				if err := push.Send(ctx, payloadFor(p, i, sizes[(p+i)%len(sizes)])...); err != nil {
					errc <- fmt.Errorf("peer %d message %d: %w", p, i, err)
					return
				}
				mu.Lock()
				sent[p]++
				mu.Unlock()
			}
		}()
	}
	total := func() (n int) {
		mu.Lock()
		defer mu.Unlock()
		for _, s := range sent {
			n += s
		}
		return n
	}

	// Nobody calls Recv: the budget fills, then the senders stall once
	// the kernel's socket buffers are full too.
	waitFor(t, "the budget to fill", func() bool { used, _ := pull.budget.usage(); return used >= budget-maxMsg })
	stalledAt := total()
	for {
		time.Sleep(300 * time.Millisecond)
		if now := total(); now == stalledAt {
			break
		} else {
			stalledAt = now
		}
	}
	if stalledAt == peers*perPeer {
		t.Fatalf("all %d messages were sent with nobody receiving; want the senders held back", stalledAt)
	}
	used, peak := pull.budget.usage()
	// Small messages (here 100 bytes and 20 KiB) may each go past the
	// budget, one per connection and per message queued.
	largestSmall := int64(20<<10 + 8 + 2*frameOverhead)
	bound := int64(budget+maxMsg+2*frameOverhead) + (peers+DefaultRecvQueue)*largestSmall
	if peak > bound {
		t.Fatalf("the socket held %d bytes of messages, more than budget + one message + the small ones = %d", peak, bound)
	}
	t.Logf("senders stalled after %d of %d messages with %d bytes held (peak %d, bound %d)", stalledAt, peers*perPeer, used, peak, bound)

	next := make([]int, peers)
	for range peers * perPeer {
		m, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("Recv: %v (received %v)", err, next)
		}
		p, i := int(binary.BigEndian.Uint32(m[0][:4])), int(binary.BigEndian.Uint32(m[0][4:]))
		if p >= peers || i != next[p] {
			t.Fatalf("message %d of peer %d arrived, want message %d", i, p, next[p])
		}
		if want := payloadFor(p, i, sizes[(p+i)%len(sizes)]); !equalFrames(m, want) {
			t.Fatalf("message %d of peer %d arrived changed", i, p)
		}
		next[p]++
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if _, peak := pull.budget.usage(); peak > bound {
		t.Fatalf("peak %d bytes held, bound %d", peak, bound)
	}
	waitFor(t, "the budget to be given back", func() bool { used, _ := pull.budget.usage(); return used == 0 })
}

// Readers that each hold part of a message, together the whole budget,
// with nothing queued for Recv to give back: one of them is let past the
// limit to finish, so everything arrives, and the socket still holds at
// most the budget plus one message.
func TestRecvBudgetPartialMessagesDoNotDeadlock(t *testing.T) {
	const (
		budget = 1 << 20
		maxMsg = 1 << 20
		peers  = 4
	)
	pull := newPull(t, WithRecvBudget(budget), WithMaxMessageSize(maxMsg))
	ctx := testCtx(t, 30*time.Second)
	for p := range peers {
		push := newPush(t, pull.Endpoint())
		go push.Send(ctx, payloadFor(p, 0, maxMsg-8)...)
	}
	// Nobody receives until the readers are stuck.
	waitFor(t, "the readers to fill the budget", func() bool { used, _ := pull.budget.usage(); return used >= budget-(128<<10) })
	time.Sleep(200 * time.Millisecond)
	seen := map[int]bool{}
	for range peers {
		m, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("Recv: %v (got %d of %d)", err, len(seen), peers)
		}
		p := int(binary.BigEndian.Uint32(m[0][:4]))
		if !equalFrames(m, payloadFor(p, 0, maxMsg-8)) || seen[p] {
			t.Fatalf("message of peer %d changed or repeated", p)
		}
		seen[p] = true
	}
	_, peak := pull.budget.usage()
	// Each message's first frame (8 bytes) is small and may go past the
	// budget.
	if bound := int64(budget+maxMsg+2*frameOverhead) + peers*(8+frameOverhead); peak > bound {
		t.Fatalf("peak %d bytes held, bound %d", peak, bound)
	}
	pull.budget.mu.Lock()
	overdrafts := pull.budget.overdrafts
	pull.budget.mu.Unlock()
	if overdrafts == 0 {
		t.Fatal("no reader needed the overdraft: the test did not build the deadlock it guards against")
	}
	t.Logf("peak %d bytes, %d overdrafts", peak, overdrafts)
}

// Time a reader spends waiting for the budget is not held against its
// peer: a message whose reading was paused for longer than the message
// timeout still arrives, and its peer stays connected.
func TestRecvBudgetWaitIsNotAStall(t *testing.T) {
	const timeout = 200 * time.Millisecond
	var logs logBuffer
	router := newRouter(t, WithLogger(logs.logger()), WithRecvBudget(1<<20), withMessageTimeout(timeout))
	c, r := rawPeer(t, router.Addr().String(), typeReq)
	first := bytes.Repeat([]byte{1}, 900<<10)
	second := bytes.Repeat([]byte{2}, 900<<10)
	c.Write(encodeMessage([][]byte{{}, first}))
	waitFor(t, "the first message to be queued", func() bool { used, _ := router.budget.usage(); return used >= 900<<10 })
	go c.Write(encodeMessage([][]byte{{}, second}))
	time.Sleep(4 * timeout) // the second waits for the budget meanwhile
	ctx := testCtx(t, 10*time.Second)
	for i, want := range [][]byte{first, second} {
		m, err := router.Recv(ctx)
		if err != nil {
			t.Fatalf("message %d: %v\n%s", i, err, logs.String())
		}
		if len(m.Frames) != 2 || !bytes.Equal(m.Frames[1], want) {
			t.Fatalf("message %d arrived changed", i)
		}
		if i == 1 {
			if err := router.Send(ctx, m.Peer, nil, []byte("ok")); err != nil {
				t.Fatalf("the peer was dropped: %v\n%s", err, logs.String())
			}
		}
	}
	if _, err := readReply(r); err != nil {
		t.Fatalf("reply: %v", err)
	}
	if strings.Contains(logs.String(), "did not finish a message") {
		t.Fatalf("the peer was blamed for the socket's wait:\n%s", logs.String())
	}
}

func readReply(r *bufio.Reader) ([][]byte, error) {
	frames, cmd, err := readMessage(r, limits{maxMessageSize: 1 << 20, maxFrames: 8})
	if err == nil && cmd != nil {
		err = errors.New("got a command")
	}
	return frames, err
}

// readMessage reserves exactly the memory it keeps: each frame's bytes
// plus frameOverhead, for small and for large (grown) frames alike; a
// failed reservation fails the read.
func TestReadMessageReserves(t *testing.T) {
	msg := [][]byte{{}, []byte("small"), bytes.Repeat([]byte{9}, 3<<20+17), bytes.Repeat([]byte{8}, smallFrame+1)}
	var reserved int64
	lim := limits{maxMessageSize: 8 << 20, maxFrames: 8, reserve: func(n int64) error { reserved += n; return nil }}
	got, _, err := readMessage(bufio.NewReader(bytes.NewReader(encodeMessage(msg))), lim)
	if err != nil || !equalFrames(got, msg) {
		t.Fatalf("readMessage: %v", err)
	}
	var want int64
	for _, f := range msg {
		want += frameOverhead + int64(len(f))
	}
	if reserved != want {
		t.Fatalf("reserved %d bytes, want %d", reserved, want)
	}
	errBudget := errors.New("no budget")
	lim.reserve = func(n int64) error {
		if reserved += n; reserved > 1<<20 {
			return errBudget
		}
		return nil
	}
	reserved = 0
	if _, _, err := readMessage(bufio.NewReader(bytes.NewReader(encodeMessage(msg))), lim); !errors.Is(err, errBudget) {
		t.Fatalf("readMessage with a failing reservation: %v", err)
	}
}

// Closing a socket whose readers wait for the budget ends them.
func TestRecvBudgetWaitEndsOnClose(t *testing.T) {
	pull, err := ListenPull("tcp://127.0.0.1:0", quiet(), WithRecvBudget(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	push := newPush(t, pull.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 4 {
		if err := push.Send(ctx, bytes.Repeat([]byte{byte(i)}, 60<<10)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the budget to fill", func() bool { used, _ := pull.budget.usage(); return used >= 60<<10 })
	done := make(chan error, 1)
	go func() { done <- pull.Close() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end a reader waiting for the budget")
	}
}
