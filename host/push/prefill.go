package push

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// PrefillConfig configures one prefill rank.
type PrefillConfig struct {
	// Plugin moves the bytes; the manager creates its own agent on it
	// (named AgentName, or a unique generated name) with AgentParams and
	// the host's defaults for an initiator (plugin.ForSide: it writes),
	// and destroys it on Close.
	Plugin      *plugin.Plugin
	AgentName   string
	AgentParams []plugin.Param

	Variant    Variant
	Completion Completion
	// XferMode is how KV reaches the plugin; the zero value, XferAuto,
	// chooses by the agent's capabilities (see XferAuto).
	XferMode XferMode

	KV       KVArgs
	Parallel Parallel
	// MLA is the engine's is_mla_backend.
	MLA bool
	// KVCacheDType is SGLang's --kv-cache-dtype (default "auto"); decode
	// refuses a prefill whose dtype or page size differs from its own.
	KVCacheDType string

	// Host is the IP this rank's PULL socket binds to and advertises
	// (default 127.0.0.1). Port 0 (the default) picks a free port.
	Host string
	Port int
	// BootstrapAddr is the bootstrap server ("host:port") this rank
	// registers with.
	BootstrapAddr string

	Settings Settings
	Observer Observer
	Logger   *slog.Logger
	// Transport carries the control messages; nil means ZMQ{} (what
	// SGLang peers speak).
	Transport Transport
	// Clock times every timeout, heartbeat and latency; nil means the
	// wall clock.
	Clock clock.Clock
}

// Prefill is one prefill rank's transfer manager (SGLang's KVManager in
// PREFILL mode): it receives decode ranks' registrations and per-request
// transfer info on its PULL socket and pushes KV to them. Safe for
// concurrent use.
type Prefill struct {
	rank
	cfg        PrefillConfig
	completion Completion // resolved: notif or status
	xfer       XferMode   // resolved: batch or prepped
	unique     int        // prefill_unique_rank

	// This rank's buffers in the planner's terms (region tables equal the
	// registered regions).
	srcKV      planner.KVSide
	srcAux     planner.AuxBuffers
	srcState   planner.StateBuffers
	stateTypes []planner.StateType

	shards []*shard

	mu      sync.Mutex
	peers   map[string]*peer  // decode ranks by agent (engine) name
	peerErr map[string]string // registrations that failed, by name (bounded)
	infos   map[uint64]*roomInfos
	senders map[uint64]*Sender
	// pend is what the transfer infos of rooms not yet both complete and
	// open hold (see roomInfos.charged), in total and per peer.
	pend pendingBudget
	// closedRooms are rooms the engine closed recently: an ABORT for one
	// of them is late, not early (see abortFromDecode).
	closedRooms recentRooms
	srcLists    map[string]*plugin.DList // prepped source lists shared by peers

}

// roomInfos is what the decode ranks of one room sent (transfer_infos).
type roomInfos struct {
	byPeer   map[string]*xferInfo
	order    []*xferInfo // arrival order
	required int
	complete bool
	// prefixLen is decode_prefix_len: tokens decode already holds.
	prefixLen int64
	arrived   time.Time
	// aborted is set by an ABORT that arrived before the sender existed.
	aborted string
	// notified: the failure was sent to decode.
	notified bool
	// charged: the infos count against the pending budget (Prefill.pend),
	// until the room has every info it waits for and the engine opened it.
	charged bool
	// overflow is why an info of this room was dropped (the pending budget
	// was full) and overflowTo where that info came from: the room fails
	// with the reason once the engine holds it.
	overflow   string
	overflowTo string
}

// xferInfo is one decode rank's per-request transfer info, whatever the
// wire variant. Immutable once stored.
type xferInfo struct {
	peer      string // decode agent (engine) name
	endpoint  string // decode PULL socket, "tcp://ip:port"
	dstPages  []int32
	dstAux    int64
	required  int
	dstState  [][]int32
	prefixLen int64
	prefixSet bool
	dummy     bool
	// cost is what the info holds in memory (infoCost); budget the pending
	// budget it was charged to ("" for agents not registered).
	cost   int64
	budget string
}

// infoOverhead is what one stored transfer info costs beyond its index
// lists: the structs, the room's map entries and the strings.
const infoOverhead = 512

// infoCost is the memory one transfer info holds, counted against the
// pending budget.
func infoCost(in *xferInfo) int64 {
	n := int64(infoOverhead + len(in.peer) + len(in.endpoint) + 4*cap(in.dstPages))
	for _, st := range in.dstState {
		n += 24 + 4*int64(cap(st))
	}
	return n
}

// pendingBudget is the memory held by transfer infos of rooms that are not
// yet both complete and open, in total and per budget (a registered
// decode agent, or "" for every agent that is not registered). Guarded by
// Prefill.mu.
type pendingBudget struct {
	total  int64
	budget map[string]int64
}

// recentRooms remembers the rooms the engine closed within a window,
// bounded in number (the oldest are forgotten first). Guarded by
// Prefill.mu.
type recentRooms struct {
	at    map[uint64]time.Time
	order []closedRoom // by time
}

type closedRoom struct {
	room uint64
	at   time.Time
}

// maxClosedRooms bounds how many closed rooms a prefill rank remembers.
const maxClosedRooms = 1 << 16

func (r *recentRooms) add(room uint64, now time.Time) {
	if r.at == nil {
		r.at = make(map[uint64]time.Time)
	}
	if len(r.order) >= maxClosedRooms {
		r.forget(r.order[0])
		r.order = r.order[1:]
	}
	r.at[room] = now
	r.order = append(r.order, closedRoom{room, now})
}

func (r *recentRooms) forget(c closedRoom) {
	if t, ok := r.at[c.room]; ok && t.Equal(c.at) {
		delete(r.at, c.room)
	}
}

func (r *recentRooms) has(room uint64) bool {
	_, ok := r.at[room]
	return ok
}

func (r *recentRooms) remove(room uint64) { delete(r.at, room) }

// expire forgets the rooms closed before cutoff.
func (r *recentRooms) expire(cutoff time.Time) {
	i := 0
	for ; i < len(r.order) && r.order[i].at.Before(cutoff); i++ {
		r.forget(r.order[i])
	}
	if i > 0 {
		r.order = append(r.order[:0:0], r.order[i:]...)
	}
}

// closeGrace is how long a closing rank lets the messages it still owes
// its peers (failure notifications, ABORTs) try to leave.
const closeGrace = time.Second

// maxPendingRooms bounds rooms whose transfer info (or ABORT) arrived but
// whose sender does not exist yet (a peer announcing rooms nobody will
// serve); what their infos hold is bounded in bytes by the pending budget
// (Settings.MaxPendingInfoBytes and MaxPendingInfoBytesPerPeer).
const maxPendingRooms = 1 << 16

// NewPrefill starts a prefill rank: it creates the agent and registers the
// buffers, binds the PULL socket, starts the transfer workers and the
// control loop, and registers with the bootstrap server (retrying as
// SGLang does, within ctx).
func NewPrefill(ctx context.Context, cfg PrefillConfig) (*Prefill, error) {
	if err := checkConfig(&cfg.Parallel, &cfg.KV, cfg.MLA, cfg.Plugin, &cfg.Host, &cfg.KVCacheDType); err != nil {
		return nil, err
	}
	if cfg.BootstrapAddr == "" {
		return nil, errors.New("push: no bootstrap server address")
	}
	if _, err := resolveXfer(cfg.Variant, cfg.XferMode, 0); err != nil {
		return nil, err // before any agent is made
	}
	m := &Prefill{
		cfg:      cfg,
		unique:   cfg.Parallel.uniqueRank(),
		peers:    make(map[string]*peer),
		peerErr:  make(map[string]string),
		infos:    make(map[uint64]*roomInfos),
		senders:  make(map[uint64]*Sender),
		srcLists: make(map[string]*plugin.DList),
		pend:     pendingBudget{budget: make(map[string]int64)},
	}
	if err := m.open(rankSetup{role: RolePrefill, plugin: cfg.Plugin, agentName: cfg.AgentName, agentParams: cfg.AgentParams,
		parallel: cfg.Parallel, settings: cfg.Settings, observer: cfg.Observer, logger: cfg.Logger,
		transport: cfg.Transport, clock: cfg.Clock}); err != nil {
		return nil, err
	}
	fail := func(err error) (*Prefill, error) {
		m.shutdown()
		return nil, err
	}
	var err error
	if m.completion, err = resolveCompletion(cfg.Variant, cfg.Completion, m.agent.Caps()); err != nil {
		return fail(err)
	}
	if m.xfer, err = resolveXfer(cfg.Variant, cfg.XferMode, m.agent.Caps()); err != nil {
		return fail(err)
	}
	// MORI sends status with SNDTIMEO 5 s.
	if err := m.listen(&cfg.KV, cfg.Host, cfg.Port, 5*time.Second); err != nil {
		return fail(err)
	}
	m.srcKV = cfg.KV.kvSide(cfg.Parallel)
	m.srcAux = cfg.KV.auxBuffers()
	m.srcState, m.stateTypes = cfg.KV.stateBuffers()
	for i := 0; i < m.set.QueueSize; i++ {
		sh := newShard()
		m.shards = append(m.shards, sh)
		m.goRun(func() { m.runWorker(sh) })
	}
	m.goServe(m.handle)
	m.goEvery(sweepPeriod(m.set.BootstrapTimeout), m.janitor)

	if err := m.registerBootstrap(ctx); err != nil {
		m.Close()
		return nil, err
	}
	m.log.Info("prefill rank ready", "agent", m.agent.Name(), "endpoint", m.pull.Endpoint(),
		"variant", cfg.Variant, "completion", m.completion, "xfer", m.xfer)
	return m, nil
}

func resolveCompletion(v Variant, c Completion, caps abi.Caps) (Completion, error) {
	switch c {
	case CompletionAuto:
		if v == VariantNIXL && caps.Has(abi.CapNotif) {
			return CompletionNotif, nil
		}
		return CompletionStatus, nil
	case CompletionNotif:
		if v == VariantMORI {
			return 0, errors.New("push: the MORI variant reports completion by status message, not notification")
		}
		if !caps.Has(abi.CapNotif) {
			return 0, errors.New("push: completion by notification needs a plugin agent with notifications")
		}
	}
	return c, nil
}

// Registration is what this rank registers with its bootstrap server
// (and what a server running in the same process may deregister when the
// rank closes: bootstrap.Server.Deregister).
func (m *Prefill) Registration() bootstrap.Registration {
	p := m.cfg.Parallel
	return bootstrap.Registration{
		AttnTPSize: p.TPSize, AttnTPRank: p.TPRank,
		AttnCPSize: p.CPSize, AttnCPRank: p.CPRank,
		AttnDPSize: p.DPSize, AttnDPRank: p.DPRank,
		PPSize: p.PPSize, PPRank: p.PPRank,
		SystemDPSize: 1, SystemDPRank: 0,
		RankIP: m.cfg.Host, RankPort: m.pull.Port(),
		PageSize: m.cfg.KV.PageSize, KVCacheDType: m.cfg.KVCacheDType,
		LoadBalanceMethod: "follow_bootstrap_room",
	}
}

func (m *Prefill) registerBootstrap(ctx context.Context) error {
	reg := m.Registration()
	start := m.clock.Now()
	err := m.tr.Bootstrap(m.cfg.BootstrapAddr).Register(ctx, reg)
	m.obs.Handshake(HandshakeEvent{Role: RolePrefill, Kind: HandshakeRegisterBootstrap, Peer: m.cfg.BootstrapAddr, Latency: m.clock.Since(start), Err: err})
	if err != nil {
		return fmt.Errorf("push: register with bootstrap server %s: %w", m.cfg.BootstrapAddr, err)
	}
	return nil
}

// Completion returns the completion signal this rank uses.
func (m *Prefill) Completion() Completion { return m.completion }

// XferMode returns how this rank hands KV to the plugin: XferBatch or
// XferPrepped (XferAuto resolved by the agent's capabilities).
func (m *Prefill) XferMode() XferMode { return m.xfer }

// Pending returns the number of rooms this rank does not hold (no
// sender) for which a decode rank sent transfer info or an ABORT. They
// are not the engine's: the infos wait for the engine to open the room,
// and are dropped after the bootstrap timeout if it never does.
func (m *Prefill) Pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for room := range m.infos {
		if _, open := m.senders[room]; !open {
			n++
		}
	}
	return n
}

// PendingInfoBytes returns what the transfer infos of rooms not yet both
// complete and open hold (the memory the pending budget bounds).
func (m *Prefill) PendingInfoBytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pend.total
}

// Peers returns the names of the registered decode ranks.
func (m *Prefill) Peers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Collect(maps.Keys(m.peers))
}

// Close stops the workers and the control loop, cancels transfers in
// flight, and destroys the agent (releasing every plugin handle). Senders
// still open report Failed.
func (m *Prefill) Close() error {
	if !m.closed.CompareAndSwap(false, true) {
		return nil
	}
	m.mu.Lock()
	open := make([]*Sender, 0, len(m.senders))
	for _, s := range m.senders {
		open = append(open, s)
	}
	m.mu.Unlock()
	for _, s := range open {
		s.fail("prefill rank closed", false) // decode hears it too
	}
	return m.shutdown()
}

// handle takes one of decode's messages (registrations, transfer info,
// ABORT). A malformed message is logged and dropped; nothing else is
// affected.
func (m *Prefill) handle(frames [][]byte) {
	var msg sglang.Message
	var err error
	if m.cfg.Variant == VariantMORI {
		msg, err = sglang.ParseMORIToPrefill(frames)
	} else {
		msg, err = sglang.ParseNIXLToPrefill(frames)
	}
	if err != nil {
		m.drops.drop("control message", err)
		return
	}
	switch v := msg.(type) {
	case *sglang.NIXLRegistration:
		m.addPeer(func() (*peer, error) { return m.nixlPeer(v, frames) }, v.AgentName)
	case *sglang.MORIRegistration:
		key, _ := v.EngineKey() // moriPeer refuses a descriptor without one
		m.addPeer(func() (*peer, error) { return m.moriPeer(v) }, key)
	case *sglang.NIXLTransferInfo:
		m.addInfo(v.Room, &xferInfo{
			peer: v.AgentName, endpoint: tcpEndpoint(v.Endpoint, v.Port),
			dstPages: v.DstKVIndices, dstAux: v.DstAuxIndex, required: v.RequiredDstInfoNum,
			dstState: v.DstStateIndices, prefixLen: v.DecodePrefixLen, prefixSet: v.DecodePrefixLenSet,
			dummy: v.IsDummy(),
		})
	case *sglang.MORITransferInfo:
		m.addInfo(v.Room, &xferInfo{
			peer: v.EngineKey, endpoint: tcpEndpoint(v.Endpoint, v.Port),
			dstPages: v.DstKVIndices, dstAux: v.DstAuxIndex, required: v.RequiredDstInfoNum,
			dstState: v.DstStateIndices, prefixLen: v.DecodePrefixLen, prefixSet: v.DecodePrefixLenSet,
			dummy: v.IsDummy(),
		})
	case *sglang.Abort:
		m.abortFromDecode(v)
	default:
		m.drops.drop("control message", fmt.Errorf("unexpected %T", msg))
	}
}

// addInfo stores one decode rank's transfer info; the room becomes
// WaitingForInput once every decode rank it waits for reported. Until the
// room has every info and the engine opened it, its infos count against
// the pending budget; an info that does not fit is dropped and its room
// fails (at once if the engine holds it, else when the engine opens it).
func (m *Prefill) addInfo(room uint64, in *xferInfo) {
	if in.required < 1 || in.required > maxSenders {
		m.drops.drop("transfer info", fmt.Errorf("room %d: required_dst_info_num %d", room, in.required))
		return
	}
	if st, ok := m.rooms.Get(room); ok && st != sglang.KVPollBootstrapping {
		// Metadata for a room already past bootstrap (or failed) is stale;
		// the worker may be using the infos (MORI's rule).
		m.log.Debug("ignoring stale transfer info", "room", room, "status", st, "peer", in.peer)
		return
	}
	in.cost = infoCost(in)
	m.mu.Lock()
	ri := m.infos[room]
	s, open := m.senders[room]
	if ri == nil {
		if !open && len(m.infos) >= maxPendingRooms+len(m.senders) {
			m.mu.Unlock()
			m.drops.drop("transfer info", fmt.Errorf("room %d: too many rooms waiting for a sender", room))
			return
		}
		ri = &roomInfos{byPeer: make(map[string]*xferInfo), arrived: m.clock.Now(), charged: true}
		m.infos[room] = ri
	}
	if ri.complete {
		m.mu.Unlock()
		return
	}
	old := ri.byPeer[in.peer]
	if ri.charged {
		if err := m.chargeLocked(in, old); err != nil {
			first := ri.overflow == ""
			if first {
				ri.overflow = fmt.Sprintf("Transfer info from decode %s dropped: %v", in.peer, err)
				ri.overflowTo = in.endpoint
			}
			reason := ri.overflow
			m.mu.Unlock()
			m.drops.drop("transfer info", fmt.Errorf("room %d: %w", room, err))
			if open && first {
				s.fail(reason, false)
			}
			return
		}
	}
	if old != nil {
		for i, o := range ri.order {
			if o == old {
				ri.order[i] = in
			}
		}
	} else {
		ri.order = append(ri.order, in)
	}
	ri.byPeer[in.peer] = in
	ri.required = in.required
	ready := len(ri.byPeer) >= ri.required
	if ready {
		ri.complete = true
		for _, o := range ri.order {
			if o.prefixSet {
				ri.prefixLen = o.prefixLen
				break
			}
		}
		if open {
			m.unchargeLocked(ri)
		}
	}
	m.mu.Unlock()
	if ready && open {
		m.rooms.Update(room, sglang.KVPollWaitingForInput)
	}
}

// chargeLocked counts in against the pending budget in place of old (the
// same decode rank's earlier info for the room, or nil), or says why it
// does not fit. Infos of registered decode agents count per agent; those
// naming any other agent share one budget. Needs m.mu.
func (m *Prefill) chargeLocked(in, old *xferInfo) error {
	key := ""
	if _, ok := m.peers[in.peer]; ok {
		key = in.peer
	}
	perPeer, total := m.pend.budget[key], m.pend.total
	if old != nil {
		total -= old.cost
		if old.budget == key {
			perPeer -= old.cost
		}
	}
	who := "decode agent " + in.peer
	if key == "" {
		who = "unregistered decode agents"
	}
	switch {
	case perPeer+in.cost > m.set.MaxPendingInfoBytesPerPeer:
		return fmt.Errorf("pending transfer info of %s would hold %d bytes, over the per-peer limit of %d", who, perPeer+in.cost, m.set.MaxPendingInfoBytesPerPeer)
	case total+in.cost > m.set.MaxPendingInfoBytes:
		return fmt.Errorf("pending transfer info would hold %d bytes, over the limit of %d", total+in.cost, m.set.MaxPendingInfoBytes)
	}
	if old != nil {
		m.uncharge(old)
	}
	in.budget = key
	m.pend.budget[key] += in.cost
	m.pend.total += in.cost
	return nil
}

func (m *Prefill) uncharge(in *xferInfo) {
	m.pend.total -= in.cost
	if m.pend.budget[in.budget] -= in.cost; m.pend.budget[in.budget] <= 0 {
		delete(m.pend.budget, in.budget)
	}
}

// unchargeLocked releases what a room's infos count against the pending
// budget. Needs m.mu.
func (m *Prefill) unchargeLocked(ri *roomInfos) {
	if !ri.charged {
		return
	}
	ri.charged = false
	for _, in := range ri.order {
		m.uncharge(in)
	}
}

// abortFromDecode handles decode's ABORT: the room fails with a reason
// naming the decode rank; in-flight transfers are cancelled by the room's
// context. An ABORT from an endpoint that is not one of the room's decode
// ranks (or, before their transfer info arrived, not a registered decode
// rank) is dropped.
func (m *Prefill) abortFromDecode(a *sglang.Abort) {
	from := tcpEndpoint(a.Endpoint, a.Port)
	reason := fmt.Sprintf("Aborted by decode %s:%d", a.Endpoint, a.Port)
	m.mu.Lock()
	ri := m.infos[a.Room]
	if ri != nil && len(ri.order) > 0 {
		known := false
		for _, in := range ri.order {
			if in.endpoint == from {
				known = true
			}
		}
		if !known {
			m.mu.Unlock()
			m.drops.drop("ABORT", fmt.Errorf("room %d: %s is not one of its decode ranks", a.Room, from))
			return
		}
	}
	if ri == nil || len(ri.order) == 0 {
		// Before any transfer info: accept it only from a decode rank that
		// registered with this rank.
		registered := false
		for _, p := range m.peers {
			registered = registered || p.endpoint == from
		}
		if !registered {
			m.mu.Unlock()
			m.drops.drop("ABORT", fmt.Errorf("room %d: %s is not a registered decode rank", a.Room, from))
			return
		}
	}
	s := m.senders[a.Room]
	if s == nil && m.closedRooms.has(a.Room) {
		// After the engine closed the room: nothing left to abort, and
		// remembering it would fail the next room with that id.
		m.mu.Unlock()
		m.log.Debug("ignoring ABORT of a closed room", "room", a.Room, "decode", from)
		return
	}
	if s == nil {
		// Before the sender exists: remember it so NewSender fails at once.
		if ri == nil {
			if len(m.infos) >= maxPendingRooms+len(m.senders) {
				m.mu.Unlock()
				return
			}
			ri = &roomInfos{byPeer: make(map[string]*xferInfo), arrived: m.clock.Now(), charged: true}
			m.infos[a.Room] = ri
		}
		ri.aborted = reason
		m.mu.Unlock()
		return
	}
	m.mu.Unlock()
	m.log.Info("room aborted by decode", "room", a.Room, "decode", from)
	s.fail(reason, true)
}

// janitor applies the bootstrap timeout and drops transfer info nobody
// claimed.
func (m *Prefill) janitor(now time.Time) {
	var expired []uint64
	m.rooms.Each(func(room uint64, s sglang.KVPoll, created time.Time) {
		if s == sglang.KVPollBootstrapping && now.Sub(created) >= m.set.BootstrapTimeout {
			expired = append(expired, room)
		}
	})
	for _, room := range expired {
		m.mu.Lock()
		s := m.senders[room]
		m.mu.Unlock()
		if s != nil {
			created, _ := m.rooms.Created(room)
			s.fail(fmt.Sprintf("Request %d timed out after %.1fs in KVPoll.Bootstrapping", room, now.Sub(created).Seconds()), false)
		}
	}
	m.mu.Lock()
	for room, ri := range m.infos {
		if _, open := m.senders[room]; !open && now.Sub(ri.arrived) >= m.set.BootstrapTimeout {
			m.unchargeLocked(ri)
			delete(m.infos, room)
		}
	}
	m.closedRooms.expire(now.Add(-m.set.BootstrapTimeout))
	m.mu.Unlock()
}

// failureTargets returns the decode endpoints to tell about the room's
// failure, once per room (nil when done already or nobody is known).
func (m *Prefill) failureTargets(room uint64) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	ri := m.infos[room]
	if ri == nil || ri.notified || (len(ri.order) == 0 && ri.overflowTo == "") {
		return nil
	}
	ri.notified = true
	eps := endpointsOf(ri.order, false)
	if ri.overflowTo != "" && !slices.Contains(eps, ri.overflowTo) {
		eps = append(eps, ri.overflowTo)
	}
	return eps
}

// sendFailure tells decode endpoints that the room failed, with the reason
// (MORI's status message; sent in both variants so the reason reaches
// decode). Best effort, in the background; Close waits for it.
func (m *Prefill) sendFailure(room uint64, reason string, eps []string) {
	if len(eps) == 0 {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		// Not m.ctx: a failure found while closing must still reach decode
		// (sendStatus bounds each send, Close gives it closeGrace).
		for _, ep := range eps {
			if err := m.sendStatus(m.farewell, ep, room, sglang.KVPollFailed, reason); err != nil {
				m.log.Debug("could not send failure status", "room", room, "decode", ep, "err", err)
			}
		}
	}()
}

// endpointsOf lists the distinct decode endpoints of infos (skipping dummy
// ones when realOnly).
func endpointsOf(infos []*xferInfo, realOnly bool) []string {
	var eps []string
	for _, in := range infos {
		if realOnly && in.dummy {
			continue
		}
		dup := false
		for _, e := range eps {
			if e == in.endpoint {
				dup = true
			}
		}
		if !dup {
			eps = append(eps, in.endpoint)
		}
	}
	return eps
}

func (m *Prefill) sendStatus(ctx context.Context, endpoint string, room uint64, st sglang.KVPoll, reason string) error {
	frames, _ := (&sglang.MORIStatus{Room: room, Status: st, PrefillUniqueRank: m.unique, Reason: reason}).Frames()
	ctx, cancel := m.clock.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return m.push.Send(ctx, endpoint, frames...)
}
