package plugin

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/backoff"
)

// TransferEvent is one finished transfer as the completion engine saw it:
// the one transfer event push, pull, bench and metrics consume.
// Durations and sizes come from the plugin's telemetry when the agent has
// it (CapTelemetry), else from the host's clock and from what the
// submitter declared (Watch.Bytes, Watch.Descs).
type TransferEvent struct {
	Op abi.Op
	// Bytes moved and descriptors handed to the plugin as the caller gave
	// them (strided descriptors count once; batch entries count as
	// descriptors).
	Bytes uint64
	Descs uint64
	// Posted is when the host posted the transfer (plugin telemetry: when
	// the plugin started it).
	Posted time.Time
	Post   time.Duration // inside the call that posted it
	Xfer   time.Duration // from post to completion
	// Plan is the time the runtime spent planning the transfer's
	// descriptors before making it; the engine leaves it as the Watch set
	// it.
	Plan time.Duration
	// Done is when the plugin marked the transfer done (telemetry, µs
	// resolution), else when the engine saw it done.
	Done time.Time
	Err  error // nil on success
}

// Handler is told when a transfer the engine watches finishes. It is
// called once per transfer, from the engine's goroutine (or, for a
// transfer done when submitted, from the submitter's, before the submit
// call returns); it must be quick and must not wait for the engine.
type Handler interface {
	TransferDone(tag any, ev TransferEvent)
}

// Watch says who to tell when a transfer ends and what the host knows of
// it: Bytes and Descs fill the event when the plugin has no telemetry,
// Plan is passed through. Passed by value: watching allocates nothing.
type Watch struct {
	Handler Handler
	Tag     any
	Bytes   uint64
	Descs   uint64
	Plan    time.Duration
	// Drive has the submitter poll the transfer itself first, while the
	// polls make progress, on an engine without an event descriptor: a
	// plugin may move the bytes in polls (the fake plugin does), and one
	// engine goroutine driving every transfer of an agent would serialise
	// what the submitters' goroutines copy in parallel. For submitters
	// that wait for their transfers anyway (push's transfer workers); the
	// submit call then returns when the transfer is done or stalls.
	Drive bool
}

// ErrAborted is the error of a transfer event for a transfer its runtime
// gave up on (Engine.Abort): the engine released (cancelled) it.
var ErrAborted = errors.New("plugin: transfer aborted")

// Adaptive polling: poll back to back for spinFor after the last progress
// or new work, then sleep from minSleep doubling to maxSleep (see the
// constants' comment in xfer.go). Notifications nobody Expects are polled
// every idleNotifPeriod without an event descriptor: each wake-up of an
// otherwise idle Go process costs 100-250µs of CPU on a loaded 2-core
// machine (timer, futex, the scheduler's spinning threads; measured: a bare
// Go timer loop at 40 wake-ups/s costs 0.65% of a core, the engine polling
// every 2ms 4.4%, every 25ms 0.8-1.0%), so 50ms keeps an idle worker well
// under 1% of a core (TestEngineIdleCPU) and delays a notification nobody
// waits for by at most that.
const (
	idleNotifPeriod = 50 * time.Millisecond
	// fdBackstop bounds a wait on the event descriptor while transfers
	// are in flight, should a plugin miss a signal.
	fdBackstop = 100 * time.Millisecond
)

// Engine is an agent's one completion engine: one goroutine that finishes
// every transfer submitted through it and delivers every notification of
// the agent to its subscribers. With an event descriptor (Agent.EventFD)
// it waits on it through Go's netpoller and never spins (the plugin
// completes transfers on its own); without one it polls adaptively
// (transfers: spin, then back off; notifications: back off) while
// transfers are in flight or notifications are Expected, polls
// notifications every idleNotifPeriod otherwise, and sleeps when there is
// neither. Get it with Agent.Engine; Agent.Close stops it.
type Engine struct {
	a    *Agent
	file *os.File // a dup of the agent's event descriptor; nil: polling
	fd   int      // file's descriptor
	rc   syscall.RawConn
	// readFn is waitFD's callback, made once (a closure per wait would
	// allocate); firstRead is its state, used by the engine's goroutine
	// only.
	readFn    func(uintptr) bool
	firstRead bool

	// seq counts the passes that drained events; a transfer submitted
	// across one may have had its signal consumed before the engine knew
	// it, so the submitter wakes the engine (see add).
	seq atomic.Uint64

	mu       sync.Mutex
	added    []*pending // handed over, not yet seen by the engine
	aborts   []abortReq
	kicked   bool
	sleeping bool
	closed   bool
	expect   int
	subs     []*sub
	wake     chan struct{} // polling mode
	done     chan struct{}

	pool sync.Pool // *pending
}

// sub is a subscriber; mu makes unsubscribing wait for a call in progress.
type sub struct {
	mu   sync.Mutex
	dead bool
	fn   func([]Notif)
}

func (s *sub) call(ns []Notif) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.dead {
		s.fn(ns)
	}
}

type abortReq struct {
	x   *Xfer
	err error
}

// pending is one transfer the engine watches.
type pending struct {
	x      *Xfer
	w      Watch
	op     abi.Op
	posted time.Time
	post   time.Duration
	keep   bool // Xfer.Wait: poll, do not release
	zombie bool // aborted, the plugin refused to release it: finish, then release
}

// Engine returns the agent's completion engine, starting it on first use.
// After Close it returns a stopped engine whose calls fail with ErrClosed.
func (a *Agent) Engine() *Engine {
	a.engineOnce.Do(func() { a.engine = newEngine(a) })
	return a.engine
}

// stopEngine stops the engine if it runs; Agent.Close calls it before
// destroying the agent.
func (a *Agent) stopEngine() {
	started := true
	a.engineOnce.Do(func() { // never started: a stopped one from now on
		started = false
		a.engine = &Engine{a: a, closed: true, wake: make(chan struct{}, 1), done: make(chan struct{})}
		a.engine.pool.New = func() any { return new(pending) }
		close(a.engine.done)
	})
	if started {
		a.engine.stop()
	}
}

func newEngine(a *Agent) *Engine {
	e := &Engine{a: a, wake: make(chan struct{}, 1), done: make(chan struct{})}
	e.pool.New = func() any { return new(pending) }
	if fd, ok := a.EventFD(); ok && fd >= 0 {
		if f, rc := openEventFD(fd); f != nil {
			e.file, e.rc, e.fd = f, rc, int(f.Fd())
			e.readFn = e.onReadable
		}
	}
	go e.run()
	return e
}

// openEventFD wraps a dup of the plugin's descriptor in an *os.File the
// netpoller watches (the plugin keeps owning fd; the engine closes only its
// dup). nil if the descriptor cannot be polled.
func openEventFD(fd int) (*os.File, syscall.RawConn) {
	d, err := syscall.Dup(fd)
	if err != nil {
		return nil, nil
	}
	syscall.CloseOnExec(d)
	if err := syscall.SetNonblock(d, true); err != nil {
		syscall.Close(d)
		return nil, nil
	}
	f := os.NewFile(uintptr(d), "kvhost-events")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, nil
	}
	// A file the poller cannot watch fails deadlines: fall back to polling.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, nil
	}
	return f, rc
}

// Native reports whether the engine waits on an event descriptor.
func (e *Engine) Native() bool { return e.file != nil }

func (e *Engine) stop() {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		<-e.done
		return
	}
	e.closed = true
	e.kickLocked()
	e.mu.Unlock()
	<-e.done
}

// SubmitPrepped makes and posts a prepped transfer in one plugin call
// (Agent.SubmitPrepped) and watches it: w.Handler learns when it ends, and
// the engine releases it then (the caller must not Close it). It returns
// the transfer, for Abort; when the transfer is done already the handler
// was called before SubmitPrepped returns. An error means nothing was
// submitted and the handler is not called.
func (e *Engine) SubmitPrepped(op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte, w Watch) (*Xfer, error) {
	s0 := e.seq.Load()
	t0 := time.Now()
	x, done, err := e.a.SubmitPrepped(op, local, localIdx, remote, remoteIdx, notif)
	if err != nil {
		return nil, err
	}
	e.submitted(x, op, t0, done, s0, w)
	return x, nil
}

// SubmitBatch is SubmitPrepped for a batch transfer (Agent.SubmitBatch).
func (e *Engine) SubmitBatch(op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte, w Watch) (*Xfer, error) {
	s0 := e.seq.Load()
	t0 := time.Now()
	x, done, err := e.a.SubmitBatch(op, pairs, entries, notif)
	if err != nil {
		return nil, err
	}
	e.submitted(x, op, t0, done, s0, w)
	return x, nil
}

func (e *Engine) submitted(x *Xfer, op abi.Op, t0 time.Time, done bool, s0 uint64, w Watch) {
	p := e.pool.Get().(*pending)
	*p = pending{x: x, w: w, op: op, posted: t0, post: time.Since(t0)}
	var tel Telemetry
	var err error
	if done {
		_, tel, err = x.PollRelease()
	} else if w.Drive && e.file == nil {
		done, tel, err = e.drive(x)
	}
	if done || err != nil {
		if err != nil {
			x.Close()
		}
		e.deliver(p, e.event(p, time.Now(), tel, err))
		e.pool.Put(p)
		return
	}
	if err := e.add(p, s0); err != nil {
		// The agent is closing: it releases the transfer.
		e.deliver(p, e.event(p, time.Now(), Telemetry{}, err))
		e.pool.Put(p)
	}
}

// drive polls x (PollRelease) in the calling goroutine while it makes
// progress: back to back for spinFor, and on for as long as each poll moves
// bytes (takes spinFor or more), as Finish does.
func (e *Engine) drive(x *Xfer) (bool, Telemetry, error) {
	spinStart := time.Now()
	for {
		p0 := time.Now()
		done, tel, err := x.PollRelease()
		if err != nil || done {
			return done, tel, err
		}
		now := time.Now()
		if now.Sub(p0) >= spinFor {
			spinStart = now
		} else if now.Sub(spinStart) >= spinFor {
			return false, Telemetry{}, nil
		}
	}
}

// Finish waits for a transfer submitted with Agent.SubmitPrepped or
// SubmitBatch (posted at t0, the submit call took post) and releases it:
// it polls in the calling goroutine for a moment (a short transfer is
// done before a hand-off would be), then leaves it to the engine. If ctx
// ends first the transfer is aborted (released) and the event carries
// ctx's error.
func (e *Engine) Finish(ctx context.Context, x *Xfer, t0 time.Time, post time.Duration, w Watch) TransferEvent {
	spinStart := time.Now()
	for {
		p0 := time.Now()
		done, tel, err := x.PollRelease()
		if err != nil || done {
			if err != nil {
				x.Close()
			}
			p := pending{w: w, op: x.op, posted: t0, post: post}
			return e.event(&p, time.Now(), tel, err)
		}
		now := time.Now()
		if now.Sub(p0) >= spinFor {
			spinStart = now // the poll moved bytes: keep driving
		} else if now.Sub(spinStart) >= spinFor {
			break
		}
	}
	wt := e.getWaiter()
	p := e.pool.Get().(*pending)
	*p = pending{x: x, w: w, op: x.op, posted: t0, post: post}
	p.w.Handler, p.w.Tag = wt, nil
	if err := e.add(p, 0); err != nil {
		ev := e.event(p, time.Now(), Telemetry{}, err)
		*p = pending{}
		e.pool.Put(p)
		e.putWaiter(wt)
		return ev
	}
	select {
	case <-wt.ch:
		ev := wt.ev
		e.putWaiter(wt)
		return ev
	case <-ctx.Done():
		e.Abort(x, ctx.Err())
		<-wt.ch // the engine answers at its next pass
		ev := wt.ev
		e.putWaiter(wt)
		return ev
	}
}

// wait is Xfer.Wait: it polls x in the calling goroutine for a moment,
// then has the engine watch it (without releasing it) until it completes,
// fails or ctx ends.
func (e *Engine) wait(ctx context.Context, x *Xfer) error {
	spinStart := time.Now()
	for {
		p0 := time.Now()
		done, err := x.Poll()
		if err != nil || done {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		now := time.Now()
		if now.Sub(p0) >= spinFor {
			spinStart = now
		} else if now.Sub(spinStart) >= spinFor {
			break
		}
	}
	wt := e.getWaiter()
	p := e.pool.Get().(*pending)
	*p = pending{x: x, w: Watch{Handler: wt}, op: x.op, posted: time.Now(), keep: true}
	if err := e.add(p, 0); err != nil {
		*p = pending{}
		e.pool.Put(p)
		e.putWaiter(wt)
		return err
	}
	select {
	case <-wt.ch:
		err := wt.ev.Err
		e.putWaiter(wt)
		return err
	case <-ctx.Done():
		e.Abort(x, ctx.Err())
		<-wt.ch
		e.putWaiter(wt)
		return ctx.Err()
	}
}

// waiter is the Handler of a caller waiting for one transfer.
type waiter struct {
	ch chan struct{}
	ev TransferEvent
}

func (w *waiter) TransferDone(_ any, ev TransferEvent) {
	w.ev = ev
	w.ch <- struct{}{}
}

var waiters = sync.Pool{New: func() any { return &waiter{ch: make(chan struct{}, 1)} }}

func (e *Engine) getWaiter() *waiter { return waiters.Get().(*waiter) }
func (e *Engine) putWaiter(w *waiter) {
	w.ev = TransferEvent{}
	waiters.Put(w)
}

// add hands p to the engine. s0 is the engine's pass count read before p's
// transfer was posted (0: unknown): if a pass drained events since, p's
// completion signal may be gone, so the engine is woken to poll it.
func (e *Engine) add(p *pending, s0 uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return closedError("completion engine of agent " + e.a.name)
	}
	e.added = append(e.added, p)
	if e.file == nil || s0 == 0 || e.seq.Load() != s0 {
		e.kickLocked()
	}
	return nil
}

// Abort gives up on a transfer the engine watches: the engine releases
// (cancels) it and its handler gets an event with err (ErrAborted if nil);
// a transfer Xfer.Wait watches is only no longer watched. A plugin that
// refuses the release (work still in flight) keeps it: the engine
// releases it once it ends. Aborting a transfer the engine does not watch
// (any more) does nothing.
func (e *Engine) Abort(x *Xfer, err error) {
	if err == nil {
		err = ErrAborted
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return
	}
	e.aborts = append(e.aborts, abortReq{x: x, err: err})
	e.kickLocked()
}

// Subscribe has fn called with every batch of notifications the agent
// receives, from the engine's goroutine (fn must be quick; the slice is
// shared by every subscriber: do not modify it). The returned function
// unsubscribes: once it returns fn is not running and is never called
// again (so it must not be called from fn). Needs CapNotif.
func (e *Engine) Subscribe(fn func([]Notif)) (cancel func(), err error) {
	if err := e.a.needCaps("get_notifs", abi.CapNotif); err != nil {
		return nil, err
	}
	s := &sub{fn: fn}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, closedError("completion engine of agent " + e.a.name)
	}
	e.subs = append(e.subs, s)
	e.kickLocked()
	e.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.dead = true
		s.mu.Unlock()
		e.mu.Lock()
		defer e.mu.Unlock()
		for i, x := range e.subs {
			if x == s {
				e.subs = append(e.subs[:i], e.subs[i+1:]...)
				return
			}
		}
	}, nil
}

// Expect adds delta to the notifications the runtime waits for now (a
// decode room waiting for its KV): while any are expected, an engine
// without an event descriptor polls notifications adaptively, as it polls
// transfers in flight, instead of every idleNotifPeriod.
func (e *Engine) Expect(delta int) {
	e.mu.Lock()
	e.expect += delta
	if e.expect < 0 {
		e.expect = 0
	}
	if delta > 0 {
		e.kickLocked()
	}
	e.mu.Unlock()
}

// kickLocked makes the engine run a pass now. Needs e.mu.
func (e *Engine) kickLocked() {
	e.kicked = true
	if !e.sleeping {
		return
	}
	e.sleeping = false
	if e.file != nil {
		e.file.SetReadDeadline(time.Unix(1, 0)) // past: the wait returns
		return
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// run is the engine's goroutine.
func (e *Engine) run() {
	defer close(e.done)
	if e.file != nil {
		defer e.file.Close()
	}
	var (
		active       []*pending
		aborts       []abortReq
		subs         []*sub
		nextNotifs   time.Time
		lastProgress = time.Now()
		sleep        = backoff.New(minSleep, maxSleep)
		timer        = time.NewTimer(time.Hour)
		events       = true // the descriptor fired (or polling): drain and read notifications
	)
	defer timer.Stop()
	for {
		if e.file != nil && events {
			e.a.DrainEvents() // an error here shows again in the polls
		}
		e.mu.Lock()
		e.seq.Add(1)
		fresh := e.kicked // new work, aborts, subscribers or expectations
		active = append(active, e.added...)
		clear(e.added)
		e.added = e.added[:0]
		aborts = append(aborts[:0], e.aborts...)
		clear(e.aborts)
		e.aborts = e.aborts[:0]
		subs = append(subs[:0], e.subs...)
		expect := e.expect > 0
		closed := e.closed
		e.kicked = false
		e.mu.Unlock()

		if closed {
			for _, p := range active {
				if p.zombie || p.keep {
					e.drop(p, closedError("agent "+e.a.name))
					continue
				}
				// Agent.Close destroys the agent and every transfer with it.
				e.deliver(p, e.event(p, time.Now(), Telemetry{}, closedError("agent "+e.a.name)))
			}
			return
		}
		for _, r := range aborts {
			for _, p := range active {
				if p.x == r.x && !p.zombie {
					e.abort(p, r.err)
				}
			}
		}
		progressed := fresh
		kept := active[:0]
		for _, p := range active {
			if p.x == nil { // delivered by abort
				e.pool.Put(p)
				continue
			}
			p0 := time.Now()
			if e.poll(p) {
				e.pool.Put(p)
				progressed = true
				continue
			}
			if time.Since(p0) >= spinFor {
				progressed = true // the poll moved bytes
			}
			kept = append(kept, p)
		}
		clear(active[len(kept):])
		active = kept

		now := time.Now()
		due := events
		if e.file == nil {
			due = expect || !now.Before(nextNotifs)
		}
		more := false // Notifs returned a batch: the plugin may hold more
		if len(subs) > 0 && due {
			ns, err := e.a.Notifs()
			if len(ns) > 0 {
				progressed, more = true, true
				for _, s := range subs {
					s.call(ns)
				}
			}
			_ = err // transient; the next poll retries (subscribers see no gap: nothing is lost)
			nextNotifs = now.Add(idleNotifPeriod)
		}
		nsubs := len(subs)
		clear(subs)
		events = false
		if more {
			// One Notifs call takes a bounded number of get_notifs
			// rounds (maxNotifRounds), and the descriptor was drained
			// before it: what it left queued would not wake the engine
			// again until the next notification arrives. Read again at
			// once until a call finds nothing.
			events, nextNotifs = true, now
			continue
		}

		if progressed {
			lastProgress = now
			sleep.Reset()
		}
		busy := len(active) > 0 || (e.file == nil && expect && nsubs > 0)
		// Spin for transfers only, and only without an event descriptor:
		// there a poll may drive them (the fake plugin copies in polls),
		// while with one the plugin completes them on its own threads
		// (kvp_get_event_fd_args), and a notification always comes from
		// the plugin's thread, which a spinning poller would keep off the
		// CPU on a small machine.
		if e.file == nil && len(active) > 0 && now.Sub(lastProgress) < spinFor {
			continue
		}

		e.mu.Lock()
		if e.kicked || e.closed {
			e.mu.Unlock()
			continue
		}
		e.sleeping = true
		if e.file != nil {
			var dl time.Time
			if len(active) > 0 {
				dl = now.Add(fdBackstop)
			}
			e.file.SetReadDeadline(dl)
		}
		e.mu.Unlock()

		if e.file != nil {
			e.waitFD()
			events = true
		} else {
			switch {
			case busy:
				e.sleepFor(timer, sleep.Next())
			case nsubs > 0:
				e.sleepFor(timer, time.Until(nextNotifs))
			default:
				<-e.wake
			}
		}
		e.mu.Lock()
		e.sleeping = false
		e.mu.Unlock()
	}
}

// sleepFor waits d or until the engine is kicked (polling mode).
func (e *Engine) sleepFor(t *time.Timer, d time.Duration) {
	if d <= 0 {
		return
	}
	t.Reset(d)
	select {
	case <-e.wake:
	case <-t.C:
	}
}

// waitFD waits until the event descriptor is readable or the engine is
// kicked (a deadline in the past) or the backstop deadline passes.
func (e *Engine) waitFD() {
	e.firstRead = true
	e.rc.Read(e.readFn)
}

// onReadable is the netpoller's callback of waitFD: false the first time
// unless the descriptor is readable already (the netpoller forgets
// readiness from before the call), true once it woke.
func (e *Engine) onReadable(fd uintptr) bool {
	if e.firstRead {
		e.firstRead = false
		return readableFD(int(fd))
	}
	return true
}

// readableFD reports whether fd is readable now (ppoll with a zero
// timeout; no cgo).
func readableFD(fd int) bool {
	type pollFd struct {
		fd      int32
		events  int16
		revents int16
	}
	const pollIn = 0x1
	pfd := pollFd{fd: int32(fd), events: pollIn}
	var ts syscall.Timespec
	n, _, errno := syscall.Syscall6(syscall.SYS_PPOLL, uintptr(unsafe.Pointer(&pfd)), 1, uintptr(unsafe.Pointer(&ts)), 0, 0, 0)
	return errno == 0 && n > 0 && pfd.revents != 0
}

// poll polls p once; when it ended it delivers its event and reports true.
func (e *Engine) poll(p *pending) bool {
	if p.keep {
		done, err := p.x.Poll()
		if !done && err == nil {
			return false
		}
		e.deliver(p, e.event(p, time.Now(), Telemetry{}, err))
		return true
	}
	done, tel, err := p.x.PollRelease()
	if !done && err == nil {
		return false
	}
	if p.zombie {
		if err != nil && p.x.Close() != nil {
			return false // still refused: keep trying
		}
		*p = pending{}
		return true
	}
	end := time.Now()
	if err != nil {
		p.x.Close() // released with its failure; closed already if it is gone
	}
	e.deliver(p, e.event(p, end, tel, err))
	return true
}

// abort releases an aborted transfer and delivers its event; a transfer
// the plugin refuses to release stays watched as a zombie.
func (e *Engine) abort(p *pending, err error) {
	ev := e.event(p, time.Now(), Telemetry{}, err)
	if !p.keep {
		if cerr := p.x.Close(); cerr != nil && !errors.Is(cerr, ErrClosed) {
			h := p.w
			p.zombie, p.w = true, Watch{}
			if h.Handler != nil {
				h.Handler.TransferDone(h.Tag, ev)
			}
			return
		}
	}
	e.deliver(p, ev)
	p.x = nil // dropped by the pass
}

func (e *Engine) drop(p *pending, err error) {
	if p.keep && p.w.Handler != nil {
		p.w.Handler.TransferDone(p.w.Tag, e.event(p, time.Now(), Telemetry{}, err))
	}
	*p = pending{}
}

// event builds p's event: telemetry when the plugin gave any, else the
// host's clock and p's Watch.
func (e *Engine) event(p *pending, end time.Time, tel Telemetry, err error) TransferEvent {
	ev := TransferEvent{Op: p.op, Bytes: p.w.Bytes, Descs: p.w.Descs, Posted: p.posted,
		Post: p.post, Xfer: end.Sub(p.posted), Plan: p.w.Plan, Done: end, Err: err}
	if err == nil && tel != (Telemetry{}) {
		// Posted stays the host's (ns) time: the plugin's is in µs.
		ev.Post, ev.Xfer = tel.Post, tel.Xfer
		if tel.Start.Unix() > 0 {
			ev.Done = tel.Start.Add(tel.Xfer)
		}
		if tel.Bytes > 0 {
			ev.Bytes = tel.Bytes
		}
		if tel.Descs > 0 {
			ev.Descs = tel.Descs
		}
	}
	return ev
}

// deliver clears p and tells its handler; the caller recycles p.
func (e *Engine) deliver(p *pending, ev TransferEvent) {
	h := p.w
	*p = pending{}
	if h.Handler != nil {
		h.Handler.TransferDone(h.Tag, ev)
	}
}
