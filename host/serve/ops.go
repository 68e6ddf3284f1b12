package serve

import (
	"context"
	"errors"
	"sort"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/engmem"
)

// opFunc handles one request on its session's goroutine and returns the
// reply's fields, or an error (an *Error for the API's codes). It must not
// block on a peer: work that waits on one runs on a goroutine and reports
// through events.
type opFunc func(s *session, r *request) (Fields, error)

// ops is the op table. Each style's file adds its ops from an init
// function with registerOp, so a new op touches no other file.
var ops = map[string]opFunc{}

func registerOp(name string, fn opFunc) {
	if _, dup := ops[name]; dup {
		panic("serve: op " + name + " registered twice")
	}
	ops[name] = fn
}

// rankOpener opens a rank of one style: it reads the style's fields,
// translates the engine's buffers through s.mem (s.useRegion records the
// regions in rk.regions), creates the rank's agent and returns the rank and
// the reply's fields beyond "rank" (agent, endpoint, ...).
type rankOpener func(s *session, r *request, rk *rankEntry) (rankImpl, Fields, error)

// styles holds a rankOpener per open_rank style; each style's file adds
// its own with registerStyle (its name is also a hello capability).
var styles = map[string]rankOpener{}

func registerStyle(name string, open rankOpener) { styles[name] = open }

func init() {
	registerOp("hello", opHello)
	registerOp("register_memory", opRegisterMemory)
	registerOp("deregister_memory", opDeregisterMemory)
	registerOp("open_rank", opOpenRank)
	registerOp("close_rank", opCloseRank)
}

// capabilities are hello's: the styles, then the fixed ones.
func capabilities() []string {
	var c []string
	for name := range styles {
		c = append(c, name)
	}
	sort.Strings(c)
	return append(c, "dram_shm", "dram_memfd", "vram_cuda_ipc", "events", "poll")
}

func opHello(s *session, r *request) (Fields, error) {
	if s.hello {
		return nil, errorf(CodeOutOfOrder, "hello was already said on this connection")
	}
	v, ok := r.get("version")
	if !ok {
		return nil, missing("version")
	}
	if v.Kind != msgpack.Array || len(v.Items) != 2 {
		return nil, wrongType("version", "[major, minor]", v)
	}
	major, ok1 := v.Items[0].Uint()
	minor, ok2 := v.Items[1].Uint()
	if !ok1 || !ok2 {
		return nil, badValue("version", "want two uints")
	}
	if major != ProtocolMajor {
		return nil, errorf(CodeVersion, "protocol %d.%d is not supported: this sidecar speaks %d.%d", major, minor, ProtocolMajor, ProtocolMinor)
	}
	client, err := r.optStr("client", "")
	if err != nil {
		return nil, err
	}
	pid, err := r.optU64("pid", 0)
	if err != nil {
		return nil, err
	}
	s.hello = true
	s.log = s.log.With("client", client, "pid", pid)
	s.log.Debug("serve: hello", "version", []uint64{major, minor})
	l := s.srv.cfg.Limits
	return Fields{
		{"version", []int{ProtocolMajor, ProtocolMinor}},
		{"sidecar", s.srv.cfg.Version},
		{"session", s.srv.session},
		{"backend", s.srv.cfg.Backend},
		{"capabilities", capabilities()},
		{"max_message", s.srv.cfg.MaxMessage},
		{"limits", Fields{{"ranks", l.Ranks}, {"regions", l.Regions}, {"rooms", l.Rooms}}},
	}, nil
}

func opRegisterMemory(s *session, r *request) (Fields, error) {
	v, ok := r.get("regions")
	if !ok {
		return nil, missing("regions")
	}
	if v.Kind != msgpack.Array {
		return nil, wrongType("regions", "array of region maps", v)
	}
	if len(v.Items) == 0 {
		return nil, badValue("regions", "empty")
	}
	if n := s.mem.len() + len(v.Items); n > s.srv.cfg.Limits.Regions {
		return nil, errorf(CodeLimit, "%d regions on this connection would exceed the limit of %d", n, s.srv.cfg.Limits.Regions)
	}
	specs := make([]engmem.Spec, len(v.Items))
	for i, it := range v.Items {
		var err error
		if specs[i], err = parseRegion(i, it); err != nil {
			return nil, err
		}
	}
	regs, err := s.mem.add(specs)
	if err != nil {
		return nil, err
	}
	ids := make([]uint64, len(regs))
	for i, x := range regs {
		ids[i] = x.ID
	}
	return Fields{{"regions", ids}}, nil
}

func opDeregisterMemory(s *session, r *request) (Fields, error) {
	ids, err := r.u64s("regions")
	if err != nil {
		return nil, err
	}
	for _, id := range ids {
		if s.mem.byID(id) == nil {
			return nil, errorf(CodeUnknown, "region %d is not registered on this connection", id)
		}
		if err := s.regionBusy(id); err != nil {
			return nil, err
		}
	}
	if err := s.mem.remove(ids); err != nil {
		return nil, err
	}
	return Fields{}, nil
}

func opOpenRank(s *session, r *request) (Fields, error) {
	style, err := r.str("style")
	if err != nil {
		return nil, err
	}
	open := styles[style]
	if open == nil {
		return nil, errorf(CodeUnsupported, "style %q is not offered by this sidecar (capabilities %v)", style, capabilities())
	}
	role, err := r.str("role")
	if err != nil {
		return nil, err
	}
	if role != "prefill" && role != "decode" {
		return nil, badValue("role", "%q is neither prefill nor decode", role)
	}
	if n := len(s.ranks) + len(s.opening); n >= s.srv.cfg.Limits.Ranks {
		return nil, errorf(CodeLimit, "this connection already has %d ranks open (limit %d)", n, s.srv.cfg.Limits.Ranks)
	}
	rk := &rankEntry{id: s.srv.nextRank.Add(1), style: style, role: role}
	impl, f, oerr := open(s, r, rk)
	var d *deferredOpen
	if errors.As(oerr, &d) {
		s.openLater(r.seq, rk, d)
		return nil, errReplyLater
	}
	if oerr != nil {
		return nil, oerr
	}
	rk.impl = impl
	s.ranks[rk.id] = rk
	return append(Fields{{"rank", rk.id}}, f...), nil
}

// deferredOpen is what a rankOpener returns, as its error, when creating
// the rank waits on a peer (an SGLang prefill rank registers with its
// bootstrap server): run finishes it on its own goroutine, within ctx,
// and must not touch the session.
type deferredOpen struct {
	run func(ctx context.Context) (rankImpl, Fields, error)
}

func (*deferredOpen) Error() string { return "serve: rank opens later" }

// openLater runs d on a goroutine; its completion adds the rank and
// answers seq on the session's goroutine. The session's other requests
// go on meanwhile; its regions stay busy and teardown waits for it.
func (s *session) openLater(seq uint64, rk *rankEntry, d *deferredOpen) {
	s.opening[rk.id] = rk
	s.openWG.Add(1)
	go func() {
		defer s.openWG.Done()
		ctx, cancel := context.WithTimeout(s.life, s.srv.cfg.OpenTimeout)
		impl, f, err := d.run(ctx)
		cancel()
		s.later(func() {
			delete(s.opening, rk.id)
			switch {
			case err != nil:
				s.send(encodeError(seq, true, asError(err, CodeBackend)))
			case s.ending:
				impl.close(s.why)
			default:
				rk.impl = impl
				s.ranks[rk.id] = rk
				s.send(encodeReply(seq, true, append(Fields{{"rank", rk.id}}, f...)))
			}
		})
	}()
}

func opCloseRank(s *session, r *request) (Fields, error) {
	rk, err := s.rankOf(r)
	if err != nil {
		return nil, err
	}
	delete(s.ranks, rk.id)
	rk.impl.close("rank closed")
	return Fields{}, nil
}
