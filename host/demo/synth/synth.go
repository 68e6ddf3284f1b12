// Package synth holds what kvhost's two demo-grade workers share around
// their synthetic KV pools (host/demo/kvpool): the push workers of
// host/demo/pushworker (SGLang style) and the pull workers of
// host/demo/pullworker (vLLM style). Each piece stands in for a part of a serving engine the
// demo does not have: the page allocator that scatters a request over the
// pool, and the per-request report an operator or `kvhost demo` reads as
// requests finish.
package synth

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync"
)

// Lines writes one JSON document per line to a writer, one call per
// finished request, so a reader (kvhost demo's progress bar) sees each
// request as it finishes. Safe for concurrent use. After the first failed
// write, later lines are dropped and the failure is logged once.
type Lines struct {
	mu  sync.Mutex
	w   io.Writer // nil: discard
	log *slog.Logger
	err error
}

// NewLines returns a Lines writing to w (nil: discard everything) and
// logging a failed write to log (nil: slog.Default()).
func NewLines(w io.Writer, log *slog.Logger) *Lines {
	if log == nil {
		log = slog.Default()
	}
	return &Lines{w: w, log: log}
}

// Write writes v as one JSON line.
func (l *Lines) Write(v any) {
	if l.w == nil {
		return
	}
	b, err := json.Marshal(v)
	if err != nil {
		err = fmt.Errorf("report line: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return
	}
	if err == nil {
		_, err = l.w.Write(append(b, '\n'))
	}
	if err != nil {
		l.err = err
		l.log.Error("writing the request report; later lines are dropped", "err", err)
	}
}

// Err returns the first write failure, nil if none.
func (l *Lines) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}
