package serve

import (
	"context"
	"encoding/hex"
	"errors"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/host/internal/zmq"
)

// session is one engine connection: what it registered, its ranks and
// rooms. Requests run one at a time, in order, on the session's goroutine,
// which alone touches hello, mem and ranks; replies and events go out
// through the router's per-peer queue in the order they are made.
type session struct {
	srv  *Server
	peer []byte
	log  *slog.Logger

	in    chan []byte
	quit  chan struct{}
	done  chan struct{}
	once  sync.Once
	why   string // the first stop's reason
	flush bool   // send the failure events before closing (shutdown)

	// life ends when the session is asked to stop: work started for it
	// (a rank being opened) gives up.
	life context.Context
	kill context.CancelFunc

	// Owned by run's goroutine.
	hello   bool
	mem     *memTable
	ranks   map[uint64]*rankEntry
	opening map[uint64]*rankEntry // ranks whose creation runs on a goroutine
	ending  bool                  // teardown started
	onClose []func(reason string)

	// Work finished on other goroutines, run on run's goroutine.
	compMu   sync.Mutex
	comps    []func()
	compWake chan struct{}
	openWG   sync.WaitGroup

	rooms  atomic.Int64 // rooms open on the session's ranks
	queued atomic.Int64 // bytes of requests waiting in in
	dead   atomic.Bool  // torn down or dropped: nothing more is sent
}

func newSession(s *Server, peer []byte) *session {
	x := &session{
		srv: s, peer: append([]byte(nil), peer...),
		log:  s.log.With("conn", hex.EncodeToString(peer)),
		in:   make(chan []byte, s.cfg.RequestQueue),
		quit: make(chan struct{}), done: make(chan struct{}),
		mem: newMemTable(&s.opener), ranks: make(map[uint64]*rankEntry),
		opening: make(map[uint64]*rankEntry), compWake: make(chan struct{}, 1),
	}
	x.life, x.kill = context.WithCancel(context.Background())
	return x
}

// stop asks the session to tear down with reason (its rooms fail with it).
// flush: the connection is alive and should see the failure events.
func (s *session) stop(reason string, flush bool) {
	s.once.Do(func() {
		s.why, s.flush = reason, flush
		if !flush {
			s.dead.Store(true)
		}
		s.kill()
		close(s.quit)
	})
}

func (s *session) run() {
	defer s.srv.wg.Done()
	defer close(s.done)
	for {
		select {
		case b := <-s.in:
			s.handle(b)
			s.queued.Add(-int64(len(b)))
			s.srv.queued.Add(-int64(len(b)))
		case <-s.compWake:
			s.runCompletions()
		case <-s.quit:
			s.teardown(s.why)
			return
		}
	}
}

// later runs fn on the session's goroutine (work finished elsewhere).
func (s *session) later(fn func()) {
	s.compMu.Lock()
	s.comps = append(s.comps, fn)
	s.compMu.Unlock()
	select {
	case s.compWake <- struct{}{}:
	default:
	}
}

func (s *session) runCompletions() {
	s.compMu.Lock()
	fns := s.comps
	s.comps = nil
	s.compMu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

// teardown fails everything the session holds and releases it.
func (s *session) teardown(reason string) {
	s.log.Debug("serve: session ends", "reason", reason)
	s.ending = true
	// Ranks still being created give up (life ended) and are closed by
	// their completions: none may outlive the regions they use.
	s.openWG.Wait()
	s.runCompletions()
	for id, rk := range s.ranks {
		rk.impl.close(reason)
		delete(s.ranks, id)
	}
	for _, fn := range s.onClose {
		fn(reason)
	}
	s.onClose = nil
	s.mem.close()
	s.dead.Store(true)
	s.srv.forget(s)
	// Requests that came after the end are not answered: the
	// connection is gone or going.
	for {
		select {
		case b := <-s.in:
			s.queued.Add(-int64(len(b)))
			s.srv.queued.Add(-int64(len(b)))
		default:
			return
		}
	}
}

// handle runs one request and answers it exactly once.
func (s *session) handle(b []byte) {
	r, seqOK, perr := parseRequest(b)
	if perr != nil {
		var seq uint64
		if r != nil {
			seq = r.seq
		}
		s.send(encodeError(seq, seqOK, asError(perr, CodeBadRequest)))
		return
	}
	f, err := s.call(r)
	if err == errReplyLater {
		return // the handler answers when its work is done
	}
	if err != nil {
		s.send(encodeError(r.seq, true, asError(err, CodeInternal)))
		return
	}
	s.send(encodeReply(r.seq, true, f))
}

func (s *session) call(r *request) (f Fields, err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("serve: panic in request", "op", r.op, "panic", p, "stack", string(debug.Stack()))
			f, err = nil, errorf(CodeInternal, "op %s: %v", r.op, p)
		}
	}()
	fn, ok := ops[r.op]
	switch {
	case r.op != "hello" && !s.hello:
		// Before hello a connection learns nothing but that it must say
		// hello: not even which ops exist.
		return nil, errorf(CodeNoHello, "op %q before hello", clip(r.op, maxQuote))
	case !ok:
		return nil, errorf(CodeUnknownOp, "op %q is not one of protocol %d.%d's", clip(r.op, maxQuote), ProtocolMajor, ProtocolMinor)
	case s.srv.closing.Load():
		return nil, errorf(CodeShuttingDown, "the sidecar is stopping")
	}
	return fn(s, r)
}

// send queues one message to the engine. An engine that leaves too many,
// or too many bytes, unread is dropped (see DefaultEventQueue).
func (s *session) send(msg []byte) {
	if s.dead.Load() {
		return
	}
	err := s.srv.router.Enqueue(s.peer, msg)
	switch {
	case err == nil:
	case errors.Is(err, zmq.ErrPeerBusy):
		n, b := s.srv.router.Queued(s.peer)
		s.log.Warn("serve: dropping an engine that does not read its replies and events", "queued", n, "queued_bytes", b,
			"limit", s.srv.cfg.EventQueue, "limit_bytes", s.srv.cfg.EventQueueBytes)
		s.dead.Store(true)
		s.srv.router.Disconnect(s.peer)
		s.stop("engine stopped reading its events", false)
	default:
		// Gone or closing: the disconnect tears the session down.
		s.log.Debug("serve: message not queued", "err", err)
	}
}

// Event sends an event on this connection. Safe from any goroutine.
func (s *session) event(name string, f Fields) { s.send(encodeEvent(name, f)) }

// takeRoom counts a new room against the connection's limit.
func (s *session) takeRoom() error {
	if n := s.rooms.Add(1); n > int64(s.srv.cfg.Limits.Rooms) {
		s.rooms.Add(-1)
		return errorf(CodeLimit, "this connection already has %d rooms open (limit %d)", n-1, s.srv.cfg.Limits.Rooms)
	}
	return nil
}

// giveRoom uncounts a room.
func (s *session) giveRoom() { s.rooms.Add(-1) }

// atClose registers fn to run at teardown (after the ranks closed).
func (s *session) atClose(fn func(reason string)) { s.onClose = append(s.onClose, fn) }

// rankEntry is one open rank of a session.
type rankEntry struct {
	id      uint64
	style   string
	role    string
	impl    rankImpl
	regions []uint64 // ids of the regions its buffers lie in
}

// rankImpl is a style's rank (SGLang's KV manager, vLLM's connector
// worker).
type rankImpl interface {
	// close fails the rank's rooms or reads with reason (peers told),
	// emits their events and destroys the rank's agent.
	close(reason string)
}

// rankOf reads the request's "rank" and returns the session's rank with
// that id: another connection's ranks are unknown.
func (s *session) rankOf(r *request) (*rankEntry, error) {
	id, err := r.u64("rank")
	if err != nil {
		return nil, err
	}
	rk := s.ranks[id]
	if rk == nil {
		return nil, errorf(CodeUnknown, "rank %d is not open on this connection", id)
	}
	return rk, nil
}

// rankAs returns the request's rank as style T.
func rankAs[T rankImpl](s *session, r *request) (*rankEntry, T, error) {
	var zero T
	rk, err := s.rankOf(r)
	if err != nil {
		return nil, zero, err
	}
	t, ok := rk.impl.(T)
	if !ok {
		return nil, zero, errorf(CodeBadRequest, "op %s does not apply to rank %d (style %s, role %s)", r.op, rk.id, rk.style, rk.role)
	}
	return rk, t, nil
}

// useRegion records that rk's buffer [addr, +length) lies in one of the
// session's regions and returns the sidecar's address of it.
func (s *session) useRegion(rk *rankEntry, what string, addr, length uint64) (uintptr, *memRegion, error) {
	local, reg, err := s.mem.translate(addr, length)
	if err != nil {
		return 0, nil, errorf(CodeBadRegion, "%s: %s", what, asError(err, CodeBadRegion).Message)
	}
	for _, id := range rk.regions {
		if id == reg.ID {
			return local, reg, nil
		}
	}
	rk.regions = append(rk.regions, reg.ID)
	return local, reg, nil
}

// regionBusy names a rank that uses (or is being opened over) region id,
// if any.
func (s *session) regionBusy(id uint64) error {
	for _, rk := range s.allRanks() {
		for _, x := range rk.regions {
			if x == id {
				return errorf(CodeBusy, "region %d is used by rank %d", id, rk.id)
			}
		}
	}
	return nil
}

// allRanks are the open ranks and those being opened.
func (s *session) allRanks() []*rankEntry {
	out := make([]*rankEntry, 0, len(s.ranks)+len(s.opening))
	for _, rk := range s.ranks {
		out = append(out, rk)
	}
	for _, rk := range s.opening {
		out = append(out, rk)
	}
	return out
}

// errReplyLater is a handler's answer when it replies itself, later, from
// the session's goroutine (see deferredOpen).
var errReplyLater = errors.New("serve: reply later")
