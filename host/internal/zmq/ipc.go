package zmq

import (
	"fmt"
	"net"
	"os"
)

// DefaultSocketMode is the permission of an ipc socket file a PULL or
// ROUTER creates (WithSocketMode): only the sidecar's user may connect.
const DefaultSocketMode os.FileMode = 0o600

// PeerCred is what the kernel says about the process at the other end of
// an ipc (unix-domain) connection: SO_PEERCRED, taken when the peer
// connected. A process cannot forge it, but its PID may have been reused
// once that process exited: compare it with a PID the peer also sends
// (and check the UID) rather than signalling it blindly.
type PeerCred struct {
	PID      int32
	UID, GID uint32
}

func (c PeerCred) String() string { return fmt.Sprintf("pid=%d uid=%d gid=%d", c.PID, c.UID, c.GID) }

// source is the key the connection limit of a bound socket is shared
// fairly between for an ipc peer: its process. Unix sockets have no
// source address, and the socket file's mode (or, for abstract sockets,
// credAllowed) already keeps other users out, so all peers are processes
// of one user (or root): sharing by process means one engine process
// that leaks connections gives them up before another engine process
// loses any (by UID they would all be one source, like TCP peers of one
// host). A process can fork to get more sources, but a same-user process
// can also ptrace the engine; the limit is against mistakes there, not
// against a hostile user.
func (c PeerCred) source() string { return fmt.Sprintf("pid:%d", c.PID) }

// credAllowed applies mode to an abstract socket's peer, since an
// abstract socket has no file whose permission the kernel would check
// on connect: connecting needs the write bit for the peer's class (owner:
// the same UID as this process; group: the same GID; others), and root
// may always connect, as with a socket file.
func credAllowed(c PeerCred, mode os.FileMode) bool {
	switch {
	case c.UID == 0:
		return true
	case c.UID == uint32(os.Getuid()):
		return mode&0o200 != 0
	case c.GID == uint32(os.Getgid()):
		return mode&0o020 != 0
	}
	return mode&0o002 != 0
}

// remoteName names a connection's peer for logs; an accepted unix
// connection has no remote address.
func remoteName(nc net.Conn) string {
	if a := nc.RemoteAddr(); a != nil && a.String() != "" {
		return a.String()
	}
	if a := nc.LocalAddr(); a != nil {
		return "peer of " + a.String()
	}
	return "unix peer"
}
