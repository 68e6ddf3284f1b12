// Package ratelogtest helps tests check that what a peer can trigger is
// logged through ratelog: a LineCounter is an io.Writer for a slog handler
// that counts the lines written and keeps the last.
package ratelogtest

import (
	"bytes"
	"sync"
)

// LineCounter counts the log lines written through it. It is safe for
// concurrent use; the zero value is ready.
type LineCounter struct {
	mu    sync.Mutex
	lines int
	last  string
}

// Write counts the newlines in p and keeps p as the last write.
func (l *LineCounter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines += bytes.Count(p, []byte{'\n'})
	l.last = string(p)
	return len(p), nil
}

// Count returns the number of lines written so far and the last write.
func (l *LineCounter) Count() (lines int, last string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lines, l.last
}
