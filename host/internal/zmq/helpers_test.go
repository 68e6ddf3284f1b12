package zmq

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// logBuffer collects log output so tests can assert that something was
// logged.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// waitFor polls cond until it holds or the test's patience runs out.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func quiet() Option { return WithLogger(slog.New(slog.DiscardHandler)) }

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// standardMessages mirrors standard_messages() in testdata/zmq_peer.py.
func standardMessages() [][][]byte {
	big := bytes.Repeat(func() []byte {
		b := make([]byte, 256)
		for i := range b {
			b[i] = byte(i)
		}
		return b
	}(), 4096)
	msgs := [][][]byte{
		{[]byte("a")},
		{{}, []byte(strings.Repeat("x", 300)), []byte("end")},
		{big, {}},
		{[]byte("NixlMsgGuard"), []byte("12345"), []byte("127.0.0.1"), []byte("5555")},
	}
	for i := range 100 {
		msgs = append(msgs, [][]byte{[]byte("seq"), []byte(fmt.Sprint(i))})
	}
	return msgs
}

func equalFrames(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

// relisten binds a PULL socket to an endpoint that was just released,
// retrying briefly: until then another socket on the machine may hold the
// port as its local end.
func relisten(t *testing.T, ep string) *Pull {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := ListenPull(ep, quiet())
		if err == nil {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("re-listen on %s: %v", ep, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// deadEndpoint returns "tcp://127.0.0.1:port" for a port that refuses
// every connection for the rest of the test (reserveEndpoint). A port
// taken from a closed listener is not enough: on a loaded machine another
// test's listener may get it, and a dial to a listener with a full backlog
// times out instead of being refused.
func deadEndpoint(t testing.TB) string {
	ep, _ := reserveEndpoint(t)
	return ep
}

// reserveEndpoint returns "tcp://127.0.0.1:port" for a port held by a
// socket bound to it that never listens, so that connections to it are
// refused and no other listener (another test, another package's test
// binary) can take it; release frees it for a listener of the test's own
// (it is also freed when the test ends).
func reserveEndpoint(t testing.TB) (ep string, release func()) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { syscall.Close(fd) }) }
	t.Cleanup(release)
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("tcp://127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port), release
}
