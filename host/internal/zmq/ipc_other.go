//go:build !linux

package zmq

import (
	"errors"
	"net"
	"os"
)

type socketFile struct{}

func (*socketFile) remove() {}

// listenUnix: binding ipc endpoints (socket mode, stale files, peer
// credentials) is implemented for Linux only.
func listenUnix(a address, mode os.FileMode) (net.Listener, *socketFile, error) {
	return nil, nil, errors.New("zmq: binding ipc:// endpoints is supported on Linux only")
}

func peerCred(net.Conn) (*PeerCred, error) { return nil, nil }
