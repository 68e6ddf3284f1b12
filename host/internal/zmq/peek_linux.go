package zmq

import (
	"net"
	"syscall"
)

// peerClosed reports whether the peer of nc has already closed or reset
// the connection, without consuming any data: a non-blocking MSG_PEEK that
// returns 0 bytes is an orderly shutdown (FIN); ECONNRESET is a reset. Any
// other outcome (data waiting, nothing yet) means the connection looks
// alive.
func peerClosed(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	gone := false
	var b [1]byte
	cerr := rc.Control(func(fd uintptr) {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case err == nil && n == 0:
			gone = true
		case err == syscall.ECONNRESET || err == syscall.ENOTCONN || err == syscall.EPIPE:
			gone = true
		}
	})
	return gone || cerr != nil
}
