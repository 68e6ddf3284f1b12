package zmq

import (
	"net"
	"syscall"
	"unsafe"
)

// nowWriter is a connection's state for writeNow (1.4 KiB, made for the
// connections Router.Enqueue writes to); c.wmu guards it.
type nowWriter struct {
	raw  syscall.RawConn // nil: not a socket, writeNow never writes
	hdrs [9 * inlineFrames]byte
	bufs [2 * inlineFrames][]byte

	// The arguments and results of one writev: fields rather than a
	// closure's variables, and fn made once, so that a write allocates
	// nothing.
	iov   [2 * inlineFrames]syscall.Iovec
	niov  int
	n     int
	errno syscall.Errno
	fn    func(fd uintptr) bool
}

// newNowWriter returns nc's nowWriter, one that never writes if nc is
// not a socket.
func newNowWriter(nc net.Conn) *nowWriter {
	w := &nowWriter{}
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return w
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return w
	}
	w.raw = raw
	w.fn = w.call
	return w
}

// writev makes one non-blocking writev of bufs (at most len(w.iov))
// and returns the bytes written, or the errno of a failed writev; err
// is the runtime's, when the descriptor cannot be written at all now
// (closed, or its write deadline passed).
func (w *nowWriter) writev(bufs net.Buffers) (n int, errno syscall.Errno, err error) {
	w.niov = 0
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		w.iov[w.niov].Base = &b[0]
		w.iov[w.niov].SetLen(len(b))
		w.niov++
	}
	// Go's network descriptors are non-blocking: the callback returns
	// true always, so Write never parks the goroutine for the poller.
	err = w.raw.Write(w.fn)
	clear(w.iov[:w.niov])
	return w.n, w.errno, err
}

// call is the syscall.RawConn.Write callback of writev.
func (w *nowWriter) call(fd uintptr) bool {
	for {
		n, _, errno := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&w.iov[0])), uintptr(w.niov))
		if errno == syscall.EINTR {
			continue
		}
		w.n, w.errno = int(n), errno
		if errno != 0 {
			w.n = 0
		}
		return true
	}
}
