// Package zmqtest runs Python peers (Debian's /usr/bin/python3 with
// python3-zmq and friends) for interoperability tests against real libzmq
// sockets. Test helpers only.
package zmqtest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// Python is the interpreter the interop tests use: Debian's, whose
// python3-zmq, python3-msgpack and python3-numpy packages
// scripts/install-test-deps.sh installs.
const Python = "/usr/bin/python3"

// RequirePython fails t unless Python can import every module: a skip
// would let `go test` pass without the interop peer (CI installs them).
func RequirePython(t testing.TB, modules ...string) {
	t.Helper()
	args := []string{"-c", "import " + strings.Join(modules, ", ")}
	if out, err := exec.Command(Python, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s cannot import %v (install with scripts/install-test-deps.sh): %v: %s",
			Python, modules, err, bytes.TrimSpace(out))
	}
}

// Peer is a running Python peer. It prints lines on stdout; Line returns
// them one at a time.
type Peer struct {
	t      testing.TB
	cmd    *exec.Cmd
	lines  chan string
	stderr *syncBuffer
	done   chan error
}

// Start runs Python with script and args. The process is killed when the
// test ends if it is still running.
func Start(t testing.TB, script string, args ...string) *Peer {
	t.Helper()
	cmd := exec.Command(Python, append([]string{script}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &Peer{t: t, cmd: cmd, lines: make(chan string, 64), stderr: &syncBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s %s: %v", Python, script, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 64<<20)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		io.Copy(io.Discard, stdout)
		close(p.lines)
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		for range p.lines {
		}
	})
	return p
}

// Line returns the next stdout line, failing the test if none comes within
// timeout or the peer exits first.
func (p *Peer) Line(timeout time.Duration) string {
	p.t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("python peer exited early: %v\nstderr:\n%s", p.wait(), p.stderr.String())
		}
		return l
	case <-time.After(timeout):
		p.t.Fatalf("python peer printed nothing for %v\nstderr:\n%s", timeout, p.stderr.String())
	}
	return ""
}

// Wait waits for the peer to exit and fails the test unless it exited 0.
func (p *Peer) Wait(timeout time.Duration) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		select {
		case _, ok := <-p.lines:
			if !ok {
				if err := p.wait(); err != nil {
					p.t.Fatalf("python peer failed: %v\nstderr:\n%s", err, p.stderr.String())
				}
				return
			}
		case <-ctx.Done():
			p.t.Fatalf("python peer still running after %v\nstderr:\n%s", timeout, p.stderr.String())
		}
	}
}

func (p *Peer) wait() error {
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(10 * time.Second):
		return fmt.Errorf("did not exit")
	}
}

// Kill kills the peer (SIGKILL, as a crash) and waits until it has exited,
// so that the kernel has closed its sockets.
func (p *Peer) Kill() {
	p.t.Helper()
	p.cmd.Process.Kill()
	for range p.lines {
	}
	p.wait()
}

// PID is the peer's process id.
func (p *Peer) PID() int { return p.cmd.Process.Pid }

// Stderr is what the peer wrote to stderr so far.
func (p *Peer) Stderr() string { return p.stderr.String() }

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
