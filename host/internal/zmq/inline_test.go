package zmq

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// pathCounts counts what Router.Enqueue did with each message
// (withEnqueueHook).
type pathCounts [3]atomic.Int64

func (c *pathCounts) String() string {
	return fmt.Sprintf("%d written inline, %d in part inline, %d queued", c[pathInline].Load(), c[pathPartial].Load(), c[pathQueued].Load())
}

func withBurstGap(d time.Duration) Option {
	return func(o *options) { o.burstGap = d }
}

func withEnqueueHook(c *pathCounts) Option {
	return func(o *options) { o.enqueueHook = func(p enqueuePath) { c[p].Add(1) } }
}

// transports are the two a Router listens on: ipc (unix) and tcp.
var transports = []string{"ipc", "tcp"}

// listenRouterOn binds a Router on transport ("ipc" or "tcp").
func listenRouterOn(t *testing.T, transport string, opts ...Option) *Router {
	t.Helper()
	ep := "tcp://127.0.0.1:0"
	if transport == "ipc" {
		ep = IPCEndpoint(ipcPath(t, "r.sock"))
	}
	r, err := ListenRouter(ep, append([]Option{quiet()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// rawDealer connects a hand-driven DEALER to r (it reads only when the
// test says so) and returns it with the id r gave it.
func rawDealer(t *testing.T, r *Router) (net.Conn, *bufio.Reader, []byte) {
	t.Helper()
	c, br := rawPeer(t, r.Addr().String(), typeDealer)
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	if _, err := c.Write(encodeMessage([][]byte{[]byte("hello")})); err != nil {
		t.Fatal(err)
	}
	m, err := r.Recv(testCtx(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return c, br, m.Peer
}

// inlineMsg is message i of a test: its index, then a body whose bytes
// depend on their offset, so a torn or shifted frame cannot pass.
func inlineMsg(i, size int) [][]byte {
	body := make([]byte, size)
	for j := range body {
		body[j] = byte(i*7 + j*13 + j>>8)
	}
	return [][]byte{[]byte(strconv.Itoa(i)), body}
}

// readInOrder reads messages from..to-1 (inlineMsg with sizes) from a
// raw peer and fails unless each arrives whole, in order; it answers
// nothing and returns the PONG commands it met on the way.
func readInOrder(t *testing.T, br *bufio.Reader, from, to int, sizes func(int) int) (pongs []string) {
	t.Helper()
	pongs, err := readMsgs(br, from, to, sizes)
	if err != nil {
		t.Fatal(err)
	}
	return pongs
}

// readMsgs is readInOrder for a goroutine other than the test's.
func readMsgs(br *bufio.Reader, from, to int, sizes func(int) int) (pongs []string, err error) {
	for i := from; i < to; {
		frames, cmd, err := readMessage(br, limits{maxMessageSize: 1 << 30, maxFrames: 4})
		if err != nil {
			return pongs, fmt.Errorf("message %d: %w (the stream is corrupt)", i, err)
		}
		if cmd != nil {
			if cmd.name != "PONG" {
				return pongs, fmt.Errorf("command %q before message %d", cmd.name, i)
			}
			pongs = append(pongs, string(cmd.body))
			continue
		}
		if !equalFrames(frames, inlineMsg(i, sizes(i))) {
			return pongs, fmt.Errorf("message %d arrived changed: %d frames, first %.20q", i, len(frames), frames[0])
		}
		i++
	}
	return pongs, nil
}

// mixedSize cycles through tiny to well above any socket buffer; bigSize
// alone is larger than what a fresh connection's kernel buffers take
// (TCP autotunes up to a few MiB on loopback; unix takes 208 KiB).
const bigSize = 16 << 20

func mixedSize(i int) int {
	return []int{0, 1, 100, 3000, 64 << 10, 300 << 10, 2, 1 << 20, 5}[i%9]
}

// A DEALER that stops reading while a router Enqueues messages of mixed
// sizes: the first go out whole from Enqueue, one is written in part
// and its rest by the drain goroutine, the later ones are queued; when
// the peer reads again, every message arrives whole, in order; and once
// the peer has caught up, Enqueue writes inline again. Over ipc and tcp.
// (No burst gap: every message may go inline.)
func TestRouterEnqueueInlinePartialQueued(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			var paths pathCounts
			r := listenRouterOn(t, tr, withEnqueueHook(&paths), WithSendQueue(1<<20), withBurstGap(0))
			_, br, peer := rawDealer(t, r)
			sizes := func(i int) int {
				switch {
				case i < 3:
					return 10 // into an empty socket: inline
				case i == 3:
					return bigSize // does not fit: in part
				}
				return mixedSize(i)
			}
			const n = 60
			for i := range n {
				if err := r.Enqueue(peer, inlineMsg(i, sizes(i))...); err != nil {
					t.Fatal(i, err)
				}
				if i == 2 && paths[pathInline].Load() != 3 {
					t.Fatalf("small messages to an idle peer: %v, want 3 inline", &paths)
				}
				if i == 3 && paths[pathPartial].Load() != 1 {
					t.Fatalf("a %d-byte message to an idle peer: %v, want it written in part", bigSize, &paths)
				}
			}
			if q := paths[pathQueued].Load(); q != n-4 {
				t.Fatalf("%v; want %d queued behind the rest", &paths, n-4)
			}
			if msgs, _ := r.Queued(peer); msgs == 0 {
				t.Fatal("nothing waiting for a peer that does not read")
			}
			readInOrder(t, br, 0, n, sizes)

			// Caught up: the socket is empty and Enqueue writes again
			// itself (the drain goroutine may still be finishing: then a
			// message is queued, so wait for that first).
			ctx := testCtx(t, 10*time.Second)
			r.Flush(ctx)
			before := paths[pathInline].Load()
			if err := r.Enqueue(peer, inlineMsg(n, 10)...); err != nil {
				t.Fatal(err)
			}
			if paths[pathInline].Load() != before+1 {
				t.Fatalf("after the peer caught up: %v, want the message written inline", &paths)
			}
			readInOrder(t, br, n, n+1, func(int) int { return 10 })
			t.Logf("%v", &paths)
		})
	}
}

// Many messages of mixed sizes, sent in bursts to a peer that reads
// slowly, pausing every few messages so that its socket (64 KiB of
// buffers) fills. Each burst starts when the peer has read everything
// before it (the socket is empty) and the peer waits after its first
// message until its third was enqueued: the first (small) is written
// inline, the second (larger than the socket) in part, the third
// queued behind its rest; the others take whichever path the socket
// allows. Every message arrives whole, in order. (No burst gap: every
// message may go inline; TestRouterEnqueueBurstsAreBatched tests it.)
func TestRouterEnqueueMixedSizesSlowReader(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			var paths pathCounts
			r := listenRouterOn(t, tr, withEnqueueHook(&paths), WithSendQueue(1<<20), withBurstGap(0))
			c, br, peer := rawDealer(t, r)
			shrinkBuffers(t, r, peer, c, 64<<10)
			const n, burst = 540, 45
			size := func(i int) int {
				if i%burst == 1 {
					return 1 << 20
				}
				return mixedSize(i)
			}
			var read atomic.Int64
			resume := make(chan struct{})
			done := make(chan error, 1)
			go func() {
				for i := range n {
					if _, err := readMsgs(br, i, i+1, size); err != nil {
						done <- err
						return
					}
					read.Store(int64(i + 1))
					if i%burst == 0 {
						<-resume
					}
					if i%10 == 9 {
						time.Sleep(2 * time.Millisecond) // the socket fills meanwhile
					}
				}
				done <- nil
			}()
			for i := range n {
				if i%burst == 0 {
					waitFor(t, "the peer to read the burst before", func() bool { return read.Load() == int64(i) })
				}
				if err := r.Enqueue(peer, inlineMsg(i, size(i))...); err != nil {
					t.Fatal(i, err)
				}
				if i%burst == 2 {
					resume <- struct{}{}
				}
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			t.Logf("%v", &paths)
			for p, what := range []string{"inline", "partial", "queued"} {
				if paths[p].Load() < n/burst {
					t.Fatalf("%v: the %s path taken less than once a burst", &paths, what)
				}
			}
		})
	}
}

// shrinkBuffers sets the kernel buffers between r and its raw peer c
// (the router's send buffer and the peer's receive buffer) to about
// size, so that what fills them is known: TCP's would grow to megabytes.
func shrinkBuffers(t *testing.T, r *Router, peer []byte, c net.Conn, size int) {
	t.Helper()
	r.mu.RLock()
	p := r.peers[string(peer)]
	r.mu.RUnlock()
	type buffered interface {
		SetWriteBuffer(int) error
		SetReadBuffer(int) error
	}
	if err := p.c.nc.(buffered).SetWriteBuffer(size); err != nil {
		t.Fatal(err)
	}
	if err := c.(buffered).SetReadBuffer(size); err != nil {
		t.Fatal(err)
	}
}

// A long burst of messages, each within the burst gap of the one
// before, is written inline only for its first burstInline messages; the
// rest are queued, and drain writes them in batches. Messages farther
// apart go inline, however many.
func TestRouterEnqueueBurstsAreBatched(t *testing.T) {
	for _, tc := range []struct {
		name      string
		gap       time.Duration // the router's burst gap
		pause     time.Duration // between two Enqueues
		n         int
		inline    int64
		queuedMin int64
	}{
		{"burst", time.Hour, 0, 300, burstInline, 300 - burstInline},
		{"apart", time.Millisecond, 2 * time.Millisecond, 20, 20, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var paths pathCounts
			r := listenRouterOn(t, "ipc", withEnqueueHook(&paths), WithSendQueue(1<<20), withBurstGap(tc.gap))
			_, br, peer := rawDealer(t, r)
			done := make(chan error, 1)
			go func() {
				_, err := readMsgs(br, 0, tc.n, func(int) int { return 100 })
				done <- err
			}()
			for i := range tc.n {
				if tc.pause > 0 {
					// Written and read before the next: the peer is idle.
					r.Flush(testCtx(t, 10*time.Second))
					time.Sleep(tc.pause)
				}
				if err := r.Enqueue(peer, inlineMsg(i, 100)...); err != nil {
					t.Fatal(i, err)
				}
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			t.Logf("%v", &paths)
			if paths[pathInline].Load() != tc.inline || paths[pathQueued].Load() < tc.queuedMin || paths[pathPartial].Load() != 0 {
				t.Fatalf("%v; want %d inline, at least %d queued", &paths, tc.inline, tc.queuedMin)
			}
		})
	}
}

// A message written in part is followed at once by more Enqueues, a
// Send and the peer's PINGs (whose PONGs the router's read loop writes):
// none of them may come between the parts of the message, or the peer
// could not parse the stream. The peer gets every message in order and
// a PONG for every PING.
func TestRouterEnqueuePartialThenHeartbeats(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			var paths pathCounts
			r := listenRouterOn(t, tr, withEnqueueHook(&paths), WithSendQueue(1<<20), withBurstGap(0))
			c, br, peer := rawDealer(t, r)
			sizes := func(i int) int {
				if i%20 == 1 {
					return bigSize / 4
				}
				return 1000
			}
			const n, pings = 80, 10
			if err := r.Enqueue(peer, inlineMsg(0, sizes(0))...); err != nil {
				t.Fatal(err)
			}
			if err := r.Enqueue(peer, inlineMsg(1, bigSize)...); err != nil {
				t.Fatal(err)
			}
			if paths[pathInline].Load() != 1 || paths[pathPartial].Load() != 1 {
				t.Fatalf("%v, want one message inline and the next written in part", &paths)
			}
			// PINGs now: the read loop answers each with a PONG, which
			// must wait for the rest of message 1.
			for k := range pings {
				ping := encodeCommand("PING", append([]byte{0, 0}, fmt.Sprint("hb", k)...))
				if _, err := c.Write(ping); err != nil {
					t.Fatal(err)
				}
			}
			// A blocking Send from another goroutine waits for the
			// writer lock too; its message comes whole, after message 1.
			sent := make(chan error, 1)
			go func() { sent <- r.Send(context.Background(), peer, []byte("sent")) }()
			size := func(i int) int {
				if i == 1 {
					return bigSize
				}
				return sizes(i)
			}
			for i := 2; i < n; i++ {
				if err := r.Enqueue(peer, inlineMsg(i, size(i))...); err != nil {
					t.Fatal(i, err)
				}
			}
			// Read everything: messages 0..n-1 in order, the Send's one
			// message and the PONGs somewhere after message 1.
			var pongs []string
			gotSent := false
			for i := 0; i < n; {
				frames, cmd, err := readMessage(br, limits{maxMessageSize: 1 << 30, maxFrames: 4})
				if err != nil {
					t.Fatalf("before message %d: %v (the stream is corrupt)", i, err)
				}
				switch {
				case cmd != nil:
					if cmd.name != "PONG" || i < 2 {
						t.Fatalf("command %q before message %d", cmd.name, i)
					}
					pongs = append(pongs, string(cmd.body))
				case len(frames) == 1 && string(frames[0]) == "sent":
					if gotSent || i < 2 {
						t.Fatalf("Send's message before message %d (or twice)", i)
					}
					gotSent = true
				case !equalFrames(frames, inlineMsg(i, size(i))):
					t.Fatalf("message %d arrived changed: %d frames, first %.20q", i, len(frames), frames[0])
				default:
					i++
				}
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
			// What is left: the Send's message or PONGs not read yet.
			for !gotSent || len(pongs) < pings {
				frames, cmd, err := readMessage(br, limits{maxMessageSize: 1 << 30, maxFrames: 4})
				switch {
				case err != nil:
					t.Fatalf("after the last message: %v", err)
				case cmd != nil && cmd.name == "PONG":
					pongs = append(pongs, string(cmd.body))
				case cmd == nil && len(frames) == 1 && string(frames[0]) == "sent" && !gotSent:
					gotSent = true
				default:
					t.Fatalf("unexpected after the last message: %q %v", frames, cmd)
				}
			}
			for k, p := range pongs {
				if p != fmt.Sprint("hb", k) {
					t.Fatalf("PONG %d echoes %q", k, p)
				}
			}
			t.Logf("%v; %d PONGs", &paths, len(pongs))
		})
	}
}

// A peer that disconnects while the rest of a partly written message is
// being written: the write fails, the connection is dropped with what
// was queued behind it, a later Enqueue says ErrUnknownPeer, and after
// Close no goroutine is left.
func TestRouterEnqueuePeerGoneMidRest(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			before := runtime.NumGoroutine()
			var paths pathCounts
			var logs logBuffer
			r, err := ListenRouter(routerEndpoint(t, tr), WithLogger(logs.logger()), withEnqueueHook(&paths))
			if err != nil {
				t.Fatal(err)
			}
			c, _, peer := rawDealer(t, r)
			if err := r.Enqueue(peer, inlineMsg(0, bigSize)...); err != nil {
				t.Fatal(err)
			}
			if paths[pathPartial].Load() != 1 {
				t.Fatalf("%v, want the message written in part", &paths)
			}
			for i := 1; i < 5; i++ {
				if err := r.Enqueue(peer, inlineMsg(i, 1000)...); err != nil {
					t.Fatal(i, err)
				}
			}
			c.Close()
			waitFor(t, "the peer's connection to be dropped", func() bool {
				return errors.Is(r.Enqueue(peer, []byte("late")), ErrUnknownPeer)
			})
			waitFor(t, "the failed write to be logged", func() bool {
				return bytes.Contains([]byte(logs.String()), []byte("queued message not written"))
			})
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			goroutinesSettle(t, before)
		})
	}
}

// Close while the rest of a partly written message waits for a peer
// that never reads (no send timeout: nothing else would end the write)
// returns, and leaves no goroutine; Enqueue after it says ErrClosed.
func TestRouterCloseWithRestPending(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			before := runtime.NumGoroutine()
			var paths pathCounts
			r, err := ListenRouter(routerEndpoint(t, tr), quiet(), WithSendTimeout(0), withEnqueueHook(&paths))
			if err != nil {
				t.Fatal(err)
			}
			c, _, peer := rawDealer(t, r)
			defer c.Close()
			if err := r.Enqueue(peer, inlineMsg(0, bigSize)...); err != nil {
				t.Fatal(err)
			}
			if err := r.Enqueue(peer, inlineMsg(1, 10)...); err != nil {
				t.Fatal(err)
			}
			if paths[pathPartial].Load() != 1 || paths[pathQueued].Load() != 1 {
				t.Fatalf("%v, want one message written in part and one queued", &paths)
			}
			done := make(chan error, 1)
			go func() { done <- r.Close() }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Close did not end the write of a message's rest")
			}
			if err := r.Enqueue(peer, []byte("x")); !errors.Is(err, ErrClosed) {
				t.Fatalf("Enqueue after Close: %v", err)
			}
			goroutinesSettle(t, before)
		})
	}
}

func routerEndpoint(t *testing.T, transport string) string {
	if transport == "ipc" {
		return IPCEndpoint(ipcPath(t, "r.sock"))
	}
	return "tcp://127.0.0.1:0"
}

// writeNow on its own, over a real socket of each transport: a message
// that fits goes out whole; one that does not leaves exactly its unsent
// bytes as the rest; a full socket takes nothing (errNotNow); a write
// deadline that passed means errNotNow, not a failure; a peer that is
// gone is a failure that closes the connection.
func TestWriteNow(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			network, addr := "tcp", "127.0.0.1:0"
			if tr == "ipc" {
				network, addr = "unix", ipcPath(t, "w.sock")
			}
			ln, err := net.Listen(network, addr)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			nc, err := net.Dial(network, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			peer, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			c := &conn{nc: nc, peer: "test", done: make(chan struct{})}
			defer c.close()
			pr := bufio.NewReader(peer)
			peer.SetDeadline(time.Now().Add(time.Minute))
			expect := func(want []byte) {
				t.Helper()
				got := make([]byte, len(want))
				if _, err := io.ReadFull(pr, got); err != nil || !bytes.Equal(got, want) {
					t.Fatalf("peer read %d bytes (%v), not the %d written", len(got), err, len(want))
				}
			}
			c.wmu.Lock()
			small := inlineMsg(1, 100)
			if rest, _, err := c.writeNow(small); rest != nil || err != nil {
				t.Fatalf("a small message: rest %d buffers, %v", len(rest), err)
			}
			c.wmu.Unlock()
			expect(encodeMessage(small))

			// One message larger than the socket takes: written in part.
			// What the peer must read is every byte writeNow and writeRest
			// report written, in that order (a test may break the rule
			// that a rest goes first: the bytes still say what was done).
			var want bytes.Buffer
			c.wmu.Lock()
			big := inlineMsg(2, bigSize)
			rest, restBytes, err := c.writeNow(big)
			if err != nil || rest == nil {
				t.Fatalf("a %d-byte message: rest %d buffers, %v", bigSize, len(rest), err)
			}
			if restBytes != buffersLen(rest) || restBytes == 0 {
				t.Fatalf("rest of %d bytes reported as %d", buffersLen(rest), restBytes)
			}
			whole := encodeMessage(big)
			want.Write(whole[:len(whole)-restBytes])
			// The rest lives in the buffers writeNow reuses: keep a copy.
			rests := []net.Buffers{{bytes.Join(rest, nil)}}
			// Fill the socket (TCP may take a little more after a moment)
			// until it takes nothing: errNotNow.
			tiny := [][]byte{[]byte("x")}
			for i := 0; ; i++ {
				if i == 1e5 {
					t.Fatal("the socket never filled")
				}
				r2, rb, err := c.writeNow(tiny)
				if err == errNotNow {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				enc := encodeMessage(tiny)
				want.Write(enc[:len(enc)-rb])
				if r2 != nil {
					rests = append(rests, net.Buffers{bytes.Join(r2, nil)})
				}
			}
			got := make(chan []byte, 1)
			go func() {
				b, _ := io.ReadAll(pr)
				got <- b
			}()
			for i, r := range rests {
				if i > 0 {
					c.wmu.Lock()
				}
				want.Write(bytes.Join(r, nil))
				if err := c.writeRest(testCtx(t, time.Minute), r); err != nil { // releases wmu
					t.Fatal(err)
				}
			}
			for i, b := range c.now.bufs {
				if b != nil {
					t.Fatalf("buffer %d still references a written message", i)
				}
			}
			if err := nc.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			if b := <-got; !bytes.Equal(b, want.Bytes()) {
				t.Fatalf("the peer read %d bytes, not the %d written", len(b), want.Len())
			}

			// A write deadline in the past: not written, not closed.
			nc.SetWriteDeadline(time.Unix(1, 0))
			c.wmu.Lock()
			if _, _, err := c.writeNow(small); err != errNotNow || c.closed() {
				t.Fatalf("past a write deadline: %v (closed: %v), want errNotNow", err, c.closed())
			}
			c.wmu.Unlock()
			nc.SetWriteDeadline(time.Time{})

			// The peer is gone: the write fails and closes the connection.
			peer.Close()
			c.wmu.Lock()
			defer c.wmu.Unlock()
			var werr error
			for range 100 { // a first write after a TCP peer's close may still succeed
				if _, _, werr = c.writeNow(small); werr != nil {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if werr == nil || werr == errNotNow || !isClosedErr(werr) || !c.closed() {
				t.Fatalf("to a closed peer: %v (closed: %v), want EPIPE or ECONNRESET and the connection closed", werr, c.closed())
			}
			if !errors.Is(werr, syscall.EPIPE) && !errors.Is(werr, syscall.ECONNRESET) {
				t.Fatalf("to a closed peer: %v", werr)
			}
		})
	}
}

func buffersLen(bufs net.Buffers) int {
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	return n
}
