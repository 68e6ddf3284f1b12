package serve

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// SGLang push rooms (docs/engine-api.md, "SGLang push rooms"): a rank is
// one push.Prefill or push.Decode, driven exactly as host/demo/pushworker
// drives them, over the engine's own memory. Room states come from the
// push runtime's room events.

func init() {
	registerStyle("sglang", openSGLang)
	registerOp("sender_create", opSenderCreate)
	registerOp("sender_init", opSenderInit)
	registerOp("sender_send", opSenderSend)
	registerOp("sender_prefix_len", opSenderPrefixLen)
	registerOp("receiver_create", opReceiverCreate)
	registerOp("receiver_init", opReceiverInit)
	registerOp("abort", opAbort)
	registerOp("close_room", opCloseRoom)
	registerOp("poll", opPoll)
}

// sglRank is one SGLang rank of a session.
type sglRank struct {
	s       *session
	id      uint64
	prefill *push.Prefill
	decode  *push.Decode
	pages   uint64   // pages of the rank's KV pool
	aux     []uint64 // slots of each aux buffer
	slots   []uint64 // slots of each state component (stateSlots)

	// rooms is touched by the session's goroutine only.
	rooms map[uint64]*sglRoom

	ctx    context.Context // ends when the rank closes: its goroutines stop
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	reasons map[uint64]string // failure reasons, for poll
}

type sglRoom struct {
	sender *push.Sender
	recv   *push.Receiver
	inited bool // receiver_init accepted
}

func (r *sglRoom) poll() sglang.KVPoll {
	if r.sender != nil {
		return r.sender.Poll()
	}
	return r.recv.Poll()
}

// sglObserver turns the rank's room changes into events; the rest goes
// to the sidecar's observer (metrics).
type sglObserver struct {
	push.Observer
	r *sglRank
}

func (o sglObserver) Room(e push.RoomEvent) {
	o.Observer.Room(e)
	f := Fields{{"rank", o.r.id}, {"room", e.Room}, {"state", int(e.To)}}
	if e.To == sglang.KVPollFailed {
		// A peer may have sent the reason: clip it, then say which of this
		// engine's regions a memory fault hit.
		reason := o.r.s.mem.engineTerms(clip(e.Reason, maxReason))
		f = append(f, Field{"reason", reason})
		o.r.mu.Lock()
		o.r.reasons[e.Room] = reason
		o.r.mu.Unlock()
	}
	o.r.s.event("room", f)
}

// kindOf is the memory kind a buffer in r is registered with the plugin as
// (the region's kind, or register_as).
func kindOf(r *memRegion) abi.MemKind { return r.PluginKind() }

// u64List reads three parallel lists (ptrs, lens, item lens).
func (r *request) lists3(p, l, i string, required bool) (ptrs, lens, items []uint64, err error) {
	get := r.u64s
	if !required {
		get = r.optU64s
	}
	if ptrs, err = get(p); err != nil {
		return
	}
	if lens, err = get(l); err != nil {
		return
	}
	if items, err = get(i); err != nil {
		return
	}
	if len(lens) != len(ptrs) || len(items) != len(ptrs) {
		err = errorf(CodeBadRequest, "fields %q, %q and %q have %d, %d and %d entries", p, l, i, len(ptrs), len(lens), len(items))
	}
	return
}

// sglArgs builds the rank's KVArgs over the session's regions.
func sglArgs(s *session, r *request, rk *rankEntry) (push.KVArgs, push.Parallel, bool, error) {
	role := rk.role
	var a push.KVArgs
	var par push.Parallel
	mla, err := r.bool("is_mla", false)
	if err != nil {
		return a, par, false, err
	}
	// A decode rank's TP position and head count decide which heads every
	// prefill rank writes into its pages: defaults would be accepted here
	// and fail (or land wrong heads) at the first transfer, so they are
	// required (docs/engine-api.md, "Required fields and defaults").
	if role == "decode" {
		for _, name := range []string{"tp_size", "tp_rank", "kv_head_num"} {
			if !r.has(name) {
				return a, par, false, missing(name)
			}
		}
		if n, _ := r.optInt("kv_head_num", 0); !mla && n == 0 {
			return a, par, false, badValue("kv_head_num", "0: an MHA decode rank holds at least one KV head")
		}
	}
	ptrs, lens, items, err := r.lists3("kv_data_ptrs", "kv_data_lens", "kv_item_lens", true)
	if err != nil {
		return a, par, false, err
	}
	if len(ptrs) == 0 {
		return a, par, false, badValue("kv_data_ptrs", "empty")
	}
	if !mla && len(ptrs)%2 != 0 {
		return a, par, false, errorf(CodeGeometry, "MHA needs K then V of every layer: %d KV buffers is odd", len(ptrs))
	}
	var pages uint64
	for i := range ptrs {
		if items[i] == 0 || lens[i]%items[i] != 0 {
			return a, par, false, errorf(CodeGeometry, "KV buffer %d: length %d is not a whole number of %d-byte pages", i, lens[i], items[i])
		}
		n := lens[i] / items[i]
		if i == 0 {
			pages = n
		} else if n != pages {
			return a, par, false, errorf(CodeGeometry, "KV buffer %d holds %d pages, buffer 0 holds %d", i, n, pages)
		}
		local, reg, err := s.useRegion(rk, fmt.Sprintf("KV buffer %d", i), ptrs[i], lens[i])
		if err != nil {
			return a, par, false, err
		}
		a.KV = append(a.KV, push.Buffer{Addr: uint64(local), Len: lens[i], ItemLen: items[i], Kind: kindOf(reg)})
	}
	ptrs, lens, items, err = r.lists3("aux_data_ptrs", "aux_data_lens", "aux_item_lens", false)
	if err != nil {
		return a, par, false, err
	}
	for i := range ptrs {
		if items[i] == 0 || lens[i] < items[i] {
			return a, par, false, errorf(CodeGeometry, "aux buffer %d: length %d holds no %d-byte item", i, lens[i], items[i])
		}
		if _, _, err := s.useRegion(rk, fmt.Sprintf("aux buffer %d", i), ptrs[i], lens[i]); err != nil {
			return a, par, false, err
		}
		b, berr := s.mem.bytes(ptrs[i], lens[i])
		if berr != nil {
			return a, par, false, errorf(CodeBadRegion, "aux buffer %d: %s (aux lives in host memory)", i, asError(berr, CodeBadRegion).Message)
		}
		a.Aux = append(a.Aux, push.AuxBuffer{Mem: b, ItemLen: items[i]})
	}
	if a.State, err = sglStateArgs(s, r, rk); err != nil {
		return a, par, false, err
	}
	ints := []struct {
		name string
		dst  *int
		def  int
	}{
		{"page_size", &a.PageSize, -1}, {"kv_head_num", &a.KVHeadNum, 1}, {"total_kv_head_num", &a.TotalKVHeads, 0},
		{"prefill_start_layer", &a.StartLayer, 0}, {"gpu_id", &a.GPUID, 0},
		{"tp_size", &par.TPSize, 1}, {"tp_rank", &par.TPRank, 0}, {"pp_size", &par.PPSize, 1}, {"pp_rank", &par.PPRank, 0},
		{"dp_size", &par.DPSize, 1}, {"dp_rank", &par.DPRank, 0},
	}
	for _, x := range ints {
		v, err := r.optInt(x.name, x.def)
		if err != nil {
			return a, par, false, err
		}
		if v < 0 {
			return a, par, false, missing(x.name)
		}
		*x.dst = v
	}
	if a.PageSize < 1 {
		return a, par, false, badValue("page_size", "%d", a.PageSize)
	}
	if a.TotalKVHeads == 0 {
		a.TotalKVHeads = a.KVHeadNum * par.TPSize
	}
	if !mla && a.KVHeadNum > 0 && a.TotalKVHeads%a.KVHeadNum != 0 && a.KVHeadNum%a.TotalKVHeads != 0 {
		return a, par, false, errorf(CodeGeometry, "kv_head_num %d and total_kv_head_num %d do not divide", a.KVHeadNum, a.TotalKVHeads)
	}
	if par.TPRank >= par.TPSize || par.PPRank >= par.PPSize || par.DPRank >= par.DPSize {
		return a, par, false, errorf(CodeBadRequest, "rank tp %d/%d pp %d/%d dp %d/%d is out of range", par.TPRank, par.TPSize, par.PPRank, par.PPSize, par.DPRank, par.DPSize)
	}
	return a, par, mla, nil
}

func openSGLang(s *session, r *request, rk *rankEntry) (rankImpl, Fields, error) {
	args, par, mla, err := sglArgs(s, r, rk)
	if err != nil {
		return nil, nil, err
	}
	params, err := rankAgentParams(s, r)
	if err != nil {
		return nil, nil, err
	}
	variant, err := r.optStr("variant", "nixl")
	if err != nil {
		return nil, nil, err
	}
	v, verr := push.ParseVariant(variant)
	if verr != nil {
		return nil, nil, badValue("variant", "%v", verr)
	}
	dtype, err := r.optStr("kv_cache_dtype", "auto")
	if err != nil {
		return nil, nil, err
	}
	host, err := r.optStr("host", s.srv.cfg.Host)
	if err != nil {
		return nil, nil, err
	}
	if net.ParseIP(host) == nil {
		return nil, nil, badValue("host", "%q is not an IP address", host)
	}
	boot, err := r.optStr("bootstrap_addr", "")
	if err != nil {
		return nil, nil, err
	}
	sr := &sglRank{s: s, id: rk.id, rooms: make(map[uint64]*sglRoom), reasons: make(map[uint64]string)}
	sr.pages = args.KV[0].Len / args.KV[0].ItemLen
	for _, b := range args.Aux {
		sr.aux = append(sr.aux, uint64(len(b.Mem))/b.ItemLen)
	}
	sr.slots = stateSlots(args.State)
	obs := sglObserver{Observer: s.srv.cfg.Observer, r: sr}
	sr.ctx, sr.cancel = context.WithCancel(context.Background())
	if rk.role == "prefill" {
		if boot == "" {
			sr.cancel()
			return nil, nil, missing("bootstrap_addr")
		}
		// Registering with the bootstrap server waits on it: the rank is
		// finished on a goroutine and answered then.
		cfg := push.PrefillConfig{
			Plugin: s.srv.cfg.Plugin, AgentParams: params,
			Variant: v, KV: args, Parallel: par, MLA: mla, KVCacheDType: dtype,
			Host: host, BootstrapAddr: boot, Settings: s.srv.cfg.Settings, Observer: obs, Logger: s.log,
		}
		return nil, nil, &deferredOpen{run: func(ctx context.Context) (rankImpl, Fields, error) {
			m, err := push.NewPrefill(ctx, cfg)
			if err != nil {
				sr.cancel()
				return nil, nil, errorf(CodeBackend, "open prefill rank: %v", err)
			}
			sr.prefill = m
			return sr, Fields{{"agent", m.Agent().Name()}, {"endpoint", m.Endpoint()}, agentParamsField(m.Agent())}, nil
		}}
	}
	ctx, cancel := context.WithTimeout(s.life, s.srv.cfg.OpenTimeout)
	defer cancel()
	var err2 error
	sr.decode, err2 = push.NewDecode(ctx, push.DecodeConfig{
		Plugin: s.srv.cfg.Plugin, AgentParams: params,
		Variant: v, KV: args, Parallel: par, MLA: mla, KVCacheDType: dtype,
		Host: host, Settings: s.srv.cfg.Settings, Observer: obs, Logger: s.log,
	})
	if err2 != nil {
		sr.cancel()
		return nil, nil, errorf(CodeBackend, "open decode rank: %v", err2)
	}
	return sr, Fields{{"agent", sr.decode.Agent().Name()}, {"endpoint", sr.decode.Endpoint()}, agentParamsField(sr.decode.Agent())}, nil
}

// close fails every unfinished room with reason (peers told), forgets
// them and closes the rank (its agent destroyed).
func (sr *sglRank) close(reason string) {
	for id, rm := range sr.rooms {
		if !rm.poll().Terminal() {
			if rm.sender != nil {
				rm.sender.Fail(reason)
			} else {
				rm.recv.Fail(reason)
			}
		}
		delete(sr.rooms, id)
		sr.s.giveRoom()
	}
	sr.cancel()
	sr.wg.Wait()
	if sr.prefill != nil {
		// Decodes stop being sent to it first (see deregisterRank).
		sr.s.srv.deregisterRank(sr.prefill.Registration())
		sr.prefill.Close()
	} else {
		sr.decode.Close()
	}
}

// roomOf reads rank and room and returns the session's room.
func roomOf(s *session, r *request) (*sglRank, uint64, *sglRoom, error) {
	_, sr, err := rankAs[*sglRank](s, r)
	if err != nil {
		return nil, 0, nil, err
	}
	room, err := r.u64("room")
	if err != nil {
		return nil, 0, nil, err
	}
	rm := sr.rooms[room]
	if rm == nil {
		return nil, 0, nil, errorf(CodeUnknown, "room %d is not open on rank %d", room, sr.id)
	}
	return sr, room, rm, nil
}

// pushError maps the push runtime's errors to the API's codes.
func pushError(err error) error {
	switch {
	case errors.Is(err, push.ErrState):
		return errorf(CodeOutOfOrder, "%v", err)
	case errors.Is(err, push.ErrRoomExists):
		return errorf(CodeExists, "%v", err)
	case errors.Is(err, push.ErrClosed):
		return errorf(CodeShuttingDown, "%v", err)
	}
	return errorf(CodeBackend, "%v", err)
}

func (sr *sglRank) newRoom(r *request, role string) (uint64, error) {
	room, err := r.u64("room")
	if err != nil {
		return 0, err
	}
	if _, ok := sr.rooms[room]; ok {
		return 0, errorf(CodeExists, "room %d is already open on rank %d", room, sr.id)
	}
	if (role == "prefill") != (sr.prefill != nil) {
		return 0, errorf(CodeBadRequest, "op %s needs a %s rank; rank %d is not", r.op, role, sr.id)
	}
	if err := sr.s.takeRoom(); err != nil {
		return 0, err
	}
	sr.mu.Lock()
	delete(sr.reasons, room)
	sr.mu.Unlock()
	return room, nil
}

func opSenderCreate(s *session, r *request) (Fields, error) {
	_, sr, err := rankAs[*sglRank](s, r)
	if err != nil {
		return nil, err
	}
	room, err := sr.newRoom(r, "prefill")
	if err != nil {
		return nil, err
	}
	snd, perr := sr.prefill.NewSender(room)
	if perr != nil {
		s.giveRoom()
		return nil, pushError(perr)
	}
	sr.rooms[room] = &sglRoom{sender: snd}
	return Fields{}, nil
}

func opSenderInit(s *session, r *request) (Fields, error) {
	sr, _, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.sender == nil {
		return nil, errorf(CodeBadRequest, "sender_init on a decode room")
	}
	n, err := r.int("num_pages")
	if err != nil {
		return nil, err
	}
	aux, err := r.i64("aux_index")
	if err != nil {
		return nil, err
	}
	if err := sr.checkAux(aux); err != nil {
		return nil, err
	}
	if perr := rm.sender.Init(n, aux); perr != nil {
		return nil, pushError(perr)
	}
	return Fields{}, nil
}

// checkPages refuses page indices outside the rank's pool.
func (sr *sglRank) checkPages(name string, pages []int32) error {
	for i, p := range pages {
		if uint64(p) >= sr.pages {
			return badValue(name, "page %d at index %d is outside the rank's %d pages", p, i, sr.pages)
		}
	}
	return nil
}

func (sr *sglRank) checkAux(aux int64) error {
	for i, n := range sr.aux {
		if aux < 0 || uint64(aux) >= n {
			return badValue("aux_index", "%d is outside aux buffer %d's %d slots", aux, i, n)
		}
	}
	return nil
}

func opSenderSend(s *session, r *request) (Fields, error) {
	sr, _, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.sender == nil {
		return nil, errorf(CodeBadRequest, "sender_send on a decode room")
	}
	pages, err := r.pages("pages")
	if err != nil {
		return nil, err
	}
	if err := sr.checkPages("pages", pages); err != nil {
		return nil, err
	}
	state, err := sr.stateIndices(r, "state_indices")
	if err != nil {
		return nil, err
	}
	if perr := rm.sender.Send(pages, state); perr != nil {
		return nil, pushError(perr)
	}
	return Fields{}, nil
}

// opSenderPrefixLen answers decode_prefix_len of a prefill room once
// every decode rank's transfer info arrived (SGLang's
// KVSender.pop_decode_prefix_len, which the prefill scheduler calls when
// the room is WaitingForInput): the tokens decode already holds, which the
// engine does not send.
func opSenderPrefixLen(s *session, r *request) (Fields, error) {
	_, room, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.sender == nil {
		return nil, errorf(CodeBadRequest, "sender_prefix_len on a decode room")
	}
	if st := rm.sender.Poll(); st == sglang.KVPollBootstrapping {
		return nil, errorf(CodeOutOfOrder, "room %d is %v: decode_prefix_len is known at WaitingForInput", room, st)
	}
	return Fields{{"prefix_len", rm.sender.DecodePrefixLen()}}, nil
}

func opReceiverCreate(s *session, r *request) (Fields, error) {
	_, sr, err := rankAs[*sglRank](s, r)
	if err != nil {
		return nil, err
	}
	addr, err := r.str("bootstrap_addr")
	if err != nil {
		return nil, err
	}
	if _, _, serr := net.SplitHostPort(addr); serr != nil {
		return nil, badValue("bootstrap_addr", "%q is not host:port", addr)
	}
	// prefill_dp_rank: the push runtime follows the room (SGLang's
	// follow_bootstrap_room); the field is read for its type only.
	if r.has("prefill_dp_rank") {
		if _, err := r.int("prefill_dp_rank"); err != nil {
			return nil, err
		}
	}
	room, err := sr.newRoom(r, "decode")
	if err != nil {
		return nil, err
	}
	rcv, perr := sr.decode.NewReceiver(addr, room)
	if perr != nil {
		s.giveRoom()
		return nil, pushError(perr)
	}
	sr.rooms[room] = &sglRoom{recv: rcv}
	timeout := s.srv.cfg.Settings.BootstrapTimeout
	if timeout <= 0 {
		timeout = push.DefaultBootstrapTimeout
	}
	sr.wg.Add(1)
	go func() {
		defer sr.wg.Done()
		ctx, cancel := context.WithTimeout(sr.ctx, timeout)
		defer cancel()
		rcv.Init(ctx) // fails the room on error: the event says why
	}()
	return Fields{}, nil
}

func opReceiverInit(s *session, r *request) (Fields, error) {
	sr, room, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.recv == nil {
		return nil, errorf(CodeBadRequest, "receiver_init on a prefill room")
	}
	pages, err := r.pages("pages")
	if err != nil {
		return nil, err
	}
	if err := sr.checkPages("pages", pages); err != nil {
		return nil, err
	}
	aux, err := r.i64("aux_index")
	if err != nil {
		return nil, err
	}
	if err := sr.checkAux(aux); err != nil {
		return nil, err
	}
	state, err := sr.stateIndices(r, "state_indices")
	if err != nil {
		return nil, err
	}
	prefix, err := r.optI64("prefix_len", 0)
	if err != nil {
		return nil, err
	}
	if prefix < 0 {
		return nil, badValue("prefix_len", "%d is negative", prefix)
	}
	if rm.inited {
		return nil, errorf(CodeOutOfOrder, "receiver_init was already accepted for room %d", room)
	}
	if st := rm.recv.Poll(); st != sglang.KVPollWaitingForInput {
		return nil, errorf(CodeOutOfOrder, "room %d is %v: receiver_init needs WaitingForInput", room, st)
	}
	rm.inited = true
	rcv := rm.recv
	sr.wg.Add(1)
	go func() {
		defer sr.wg.Done()
		rcv.SendMetadata(sr.ctx, pages, aux, state, prefix) // fails the room on error
	}()
	return Fields{}, nil
}

func opAbort(s *session, r *request) (Fields, error) {
	_, _, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.sender != nil {
		rm.sender.Abort()
	} else {
		rm.recv.Abort()
	}
	return Fields{}, nil
}

func opCloseRoom(s *session, r *request) (Fields, error) {
	sr, room, rm, err := roomOf(s, r)
	if err != nil {
		return nil, err
	}
	if rm.sender != nil {
		rm.sender.Close()
	} else {
		rm.recv.Close()
	}
	delete(sr.rooms, room)
	sr.mu.Lock()
	delete(sr.reasons, room)
	sr.mu.Unlock()
	s.giveRoom()
	return Fields{}, nil
}

func opPoll(s *session, r *request) (Fields, error) {
	_, sr, err := rankAs[*sglRank](s, r)
	if err != nil {
		return nil, err
	}
	// No rank has more rooms than its connection may open: the reply
	// stays as small as the connection's own rooms.
	rooms, err := r.rooms("rooms", s.srv.cfg.Limits.Rooms)
	if err != nil {
		return nil, err
	}
	states := make([]byte, len(rooms))
	reasons := map[string]string{}
	for i, id := range rooms {
		rm := sr.rooms[id]
		if rm == nil {
			states[i] = 255
			continue
		}
		st := rm.poll()
		states[i] = byte(st)
		if st == sglang.KVPollFailed {
			sr.mu.Lock()
			reasons[strconv.FormatUint(id, 10)] = sr.reasons[id]
			sr.mu.Unlock()
		}
	}
	return Fields{{"states", states}, {"reasons", reasons}}, nil
}
