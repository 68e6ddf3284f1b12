package peerproc

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

const testEnv = "KVHOST_PEERPROC_TEST"

// The test binary doubles as the peer process.
func TestMain(m *testing.M) {
	if os.Getenv(testEnv) == "1" {
		if err := ServeStdio(); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func self() *exec.Cmd { return exec.Command(os.Args[0], "-test.run=^$") }

func openFake(t *testing.T) (*plugin.Plugin, []string) {
	t.Helper()
	dirs := plugin.SearchDirs("")
	p, err := plugin.Load("fake", dirs)
	if err != nil {
		t.Fatalf("fake plugin not built (run make plugin-fake): %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p, dirs
}

func TestPattern(t *testing.T) {
	b, err := Map(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer Unmap(b)
	for _, n := range []int{1, 7, 8, 9, 1000, 4096} {
		Fill(b[:n], 42)
		if bad := Verify(b[:n], 42); bad != -1 {
			t.Fatalf("n=%d: fresh pattern fails at %d", n, bad)
		}
		if bad := Verify(b[:n], 43); bad < 0 || bad >= 8 {
			t.Fatalf("n=%d: another seed's pattern passes up to %d", n, bad)
		}
		b[n-1] ^= 1
		if bad := Verify(b[:n], 42); bad != int64(n-1) {
			t.Fatalf("n=%d: flipped last byte found at %d", n, bad)
		}
	}
	Fill(b, 7)
	if bad := Verify(b[8:], 7); bad < 0 || bad >= 8 {
		t.Errorf("the pattern shifted by a word passes up to %d", bad)
	}
	clear(b)
	if bad := Verify(b, 1); bad < 0 || bad >= 8 {
		t.Fatalf("zeros pass up to %d", bad)
	}
	if _, err := Map(0); err == nil {
		t.Error("Map(0) succeeded")
	}
}

// A MemAgent here and a RemoteAgent in a peer process answer alike, and
// bytes written into the peer process by a transfer are checked there.
func TestLocalAndRemoteAgentsAgree(t *testing.T) {
	p, dirs := openFake(t)
	proc, err := Start(self(), "fake", dirs, Options{Env: testEnv, What: "test peer", AnswerWithin: 20 * time.Second, Stderr: os.Stderr})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := proc.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	if proc.Pid() == os.Getpid() || proc.Pid() <= 0 {
		t.Errorf("peer pid %d, this process %d", proc.Pid(), os.Getpid())
	}
	local, err := NewMemAgent(p, "pp-local", nil, []uint64{8192, 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	remote, err := proc.NewAgent("pp-remote", nil, []uint64{8192, 4096})
	if err != nil {
		t.Fatal(err)
	}
	for _, peer := range []Peer{local, remote} {
		rs := peer.Regions()
		if len(rs) != 2 || rs[0].Len != 8192 || rs[1].Len != 4096 || rs[0].Kind != abi.DRAM || rs[0].Blob == nil {
			t.Errorf("%s: regions %+v", peer.Name(), rs)
		}
		if err := peer.Fill(0, 100, 1000, 9); err != nil {
			t.Fatal(err)
		}
		want := make([]byte, 1000)
		Fill(want, 9)
		if got, err := peer.Bytes(0, 100, 1000); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: bytes after Fill: %v", peer.Name(), err)
		}
		if s, err := peer.Sum(0, 100, 1000); err != nil || !bytes.Equal(s, Sum(want)) {
			t.Errorf("%s: sum after Fill: %v", peer.Name(), err)
		}
		if bad, err := peer.Verify(0, 100, 1000, 9); err != nil || bad != -1 {
			t.Errorf("%s: Verify of the pattern: %d, %v", peer.Name(), bad, err)
		}
		if err := peer.Clear(0, 600, 10); err != nil {
			t.Fatal(err)
		}
		if bad, err := peer.Verify(0, 100, 1000, 9); err != nil || bad < 500 || bad > 507 {
			t.Errorf("%s: Verify after clearing [600, 610): %d, %v", peer.Name(), bad, err)
		}
		if _, err := peer.Sum(1, 4000, 97); err == nil {
			t.Errorf("%s: a span past the region was accepted", peer.Name())
		}
		if _, err := peer.Verify(2, 0, 1, 1); err == nil {
			t.Errorf("%s: region 2 of 2 was accepted", peer.Name())
		}
	}
	// Connect them, move bytes here -> there, check there; notify both ways.
	md, err := remote.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	name, err := local.LoadRemote(md)
	if err != nil || name != "pp-remote" {
		t.Fatalf("LoadRemote: %q, %v", name, err)
	}
	lmd, _ := local.Metadata()
	if name, err := remote.LoadRemote(lmd); err != nil || name != "pp-local" {
		t.Fatalf("remote LoadRemote: %q, %v", name, err)
	}
	if _, err := remote.LoadRemote([]byte("garbage")); !errors.Is(err, plugin.ErrInvalidParam) || !strings.Contains(err.Error(), "in the test peer") {
		t.Errorf("a plugin error in the peer: %v, want ErrInvalidParam from the test peer", err)
	}
	rr, err := local.Agent.ImportRegion(name, remote.Regions()[0].Blob)
	if err != nil {
		t.Fatal(err)
	}
	Fill(local.Bufs[0], 77)
	x, err := local.Agent.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: local.Registered[0], Remote: rr}}, []abi.BatchEntry{{Len: 8192, Count: 1}}, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if err := x.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if bad, err := remote.Verify(0, 0, 8192, 77); err != nil || bad != -1 {
		t.Errorf("bytes written into the peer process: first bad %d, %v", bad, err)
	}
	if bs, err := remote.Notifs(1, 5*time.Second); err != nil || len(bs) != 1 || string(bs[0][0].Msg) != "done" || bs[0][0].From != "pp-local" {
		t.Errorf("notification in the peer: %+v, %v", bs, err)
	}
	if err := remote.SendNotif("pp-local", nil); err != nil {
		t.Fatal(err)
	}
	if bs, err := local.Notifs(1, 5*time.Second); err != nil || len(bs) != 1 || bs[0][0].Msg == nil || len(bs[0][0].Msg) != 0 {
		t.Errorf("empty notification from the peer: %+v, %v", bs, err)
	}
	if err := remote.Close(); err != nil {
		t.Errorf("closing the remote agent: %v", err)
	}
	if _, err := remote.Metadata(); err == nil {
		t.Error("a closed remote agent answered")
	}
}

// A peer process that does not answer is killed: the run fails instead of
// hanging.
func TestProcThatDoesNotAnswerIsKilled(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatalf("no sleep command: %v", err)
	}
	start := time.Now()
	_, err = Start(exec.Command(sleep, "60"), "fake", nil, Options{AnswerWithin: 200 * time.Millisecond, ExitWithin: time.Second})
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("Start of a silent process: %v, want it killed", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("it took %v to give up on the process", d)
	}
}

// A peer process that fails says why: its exit status and stderr.
func TestProcFailureQuotesStderr(t *testing.T) {
	_, err := Start(exec.Command("/bin/sh", "-c", "echo peer broke >&2; exit 3"), "fake", nil, Options{What: "target process"})
	if err == nil || !strings.Contains(err.Error(), "peer broke") || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "target process") {
		t.Fatalf("err = %v, want the process's stderr and exit status", err)
	}
	if _, err := Start(exec.Command("/nonexistent/peer"), "fake", nil, Options{}); err == nil {
		t.Fatal("a missing binary started")
	}
	_, dirs := openFake(t)
	if _, err := Start(self(), "nosuchplugin", dirs, Options{Env: testEnv}); err == nil || !strings.Contains(err.Error(), "nosuchplugin") {
		t.Fatalf("unknown plugin: %v", err)
	}
}

// Kill ends the process; later calls fail at once and Close does not hang.
func TestProcKill(t *testing.T) {
	_, dirs := openFake(t)
	proc, err := Start(self(), "fake", dirs, Options{Env: testEnv})
	if err != nil {
		t.Fatal(err)
	}
	a, err := proc.NewAgent("doomed", nil, []uint64{4096})
	if err != nil {
		t.Fatal(err)
	}
	proc.Kill()
	if _, err := a.Metadata(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("a call after Kill: %v", err)
	}
	if err := proc.Close(); err == nil {
		t.Error("Close of a killed process reported success")
	}
}
