package zmq

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"
	"time"
)

// socketFile is the file of a bound ipc socket, removed on Close only if
// it is still ours (same device and inode): another listener may have
// replaced it after taking it for stale.
type socketFile struct {
	path     string
	dev, ino uint64
}

func (f *socketFile) remove() {
	if f == nil {
		return
	}
	fi, err := os.Lstat(f.path)
	if err != nil {
		return
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && uint64(st.Dev) == f.dev && st.Ino == f.ino {
		os.Remove(f.path)
	}
}

// staleProbeTimeout bounds the connection attempt that tells a live
// listener's socket file from a stale one.
const staleProbeTimeout = time.Second

// listenUnix binds and listens on a unix-domain stream socket. A socket
// file is created with mode (chmod between bind and listen: no peer can
// connect before the mode is set, since connections to a socket that does
// not listen yet are refused). An existing file at the path is removed
// only if it is a socket nobody listens on (a connection to it is
// refused): a live listener there makes listenUnix fail with an error
// wrapping syscall.EADDRINUSE, and a file that is not a socket is never
// removed. Two processes starting on one path at the same moment can
// still both take the file for stale; the one that binds last wins the
// path, and the other's Close leaves it alone (socketFile).
func listenUnix(a address, mode os.FileMode) (net.Listener, *socketFile, error) {
	path, abstract := a.addr, a.abstract()
	if !abstract {
		if err := clearStale(path); err != nil {
			return nil, nil, err
		}
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("zmq: listen on %s: %w", IPCEndpoint(path), err)
	}
	fail := func(what string, err error) (net.Listener, *socketFile, error) {
		syscall.Close(fd)
		return nil, nil, fmt.Errorf("zmq: listen on %s: %s: %w", IPCEndpoint(path), what, err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		return fail("bind", err)
	}
	var sf *socketFile
	if !abstract {
		fi, err := os.Lstat(path)
		if err != nil {
			return fail("stat", err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		sf = &socketFile{path: path, dev: uint64(st.Dev), ino: st.Ino}
		if err := os.Chmod(path, mode.Perm()); err != nil {
			sf.remove()
			return fail("chmod", err)
		}
	}
	if err := syscall.Listen(fd, syscall.SOMAXCONN); err != nil {
		sf.remove()
		return fail("listen", err)
	}
	f := os.NewFile(uintptr(fd), path)
	ln, err := net.FileListener(f) // dups fd
	f.Close()
	if err != nil {
		sf.remove()
		return nil, nil, fmt.Errorf("zmq: listen on %s: %w", IPCEndpoint(path), err)
	}
	return ln, sf, nil
}

// clearStale removes a socket file nobody listens on (a process that
// bound it died without removing it), so that a restarted listener can
// bind again; see listenUnix.
func clearStale(path string) error {
	ep := IPCEndpoint(path)
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("zmq: listen on %s: %w", ep, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("zmq: listen on %s: %w: the path exists and is not a socket", ep, syscall.EADDRINUSE)
	}
	c, err := net.DialTimeout("unix", path, staleProbeTimeout)
	if err == nil {
		c.Close()
		return fmt.Errorf("zmq: listen on %s: %w: a listener answers there", ep, syscall.EADDRINUSE)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		// EACCES (another user's socket), EAGAIN (a live listener with a
		// full backlog), a timeout: not provably stale.
		return fmt.Errorf("zmq: listen on %s: cannot tell whether the existing socket is in use: %w", ep, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("zmq: listen on %s: removing the stale socket: %w", ep, err)
	}
	return nil
}

// peerCred returns the credentials of a unix-domain connection's peer
// (SO_PEERCRED), nil for other connections.
func peerCred(nc net.Conn) (*PeerCred, error) {
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		return nil, nil
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var u *syscall.Ucred
	var uerr error
	if err := rc.Control(func(fd uintptr) {
		u, uerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if uerr != nil {
		return nil, fmt.Errorf("SO_PEERCRED: %w", uerr)
	}
	return &PeerCred{PID: u.Pid, UID: u.Uid, GID: u.Gid}, nil
}
