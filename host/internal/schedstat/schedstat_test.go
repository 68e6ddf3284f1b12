package schedstat

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// writeProc makes a fake proc root: process pid with one task per entry
// of files (tid -> schedstat content; "" leaves the task without the file).
func writeProc(t *testing.T, pid string, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for tid, content := range files {
		dir := filepath.Join(root, pid, "task", tid)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if content == "" {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "schedstat"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Thread
		bad  bool
	}{
		{in: "845423 12 1\n", want: Thread{Run: 845423, Wait: 12, Slices: 1}},
		{in: "0 0 0", want: Thread{}},
		{in: "18446744073709551615 0 0\n", bad: true}, // ns beyond time.Duration
		{in: "1 2\n", bad: true},
		{in: "1 2 3 4\n", bad: true},
		{in: "1 -2 3\n", bad: true},
		{in: "1  2 3\n", bad: true},
		{in: "a b c\n", bad: true},
		{in: "", bad: true},
		{in: "1 2 3\n\n", bad: true},
	} {
		got, err := Parse([]byte(tc.in))
		if tc.bad {
			if err == nil {
				t.Errorf("Parse(%q) = %+v, want an error", tc.in, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("Parse(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}

func TestReadSynthetic(t *testing.T) {
	root := writeProc(t, "42", map[string]string{
		"42": "1000000000 500000000 10\n",
		"43": "2000 3000 4\n",
	})
	// Not a thread: ignored.
	if err := os.MkdirAll(filepath.Join(root, "42", "task", "notatid"), 0o755); err != nil {
		t.Fatal(err)
	}
	snap, err := Read(root, "42")
	if err != nil {
		t.Fatal(err)
	}
	want := Snapshot{42: {Run: time.Second, Wait: 500 * time.Millisecond, Slices: 10}, 43: {Run: 2000, Wait: 3000, Slices: 4}}
	if len(snap) != len(want) || snap[42] != want[42] || snap[43] != want[43] {
		t.Fatalf("Read = %+v, want %+v", snap, want)
	}
}

func TestReadUnavailable(t *testing.T) {
	// A kernel without CONFIG_SCHED_INFO: the task is there, its file not.
	root := writeProc(t, "7", map[string]string{"7": ""})
	if _, err := Read(root, "7"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Read without schedstat files: %v, want ErrUnavailable", err)
	}
	w := BeginAt(root, 7)
	if _, err := w.End(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Window.End without schedstat files: %v, want ErrUnavailable", err)
	}
}

func TestReadNoProcess(t *testing.T) {
	_, err := Read(t.TempDir(), "99")
	if err == nil || errors.Is(err, ErrUnavailable) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Read of a missing process: %v, want a not-exist error", err)
	}
}

func TestReadMalformed(t *testing.T) {
	for _, content := range []string{"1 2\n", "x y z\n", strings.Repeat("1", 300) + " 2 3\n"} {
		root := writeProc(t, "5", map[string]string{"5": "1 1 1\n", "6": content})
		_, err := Read(root, "5")
		if err == nil || errors.Is(err, ErrUnavailable) {
			t.Errorf("Read with schedstat %.20q...: %v, want a parse error", content, err)
		} else if !strings.Contains(err.Error(), filepath.Join("task", "6", "schedstat")) {
			t.Errorf("error %q does not name the file", err)
		}
	}
}

func TestDelta(t *testing.T) {
	before := Snapshot{
		1: {Run: 1 * time.Second, Wait: 100 * time.Millisecond, Slices: 5},
		2: {Run: 2 * time.Second, Wait: 0, Slices: 1},
		3: {Run: 9 * time.Second, Wait: 9 * time.Second, Slices: 9},  // ends: lost
		4: {Run: 5 * time.Second, Wait: 5 * time.Second, Slices: 50}, // tid reused below
	}
	after := Snapshot{
		1: {Run: 1500 * time.Millisecond, Wait: 400 * time.Millisecond, Slices: 8},
		2: {Run: 2 * time.Second, Wait: 0, Slices: 1},                            // idle
		5: {Run: 250 * time.Millisecond, Wait: 50 * time.Millisecond, Slices: 2}, // new
		4: {Run: 10 * time.Millisecond, Wait: 20 * time.Millisecond, Slices: 1},  // new thread, old tid
	}
	u := Delta(before, after)
	want := Usage{RunSeconds: 0.5 + 0.25 + 0.01, WaitSeconds: 0.3 + 0.05 + 0.02, Timeslices: 3 + 2 + 1, Threads: 3}
	if !near(u.RunSeconds, want.RunSeconds) || !near(u.WaitSeconds, want.WaitSeconds) ||
		u.Timeslices != want.Timeslices || u.Threads != want.Threads {
		t.Fatalf("Delta = %+v, want %+v", u, want)
	}
	if r := u.WaitPerRun(); !near(r, want.WaitSeconds/want.RunSeconds) {
		t.Fatalf("WaitPerRun = %v", r)
	}
	if s := u.Add(u); !near(s.RunSeconds, 2*u.RunSeconds) || !near(s.WaitSeconds, 2*u.WaitSeconds) ||
		s.Timeslices != 2*u.Timeslices || s.Threads != 2*u.Threads {
		t.Fatalf("Add = %+v", s)
	}
	if (Usage{WaitSeconds: 1}).WaitPerRun() != 0 {
		t.Fatal("WaitPerRun with nothing run is not 0")
	}
}

func near(a, b float64) bool { d := a - b; return d < 1e-9 && d > -1e-9 }

// TestSelfSpinningThread reads this very process: a goroutine spinning on
// its own OS thread must show that thread's run time growing.
func TestSelfSpinningThread(t *testing.T) {
	tidc := make(chan int)
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tidc <- gettid()
		for !stop.Load() {
		}
	}()
	tid := <-tidc
	defer func() { stop.Store(true); <-done }()
	w := Begin(0)
	before, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := before[tid]; !ok {
		t.Fatalf("thread %d not in /proc/self/task: %v", tid, before)
	}
	// Wait until the spinning thread has run 50 ms more, however loaded
	// the machine (no bound on how long that takes).
	var after Snapshot
	deadline, bounded := t.Deadline()
	for {
		if bounded && time.Until(deadline) < 5*time.Second {
			t.Fatalf("thread %d ran %v since the first read; its run time does not grow", tid, after[tid].Run-before[tid].Run)
		}
		time.Sleep(10 * time.Millisecond)
		if after, err = Self(); err != nil {
			t.Fatal(err)
		}
		if after[tid].Run-before[tid].Run >= 50*time.Millisecond {
			break
		}
	}
	if after[tid].Slices < before[tid].Slices {
		t.Fatalf("timeslices went back: %+v -> %+v", before[tid], after[tid])
	}
	u, err := w.End()
	if err != nil {
		t.Fatal(err)
	}
	if u.RunSeconds < 0.05 || u.WaitSeconds < 0 || u.Threads < 1 {
		t.Fatalf("window over the spinning thread: %+v, want at least 0.05 s run", u)
	}
}

// A thread being reaped reads empty (or ESRCH): it is left out, not an
// error that drops the whole snapshot.
func TestReadEmptyIsAnEndedThread(t *testing.T) {
	root := writeProc(t, "5", map[string]string{"5": "1 1 1\n", "6": "x"})
	if err := os.WriteFile(filepath.Join(root, "5", "task", "6", "schedstat"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	snap, err := Read(root, "5")
	if err != nil || len(snap) != 1 || snap[5] != (Thread{Run: 1, Wait: 1, Slices: 1}) {
		t.Fatalf("Read with an empty schedstat: %+v, %v; want only thread 5", snap, err)
	}
}

// Threads that end while this process's are read never fail the read
// (a goroutine that locks its OS thread and returns ends that thread).
func TestSelfWhileThreadsEnd(t *testing.T) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			ended := make(chan struct{})
			go func() {
				runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
				close(ended)
			}()
			<-ended
		}
	}()
	deadline := time.Now().Add(2 * time.Second)
	reads := 0
	for time.Now().Before(deadline) {
		if _, err := Self(); err != nil {
			close(stop)
			<-done
			t.Fatalf("read %d of /proc/self while threads end: %v", reads, err)
		}
		reads++
	}
	close(stop)
	<-done
	t.Logf("%d reads", reads)
}
