package zmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
)

// Router.Enqueue writes a message to an idle peer itself, at once,
// instead of starting a goroutine to write it: a goroutine per reply
// costs a scheduler wakeup of another thread, which on a small VM is
// more CPU than the write. writeNow is that write: one non-blocking
// writev of the message's frames, of which the kernel takes what fits
// in the socket's buffer, and never a wait for the peer.

// inlineFrames bounds the frames of a message writeNow writes: it
// encodes them into the connection's own buffers (nowWriter), so the
// write allocates nothing. The control plane's messages have one or two
// frames; a message of more takes the queue.
const inlineFrames = 16

// errNotNow is writeNow's answer when it wrote nothing: the socket's
// buffer is full, the message has too many frames, or the connection
// cannot be written without blocking (closed, a write deadline passed);
// the message takes the queue, whose writer sorts that out.
var errNotNow = errors.New("zmq: not written at once")

// writeNow writes as much of one message as the kernel takes without
// blocking. The caller holds c.wmu. It returns:
//
//   - rest nil, err nil: the whole message was written;
//   - rest not nil: the first bytes were written and rest (restBytes
//     bytes, the connection's own buffers) must follow before anything
//     else is written on the connection: the caller keeps c.wmu and
//     hands it with rest to writeRest;
//   - errNotNow: nothing was written;
//   - another error: the write failed and the connection is closed, as
//     writeLocked does.
func (c *conn) writeNow(frames [][]byte) (rest net.Buffers, restBytes int, err error) {
	if c.now == nil {
		c.now = newNowWriter(c.nc)
	}
	w := c.now
	if w.raw == nil || len(frames) > inlineFrames {
		return nil, 0, errNotNow
	}
	bufs, err := appendFrames(w.bufs[:0], w.hdrs[:], [][][]byte{frames})
	if err != nil {
		return nil, 0, err
	}
	total := 0
	for _, b := range bufs {
		total += len(b)
	}
	n, errno, err := w.writev(bufs)
	switch {
	case err != nil || errno == syscall.EAGAIN || (errno == 0 && n == 0):
		// err: the descriptor could not be written now (closed, or a
		// deadline passed); either way nothing was written.
		w.clear(len(bufs))
		return nil, 0, errNotNow
	case errno != 0:
		w.clear(len(bufs))
		c.close()
		return nil, 0, fmt.Errorf("zmq: write to %s: %w", c.peer, errno)
	case n == total:
		w.clear(len(bufs))
		return nil, 0, nil
	}
	for rest, left := bufs, n; ; {
		if left < len(rest[0]) {
			rest[0] = rest[0][left:]
			return rest, total - n, nil
		}
		left -= len(rest[0])
		rest = rest[1:]
	}
}

// writeRest writes rest, what writeNow left of a message, within ctx
// (closing the connection on failure, as writeLocked does), then
// releases c.wmu, which writeNow's caller kept for it.
func (c *conn) writeRest(ctx context.Context, rest net.Buffers) error {
	defer c.wmu.Unlock()
	deadline, _ := ctx.Deadline()
	err := c.writeLocked(ctx, rest, deadline)
	c.now.clear(len(c.now.bufs)) // writeNow made it
	return err
}

// clear drops the first n buffers' references to the caller's frames,
// so that the connection does not keep a message alive.
func (w *nowWriter) clear(n int) {
	clear(w.bufs[:n])
}
