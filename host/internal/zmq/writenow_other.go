//go:build !linux

package zmq

import (
	"errors"
	"net"
	"syscall"
)

// nowWriter: without Linux's writev, writeNow never writes and every
// message takes Router.Enqueue's queue.
type nowWriter struct {
	raw  syscall.RawConn // always nil
	hdrs [9 * inlineFrames]byte
	bufs [2 * inlineFrames][]byte
}

func newNowWriter(net.Conn) *nowWriter { return &nowWriter{} }

func (w *nowWriter) writev(net.Buffers) (int, syscall.Errno, error) {
	return 0, 0, errors.New("zmq: no non-blocking write")
}
