package conformance

import (
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"time"
)

// Status is the outcome of one case.
type Status string

const (
	Pass Status = "PASS"
	Fail Status = "FAIL"
	Skip Status = "SKIP"
)

// Result is the outcome of one case in one configuration.
type Result struct {
	Mode     Mode
	Case     string
	Status   Status
	Log      []string // Logf, Errorf, Fatalf and Skipf lines, in order
	Duration time.Duration
}

// caseTimeout bounds one case run by Run; a case that runs longer is
// reported as failed and the run stops (its goroutine cannot be stopped).
const caseTimeout = 2 * time.Minute

// Run runs every case against cfg and writes one line per case to w (with
// the case's log lines indented under failures and skips). It returns the
// results; err is non-nil only when the suite could not run at all or a
// case hung.
func Run(cfg Config, w io.Writer) ([]Result, error) {
	s, err := Open(cfg)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	var results []Result
	for _, c := range Cases() {
		r, hung := runCase(s, c)
		results = append(results, r)
		fmt.Fprintf(w, "%s  %-12s %-22s %s\n", r.Status, cfg.Mode, c.Name, r.Duration.Round(time.Millisecond))
		if r.Status != Pass {
			for _, l := range r.Log {
				fmt.Fprintf(w, "      %s\n", strings.ReplaceAll(l, "\n", "\n      "))
			}
		}
		if hung {
			return results, fmt.Errorf("case %s did not finish within %v", c.Name, caseTimeout)
		}
	}
	return results, nil
}

func runCase(s *Suite, c Case) (Result, bool) {
	t := &runT{}
	start := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer t.runCleanups()
		c.Run(t, s)
	}()
	hung := false
	select {
	case <-done:
	case <-time.After(caseTimeout):
		hung = true
		t.Errorf("timed out after %v", caseTimeout)
	}
	r := Result{Mode: s.cfg.Mode, Case: c.Name, Status: Pass, Duration: time.Since(start)}
	t.mu.Lock()
	defer t.mu.Unlock()
	r.Log = append([]string(nil), t.log...)
	switch {
	case t.failed:
		r.Status = Fail
	case t.skipped:
		r.Status = Skip
	}
	return r, hung
}

// runT is the TB of Run. Fatalf and Skipf end the case's goroutine with
// runtime.Goexit, as testing.T does; the deferred cleanups still run.
type runT struct {
	mu       sync.Mutex
	log      []string
	failed   bool
	skipped  bool
	cleanups []func()
}

func (t *runT) Helper() {}

func (t *runT) add(s string) {
	t.mu.Lock()
	t.log = append(t.log, s)
	t.mu.Unlock()
}

func (t *runT) Logf(format string, args ...any) { t.add(fmt.Sprintf(format, args...)) }

func (t *runT) Errorf(format string, args ...any) {
	t.add(fmt.Sprintf(format, args...))
	t.mu.Lock()
	t.failed = true
	t.mu.Unlock()
}

func (t *runT) Fatalf(format string, args ...any) {
	t.Errorf(format, args...)
	runtime.Goexit()
}

func (t *runT) Skipf(format string, args ...any) {
	t.add(fmt.Sprintf(format, args...))
	t.mu.Lock()
	t.skipped = true
	t.mu.Unlock()
	runtime.Goexit()
}

func (t *runT) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}

func (t *runT) Cleanup(f func()) {
	t.mu.Lock()
	t.cleanups = append(t.cleanups, f)
	t.mu.Unlock()
}

// runCleanups runs the cleanups last-in first-out, as testing.T does. A
// cleanup that calls Fatalf ends only itself.
func (t *runT) runCleanups() {
	for {
		t.mu.Lock()
		n := len(t.cleanups)
		if n == 0 {
			t.mu.Unlock()
			return
		}
		f := t.cleanups[n-1]
		t.cleanups = t.cleanups[:n-1]
		t.mu.Unlock()
		done := make(chan struct{})
		go func() {
			defer close(done)
			f()
		}()
		<-done
	}
}
