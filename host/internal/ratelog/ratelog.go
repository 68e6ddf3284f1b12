// Package ratelog is kvhost's one rate-limited logger: every log line a
// peer can trigger (a refused connection, a malformed message, a bad HTTP
// request, a notification for an unknown request) goes through it, so a
// hostile or broken peer cannot flood the log however fast it sends.
//
// A Logger is a *slog.Logger whose handler lets through at most Burst
// lines of each kind (level and message) per Window; the rest are
// counted, and when the window ends one line per kind reports how many
// were suppressed ("suppressed 1234 similar lines: <message>"), so
// nothing disappears silently. At most MaxKinds kinds are tracked per
// window; lines of further kinds share one more count. Loggers derived
// with With or WithGroup share their parent's limits.
package ratelog

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// Limits of every Logger: a peer flooding one kind of line costs at most
// (Burst + 1) lines per Window, and a flood of many kinds at most
// MaxKinds × Burst + MaxKinds + 1.
const (
	Window   = 10 * time.Second
	Burst    = 10 // lines of one kind per window
	MaxKinds = 32 // kinds tracked per window
)

// Logger is a rate-limited *slog.Logger (see the package comment). Close
// reports what is still suppressed and stops its timer. Safe for
// concurrent use.
type Logger struct {
	*slog.Logger
	s *state
}

// New returns a rate-limited logger writing through l's handler (nil:
// slog.Default()).
func New(l *slog.Logger) *Logger {
	if l == nil {
		l = slog.Default()
	}
	return newWith(l, Window, Burst, MaxKinds)
}

func newWith(l *slog.Logger, window time.Duration, burst, maxKinds int) *Logger {
	s := &state{window: window, burst: burst, maxKinds: maxKinds, kinds: make(map[kind]*count)}
	return &Logger{Logger: slog.New(&handler{inner: l.Handler(), s: s}), s: s}
}

// Close logs the counts of lines suppressed in the current window and
// stops the timer that would have; lines logged afterwards are still
// limited, and their counts reported by the next Close or window end.
// Owners call it when they close, so that no count is lost and no timer
// outlives them.
func (l *Logger) Close() {
	l.s.flush()
}

// kind is what makes two lines "similar".
type kind struct {
	level slog.Level
	msg   string
}

// overflow counts lines of kinds past maxKinds.
var overflow = kind{msg: ""}

type count struct {
	logged, suppressed int
	h                  slog.Handler // the handler of the last suppressed line, for its report
}

type state struct {
	window   time.Duration
	burst    int
	maxKinds int

	// flushMu serialises flushes from collecting the counts to writing
	// the last report, so that a Close that returns has every count
	// written, including those of a window-end flush running on the
	// timer's goroutine at the same time. Taken before mu, never under it.
	flushMu sync.Mutex

	mu    sync.Mutex
	start time.Time // of the current window; zero when none is open
	kinds map[kind]*count
	timer *time.Timer // reports the window's suppressed counts at its end
}

type handler struct {
	inner slog.Handler
	s     *state
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool { return h.inner.Enabled(ctx, l) }

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &handler{inner: h.inner.WithAttrs(as), s: h.s}
}

func (h *handler) WithGroup(name string) slog.Handler {
	return &handler{inner: h.inner.WithGroup(name), s: h.s}
}

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if h.s.admit(kind{r.Level, r.Message}, h.inner) {
		return h.inner.Handle(ctx, r)
	}
	return nil
}

// admit counts one line of kind k and reports whether to write it.
func (s *state) admit(k kind, h slog.Handler) bool {
	now := time.Now()
	s.mu.Lock()
	if !s.start.IsZero() && now.Sub(s.start) >= s.window {
		// The window's timer is due; report its counts now, in order.
		s.mu.Unlock()
		s.flush()
		s.mu.Lock()
	}
	if s.start.IsZero() {
		s.start = now
	}
	c := s.kinds[k]
	if c == nil {
		if len(s.kinds) >= s.maxKinds {
			k = overflow
			c = s.kinds[k]
		}
		if c == nil {
			c = &count{}
			s.kinds[k] = c
		}
	}
	if k != overflow && c.logged < s.burst {
		c.logged++
		s.mu.Unlock()
		return true
	}
	c.suppressed++
	c.h = h
	if s.timer == nil {
		s.timer = time.AfterFunc(s.start.Add(s.window).Sub(now), s.flush)
	}
	s.mu.Unlock()
	return false
}

// flush ends the current window: it reports each kind's suppressed lines
// and forgets the counts.
func (s *state) flush() {
	type report struct {
		k kind
		c *count
	}
	var reports []report
	s.flushMu.Lock()
	defer s.flushMu.Unlock()
	s.mu.Lock()
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	for k, c := range s.kinds {
		if c.suppressed > 0 {
			reports = append(reports, report{k, c})
		}
	}
	s.kinds = make(map[kind]*count)
	s.start = time.Time{}
	s.mu.Unlock()
	for _, r := range reports {
		level, msg := r.k.level, fmt.Sprintf("suppressed %d similar lines: %s", r.c.suppressed, r.k.msg)
		if r.k == overflow {
			level, msg = slog.LevelWarn, fmt.Sprintf("suppressed %d lines of other kinds", r.c.suppressed)
		}
		rec := slog.NewRecord(time.Now(), level, msg, 0)
		rec.AddAttrs(slog.Int("suppressed", r.c.suppressed), slog.Duration("window", s.window))
		if r.c.h.Enabled(context.Background(), level) {
			r.c.h.Handle(context.Background(), rec)
		}
	}
}
