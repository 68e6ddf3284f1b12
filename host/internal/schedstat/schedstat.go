// Package schedstat reads the kernel's per-thread scheduler statistics,
// /proc/<pid>/task/<tid>/schedstat: how long each thread of a process ran
// on a CPU and how long it waited, runnable, on a runqueue for one. On a
// machine with fewer cores than busy threads the wait is what the
// process lost to the others; a transfer rate measured over wall time
// (kvhost demo's, make demo-engine's) is then bounded by it, not by
// kvhost.
//
// The file holds three decimal numbers: nanoseconds on a CPU, nanoseconds
// waiting on a runqueue, timeslices run. Kernels built without
// CONFIG_SCHED_INFO have no such file: Read then returns ErrUnavailable,
// which callers report as "not measured" rather than fail on.
package schedstat

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrUnavailable is returned where the kernel keeps no per-thread
// schedstat (built without CONFIG_SCHED_INFO).
var ErrUnavailable = errors.New("schedstat: this kernel keeps no per-thread schedstat (CONFIG_SCHED_INFO)")

// Thread is one thread's counters since it started.
type Thread struct {
	Run    time.Duration // on a CPU
	Wait   time.Duration // runnable, waiting on a runqueue for a CPU
	Slices uint64        // timeslices run
}

// Snapshot is every thread of a process at one moment, keyed by thread id.
type Snapshot map[int]Thread

// maxFileBytes bounds what is read of one schedstat file: three uint64s in
// decimal and their separators need under 64 bytes.
const maxFileBytes = 256

// Self reads every thread of this process.
func Self() (Snapshot, error) { return Read("/proc", "self") }

// Process reads every thread of process pid.
func Process(pid int) (Snapshot, error) { return Read("/proc", strconv.Itoa(pid)) }

// Read reads every thread of process pid ("self" or a number) under the
// proc file system mounted at root. A thread that ends while it is read is
// left out; a process that does not exist is an error (fs.ErrNotExist);
// a kernel without the files is ErrUnavailable; a file that is not three
// numbers is an error naming it.
func Read(root, pid string) (Snapshot, error) {
	dir := filepath.Join(root, pid, "task")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("schedstat: %w", err)
	}
	snap := make(Snapshot, len(ents))
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil || tid <= 0 {
			continue // not a thread
		}
		name := filepath.Join(dir, e.Name(), "schedstat")
		b, err := readBounded(name)
		if errors.Is(err, syscall.ESRCH) || (err == nil && len(b) == 0) {
			// The thread ended between the open and the read: the kernel
			// answers ESRCH (or nothing) for a thread being reaped.
			continue
		}
		if errors.Is(err, fs.ErrNotExist) {
			if _, serr := os.Stat(filepath.Join(dir, e.Name())); serr == nil {
				// The thread is there, its schedstat is not.
				return nil, ErrUnavailable
			}
			continue // the thread ended after the listing
		}
		if err != nil {
			return nil, fmt.Errorf("schedstat: %w", err)
		}
		t, err := Parse(b)
		if err != nil {
			return nil, fmt.Errorf("schedstat: %s: %w", name, err)
		}
		snap[tid] = t
	}
	return snap, nil
}

func readBounded(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, maxFileBytes+1)
	n := 0
	for n < len(b) {
		m, err := f.Read(b[n:])
		n += m
		if err == io.EOF || (err == nil && m == 0) {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if n > maxFileBytes {
		return nil, fmt.Errorf("%s: longer than %d bytes", name, maxFileBytes)
	}
	return b[:n], nil
}

// Parse parses one schedstat file: three unsigned decimal numbers
// separated by single spaces, then an optional newline.
func Parse(b []byte) (Thread, error) {
	s := strings.TrimSuffix(string(b), "\n")
	f := strings.Split(s, " ")
	if len(f) != 3 {
		return Thread{}, fmt.Errorf("want 3 numbers, got %q", s)
	}
	var v [3]uint64
	for i, x := range f {
		n, err := strconv.ParseUint(x, 10, 64)
		if err != nil {
			return Thread{}, fmt.Errorf("field %d of %q: not an unsigned number", i+1, s)
		}
		v[i] = n
	}
	if v[0] > uint64(1<<63-1) || v[1] > uint64(1<<63-1) {
		return Thread{}, fmt.Errorf("%q: nanoseconds out of range", s)
	}
	return Thread{Run: time.Duration(v[0]), Wait: time.Duration(v[1]), Slices: v[2]}, nil
}

// Usage is what a process's threads did between two snapshots. Seconds
// are wall seconds summed over threads (two threads running for 1 s each
// ran 2 s).
type Usage struct {
	RunSeconds  float64 `json:"run_seconds"`  // on a CPU
	WaitSeconds float64 `json:"wait_seconds"` // runnable, waiting for a CPU
	Timeslices  uint64  `json:"timeslices"`
	Threads     int     `json:"threads"` // threads that ran in the window
}

// Delta is what the threads of after did since before. A thread that
// started between the snapshots counts from zero (its whole life is in
// the window); one that ended between them is lost (the kernel drops its
// counters with it), so a process whose threads come and go is
// undercounted. A thread id the kernel reused for a new thread shows
// counters below the old one's and counts from zero too.
func Delta(before, after Snapshot) Usage {
	var u Usage
	for tid, a := range after {
		b, ok := before[tid]
		if !ok || a.Run < b.Run || a.Wait < b.Wait || a.Slices < b.Slices {
			b = Thread{}
		}
		run, wait := a.Run-b.Run, a.Wait-b.Wait
		u.RunSeconds += run.Seconds()
		u.WaitSeconds += wait.Seconds()
		u.Timeslices += a.Slices - b.Slices
		if run > 0 || wait > 0 {
			u.Threads++
		}
	}
	return u
}

// Add returns the sum of u and o (the threads of two processes).
func (u Usage) Add(o Usage) Usage {
	return Usage{RunSeconds: u.RunSeconds + o.RunSeconds, WaitSeconds: u.WaitSeconds + o.WaitSeconds,
		Timeslices: u.Timeslices + o.Timeslices, Threads: u.Threads + o.Threads}
}

// WaitPerRun is the seconds waited for a core per second on one: 0 where
// a core was always free, 1 where threads waited as long as they ran. 0
// when nothing ran.
func (u Usage) WaitPerRun() float64 {
	if u.RunSeconds <= 0 {
		return 0
	}
	return u.WaitSeconds / u.RunSeconds
}

// Window measures a process's threads from Begin to End.
type Window struct {
	root, pid string
	before    Snapshot
	err       error
}

// Begin starts a window over process pid's threads (0: this process).
func Begin(pid int) *Window { return BeginAt("/proc", pid) }

// BeginAt is Begin under a proc file system mounted at root.
func BeginAt(root string, pid int) *Window {
	w := &Window{root: root, pid: "self"}
	if pid != 0 {
		w.pid = strconv.Itoa(pid)
	}
	w.before, w.err = Read(w.root, w.pid)
	return w
}

// End returns what the threads did since Begin; the error is Begin's or
// its own (ErrUnavailable where the kernel keeps no schedstat).
func (w *Window) End() (Usage, error) {
	if w.err != nil {
		return Usage{}, w.err
	}
	after, err := Read(w.root, w.pid)
	if err != nil {
		return Usage{}, err
	}
	return Delta(w.before, after), nil
}

// Measure is End for a report that may go without: nil for a nil window
// (nothing was to be measured) or where End fails (logged on log, when
// not nil, at warn level).
func (w *Window) Measure(log *slog.Logger) *Usage {
	if w == nil {
		return nil
	}
	u, err := w.End()
	if err != nil {
		if log != nil {
			log.Warn("not reporting the threads' CPU time", "err", err)
		}
		return nil
	}
	return &u
}
