package zmq

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// ipcPath returns a socket path in a fresh directory removed when the
// test ends. t.TempDir's paths can pass sun_path's 107 bytes.
func ipcPath(t testing.TB, name string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "zq")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, name)
}

// abstractName returns an abstract socket name unique to this process and
// test.
func abstractName(t testing.TB) string {
	return fmt.Sprintf("@kvhost-zmq-test-%d-%s-%d", os.Getpid(), t.Name(), time.Now().UnixNano())
}

func TestParseEndpoint(t *testing.T) {
	for _, c := range []struct {
		ep, network, addr string
	}{
		{"ipc:///run/kvhost/engine.sock", "unix", "/run/kvhost/engine.sock"},
		{"ipc://rel.sock", "unix", "rel.sock"},
		{"ipc://@kvhost", "unix", "@kvhost"},
		{"tcp://127.0.0.1:5", "tcp", "127.0.0.1:5"},
	} {
		a, err := parseEndpoint(c.ep, false)
		if err != nil || a.network != c.network || a.addr != c.addr {
			t.Errorf("%s: %+v %v", c.ep, a, err)
		}
	}
	for _, ep := range []string{"ipc://", "ipc://@", "ipc://*", "ipc://" + strings.Repeat("a", maxIPCPath+1), "ipc://a\x00b", "inproc://x", "udp://1.2.3.4:5"} {
		if _, err := parseEndpoint(ep, true); err == nil {
			t.Errorf("%q accepted", ep)
		}
	}
	if _, err := parseEndpoint("ipc://"+strings.Repeat("a", maxIPCPath), true); err != nil {
		t.Errorf("a path of %d bytes: %v", maxIPCPath, err)
	}
}

// PUSH to PULL and REQ to ROUTER over a socket file: messages arrive, the
// router sees our own credentials, the file has mode 0600, the endpoint
// is reported as given, and Close removes the file.
func TestIPCSocketsAndCredentials(t *testing.T) {
	path := ipcPath(t, "ctl.sock")
	ep := IPCEndpoint(path)
	r, err := ListenRouter(ep, quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Endpoint() != ep || r.Port() != 0 {
		t.Fatalf("endpoint %q port %d", r.Endpoint(), r.Port())
	}
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket file: %v %v", fi.Mode(), err)
	}
	ctx := testCtx(t, 10*time.Second)
	done := make(chan error, 1)
	go func() {
		m, err := r.Recv(ctx)
		if err == nil {
			switch {
			case m.Cred == nil:
				err = errors.New("no credentials on an ipc message")
			case m.Cred.PID != int32(os.Getpid()) || m.Cred.UID != uint32(os.Getuid()) || m.Cred.GID != uint32(os.Getgid()):
				err = fmt.Errorf("credentials %v, want ours", *m.Cred)
			default:
				err = r.Send(ctx, m.Peer, nil, []byte("pong"), m.Frames[1])
			}
		}
		done <- err
	}()
	rep, err := Request(ctx, ep, [][]byte{[]byte("ping")}, quiet())
	if err != nil || !equalFrames(rep, [][]byte{[]byte("pong"), []byte("ping")}) {
		t.Fatalf("request: %q %v", rep, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	r.Close()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket file after Close: %v", err)
	}

	pullPath := ipcPath(t, "pull.sock")
	pull, err := ListenPull(IPCEndpoint(pullPath), quiet(), WithSocketMode(0o660))
	if err != nil {
		t.Fatal(err)
	}
	defer pull.Close()
	if fi, err := os.Lstat(pullPath); err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("WithSocketMode(0660): %v %v", fi.Mode(), err)
	}
	push, err := DialPush(pull.Endpoint(), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer push.Close()
	for i, m := range standardMessages() {
		if err := push.Send(ctx, m...); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		got, err := pull.Recv(ctx)
		if err != nil || !equalFrames(got, m) {
			t.Fatalf("message %d: %d frames, %v", i, len(got), err)
		}
	}
}

// A second socket on a path where a listener answers is refused (the
// first keeps working); a stale socket file (its listener died without
// removing it) is replaced; a file that is not a socket is never removed.
func TestIPCListenOnExistingPath(t *testing.T) {
	path := ipcPath(t, "s.sock")
	ep := IPCEndpoint(path)
	first, err := ListenRouter(ep, quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if _, err := ListenPull(ep, quiet()); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("second listener on a live path: %v, want EADDRINUSE", err)
	}
	ctx := testCtx(t, 10*time.Second)
	go echoServer(ctx, first, new(atomic.Int64))
	if rep, err := Request(ctx, ep, [][]byte{[]byte("x")}, quiet()); err != nil || string(rep[0]) != "echo" {
		t.Fatalf("the first listener after the refusal: %q %v", rep, err)
	}

	// A stale socket: bound, listened on, closed without unlinking (as a
	// killed process leaves it).
	stalePath := ipcPath(t, "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stalePath, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if _, err := os.Lstat(stalePath); err != nil {
		t.Fatalf("stale file missing: %v", err)
	}
	p, err := ListenPull(IPCEndpoint(stalePath), quiet())
	if err != nil {
		t.Fatalf("listen over a stale socket file: %v", err)
	}
	push, _ := DialPush(p.Endpoint(), quiet())
	if err := push.Send(ctx, []byte("after stale")); err != nil {
		t.Fatal(err)
	}
	if m, err := p.Recv(ctx); err != nil || string(m[0]) != "after stale" {
		t.Fatalf("recv: %q %v", m, err)
	}
	push.Close()
	p.Close()

	regular := ipcPath(t, "file")
	if err := os.WriteFile(regular, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ListenRouter(IPCEndpoint(regular), quiet()); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("listen on a regular file: %v", err)
	}
	if b, err := os.ReadFile(regular); err != nil || string(b) != "keep me" {
		t.Fatalf("regular file after the refusal: %q %v", b, err)
	}
}

// Close removes the socket file only while it is still the socket's: a
// listener that replaced it (after taking it for stale) keeps its file.
func TestIPCCloseLeavesAReplacedFile(t *testing.T) {
	path := ipcPath(t, "s.sock")
	old, err := ListenPull(IPCEndpoint(path), quiet())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	repl, err := ListenPull(IPCEndpoint(path), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer repl.Close()
	old.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the replacement's file was removed: %v", err)
	}
	push, _ := DialPush(repl.Endpoint(), quiet())
	defer push.Close()
	ctx := testCtx(t, 10*time.Second)
	if err := push.Send(ctx, []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := repl.Recv(ctx); err != nil {
		t.Fatal(err)
	}
}

// connectProbe is a Python client that connects to a unix socket (a path
// or "@name") and reports what it met: GREETING (the socket sent its
// ZMTP greeting: the connection was accepted), CLOSED (closed before a
// byte), or ERROR and the errno name.
const connectProbe = `
import errno, socket, sys
p = sys.argv[1]
if p.startswith("@"):
    p = "\0" + p[1:]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(p)
    b = s.recv(1)
except OSError as e:
    print("ERROR", errno.errorcode.get(e.errno, e.errno))
    sys.exit(0)
print("GREETING" if b else "CLOSED")
`

// probeAs runs connectProbe against addr as uid and gid (only root can
// switch), returning its verdict.
func probeAs(t *testing.T, addr string, uid, gid uint32) string {
	t.Helper()
	cmd := exec.Command(zmqtest.Python, "-c", connectProbe, addr)
	cmd.Dir = "/"
	if uid != uint32(os.Getuid()) {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("probe as uid %d: %v: %s", uid, err, out)
	}
	return strings.TrimSpace(string(out))
}

// nobody is the user the cross-user tests connect as when they run as
// root.
const nobody = 65534

// An abstract socket has no file: it applies the socket mode to each
// peer's credentials itself, before the handshake. A peer of another user
// is refused with the default 0600 (run as root, the test connects as
// nobody; otherwise as itself, with mode 0, since root may always
// connect, as to a socket file); the socket's own user gets in.
func TestIPCAbstractSocket(t *testing.T) {
	zmqtest.RequirePython(t, "socket")
	ctx := testCtx(t, 10*time.Second)
	name := abstractName(t)
	ep := IPCEndpoint(name)
	var logs logBuffer
	opts := []Option{WithLogger(logs.logger())}
	if os.Getuid() != 0 {
		opts = append(opts, WithSocketMode(0))
	}
	r, err := ListenRouter(ep, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Endpoint() != ep {
		t.Fatalf("endpoint %q, want %q", r.Endpoint(), ep)
	}
	if _, err := ListenRouter(ep, quiet()); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("second listener on a live abstract name: %v", err)
	}
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	if uid == 0 {
		uid, gid = nobody, nobody
	}
	if got := probeAs(t, name, uid, gid); got != "CLOSED" {
		t.Fatalf("peer of uid %d: %s, want CLOSED", uid, got)
	}
	waitFor(t, "the refusal logged", func() bool { return strings.Contains(logs.String(), "may not connect") })

	open, err := ListenRouter(IPCEndpoint(abstractName(t)), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	go echoServer(ctx, open, new(atomic.Int64))
	if rep, err := Request(ctx, open.Endpoint(), [][]byte{[]byte("x")}, quiet()); err != nil || string(rep[0]) != "echo" {
		t.Fatalf("request from the socket's user: %q %v", rep, err)
	}
}

// The socket file's mode keeps other users out (run as root, where the
// kernel's check can be shown: a peer as nobody is refused by 0600 and
// let in by 0666; as another user, only the mode bits are checked, in
// TestIPCSocketsAndCredentials).
func TestIPCSocketFileModeAcrossUsers(t *testing.T) {
	zmqtest.RequirePython(t, "socket")
	if os.Getuid() != 0 {
		p, err := ListenPull(IPCEndpoint(ipcPath(t, "s.sock")), quiet())
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if fi, err := os.Lstat(strings.TrimPrefix(p.Endpoint(), "ipc://")); err != nil || fi.Mode().Perm() != DefaultSocketMode {
			t.Fatalf("mode %v %v", fi.Mode(), err)
		}
		return
	}
	for _, c := range []struct {
		mode os.FileMode
		want string
	}{{DefaultSocketMode, "ERROR EACCES"}, {0o666, "GREETING"}} {
		path := ipcPath(t, "s.sock")
		if err := os.Chmod(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		p, err := ListenPull(IPCEndpoint(path), quiet(), WithSocketMode(c.mode))
		if err != nil {
			t.Fatal(err)
		}
		got := probeAs(t, path, nobody, nobody)
		p.Close()
		if got != c.want {
			t.Fatalf("mode %v: nobody got %s, want %s", c.mode, got, c.want)
		}
	}
}

func TestCredAllowed(t *testing.T) {
	me, grp := uint32(os.Getuid()), uint32(os.Getgid())
	other := me + 1000
	for _, c := range []struct {
		cred PeerCred
		mode os.FileMode
		want bool
	}{
		{PeerCred{UID: 0, GID: 0}, 0, true},
		{PeerCred{UID: other, GID: grp + 1000}, 0o600, me == 0 && other == 0},
		{PeerCred{UID: other, GID: grp + 1000}, 0o602, true},
		{PeerCred{UID: other, GID: grp}, 0o620, true},
		{PeerCred{UID: other, GID: grp}, 0o600, false},
	} {
		if got := credAllowed(c.cred, c.mode); got != c.want {
			t.Errorf("%v with mode %v: %v, want %v", c.cred, c.mode, got, c.want)
		}
	}
	if me != 0 {
		if !credAllowed(PeerCred{UID: me, GID: grp}, 0o600) || credAllowed(PeerCred{UID: me, GID: grp}, 0o400) {
			t.Error("owner bits not applied to our own UID")
		}
	}
}

// ipc peers share the connection limit by process: our connections are
// one source named by our PID.
func TestIPCSourceIsThePeerProcess(t *testing.T) {
	p, err := ListenPull(IPCEndpoint(ipcPath(t, "s.sock")), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := testCtx(t, 10*time.Second)
	for i := range 3 {
		push, _ := DialPush(p.Endpoint(), quiet())
		defer push.Close()
		if err := push.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		if _, err := p.Recv(ctx); err != nil {
			t.Fatal(err)
		}
	}
	p.srv.mu.Lock()
	defer p.srv.mu.Unlock()
	want := fmt.Sprintf("pid:%d", os.Getpid())
	if len(p.srv.bySource) != 1 || len(p.srv.bySource[want]) != 3 {
		t.Fatalf("sources %v, want 3 connections of %s", p.srv.bySource, want)
	}
}

// libzmq DEALER and REQ peers -> our ROUTER on an ipc endpoint.
func TestInteropPythonDealerAndReqToGoIPCRouter(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	r, err := ListenRouter(IPCEndpoint(ipcPath(t, "r.sock")), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	const n = 20
	dealer := zmqtest.Start(t, peerScript, "dealer", r.Endpoint(), fmt.Sprint(n))
	ctx := testCtx(t, 30*time.Second)
	for i := range n {
		m, err := r.Recv(ctx)
		if err != nil {
			t.Fatalf("dealer message %d: %v\npeer stderr: %s", i, err, dealer.Stderr())
		}
		if !equalFrames(m.Frames, [][]byte{[]byte("d"), []byte(fmt.Sprint(i))}) || m.Cred == nil || m.Cred.UID != uint32(os.Getuid()) {
			t.Fatalf("dealer message %d: %q from %v", i, m.Frames, m.Cred)
		}
		if err := r.Send(ctx, m.Peer, append([][]byte{[]byte("echo")}, m.Frames...)...); err != nil {
			t.Fatal(err)
		}
	}
	if got := dealer.Line(20 * time.Second); got != fmt.Sprint("OK ", n) {
		t.Fatalf("dealer said %q", got)
	}
	dealer.Wait(10 * time.Second)

	req := zmqtest.Start(t, peerScript, "req", r.Endpoint(), fmt.Sprint(n))
	for i := range n {
		m, err := r.Recv(ctx)
		if err != nil {
			t.Fatalf("request %d: %v\npeer stderr: %s", i, err, req.Stderr())
		}
		if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || string(m.Frames[1]) != "req" {
			t.Fatalf("request %d: %q", i, m.Frames)
		}
		if err := r.Send(ctx, m.Peer, nil, []byte("rep"), m.Frames[2]); err != nil {
			t.Fatal(err)
		}
	}
	if got := req.Line(20 * time.Second); got != fmt.Sprint("OK ", n) {
		t.Fatalf("req peer said %q", got)
	}
	req.Wait(10 * time.Second)
}

// our PUSH -> libzmq PULL, our REQ -> libzmq ROUTER, both on ipc
// endpoints that libzmq bound.
func TestInteropGoToPythonIPC(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	ctx := testCtx(t, 30*time.Second)
	pullEP := IPCEndpoint(ipcPath(t, "pull.sock"))
	pull := zmqtest.Start(t, peerScript, "pull", pullEP)
	portLine(t, pull)
	push, err := DialPush(pullEP, quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer push.Close()
	msgs := standardMessages()
	for i, m := range msgs {
		if err := push.Send(ctx, m...); err != nil {
			t.Fatalf("send %d: %v\npeer stderr: %s", i, err, pull.Stderr())
		}
	}
	if got := pull.Line(20 * time.Second); got != fmt.Sprint("OK ", len(msgs)) {
		t.Fatalf("pull peer said %q", got)
	}
	pull.Wait(10 * time.Second)

	const n = 5
	routerEP := IPCEndpoint(ipcPath(t, "router.sock"))
	router := zmqtest.Start(t, peerScript, "router", fmt.Sprint(n), routerEP)
	portLine(t, router)
	for i := range n {
		rep, err := Request(ctx, routerEP, [][]byte{[]byte("hi"), {byte(i)}}, quiet())
		if err != nil || !equalFrames(rep, [][]byte{[]byte("echo"), []byte("hi"), {byte(i)}}) {
			t.Fatalf("request %d: %q %v\npeer stderr: %s", i, rep, err, router.Stderr())
		}
	}
	if got := router.Line(20 * time.Second); got != fmt.Sprint("OK ", n) {
		t.Fatalf("router peer said %q", got)
	}
	router.Wait(10 * time.Second)
}
