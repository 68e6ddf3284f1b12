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
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/host/zmq"
	"github.com/kvhost/kvhost/planner"
)

// PrefillConfig configures one prefill rank.
type PrefillConfig struct {
	// Plugin moves the bytes; the manager creates its own agent on it
	// (named AgentName, or a unique generated name) with AgentParams, and
	// destroys it on Close.
	Plugin      *plugin.Plugin
	AgentName   string
	AgentParams []plugin.Param

	Variant    Variant
	Completion Completion
	XferMode   XferMode

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
}

// Prefill is one prefill rank's transfer manager (SGLang's KVManager in
// PREFILL mode): it receives decode ranks' registrations and per-request
// transfer info on its PULL socket and pushes KV to them. Safe for
// concurrent use.
type Prefill struct {
	rank
	cfg        PrefillConfig
	completion Completion // resolved: notif or status
	unique     int        // prefill_unique_rank

	// This rank's buffers in the planner's terms (region tables equal the
	// registered regions).
	srcKV      planner.KVSide
	srcAux     planner.AuxBuffers
	srcState   planner.StateBuffers
	stateTypes []planner.StateType

	shards []*shard

	mu       sync.Mutex
	peers    map[string]*peer  // decode ranks by agent (engine) name
	peerErr  map[string]string // registrations that failed, by name (bounded)
	infos    map[uint64]*roomInfos
	senders  map[uint64]*Sender
	srcLists map[string]*plugin.DList // prepped source lists shared by peers

	// notifyCtx bounds failure notifications; Close cancels it after
	// closeGrace so a dead decode endpoint cannot hold Close for long.
	notifyCtx    context.Context
	notifyCancel context.CancelFunc
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
}

// closeGrace is how long Close lets failure notifications in flight try to
// reach decode.
const closeGrace = time.Second

// maxPendingRooms bounds rooms whose transfer info arrived but whose sender
// does not exist yet (a peer announcing rooms nobody will serve).
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
	if cfg.Variant == VariantMORI && cfg.XferMode == XferPrepped {
		return nil, errors.New("push: prepped transfers are SGLang NIXL's; the MORI variant posts batch writes")
	}
	m := &Prefill{
		cfg:      cfg,
		unique:   cfg.Parallel.uniqueRank(),
		peers:    make(map[string]*peer),
		peerErr:  make(map[string]string),
		infos:    make(map[uint64]*roomInfos),
		senders:  make(map[uint64]*Sender),
		srcLists: make(map[string]*plugin.DList),
	}
	if err := m.open(rankSetup{role: RolePrefill, plugin: cfg.Plugin, agentName: cfg.AgentName, agentParams: cfg.AgentParams,
		parallel: cfg.Parallel, settings: cfg.Settings, observer: cfg.Observer, logger: cfg.Logger}); err != nil {
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
	// MORI sends status with SNDTIMEO 5 s.
	if err := m.listen(&cfg.KV, cfg.Host, cfg.Port, zmq.WithSendTimeout(5*time.Second)); err != nil {
		return fail(err)
	}
	m.srcKV = cfg.KV.kvSide(cfg.Parallel)
	m.srcAux = cfg.KV.auxBuffers()
	m.srcState, m.stateTypes = cfg.KV.stateBuffers()
	m.notifyCtx, m.notifyCancel = context.WithCancel(context.Background())
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
		"variant", cfg.Variant, "completion", m.completion, "xfer", cfg.XferMode)
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

func (m *Prefill) registerBootstrap(ctx context.Context) error {
	p := m.cfg.Parallel
	reg := bootstrap.Registration{
		AttnTPSize: p.TPSize, AttnTPRank: p.TPRank,
		AttnCPSize: p.CPSize, AttnCPRank: p.CPRank,
		AttnDPSize: p.DPSize, AttnDPRank: p.DPRank,
		PPSize: p.PPSize, PPRank: p.PPRank,
		SystemDPSize: 1, SystemDPRank: 0,
		RankIP: m.cfg.Host, RankPort: m.pull.Port(),
		PageSize: m.cfg.KV.PageSize, KVCacheDType: m.cfg.KVCacheDType,
		LoadBalanceMethod: "follow_bootstrap_room",
	}
	start := time.Now()
	err := bootstrap.NewClient(m.cfg.BootstrapAddr).Register(ctx, reg)
	m.obs.Handshake(HandshakeEvent{Role: RolePrefill, Kind: HandshakeRegisterBootstrap, Peer: m.cfg.BootstrapAddr, Latency: time.Since(start), Err: err})
	if err != nil {
		return fmt.Errorf("push: register with bootstrap server %s: %w", m.cfg.BootstrapAddr, err)
	}
	return nil
}

// Completion returns the completion signal this rank uses.
func (m *Prefill) Completion() Completion { return m.completion }

// Pending returns the number of rooms with transfer info but no sender
// yet, plus rooms with both (for leak checks).
func (m *Prefill) Pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.infos)
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
	grace := time.AfterFunc(closeGrace, m.notifyCancel)
	defer grace.Stop()
	defer m.notifyCancel()
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
		m.addPeer(func() (*peer, error) { return m.moriPeer(v) }, "")
	case *sglang.NIXLTransferInfo:
		m.addInfo(v.Room, &xferInfo{
			peer: v.AgentName, endpoint: zmq.TCPEndpoint(v.Endpoint, v.Port),
			dstPages: v.DstKVIndices, dstAux: v.DstAuxIndex, required: v.RequiredDstInfoNum,
			dstState: v.DstStateIndices, prefixLen: v.DecodePrefixLen, prefixSet: v.DecodePrefixLenSet,
			dummy: v.IsDummy(),
		})
	case *sglang.MORITransferInfo:
		m.addInfo(v.Room, &xferInfo{
			peer: v.EngineKey, endpoint: zmq.TCPEndpoint(v.Endpoint, v.Port),
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
// WaitingForInput once every decode rank it waits for reported.
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
	m.mu.Lock()
	ri := m.infos[room]
	if ri == nil {
		if len(m.infos) >= maxPendingRooms+len(m.senders) {
			m.mu.Unlock()
			m.drops.drop("transfer info", fmt.Errorf("room %d: too many rooms waiting for a sender", room))
			return
		}
		ri = &roomInfos{byPeer: make(map[string]*xferInfo), arrived: time.Now()}
		m.infos[room] = ri
	}
	if ri.complete {
		m.mu.Unlock()
		return
	}
	if old, ok := ri.byPeer[in.peer]; ok {
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
	}
	_, open := m.senders[room]
	m.mu.Unlock()
	if ready && open {
		m.rooms.Update(room, sglang.KVPollWaitingForInput)
	}
}

// abortFromDecode handles decode's ABORT: the room fails with a reason
// naming the decode rank; in-flight transfers are cancelled by the room's
// context. An ABORT from an endpoint that is not one of the room's decode
// ranks (or, before their transfer info arrived, not a registered decode
// rank) is dropped.
func (m *Prefill) abortFromDecode(a *sglang.Abort) {
	from := zmq.TCPEndpoint(a.Endpoint, a.Port)
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
	if s == nil {
		// Before the sender exists: remember it so NewSender fails at once.
		if ri == nil {
			if len(m.infos) >= maxPendingRooms+len(m.senders) {
				m.mu.Unlock()
				return
			}
			ri = &roomInfos{byPeer: make(map[string]*xferInfo), arrived: time.Now()}
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
			delete(m.infos, room)
		}
	}
	m.mu.Unlock()
}

// failureTargets returns the decode endpoints to tell about the room's
// failure, once per room (nil when done already or nobody is known).
func (m *Prefill) failureTargets(room uint64) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	ri := m.infos[room]
	if ri == nil || ri.notified || len(ri.order) == 0 {
		return nil
	}
	ri.notified = true
	return endpointsOf(ri.order, false)
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
			if err := m.sendStatus(m.notifyCtx, ep, room, sglang.KVPollFailed, reason); err != nil {
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
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return m.push.Send(ctx, endpoint, frames...)
}
