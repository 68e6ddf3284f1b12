package synth

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
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
