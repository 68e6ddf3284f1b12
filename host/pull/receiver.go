package pull

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memkind"
	"github.com/kvhost/kvhost/host/internal/ratelog"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
	"github.com/kvhost/kvhost/planner"
)

// Errors a Load can finish with (wrapped; test with errors.Is).
var (
	// ErrHandshake: the handshake with the remote engine failed (the
	// wrapped error says why: unreachable, hash or engine id mismatch,
	// incompatible geometry).
	ErrHandshake = errors.New("pull: handshake failed")
	// ErrTransfer: the READ could not be made or posted, or failed.
	ErrTransfer = errors.New("pull: READ failed")
	// ErrReadTimeout: the READ did not complete within ReadTimeout.
	ErrReadTimeout = errors.New("pull: READ timed out")
	// ErrClosed: the Receiver was closed before the load finished.
	ErrClosed = errors.New("pull: receiver closed")
)

// ReceiverConfig configures one decode TP rank.
type ReceiverConfig struct {
	// EngineID is this decode engine's id (for logs).
	EngineID string
	TPRank   int
	TPSize   int
	// Agent is this rank's agent; it needs notifications (CapNotif).
	Agent *plugin.Agent
	Cache Cache
	// MLA: one latent cache per layer, replicated on every rank.
	MLA bool
	// BlocksFirst: K and V share each layer's region, block by block
	// (FlashInfer).
	BlocksFirst bool
	// TotalKVHeads is the model's KV head count (not used for MLA).
	TotalKVHeads int
	// BlockWindows is the per-layer local-attention window in blocks (0:
	// global attention); nil when every layer is global.
	BlockWindows []int
	// CompatHash is this engine's compatibility hash; a peer with another
	// one is refused unless SkipCompatCheck (vLLM's
	// enforce_handshake_compat=false).
	CompatHash      string
	SkipCompatCheck bool
	// HandshakeTimeout bounds a whole handshake: the exchange on the side
	// channel, loading the peer's agent metadata and preparing the
	// descriptor lists. The requests waiting for it fail when it runs
	// out, even if a plugin call is still under way (its result is then
	// released). 0 means vLLM's 5 s (which bounds only the exchange).
	HandshakeTimeout time.Duration
	// ReadTimeout fails a READ still running after it; 0 waits forever, as
	// vLLM does.
	ReadTimeout time.Duration
	// MaxDescriptors bounds each descriptor list prepared for a remote
	// rank (regions × blocks it advertises, and the local list its block
	// size asks for), checked on the declared geometry before anything is
	// built, so a peer advertising absurd geometry cannot exhaust memory.
	// 0 means DefaultMaxDescriptors of this rank's own geometry.
	MaxDescriptors int
	// MaxTotalDescriptors bounds the remote descriptors of all peers held
	// at once; a handshake that would pass it is refused. 0 means
	// DefaultTotalPeers × MaxDescriptors.
	MaxTotalDescriptors int
	// PeerIdleTimeout releases a peer (its remote list and, when no other
	// peer uses it, its remote agent) once no request has used it for this
	// long; the next request naming the engine handshakes again. 0 means
	// DefaultPeerIdleTimeout. An evicted peer is gone within 1.25 ×
	// PeerIdleTimeout of its last request finishing.
	PeerIdleTimeout time.Duration
	Logger          *slog.Logger // nil: slog.Default()
	Observer        Observer     // nil: NopObserver
	// ZMQ options for handshake sockets (of the default Transport).
	ZMQ []ZMQOption
	// Transport runs the handshake exchange; nil means ZMQ{Options: ZMQ}.
	Transport Transport
	// Clock times handshakes, READs, idle peers and heartbeats; nil means
	// the wall clock.
	Clock clock.Clock
	// Gen is this engine's connector generation (nil: version 2): the
	// handshake it sends, the metadata it requires, the count its READ
	// notifications carry and whether it renews the prefill's leases.
	Gen *vllm.Generation
	// Lease is the prefill's lease (kv_lease_duration; 0 means
	// vllm.DefaultLease) in a generation with leases: while a load is in
	// flight, every Lease//6 its remote request id is sent in a heartbeat
	// to the peer's agent.
	Lease time.Duration
}

// LoadRequest is one request's pull (vLLM's kv_connector/v1/nixl_connector.py's ReqMeta to receive).
type LoadRequest struct {
	// RequestID is the decode's own request id (results and logs).
	RequestID string
	// LocalBlockIDs are the decode blocks to fill, in token order: the
	// request's blocks after those a local prefix-cache hit already holds.
	// Empty is a full prefix hit: nothing is read and the prefill is only
	// notified so it can free its blocks. Ids must be distinct.
	LocalBlockIDs []int32
	// Params are the kv_transfer_params the prefill returned.
	Params KVTransferParams
}

// LoadResult is how a load ended.
type LoadResult struct {
	RequestID string
	// Err is nil when every block arrived (or, NotifyOnly, the prefill was
	// told to free); otherwise it wraps ErrInvalidParams, ErrHandshake,
	// ErrTransfer, ErrReadTimeout or ErrClosed.
	Err error
	// NotifyOnly: a full prefix hit, nothing was read. The notification may
	// still have failed to go out (counted in Stats, logged): the prefill
	// then frees on expiry, and the request itself is fine.
	NotifyOnly bool
	// InvalidBlocks are the local blocks that did not load (all of
	// LocalBlockIDs when Err != nil); they are also reported by
	// BlockIDsWithLoadErrors.
	InvalidBlocks []int32
	// Stat is the READ's telemetry (zero without a READ).
	Stat TransferStat
	// Latency runs from Load to the end, handshake wait included.
	Latency time.Duration
}

// Load is a pull in progress.
type Load struct {
	req   LoadRequest
	start time.Time
	done  chan struct{}
	res   LoadResult
	peer  *peer // the ready peer it uses (counted in peer.inflight)
}

// Done is closed when the load has finished.
func (l *Load) Done() <-chan struct{} { return l.done }

// Result waits for the load to finish and returns how it ended.
func (l *Load) Result() LoadResult {
	<-l.done
	return l.res
}

// Wait is Result bounded by ctx; the load goes on if ctx ends first.
func (l *Load) Wait(ctx context.Context) (LoadResult, error) {
	select {
	case <-l.done:
		return l.res, nil
	case <-ctx.Done():
		return LoadResult{}, ctx.Err()
	}
}

// PeerInfo describes a completed handshake.
type PeerInfo struct {
	EngineID       string
	AgentName      string
	RemoteTPRank   int
	RemoteTPSize   int
	TPRatio        int
	BlockSizeRatio int
	Replicated     bool
	// LocalDescs and RemoteDescs are the lengths of the prepared lists.
	LocalDescs, RemoteDescs int
	// Reorder: received blocks are reordered into the local layout.
	Reorder bool
	// ClockOffset is the prefill's clock minus ours in seconds, from the
	// handshake (version 6; 0 before).
	ClockOffset float64
}

// Receiver is one decode TP rank of the pull model. It is safe for
// concurrent use.
type Receiver struct {
	cfg      ReceiverConfig
	gen      *vllm.Generation
	start    time.Time // the origin of this side's clock in handshakes
	clock    clock.Clock
	tr       Transport
	log      *slog.Logger    // rate-limited: peers can trigger its lines
	rlog     *ratelog.Logger // log's limiter, flushed by Close
	obs      Observer
	local    planner.VLLMDecode
	regions  []*plugin.Region
	hasTelem bool
	// geometry of the reorder after reads from smaller prefill blocks
	headsLocal int

	ctx    context.Context
	cancel context.CancelFunc
	ops    sync.WaitGroup // issuers running; Close waits for them
	wg     sync.WaitGroup // eviction and handshakes
	reads  sync.WaitGroup // READs submitted and not reported yet

	mu     sync.Mutex
	closed bool
	peers  map[string]*peer
	// remoteDescs counts the remote descriptors of the peers in peers
	// (reserved by a handshake before it builds its list).
	remoteDescs int
	inflight    map[*readOp]struct{} // submitted READs the engine has not reported
	invalid     map[int32]struct{}
	stats       Stats

	listMu     sync.Mutex
	localLists map[int]*plugin.DList // by block-size ratio

	// agents loads, counts and removes remote agents (never under mu).
	agents *remoteAgents

	scratchMu sync.Mutex
	lids      []int32
	rids      []int32

	reorderMu  sync.Mutex
	reorderBuf []byte

	pendingLoads atomic.Int64 // loads not finished yet
	hbSent       atomic.Int64 // heartbeat rounds run
	// watched are the requests whose leases are renewed before their
	// load (Watch), by local request id; guarded by mu.
	watched map[string]watchedReq
}

// peer is one remote engine as this rank sees it. Fields other than
// waiting and ready are set by the handshake before ready and read-only
// after.
type peer struct {
	engineID string
	endpoint string
	tpSize   int
	ready    bool
	waiting  []*Load
	// abandoned: the handshake outlived HandshakeTimeout; its waiters
	// failed and the peer goes once the handshake returns.
	abandoned bool
	// inflight counts the loads using the peer; idleSince is when it last
	// dropped to 0. descs is the remote descriptors it reserved.
	inflight  int
	idleSince time.Time
	descs     int
	// loads are the loads using the ready peer (inflight of them), whose
	// remote request ids the heartbeats name.
	loads map[*Load]struct{}

	info     PeerInfo
	reader   *planner.VLLMReader
	name     string
	localDL  *plugin.DList
	remoteDL *plugin.DList
	// localLens[j] is the descriptor length of region j of the local list
	// (bytes of a READ when the plugin has no telemetry).
	localLens   []uint64
	localBlocks int
}

// readOp is a READ submitted to the agent's completion engine. x, expiry
// and done are guarded by Receiver.mu.
type readOp struct {
	r      *Receiver
	load   *Load
	peer   *peer
	x      *plugin.Xfer
	expiry clock.Timer // aborts the READ at ReadTimeout; nil without one
	done   bool        // the engine reported it
}

// expire aborts the READ: ReadTimeout passed (on the Receiver's clock).
func (op *readOp) expire() {
	r := op.r
	r.mu.Lock()
	x := op.x
	r.mu.Unlock()
	if x != nil {
		r.cfg.Agent.Engine().Abort(x, fmt.Errorf("%w after %v", ErrReadTimeout, r.cfg.ReadTimeout))
	}
}

// Descriptor bounds. A prepared descriptor costs the decode about 80
// bytes while a list is built (40 as the ABI passes it, the plugin's own
// copy) and the plugin's copy for as long as the peer is held.
const (
	// MaxDescriptorsCap is the largest default MaxDescriptors: 2^26
	// descriptors, several times what a 100-layer model with 100k blocks
	// per region needs.
	MaxDescriptorsCap = 1 << 26
	// MinDefaultMaxDescriptors is the smallest default MaxDescriptors.
	MinDefaultMaxDescriptors = 1 << 20
	// DefaultDescriptorFactor: by default a peer's list may be this many
	// times this rank's own (regions × blocks): a prefill with more or
	// smaller blocks, not one that declares a thousand times our memory.
	DefaultDescriptorFactor = 16
	// DefaultTotalPeers: MaxTotalDescriptors is by default this many
	// peers at MaxDescriptors.
	DefaultTotalPeers = 4
	// DefaultPeerIdleTimeout is the default PeerIdleTimeout.
	DefaultPeerIdleTimeout = 5 * time.Minute
)

// DefaultMaxDescriptors is MaxDescriptors' default for a rank whose own
// cache has the given descriptors (regions × blocks):
// DefaultDescriptorFactor times as many, within [MinDefaultMaxDescriptors,
// MaxDescriptorsCap].
func DefaultMaxDescriptors(own int) int {
	if own > MaxDescriptorsCap/DefaultDescriptorFactor {
		return MaxDescriptorsCap
	}
	return max(own*DefaultDescriptorFactor, MinDefaultMaxDescriptors)
}

// NewReceiver checks the rank's geometry, registers its KV cache and starts
// its poller. Close undoes it.
func NewReceiver(cfg ReceiverConfig) (*Receiver, error) {
	if cfg.Agent == nil {
		return nil, errors.New("pull: receiver needs an agent")
	}
	if cfg.Agent.Caps()&abi.CapNotif == 0 {
		return nil, fmt.Errorf("pull: agent %s (plugin %s) has no notifications: the prefill could not learn a READ completed",
			cfg.Agent.Name(), cfg.Agent.Plugin().Name())
	}
	if err := cfg.Cache.check(); err != nil {
		return nil, err
	}
	if cfg.HandshakeTimeout < 0 || cfg.ReadTimeout < 0 || cfg.PeerIdleTimeout < 0 || cfg.MaxDescriptors < 0 || cfg.MaxTotalDescriptors < 0 {
		return nil, errors.New("pull: negative timeout or descriptor limit")
	}
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if cfg.PeerIdleTimeout == 0 {
		cfg.PeerIdleTimeout = DefaultPeerIdleTimeout
	}
	if cfg.MaxDescriptors == 0 {
		own := 0
		if cfg.Cache.NumBlocks > 0 && len(cfg.Cache.Regions) <= MaxDescriptorsCap/cfg.Cache.NumBlocks {
			own = len(cfg.Cache.Regions) * cfg.Cache.NumBlocks
		} else {
			own = MaxDescriptorsCap
		}
		cfg.MaxDescriptors = DefaultMaxDescriptors(own)
	}
	if cfg.MaxTotalDescriptors == 0 {
		cfg.MaxTotalDescriptors = DefaultTotalPeers * cfg.MaxDescriptors
	}
	if cfg.Lease < 0 {
		return nil, errors.New("pull: negative lease")
	}
	if cfg.Lease == 0 {
		cfg.Lease = vllm.DefaultLease
	}
	r := &Receiver{
		cfg:        cfg,
		gen:        vllm.Or(cfg.Gen),
		clock:      clock.Or(cfg.Clock),
		tr:         transportOr(cfg.Transport, cfg.ZMQ),
		log:        cfg.Logger,
		obs:        cfg.Observer,
		hasTelem:   cfg.Agent.Caps()&abi.CapTelemetry != 0,
		inflight:   map[*readOp]struct{}{},
		peers:      make(map[string]*peer),
		invalid:    make(map[int32]struct{}),
		localLists: make(map[int]*plugin.DList),
		watched:    make(map[string]watchedReq),
	}
	if r.log == nil {
		r.log = slog.Default()
	}
	r.rlog = ratelog.New(r.log)
	r.log = r.rlog.With("component", "pull_receiver", "engine_id", cfg.EngineID, "tp_rank", cfg.TPRank)
	r.agents = newRemoteAgents(cfg.Agent, r.log)
	if r.obs == nil {
		r.obs = NopObserver{}
	}
	r.local = planner.VLLMDecode{
		Agent:        cfg.Cache.agent(),
		TPRank:       cfg.TPRank,
		TPSize:       cfg.TPSize,
		MLA:          cfg.MLA,
		BlocksFirst:  cfg.BlocksFirst,
		TotalKVHeads: cfg.TotalKVHeads,
		BlockWindows: slices.Clone(cfg.BlockWindows),
	}
	// The geometry checks of the handshake, against ourselves: a decode
	// whose own registration is unusable fails here, not per request.
	if _, err := planner.NewVLLMReader(r.local, r.local.Agent, cfg.TPSize); err != nil {
		return nil, fmt.Errorf("pull: decode geometry: %w", err)
	}
	r.headsLocal = 1
	if !cfg.MLA && cfg.TPSize < cfg.TotalKVHeads {
		r.headsLocal = cfg.TotalKVHeads / cfg.TPSize
	}
	regs, err := register(cfg.Agent, &r.cfg.Cache)
	if err != nil {
		return nil, err
	}
	r.regions = regs
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.start = r.clock.Now()
	r.wg.Add(1)
	go r.evictIdle()
	if r.gen.Lease {
		// Armed here, so a test on a fake clock finds it armed.
		interval, _ := vllm.LeaseTimes(cfg.Lease)
		t := r.clock.NewTicker(interval)
		r.wg.Add(1)
		go r.heartbeat(t)
	}
	return r, nil
}

// Load starts pulling one request and returns at once; the result comes
// through the returned Load. A request naming a remote engine this rank has
// not met yet waits for a background handshake with it (one per engine).
func (r *Receiver) Load(req LoadRequest) *Load {
	req.LocalBlockIDs = slices.Clone(req.LocalBlockIDs)
	req.Params.RemoteBlockIDs = slices.Clone(req.Params.RemoteBlockIDs)
	l := &Load{req: req, start: r.clock.Now(), done: make(chan struct{})}
	r.pendingLoads.Add(1)
	p := &req.Params
	if err := p.checkPull(); err != nil {
		r.fail(l, err, false)
		return l
	}
	remoteRank, err := planner.VLLMTargetRemoteRank(r.cfg.TPRank, r.cfg.TPSize, p.RemoteTPSize())
	if err != nil {
		r.fail(l, fmt.Errorf("%w: %w", ErrInvalidParams, err), false)
		return l
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		r.fail(l, ErrClosed, false)
		return l
	}
	pr := r.peers[p.RemoteEngineID]
	switch {
	case pr == nil:
		r.startHandshakeLocked(p, remoteRank, l)
		r.mu.Unlock()
		return l
	case pr.tpSize != p.RemoteTPSize():
		r.mu.Unlock()
		r.fail(l, fmt.Errorf("%w: tp_size %d, but engine %s has TP size %d", ErrInvalidParams, p.RemoteTPSize(), pr.engineID, pr.tpSize), false)
		return l
	case pr.abandoned:
		r.mu.Unlock()
		r.fail(l, fmt.Errorf("%w: engine %s at %s: the last handshake is still running past the %v handshake timeout",
			ErrHandshake, pr.engineID, pr.endpoint, r.cfg.HandshakeTimeout), false)
		return l
	case !pr.ready:
		pr.waiting = append(pr.waiting, l)
		r.mu.Unlock()
		return l
	}
	pr.inflight++
	l.peer = pr
	pr.loads[l] = struct{}{}
	r.ops.Add(1)
	r.mu.Unlock()
	defer r.ops.Done()
	r.issue(l, pr)
	return l
}

// startHandshakeLocked starts the background handshake with the engine p
// names (remote TP rank remoteRank), its first waiting load l (nil for
// none). Callers hold r.mu and checked that the engine has no peer.
func (r *Receiver) startHandshakeLocked(p *KVTransferParams, remoteRank int, l *Load) {
	pr := &peer{engineID: p.RemoteEngineID, endpoint: p.Endpoint(), tpSize: p.RemoteTPSize()}
	if l != nil {
		pr.waiting = []*Load{l}
	}
	r.peers[pr.engineID] = pr
	r.wg.Add(1)
	go r.handshake(pr, remoteRank)
}

// handshake runs one engine's handshake, then starts or fails the requests
// that waited for it. Requests wait at most HandshakeTimeout: past it they
// fail, and whatever the handshake still builds is released when it
// returns.
func (r *Receiver) handshake(pr *peer, remoteRank int) {
	defer r.wg.Done()
	start := r.clock.Now()
	deadline := start.Add(r.cfg.HandshakeTimeout)
	// The timer is armed before connect starts (so that a test on a fake
	// clock that sees a timer of HandshakeTimeout armed sees this one).
	timer := r.clock.NewTimer(r.cfg.HandshakeTimeout)
	result := make(chan error, 1)
	go func() { result <- r.connect(pr, remoteRank, deadline) }()
	var err error
	select {
	case err = <-result:
		timer.Stop()
	case <-timer.C():
		r.abandon(pr)
		err = <-result
	}
	d := r.clock.Since(start)
	r.obs.Handshake(d, err)

	r.mu.Lock()
	waiting := pr.waiting
	pr.waiting = nil
	built := err == nil // what connect built is released below, outside mu
	if err == nil && (r.closed || pr.abandoned) {
		err = ErrClosed
		if pr.abandoned {
			err = fmt.Errorf("took %v, past the %v handshake timeout", d, r.cfg.HandshakeTimeout)
		}
	}
	if err != nil {
		if r.peers[pr.engineID] == pr {
			delete(r.peers, pr.engineID) // the next request tries again
		}
		r.remoteDescs -= pr.descs
		pr.descs = 0
		r.mu.Unlock()
		if built {
			// The peer is in no map: nothing else reaches it. Its release
			// calls the plugin, which may block: never under mu.
			r.releasePeer(pr)
		}
		if !errors.Is(err, ErrClosed) {
			err = fmt.Errorf("%w: engine %s at %s: %w", ErrHandshake, pr.engineID, pr.endpoint, err)
			r.log.Error("handshake failed; failing the requests that waited for it", "remote_engine_id", pr.engineID,
				"endpoint", pr.endpoint, "requests", len(waiting), "err", err)
		}
		for _, l := range waiting {
			r.fail(l, err, false)
		}
		return
	}
	pr.ready = true
	pr.inflight += len(waiting)
	pr.idleSince = r.clock.Now()
	pr.loads = make(map[*Load]struct{}, len(waiting))
	for _, l := range waiting {
		l.peer = pr
		pr.loads[l] = struct{}{}
	}
	r.ops.Add(1)
	r.mu.Unlock()
	defer r.ops.Done()
	r.log.Info("handshake done", "remote_engine_id", pr.engineID, "agent", pr.name, "remote_tp_rank", remoteRank,
		"tp_ratio", pr.info.TPRatio, "block_size_ratio", pr.info.BlockSizeRatio, "local_descs", pr.info.LocalDescs,
		"remote_descs", pr.info.RemoteDescs, "took", d)
	for _, l := range waiting {
		r.issue(l, pr)
	}
}

// abandon fails the requests waiting for a handshake that outlived
// HandshakeTimeout; requests for the engine fail at once until it returns.
func (r *Receiver) abandon(pr *peer) {
	r.mu.Lock()
	pr.abandoned = true
	waiting := pr.waiting
	pr.waiting = nil
	r.mu.Unlock()
	err := fmt.Errorf("%w: engine %s at %s: not done within the %v handshake timeout: %w",
		ErrHandshake, pr.engineID, pr.endpoint, r.cfg.HandshakeTimeout, context.DeadlineExceeded)
	r.log.Error("handshake timed out; failing the requests that waited for it", "remote_engine_id", pr.engineID,
		"endpoint", pr.endpoint, "requests", len(waiting), "timeout", r.cfg.HandshakeTimeout)
	for _, l := range waiting {
		r.fail(l, err, false)
	}
}

// testHookAfterFetch, when set by a test, runs after the handshake
// exchange (to make the rest of a handshake slow).
var testHookAfterFetch atomic.Pointer[func()]

// connect fetches the remote rank's metadata and sets up everything reads
// from it need: remote agent, geometry, both prepared lists.
func (r *Receiver) connect(pr *peer, remoteRank int, deadline time.Time) error {
	ctx, cancel := r.clock.WithDeadline(r.ctx, deadline)
	defer cancel()
	md, offset, err := FetchHandshakeClock(ctx, pr.endpoint, remoteRank, FetchOptions{
		Expect: vllm.Expect{LocalHash: r.cfg.CompatHash, EnforceHash: !r.cfg.SkipCompatCheck, EngineID: pr.engineID,
			Gen: r.gen},
		Timeout:    r.cfg.HandshakeTimeout,
		Request:    r.tr.Request,
		Clock:      r.clock,
		LocalClock: func(t time.Time) float64 { return t.Sub(r.start).Seconds() },
	})
	if err != nil {
		if r.ctx.Err() != nil {
			return ErrClosed
		}
		return err
	}
	if hook := testHookAfterFetch.Load(); hook != nil {
		(*hook)()
	}
	// What version 6's metadata adds, kvhost does not transfer: Mamba
	// state, and kernel blocks smaller than the logical ones.
	if r.gen.Version >= 6 {
		if md.SSMSizes != [2]int{} {
			return fmt.Errorf("the prefill has Mamba state (ssm_sizes %v): kvhost transfers attention KV only", md.SSMSizes)
		}
		if md.PhysicalBlocksPerLogical != 1 {
			return fmt.Errorf("physical_blocks_per_logical_kv_block is %d: kvhost reads logical blocks only (1)", md.PhysicalBlocksPerLogical)
		}
	}
	// What version 10's adds: block strides other than the block length
	// (blocks not back to back) and context parallel engines, whose ranks
	// each hold a slice of a block's tokens.
	if slices.Contains(r.gen.MetadataFields, "block_strides") && !slices.Equal(md.BlockStrides, md.BlockLens) {
		return fmt.Errorf("block_strides %v are not block_lens %v: kvhost reads back-to-back blocks only", md.BlockStrides, md.BlockLens)
	}
	if slices.Contains(r.gen.MetadataDefaults, "dcp_size") && (md.DCPSize != 1 || md.PCPSize != 1) {
		return fmt.Errorf("the prefill is context parallel (dcp_size %d, pcp_size %d): kvhost reads engines without context parallelism only (1, 1)", md.DCPSize, md.PCPSize)
	}
	// What version 11's and 12's add: region layouts of several groups,
	// sizes or memory types, pooled layers.
	if err := md.CheckMappable(r.cfg.Cache.Kind.String()); err != nil {
		return err
	}
	remote, err := remoteAgent(md, r.cfg.Cache.Kind)
	if err != nil {
		return err
	}
	reader, err := planner.NewVLLMReader(r.local, remote, pr.tpSize)
	if err != nil {
		return fmt.Errorf("incompatible KV geometry: %w", err)
	}
	// The reader's lists are closed forms; the descriptors are made below,
	// once the declared geometry is within the bounds.
	rl := reader.RemoteList()
	if rl.Len() > r.cfg.MaxDescriptors {
		return fmt.Errorf("the prefill advertises %d regions of %d blocks: %d descriptors, more than the %d this decode prepares for a peer (MaxDescriptors)",
			len(remote.BaseAddrs), remote.NumBlocks, rl.Len(), r.cfg.MaxDescriptors)
	}
	if ll := reader.LocalList(); ll.Len() > r.cfg.MaxDescriptors {
		return fmt.Errorf("the prefill's block size %d needs a local list of %d descriptors, more than the %d this decode prepares for a peer (MaxDescriptors)",
			remote.BlockSize, ll.Len(), r.cfg.MaxDescriptors)
	}
	if reader.RemoteRank() != remoteRank {
		return fmt.Errorf("reader targets TP rank %d, handshake was with %d", reader.RemoteRank(), remoteRank)
	}
	// Heads of one rank are contiguous in a block only in HND: a head slice
	// of an NHD block is not one byte range.
	if !r.cfg.MLA && !reader.Replicated() && reader.TPRatio() > 1 &&
		(md.KVCacheLayout != LayoutHND || r.cfg.Cache.Layout != LayoutHND) {
		return fmt.Errorf("heterogeneous TP (tp_ratio %d) needs the %s layout on both sides, prefill has %s and decode %s",
			reader.TPRatio(), LayoutHND, md.KVCacheLayout, r.cfg.Cache.Layout)
	}
	reorder := reader.BlockSizeRatio() > 1 && !r.cfg.MLA && (r.cfg.Cache.Layout == LayoutHND || r.cfg.BlocksFirst)
	if reorder {
		if err := r.checkReorder(reader.BlockSizeRatio()); err != nil {
			return err
		}
	}
	if err := r.reserve(pr, rl.Len()); err != nil {
		return err
	}
	localDL, err := r.localList(reader)
	if err != nil {
		return err
	}
	name, err := r.agents.acquire(md.AgentMetadata)
	if err != nil {
		return fmt.Errorf("load remote agent metadata: %w", err)
	}
	remoteDL, err := r.cfg.Agent.PrepRemote(name, r.cfg.Cache.Kind, xferDescs(&rl))
	if err != nil {
		r.agents.release(name, nil)
		return fmt.Errorf("prepare the remote descriptor list: %w", err)
	}
	ll := reader.LocalList()
	pr.reader, pr.name, pr.localDL, pr.remoteDL = reader, name, localDL, remoteDL
	pr.localBlocks = ll.Blocks
	for _, reg := range ll.Regions {
		pr.localLens = append(pr.localLens, reg.Len)
	}
	pr.info = PeerInfo{
		EngineID: pr.engineID, AgentName: name, RemoteTPRank: remoteRank, RemoteTPSize: pr.tpSize,
		TPRatio: reader.TPRatio(), BlockSizeRatio: reader.BlockSizeRatio(), Replicated: reader.Replicated(),
		LocalDescs: localDL.Len(), RemoteDescs: remoteDL.Len(), Reorder: reorder, ClockOffset: offset,
	}
	return nil
}

// remoteAgent turns handshake metadata into the planner's geometry.
func remoteAgent(md *vllm.AgentMetadata, kind abi.MemKind) (planner.VLLMAgent, error) {
	if md.DeviceID < 0 {
		return planner.VLLMAgent{}, fmt.Errorf("device_id %d is negative", md.DeviceID)
	}
	lens := make([]uint64, len(md.BlockLens))
	for i, l := range md.BlockLens {
		if l <= 0 {
			return planner.VLLMAgent{}, fmt.Errorf("block_lens[%d] = %d", i, l)
		}
		lens[i] = uint64(l)
	}
	return planner.VLLMAgent{
		BaseAddrs:     md.KVCachesBaseAddr,
		BlockLens:     lens,
		NumBlocks:     md.NumBlocks,
		BlockSize:     md.BlockSize,
		KVCacheLayout: md.KVCacheLayout,
		DeviceID:      uint64(md.DeviceID),
		Kind:          memkind.ToPlanner(kind),
	}, nil
}

// localList returns the local prepared list for a block-size ratio,
// preparing it the first time (vLLM's kv_connector/v1/nixl_connector.py's src_xfer_side_handles).
func (r *Receiver) localList(reader *planner.VLLMReader) (*plugin.DList, error) {
	r.listMu.Lock()
	defer r.listMu.Unlock()
	if dl := r.localLists[reader.BlockSizeRatio()]; dl != nil {
		return dl, nil
	}
	ll := reader.LocalList()
	dl, err := r.cfg.Agent.PrepLocal(r.cfg.Cache.Kind, xferDescs(&ll))
	if err != nil {
		return nil, fmt.Errorf("prepare the local descriptor list: %w", err)
	}
	r.localLists[reader.BlockSizeRatio()] = dl
	return dl, nil
}

// xferDescs lists every descriptor of l, in id order.
func xferDescs(l *planner.VLLMDescList) []abi.XferDesc {
	out := make([]abi.XferDesc, 0, l.Len())
	for _, reg := range l.Regions {
		addr := reg.Addr
		for b := 0; b < l.Blocks; b++ {
			out = append(out, abi.XferDesc{Addr: addr, Len: reg.Len, Count: 1, DevID: l.DeviceID})
			addr += reg.Stride
		}
	}
	return out
}

// issue makes and posts a request's READ, or sends only its notification.
func (r *Receiver) issue(l *Load, pr *peer) {
	p := &l.req.Params
	// planner.VLLMAlignRemote: where kvhost differs from vLLM (a partial
	// prefix hit with larger decode blocks); `kvhost plan` does the same.
	remote := pr.reader.AlignRemote(len(l.req.LocalBlockIDs), p.RemoteBlockIDs)
	notif := []byte(vllm.ReadNotif(p.RemoteRequestID, r.gen.NotifNumber(pr.reader.TPRatio(), r.cfg.TPSize)))

	r.scratchMu.Lock()
	t0 := time.Now()
	lids, rids, notifyOnly, err := pr.reader.AppendRead(r.lids[:0], r.rids[:0], l.req.LocalBlockIDs, remote)
	planned := time.Since(t0)
	r.lids, r.rids = lids[:0], rids[:0] // keep what they grew to
	if err != nil {
		r.scratchMu.Unlock()
		r.fail(l, fmt.Errorf("%w: %w", ErrInvalidParams, err), false)
		return
	}
	if notifyOnly {
		r.scratchMu.Unlock()
		res := LoadResult{NotifyOnly: true}
		if err := r.cfg.Agent.SendNotif(pr.name, notif); err != nil {
			r.log.Error("notification failed: the prefill frees the request's blocks only when its abort timeout expires",
				"request_id", l.req.RequestID, "remote_request_id", p.RemoteRequestID, "err", err)
			r.mu.Lock()
			r.stats.RecordFailedNotification()
			r.mu.Unlock()
			r.obs.FailedNotification()
		}
		r.finish(l, res)
		return
	}
	op := &readOp{r: r, load: l, peer: pr}
	var bytes uint64
	if !r.hasTelem {
		for _, id := range lids {
			bytes += pr.localLens[int(id)/pr.localBlocks]
		}
	}
	r.mu.Lock()
	r.inflight[op] = struct{}{}
	r.mu.Unlock()
	r.reads.Add(1)
	// One plugin call to make and post the READ (submit_xfer where the
	// plugin has it); the engine reports it to TransferDone and releases
	// it (one more call).
	x, err := r.cfg.Agent.Engine().SubmitPrepped(abi.Read, pr.localDL, lids, pr.remoteDL, rids, notif,
		plugin.Watch{Handler: r, Tag: op, Bytes: bytes, Descs: uint64(len(lids)), Plan: planned})
	r.scratchMu.Unlock()
	if err != nil {
		r.mu.Lock()
		delete(r.inflight, op)
		r.mu.Unlock()
		r.reads.Done()
		r.fail(l, fmt.Errorf("%w: submit: %w", ErrTransfer, err), true)
		return
	}
	r.mu.Lock()
	if !op.done {
		op.x = x
		if r.cfg.ReadTimeout > 0 {
			op.expiry = r.clock.AfterFunc(r.cfg.ReadTimeout, op.expire)
		}
	}
	r.mu.Unlock()
}

// TransferDone is the completion engine's report of a READ: it completed,
// failed, timed out (aborted by expire) or was cancelled by Close.
func (r *Receiver) TransferDone(tag any, ev plugin.TransferEvent) {
	op := tag.(*readOp)
	r.mu.Lock()
	op.done, op.x = true, nil
	expiry := op.expiry
	delete(r.inflight, op)
	r.mu.Unlock()
	if expiry != nil {
		expiry.Stop()
	}
	defer r.reads.Done()
	switch {
	case ev.Err == nil:
		r.complete(op, ev)
	case errors.Is(ev.Err, ErrReadTimeout), errors.Is(ev.Err, ErrClosed):
		r.fail(op.load, ev.Err, !errors.Is(ev.Err, ErrClosed))
	default:
		r.fail(op.load, fmt.Errorf("%w: %w", ErrTransfer, ev.Err), true)
	}
}

// complete finishes a READ that completed: stat is the engine's event
// (telemetry when the plugin has it, else the host's clock and the bytes
// of the READ's descriptors).
func (r *Receiver) complete(op *readOp, stat TransferStat) {
	if op.peer.info.Reorder {
		if err := r.reorder(op.load.req.LocalBlockIDs, op.peer.info.BlockSizeRatio); err != nil {
			r.fail(op.load, err, false)
			return
		}
	}
	r.mu.Lock()
	r.stats.RecordTransfer(stat)
	r.mu.Unlock()
	r.obs.Transfer(stat)
	r.finish(op.load, LoadResult{Stat: stat})
}

// fail finishes a load that did not deliver its blocks: they are invalid.
func (r *Receiver) fail(l *Load, err error, transfer bool) {
	r.mu.Lock()
	for _, b := range l.req.LocalBlockIDs {
		r.invalid[b] = struct{}{}
	}
	if transfer {
		r.stats.RecordFailedTransfer()
	}
	r.mu.Unlock()
	if transfer {
		r.obs.FailedTransfer()
	}
	if !errors.Is(err, ErrClosed) {
		r.log.Warn("KV load failed; marking its blocks invalid", "request_id", l.req.RequestID,
			"remote_request_id", l.req.Params.RemoteRequestID, "blocks", len(l.req.LocalBlockIDs), "err", err)
	}
	r.finish(l, LoadResult{Err: err, InvalidBlocks: slices.Clone(l.req.LocalBlockIDs)})
}

func (r *Receiver) finish(l *Load, res LoadResult) {
	if pr := l.peer; pr != nil {
		r.mu.Lock()
		delete(pr.loads, l)
		if pr.inflight--; pr.inflight == 0 {
			pr.idleSince = r.clock.Now()
		}
		r.mu.Unlock()
	}
	r.Unwatch(l.req.RequestID) // vLLM stops at finished_recving
	res.RequestID = l.req.RequestID
	res.Latency = r.clock.Since(l.start)
	l.res = res
	r.pendingLoads.Add(-1)
	close(l.done)
}

// Pending returns the loads started and not finished yet (waiting for a
// handshake or reading): a gauge for metrics.
func (r *Receiver) Pending() int { return int(r.pendingLoads.Load()) }

// BlockIDsWithLoadErrors returns, sorted, and forgets the local blocks
// that failed to load since the last call (vLLM's kv_connector/v1/nixl_connector.py's
// get_block_ids_with_load_errors).
func (r *Receiver) BlockIDsWithLoadErrors() []int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := slices.Sorted(maps.Keys(r.invalid))
	clear(r.invalid)
	return out
}

// TakeStats returns the statistics recorded since the last call and
// resets them (vLLM's kv_connector/v1/nixl_connector.py's get_kv_connector_stats).
func (r *Receiver) TakeStats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stats.CloneAndReset()
}

// Peers describes the engines this rank completed a handshake with.
func (r *Receiver) Peers() []PeerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []PeerInfo
	for _, pr := range r.peers {
		if pr.ready {
			out = append(out, pr.info)
		}
	}
	slices.SortFunc(out, func(a, b PeerInfo) int {
		if a.EngineID < b.EngineID {
			return -1
		}
		if a.EngineID > b.EngineID {
			return 1
		}
		return 0
	})
	return out
}

// reserve counts a peer's remote descriptors against MaxTotalDescriptors
// (the handshake gives them back if it fails, eviction when it goes).
func (r *Receiver) reserve(pr *peer, n int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n > r.cfg.MaxTotalDescriptors-r.remoteDescs {
		return fmt.Errorf("the prefill's %d descriptors would take the peers' %d past the %d this decode holds in all (MaxTotalDescriptors)",
			n, r.remoteDescs, r.cfg.MaxTotalDescriptors)
	}
	r.remoteDescs += n
	pr.descs = n
	return nil
}

// evictIdle releases, every quarter PeerIdleTimeout, the peers no request
// has used for PeerIdleTimeout.
func (r *Receiver) evictIdle() {
	defer r.wg.Done()
	t := r.clock.NewTicker(max(r.cfg.PeerIdleTimeout/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C():
			// The clock, not the tick: a tick a slow loop read late is stale.
			now := r.clock.Now()
			var idle []*peer
			r.mu.Lock()
			for id, pr := range r.peers {
				if pr.ready && pr.inflight == 0 && now.Sub(pr.idleSince) >= r.cfg.PeerIdleTimeout {
					delete(r.peers, id)
					r.remoteDescs -= pr.descs
					pr.descs = 0
					idle = append(idle, pr)
				}
			}
			r.mu.Unlock()
			for _, pr := range idle {
				r.log.Info("releasing an idle peer", "remote_engine_id", pr.engineID, "agent", pr.name,
					"idle", now.Sub(pr.idleSince).Round(time.Millisecond))
				r.releasePeer(pr)
			}
		}
	}
}

// releasePeer releases a peer's remote list and remote agent (once no
// load is in flight: see remoteAgents). The local list is shared and
// released by Close.
func (r *Receiver) releasePeer(pr *peer) {
	r.agents.release(pr.name, pr.remoteDL)
	pr.remoteDL, pr.name = nil, ""
}

// Close fails loads still waiting or running (ErrClosed), then releases
// every transfer, prepared list and remote agent, and deregisters the KV
// cache. Calling it again is a no-op.
func (r *Receiver) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.mu.Unlock()
	r.ops.Wait() // nothing posts after this
	r.cancel()
	// The engine releases (cancels) the READs still running and reports
	// them failed with ErrClosed.
	r.mu.Lock()
	var running []*plugin.Xfer
	for op := range r.inflight {
		if op.x != nil {
			running = append(running, op.x)
		}
	}
	r.mu.Unlock()
	for _, x := range running {
		r.cfg.Agent.Engine().Abort(x, ErrClosed)
	}
	r.reads.Wait()
	r.wg.Wait() // handshakes failed their waiters
	for _, pr := range r.peers {
		if pr.ready {
			r.releasePeer(pr)
		}
	}
	clear(r.peers)
	var errs []error
	for ratio, dl := range r.localLists {
		if err := dl.Close(); err != nil {
			errs = append(errs, fmt.Errorf("pull: release local list (block-size ratio %d): %w", ratio, err))
		}
	}
	clear(r.localLists)
	if err := r.cfg.Agent.Deregister(r.regions...); err != nil {
		errs = append(errs, fmt.Errorf("pull: deregister KV cache: %w", err))
	}
	r.rlog.Close()
	return errors.Join(errs...)
}
