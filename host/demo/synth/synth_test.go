package synth

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

type failAfter struct {
	n   int
	buf bytes.Buffer
}

func (f *failAfter) Write(b []byte) (int, error) {
	if f.n == 0 {
		return 0, errors.New("disk full")
	}
	f.n--
	return f.buf.Write(b)
}

func TestLines(t *testing.T) {
	var buf bytes.Buffer
	l := NewLines(&buf, nil)
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() { defer wg.Done(); l.Write(map[string]int{"i": i}) }()
	}
	wg.Wait()
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	if len(lines) != 50 || l.Err() != nil {
		t.Fatalf("%d lines, err %v", len(lines), l.Err())
	}
	for _, line := range lines {
		if !strings.HasPrefix(line, `{"i":`) || !strings.HasSuffix(line, "}") {
			t.Fatalf("line %q", line)
		}
	}

	var logs bytes.Buffer
	f := &failAfter{n: 1}
	l = NewLines(f, slog.New(slog.NewTextHandler(&logs, nil)))
	for range 3 {
		l.Write("x")
	}
	if f.buf.String() != "\"x\"\n" || l.Err() == nil || strings.Count(logs.String(), "disk full") != 1 {
		t.Fatalf("wrote %q, err %v, logs %q", f.buf.String(), l.Err(), logs.String())
	}
	bad := NewLines(io.Discard, slog.New(slog.NewTextHandler(&logs, nil)))
	bad.Write(func() {}) // JSON cannot encode it: reported, not written
	if bad.Err() == nil {
		t.Fatal("a value JSON cannot encode was accepted")
	}
	NewLines(nil, nil).Write("nothing") // a nil writer discards
}

func TestAllocator(t *testing.T) {
	a := NewAllocator(8, 1)
	got, err := a.Get(t.Context(), 5)
	if err != nil || len(got) != 5 || a.Free() != 3 {
		t.Fatalf("%v %v, %d free", got, err, a.Free())
	}
	seen := map[int32]bool{}
	for _, p := range got {
		if p < 0 || p >= 8 || seen[p] {
			t.Fatalf("pages %v: not distinct slots of 0..7", got)
		}
		seen[p] = true
	}
	if _, err := a.Get(t.Context(), 9); err == nil || !strings.Contains(err.Error(), "9 pages needed, the pool has 8") {
		t.Fatalf("more than the pool: %v", err)
	}
	// Too few free: Get waits until Put gives some back.
	done := make(chan []int32)
	go func() {
		more, err := a.Get(t.Context(), 4)
		if err != nil {
			t.Error(err)
		}
		done <- more
	}()
	select {
	case <-done:
		t.Fatal("Get returned with 3 free of 4")
	case <-time.After(20 * time.Millisecond):
	}
	a.Put(got[:1])
	if more := <-done; len(more) != 4 || a.Free() != 0 {
		t.Fatalf("after Put: %v, %d free", more, a.Free())
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	if _, err := a.Get(ctx, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("an empty pool past the deadline: %v", err)
	}
}
