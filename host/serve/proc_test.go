package serve

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// binaries builds kvhost and the test engine, once per test process,
// into a directory TestMain removes.
func binaries(t *testing.T) (kvhost, engine string) {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "kvhost-serve-bin-")
		if buildErr != nil {
			return
		}
		for _, b := range []struct{ out, pkg string }{{"kvhost", "../../cmd/kvhost"}, {"testengine", "./internal/testengine"}} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(buildDir, b.out), b.pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %v\n%s", b.pkg, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(buildDir, "kvhost"), filepath.Join(buildDir, "testengine")
}

// proc is a child process whose stdout lines the test reads.
type proc struct {
	t     *testing.T
	name  string
	cmd   *exec.Cmd
	lines chan string
	done  chan struct{}
	err   error
	log   strings.Builder
	mu    sync.Mutex
}

func start(t *testing.T, name string, path string, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, cmd: exec.Command(path, args...), lines: make(chan string, 1024), done: make(chan struct{})}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = &lockedWriter{p: p}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.mu.Lock()
			fmt.Fprintln(&p.log, sc.Text())
			p.mu.Unlock()
			p.lines <- sc.Text()
		}
		close(p.lines)
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		// A test engine the test killed cannot unlink its pools
		// (internal/testengine names them /kvte-PID-RANK).
		names, _ := filepath.Glob(fmt.Sprintf("/dev/shm/kvte-%d-*", p.cmd.Process.Pid))
		for _, n := range names {
			os.Remove(n)
		}
		if t.Failed() {
			p.mu.Lock()
			t.Logf("%s output:\n%s", name, p.log.String())
			p.mu.Unlock()
		}
	})
	return p
}

type lockedWriter struct{ p *proc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.log.Write(b)
}

// expect waits for a line starting with prefix and returns it.
func (p *proc) expect(prefix string) string {
	p.t.Helper()
	timer := time.NewTimer(60 * time.Second)
	defer timer.Stop()
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				p.t.Fatalf("%s exited before %q", p.name, prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
			if strings.HasPrefix(l, "FAIL") {
				p.t.Fatalf("%s: %s", p.name, l)
			}
		case <-timer.C:
			p.t.Fatalf("%s: no %q within 60 s", p.name, prefix)
		}
	}
}

// wait waits for the process to exit and returns its error.
func (p *proc) wait() error {
	p.t.Helper()
	go io.Copy(io.Discard, chanReader(p.lines))
	select {
	case <-p.done:
		return p.err
	case <-time.After(60 * time.Second):
		p.t.Fatalf("%s did not exit", p.name)
		return nil
	}
}

type chanReader chan string

func (c chanReader) Read(b []byte) (int, error) {
	if _, ok := <-c; !ok {
		return 0, io.EOF
	}
	return 0, nil
}

// sidecar starts `kvhost serve` on the fake plugin and returns it with its
// control endpoint.
func sidecar(t *testing.T, kvhost, sock string, extra ...string) (*proc, string) {
	t.Helper()
	dir := filepath.Dir(faketest.Plugin(t).Path())
	args := append([]string{"--plugin-path", dir, "--log-level", "debug", "serve", "--control", "ipc://" + sock, "--cudart", standin(t)}, extra...)
	p := start(t, "sidecar "+filepath.Base(sock), kvhost, args...)
	ep := p.expect("ipc://")
	return p, ep
}

// TestTwoProcesses: two `kvhost serve` processes, each driven by a test
// engine process, move KV (TP 1->1 over host memory, 2->4 over stand-in
// CUDA IPC) and verify every byte in the decode engine's memory; SIGTERM
// stops each sidecar cleanly and removes its socket.
func TestTwoProcesses(t *testing.T) {
	kvhost, engine := binaries(t)
	for _, c := range []struct {
		name     string
		ptp, dtp int
		vram     bool
		rooms    string
	}{
		{"1to1", 1, 1, false, "1,2,3"},
		{"2to4", 2, 4, true, "4,5"},
	} {
		t.Run(c.name, func(t *testing.T) {
			// One bootstrap server per prefill deployment, as in SGLang:
			// each case has its own sidecars.
			dir := t.TempDir()
			ps, pep := sidecar(t, kvhost, filepath.Join(dir, "p.sock"))
			ds, dep := sidecar(t, kvhost, filepath.Join(dir, "d.sock"))
			vram := fmt.Sprintf("-vram=%v", c.vram)
			pre := start(t, "prefill engine", engine, "-control", pep, "-role", "prefill", "-tp", fmt.Sprint(c.ptp), vram, "-rooms", c.rooms, "-start-bootstrap")
			boot := strings.TrimPrefix(pre.expect("BOOTSTRAP "), "BOOTSTRAP ")
			dec := start(t, "decode engine", engine, "-control", dep, "-role", "decode", "-tp", fmt.Sprint(c.dtp), vram, "-rooms", c.rooms, "-bootstrap", boot)
			if err := dec.wait(); err != nil {
				t.Fatalf("decode engine: %v", err)
			}
			if err := pre.wait(); err != nil {
				t.Fatalf("prefill engine: %v", err)
			}
			for _, p := range []*proc{ps, ds} {
				p.cmd.Process.Signal(syscall.SIGTERM)
				if err := p.wait(); err != nil {
					t.Errorf("%s after SIGTERM: %v", p.name, err)
				}
			}
			for _, s := range []string{"p.sock", "d.sock"} {
				if _, err := os.Stat(filepath.Join(dir, s)); !os.IsNotExist(err) {
					t.Errorf("socket %s left behind: %v", s, err)
				}
			}
		})
	}
}
