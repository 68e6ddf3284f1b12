package ratelog

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

type buf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *buf) lines() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Split(strings.TrimSpace(b.b.String()), "\n")
}

// A flood of one kind of line writes Burst lines and, at the end of the
// window, one line with the count of the rest; other kinds have their own
// allowance; loggers made by With share their parent's.
func TestFloodIsCountedNotWritten(t *testing.T) {
	var out buf
	l := newWith(slog.New(slog.NewTextHandler(&out, nil)), 200*time.Millisecond, 3, 8)
	child := l.With("component", "x")
	for i := range 1000 {
		l.Warn("bad request", "i", i)
		child.Warn("bad request", "i", i)
	}
	l.Error("other kind")
	l.Debug("disabled level") // not enabled: neither written nor counted
	time.Sleep(400 * time.Millisecond)
	got := out.lines()
	if len(got) != 3+1+1 {
		t.Fatalf("%d lines, want 3 + 1 + the report:\n%s", len(got), strings.Join(got, "\n"))
	}
	if last := got[len(got)-1]; !strings.Contains(last, "suppressed 1997 similar lines: bad request") || !strings.Contains(last, "component=x") {
		t.Fatalf("report %q", last)
	}
	// A new window lets lines through again.
	l.Warn("bad request", "i", "again")
	if got := out.lines(); !strings.Contains(got[len(got)-1], "i=again") {
		t.Fatalf("after the window: %q", got[len(got)-1])
	}
	l.Close()
}

// Kinds past MaxKinds share one count; Close reports what is pending and
// stops the timer.
func TestManyKindsAndClose(t *testing.T) {
	var out buf
	l := newWith(slog.New(slog.NewTextHandler(&out, nil)), time.Hour, 1, 4)
	for i := range 100 {
		l.Info(fmt.Sprint("kind ", i))
	}
	l.Info("kind 0")
	if n := len(out.lines()); n != 4 {
		t.Fatalf("%d lines before Close, want 4", n)
	}
	l.Close()
	got := strings.Join(out.lines(), "\n")
	if !strings.Contains(got, "suppressed 96 lines of other kinds") || !strings.Contains(got, "suppressed 1 similar lines: kind 0") {
		t.Fatalf("after Close:\n%s", got)
	}
	if l.s.timer != nil {
		t.Fatal("timer still armed after Close")
	}
}

func TestConcurrentUse(t *testing.T) {
	var out buf
	l := newWith(slog.New(slog.NewTextHandler(&out, nil)), 50*time.Millisecond, 2, 4)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				l.Warn(fmt.Sprint("kind ", (g+i)%6))
			}
		})
	}
	wg.Wait()
	l.Close()
	total := 0
	for _, line := range out.lines() {
		i := strings.Index(line, "suppressed=")
		if i < 0 {
			total++
			continue
		}
		var n int
		if _, err := fmt.Sscanf(line[i+len("suppressed="):], "%d", &n); err != nil {
			t.Fatalf("report %q: %v", line, err)
		}
		total += n
	}
	if total != 8*2000 {
		t.Fatalf("lines written plus suppressed = %d, want %d", total, 8*2000)
	}
}

// blockingReports is a handler that holds each "suppressed" report until
// release is closed, telling entered when the first one arrives.
type blockingReports struct {
	slog.Handler
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (h *blockingReports) Handle(ctx context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, "suppressed ") {
		h.once.Do(func() { close(h.entered) })
		<-h.release
	}
	return h.Handler.Handle(ctx, r)
}

// Close returns only once a window-end report that the timer's flush is
// writing at that moment is written: a Close that returned earlier let
// its owner read (or exit before) an incomplete log, the race that
// TestConcurrentUse met on a loaded machine.
func TestCloseWaitsForTimerFlush(t *testing.T) {
	var out buf
	h := &blockingReports{Handler: slog.NewTextHandler(&out, nil), entered: make(chan struct{}), release: make(chan struct{})}
	l := newWith(slog.New(h), time.Millisecond, 1, 4)
	l.Warn("again")
	l.Warn("again") // suppressed: the window's timer will report it
	<-h.entered     // the timer's flush is writing its report
	closed := make(chan struct{})
	go func() {
		l.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while the timer's report was still being written")
	case <-time.After(50 * time.Millisecond):
	}
	close(h.release)
	<-closed
	if got := strings.Join(out.lines(), "\n"); !strings.Contains(got, "suppressed 1 similar lines: again") {
		t.Fatalf("after Close:\n%s", got)
	}
}
