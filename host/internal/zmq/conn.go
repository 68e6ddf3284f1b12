package zmq

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrClosed is returned by operations on a closed socket.
var ErrClosed = errors.New("zmq: socket closed")

// conn is one ZMTP connection after a successful handshake. Reads happen on
// one goroutine (the owner's read loop); writes are serialized by wmu and
// may come from any goroutine.
type conn struct {
	nc       net.Conn
	r        *bufio.Reader
	lim      limits
	peerType string
	peer     string // remote address, for logs
	sent     bool   // our READY was sent (handshake only)
	// msgTimeout, when positive, bounds how long the rest of a message may
	// take once its first byte arrived, and idleTimeout, when positive,
	// how long the peer may stay silent between messages (both set on
	// accepted connections, whose peers we do not choose).
	msgTimeout  time.Duration
	idleTimeout time.Duration

	// Accepted connections: src is the peer's IP address or process (the
	// "source" the server's connection limit is shared fairly between);
	// lastActive (unix ns) is when the peer last began or finished a
	// message, or finished its handshake; inMessage is set while a
	// message is being read. The read loop writes them, the server's
	// eviction reads them.
	src        string
	cred       *PeerCred // ipc peers (SO_PEERCRED); nil for TCP
	lastActive atomic.Int64
	inMessage  atomic.Bool

	// budget, when set (connections of bound sockets), is charged for the
	// memory of every received message before it is allocated; stop ends
	// a wait for it (the socket's done channel). held is what the message
	// being read holds so far; only the read loop touches it.
	budget *recvBudget
	stop   <-chan struct{}
	held   int64
	// Guarded by budget.mu: waiting is set while the read loop waits for
	// the budget; contendBy is when the message being read must be
	// finished because another connection waits for the budget (zero:
	// no such bound). contended mirrors contendBy != 0 for the read
	// loop's error message.
	waiting   bool
	contendBy time.Time
	contended atomic.Bool

	// wmu serializes writes: whoever holds it owns the byte stream to
	// the peer. Router.Enqueue's inline write may leave it held on
	// purpose for the drain goroutine that writes the rest of a partly
	// written message (see Router.writeInline).
	wmu sync.Mutex
	// now is the state of the non-blocking write (writeNow), made by
	// its first use; wmu guards it.
	now *nowWriter

	closeOnce sync.Once
	done      chan struct{} // closed by close()
}

// handshake runs the ZMTP greeting and READY exchange on nc as a socket of
// type local, all under one deadline. On failure nc is closed.
func handshake(nc net.Conn, local string, o *options) (*conn, error) {
	c, err := handshakeConn(nc, local, o, false)
	if err == nil {
		err = c.finishHandshake(local, o)
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("zmq: handshake with %s: %w", remoteName(nc), err)
	}
	return c, nil
}

// handshakeConn runs the handshake up to the peer's READY. A connecting
// socket sends its READY first, as libzmq does; a bound one (peerFirst)
// reads the peer's READY before it sends its own, so that it can still
// refuse the connection (see server.admit) before the peer may send a
// message, which would otherwise be lost. finishHandshake completes it.
func handshakeConn(nc net.Conn, local string, o *options, peerFirst bool) (*conn, error) {
	if err := nc.SetDeadline(time.Now().Add(o.handshakeTimeout)); err != nil {
		return nil, err
	}
	if _, err := nc.Write(greeting()); err != nil {
		return nil, err
	}
	r := bufio.NewReaderSize(nc, 64<<10)
	g := make([]byte, greetingSize)
	if _, err := io.ReadFull(r, g); err != nil {
		return nil, fmt.Errorf("reading greeting: %w", err)
	}
	if err := checkGreeting(g); err != nil {
		return nil, err
	}
	c := &conn{
		nc:   nc,
		r:    r,
		lim:  limits{maxMessageSize: o.maxMessageSize, maxFrames: o.maxFrames, discardOversize: o.discardOversize},
		peer: remoteName(nc),
		done: make(chan struct{}),
	}
	if !peerFirst {
		if err := c.sendReady(local); err != nil {
			return nil, err
		}
		c.sent = true
	}
	// Until READY, only a command is acceptable: a data frame larger than a
	// command is refused by its header instead of being read (under the
	// handshake deadline, but up to MaxMessageSize bytes per connection).
	_, cmd, err := readMessage(r, limits{maxMessageSize: maxCommandSize, maxFrames: 1})
	if err != nil {
		return nil, fmt.Errorf("reading READY: %w", err)
	}
	if cmd == nil {
		return nil, protoErr("peer sent a message before READY")
	}
	switch cmd.name {
	case "READY":
	case "ERROR":
		return nil, fmt.Errorf("peer refused the connection: %s", errorReason(cmd.body))
	default:
		return nil, protoErr("expected READY, got command %q", cmd.name)
	}
	props, err := parseProperties(cmd.body)
	if err != nil {
		return nil, err
	}
	c.peerType = strings.ToUpper(string(props["socket-type"]))
	if !compatible(local, c.peerType) {
		// Tell the peer why, as libzmq does, then give up.
		nc.Write(encodeCommand("ERROR", errorBody("Invalid socket type")))
		return nil, protoErr("peer socket type %q cannot talk to %s", c.peerType, local)
	}
	return c, nil
}

// sendReady writes our READY command.
func (c *conn) sendReady(local string) error {
	_, err := c.nc.Write(encodeCommand("READY", readyMetadata(local)))
	return err
}

// finishHandshake sends our READY if the peer's came first, then lifts
// the handshake deadline and turns on TCP keep-alives.
func (c *conn) finishHandshake(local string, o *options) error {
	if !c.sent {
		if err := c.sendReady(local); err != nil {
			return err
		}
		c.sent = true
	}
	if err := c.nc.SetDeadline(time.Time{}); err != nil {
		return err
	}
	if tc, ok := c.nc.(*net.TCPConn); ok && o.keepAlive > 0 {
		tc.SetKeepAlive(true)
		tc.SetKeepAlivePeriod(o.keepAlive)
	}
	c.lastActive.Store(time.Now().UnixNano())
	return nil
}

func errorBody(reason string) []byte {
	if len(reason) > 255 {
		reason = reason[:255]
	}
	return append([]byte{byte(len(reason))}, reason...)
}

func errorReason(body []byte) string {
	if len(body) == 0 || int(body[0]) > len(body)-1 {
		return "(no reason)"
	}
	return fmt.Sprintf("%q", body[1:1+int(body[0])])
}

// useBudget makes c charge received messages to b, waiting for it until
// stop is closed. Call before the read loop starts.
func (c *conn) useBudget(b *recvBudget, stop <-chan struct{}) {
	c.budget, c.stop = b, stop
	c.lim.reserve = c.reserve
}

// reserve charges n bytes of the message being read to the budget. Time
// spent waiting for the budget is the socket's, not the peer's: the
// message deadline starts afresh after a wait (recvBudget.reserve).
func (c *conn) reserve(n int64) error {
	if err := c.budget.reserve(c, c.held, n, c.stop); err != nil {
		return err
	}
	c.held += n
	return nil
}

// recv returns the next data message and the bytes it holds of the
// connection's receive budget (0 without one; the receiver of the message
// gives them back with budget.release). PING is answered with PONG; ERROR
// ends the connection; other commands are ignored. Any error means the
// connection is unusable; the caller closes it.
func (c *conn) recv() ([][]byte, int64, error) {
	for {
		frames, cmd, err := c.readMessage()
		held := c.held
		c.held = 0
		if c.budget != nil {
			c.budget.endMessage(c, held, err == nil)
		}
		if err == errOversized {
			return [][]byte{}, 0, nil // the marker: see WithDiscardOversize
		}
		if err != nil {
			return nil, 0, err
		}
		if cmd == nil {
			return frames, held, nil
		}
		switch cmd.name {
		case "PING":
			// PING body: 2-byte TTL, then up to 16 bytes of context that
			// PONG echoes.
			var ctxBytes []byte
			if len(cmd.body) > 2 {
				ctxBytes = cmd.body[2:]
			}
			if err := c.writeRaw(context.Background(), [][]byte{encodeCommand("PONG", ctxBytes)}, time.Now().Add(5*time.Second)); err != nil {
				return nil, 0, err
			}
		case "ERROR":
			return nil, 0, fmt.Errorf("zmq: peer %s closed the connection with ERROR %s", c.peer, errorReason(cmd.body))
		}
	}
}

// errIdle ends a connection whose peer stayed silent for idleTimeout.
var errIdle = errors.New("zmq: peer idle")

// readMessage reads the next message or command, within msgTimeout of its
// first byte when that is set: a peer that starts a message and stalls (a
// slowloris) is dropped instead of holding its goroutine and partial
// message forever. A peer silent between messages for idleTimeout is
// dropped too.
func (c *conn) readMessage() ([][]byte, *command, error) {
	if c.msgTimeout <= 0 {
		return readMessage(c.r, c.lim)
	}
	// Also lifts a deadline the budget may have set for the message
	// before (recvBudget.reserve): it is over.
	var idleUntil time.Time
	if c.idleTimeout > 0 {
		idleUntil = time.Now().Add(c.idleTimeout)
	}
	if err := c.nc.SetReadDeadline(idleUntil); err != nil {
		return nil, nil, err
	}
	if _, err := c.r.Peek(1); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("%w for %v", errIdle, c.idleTimeout)
		}
		return nil, nil, err
	}
	c.lastActive.Store(time.Now().UnixNano())
	c.inMessage.Store(true)
	defer func() {
		c.inMessage.Store(false)
		c.lastActive.Store(time.Now().UnixNano())
	}()
	if err := c.nc.SetReadDeadline(time.Now().Add(c.msgTimeout)); err != nil {
		return nil, nil, err
	}
	frames, cmd, err := readMessage(c.r, c.lim)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if c.contended.Load() {
				err = fmt.Errorf("peer did not finish a message while others waited for the receive budget: %w", err)
			} else {
				err = fmt.Errorf("peer did not finish a message within %v: %w", c.msgTimeout, err)
			}
		}
		return nil, nil, err
	}
	return frames, cmd, nil
}

// send writes one message. ctx bounds the write (deadline and
// cancellation). On any error the connection is closed: a partially written
// message leaves the stream unusable, and the receiver drops the partial
// message.
func (c *conn) send(ctx context.Context, frames [][]byte) error {
	return c.sendBatch(ctx, [][][]byte{frames})
}

// sendBatch writes msgs, in order, in one write.
func (c *conn) sendBatch(ctx context.Context, msgs [][][]byte) error {
	nf := 0
	for _, frames := range msgs {
		nf += len(frames)
	}
	bufs, err := appendFrames(make(net.Buffers, 0, 2*nf), make([]byte, 9*nf), msgs)
	if err != nil {
		return err
	}
	deadline, _ := ctx.Deadline()
	return c.writeRaw(ctx, bufs, deadline)
}

// appendFrames appends to bufs the ZMTP frames of msgs, in order, ready
// for one writev: each frame's header, encoded into hdrs (9 bytes a frame
// at most), then its body, not copied.
func appendFrames(bufs net.Buffers, hdrs []byte, msgs [][][]byte) (net.Buffers, error) {
	for _, frames := range msgs {
		if len(frames) == 0 {
			return nil, errors.New("zmq: a message needs at least one frame")
		}
		for i, f := range frames {
			var flags byte
			if i < len(frames)-1 {
				flags = flagMore
			}
			h := hdrs[:9:9]
			hdrs = hdrs[9:]
			n := frameHeader(h, flags, len(f))
			bufs = append(bufs, h[:n])
			if len(f) > 0 {
				bufs = append(bufs, f)
			}
		}
	}
	return bufs, nil
}

// writeRaw writes bufs under the writer lock; see writeLocked.
func (c *conn) writeRaw(ctx context.Context, bufs net.Buffers, deadline time.Time) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.writeLocked(ctx, bufs, deadline)
}

// writeLocked writes bufs, blocking until the kernel took them all, ctx
// ends or deadline passes; on any error the connection is closed. The
// caller holds c.wmu.
func (c *conn) writeLocked(ctx context.Context, bufs net.Buffers, deadline time.Time) error {
	select {
	case <-c.done:
		return ErrClosed
	default:
	}
	if err := c.nc.SetWriteDeadline(deadline); err != nil {
		c.close()
		return err
	}
	stop := context.AfterFunc(ctx, func() { c.nc.SetWriteDeadline(time.Unix(1, 0)) })
	_, err := bufs.WriteTo(c.nc)
	stop()
	if err != nil {
		c.close()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("zmq: write to %s: %w", c.peer, ctxErr)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) && !deadline.IsZero() && !time.Now().Before(deadline) {
			// The socket deadline is ctx's (or the PONG's) and can fire a
			// moment before ctx reports it.
			return fmt.Errorf("zmq: write to %s: %w", c.peer, context.DeadlineExceeded)
		}
		return fmt.Errorf("zmq: write to %s: %w", c.peer, err)
	}
	return nil
}

func (c *conn) close() {
	c.closeOnce.Do(func() {
		close(c.done)
		c.nc.Close()
	})
}

func (c *conn) closed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// isClosedErr reports errors that just mean "this connection ended".
func isClosedErr(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, ErrClosed) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
