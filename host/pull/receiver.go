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
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
	"github.com/kvhost/kvhost/host/zmq"
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
	// HandshakeTimeout bounds one handshake exchange; 0 means vLLM's 5 s.
	HandshakeTimeout time.Duration
	// ReadTimeout fails a READ still running after it; 0 waits forever, as
	// vLLM does.
	ReadTimeout time.Duration
	// MaxDescriptors bounds the descriptor list prepared for a remote rank
	// (regions × blocks it advertises), so a peer advertising absurd
	// geometry cannot exhaust memory; 0 means DefaultMaxDescriptors.
	MaxDescriptors int
	Logger         *slog.Logger // nil: slog.Default()
	Observer       Observer     // nil: NopObserver
	// ZMQ options for handshake sockets.
	ZMQ []zmq.Option
}

// LoadRequest is one request's pull (the reference's ReqMeta to receive).
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
}

// Receiver is one decode TP rank of the pull model. It is safe for
// concurrent use.
type Receiver struct {
	cfg      ReceiverConfig
	log      *slog.Logger
	obs      Observer
	local    planner.VLLMDecode
	regions  []*plugin.Region
	hasTelem bool
	// geometry of the reorder after reads from smaller prefill blocks
	headsLocal int

	ctx    context.Context
	cancel context.CancelFunc
	ops    sync.WaitGroup // issuers running; Close waits for them
	wg     sync.WaitGroup // poller and handshakes
	wake   chan struct{}

	mu      sync.Mutex
	closed  bool
	peers   map[string]*peer
	pending []*readOp // posted READs not yet with the poller
	invalid map[int32]struct{}
	stats   Stats

	listMu     sync.Mutex
	localLists map[int]*plugin.DList // by block-size ratio

	scratchMu sync.Mutex
	lids      []int32
	rids      []int32

	reorderMu  sync.Mutex
	reorderBuf []byte

	pendingLoads atomic.Int64 // loads not finished yet
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

// readOp is a posted READ.
type readOp struct {
	load   *Load
	peer   *peer
	x      *plugin.Xfer
	posted time.Time
	post   time.Duration
	descs  int
	bytes  uint64 // from the descriptors, for agents without telemetry
}

// DefaultMaxDescriptors is the default ReceiverConfig.MaxDescriptors: 2^26
// block descriptors (2.5 GiB as the ABI passes them), several times what a
// 100-layer model with 100k blocks per region needs.
const DefaultMaxDescriptors = 1 << 26

// Poll backoff of the Receiver's poller.
const (
	pollMinSleep = 20 * time.Microsecond
	pollMaxSleep = 200 * time.Microsecond
)

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
	if cfg.HandshakeTimeout < 0 || cfg.ReadTimeout < 0 || cfg.MaxDescriptors < 0 {
		return nil, errors.New("pull: negative timeout or descriptor limit")
	}
	if cfg.MaxDescriptors == 0 {
		cfg.MaxDescriptors = DefaultMaxDescriptors
	}
	r := &Receiver{
		cfg:        cfg,
		log:        cfg.Logger,
		obs:        cfg.Observer,
		hasTelem:   cfg.Agent.Caps()&abi.CapTelemetry != 0,
		wake:       make(chan struct{}, 1),
		peers:      make(map[string]*peer),
		invalid:    make(map[int32]struct{}),
		localLists: make(map[int]*plugin.DList),
	}
	if r.log == nil {
		r.log = slog.Default()
	}
	r.log = r.log.With("component", "pull_receiver", "engine_id", cfg.EngineID, "tp_rank", cfg.TPRank)
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
	r.wg.Add(1)
	go r.poll()
	return r, nil
}

// Load starts pulling one request and returns at once; the result comes
// through the returned Load. A request naming a remote engine this rank has
// not met yet waits for a background handshake with it (one per engine).
func (r *Receiver) Load(req LoadRequest) *Load {
	req.LocalBlockIDs = slices.Clone(req.LocalBlockIDs)
	req.Params.RemoteBlockIDs = slices.Clone(req.Params.RemoteBlockIDs)
	l := &Load{req: req, start: time.Now(), done: make(chan struct{})}
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
		pr = &peer{engineID: p.RemoteEngineID, endpoint: p.Endpoint(), tpSize: p.RemoteTPSize(), waiting: []*Load{l}}
		r.peers[pr.engineID] = pr
		r.wg.Add(1)
		r.mu.Unlock()
		go r.handshake(pr, remoteRank)
		return l
	case pr.tpSize != p.RemoteTPSize():
		r.mu.Unlock()
		r.fail(l, fmt.Errorf("%w: tp_size %d, but engine %s has TP size %d", ErrInvalidParams, p.RemoteTPSize(), pr.engineID, pr.tpSize), false)
		return l
	case !pr.ready:
		pr.waiting = append(pr.waiting, l)
		r.mu.Unlock()
		return l
	}
	r.ops.Add(1)
	r.mu.Unlock()
	defer r.ops.Done()
	r.issue(l, pr)
	return l
}

// handshake runs one engine's handshake, then starts or fails the requests
// that waited for it.
func (r *Receiver) handshake(pr *peer, remoteRank int) {
	defer r.wg.Done()
	start := time.Now()
	err := r.connect(pr, remoteRank)
	d := time.Since(start)
	r.obs.Handshake(d, err)

	r.mu.Lock()
	waiting := pr.waiting
	pr.waiting = nil
	if err == nil && r.closed {
		r.releasePeer(pr)
		err = ErrClosed
	}
	if err != nil {
		delete(r.peers, pr.engineID) // the next request tries again
		r.mu.Unlock()
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

// connect fetches the remote rank's metadata and sets up everything reads
// from it need: remote agent, geometry, both prepared lists.
func (r *Receiver) connect(pr *peer, remoteRank int) error {
	md, err := vllm.FetchHandshake(r.ctx, pr.endpoint, remoteRank, vllm.FetchOptions{
		Expect:  vllm.Expect{LocalHash: r.cfg.CompatHash, EnforceHash: !r.cfg.SkipCompatCheck, EngineID: pr.engineID},
		Timeout: r.cfg.HandshakeTimeout,
		ZMQ:     r.cfg.ZMQ,
	})
	if err != nil {
		if r.ctx.Err() != nil {
			return ErrClosed
		}
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
	// The reader's lists are closed forms; the descriptors are made below.
	rl := reader.RemoteList()
	if rl.Len() > r.cfg.MaxDescriptors {
		return fmt.Errorf("the prefill advertises %d regions of %d blocks: %d descriptors, more than the %d this decode prepares for a peer (MaxDescriptors)",
			len(remote.BaseAddrs), remote.NumBlocks, rl.Len(), r.cfg.MaxDescriptors)
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
	localDL, err := r.localList(reader)
	if err != nil {
		return err
	}
	name, err := r.cfg.Agent.LoadRemote(md.AgentMetadata)
	if err != nil {
		return fmt.Errorf("load remote agent metadata: %w", err)
	}
	remoteDL, err := r.cfg.Agent.PrepRemote(name, r.cfg.Cache.Kind, xferDescs(&rl))
	if err != nil {
		if rerr := r.cfg.Agent.RemoveRemote(name); rerr != nil {
			r.log.Warn("removing remote agent after a failed handshake", "agent", name, "err", rerr)
		}
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
		LocalDescs: localDL.Len(), RemoteDescs: remoteDL.Len(), Reorder: reorder,
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
		Kind:          planner.MemKind(kind),
	}, nil
}

// localList returns the local prepared list for a block-size ratio,
// preparing it the first time (the reference's src_xfer_side_handles).
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
	notif := []byte(vllm.ReadNotif(p.RemoteRequestID, pr.reader.TPRatio()))

	r.scratchMu.Lock()
	lids, rids, notifyOnly, err := pr.reader.AppendRead(r.lids[:0], r.rids[:0], l.req.LocalBlockIDs, remote)
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
	op := &readOp{load: l, peer: pr, descs: len(lids)}
	if !r.hasTelem {
		for _, id := range lids {
			op.bytes += pr.localLens[int(id)/pr.localBlocks]
		}
	}
	x, err := r.cfg.Agent.MakePreppedXfer(abi.Read, pr.localDL, lids, pr.remoteDL, rids, notif)
	r.scratchMu.Unlock()
	if err != nil {
		r.fail(l, fmt.Errorf("%w: make: %w", ErrTransfer, err), true)
		return
	}
	op.x = x
	op.posted = time.Now()
	done, err := x.Post()
	op.post = time.Since(op.posted)
	if err != nil {
		r.failOp(op, fmt.Errorf("%w: post: %w", ErrTransfer, err))
		return
	}
	if done {
		r.complete(op)
		return
	}
	r.mu.Lock()
	r.pending = append(r.pending, op)
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// poll completes posted READs, backing off while none progresses. On Close
// it cancels the ones still running.
func (r *Receiver) poll() {
	defer r.wg.Done()
	var active []*readOp
	sleep := newBackoff(pollMinSleep, pollMaxSleep)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		r.mu.Lock()
		active = append(active, r.pending...)
		clear(r.pending)
		r.pending = r.pending[:0]
		r.mu.Unlock()
		if r.ctx.Err() != nil {
			for _, op := range active {
				r.failOp(op, ErrClosed)
			}
			return
		}
		if len(active) == 0 {
			sleep.reset()
			select {
			case <-r.wake:
			case <-r.ctx.Done():
			}
			continue
		}
		progressed := false
		now := time.Now()
		kept := active[:0]
		for _, op := range active {
			done, err := op.x.Poll()
			switch {
			case err != nil:
				r.failOp(op, fmt.Errorf("%w: %w", ErrTransfer, err))
			case done:
				r.complete(op)
			case r.cfg.ReadTimeout > 0 && now.Sub(op.posted) > r.cfg.ReadTimeout:
				r.failOp(op, fmt.Errorf("%w after %v", ErrReadTimeout, r.cfg.ReadTimeout))
			default:
				kept = append(kept, op)
				continue
			}
			progressed = true
		}
		clear(active[len(kept):])
		active = kept
		t.Reset(sleep.after(progressed))
		select {
		case <-r.wake:
			sleep.reset()
		case <-t.C:
		case <-r.ctx.Done():
		}
	}
}

// complete finishes a READ that completed.
func (r *Receiver) complete(op *readOp) {
	stat := TransferStat{Xfer: time.Since(op.posted), Post: op.post, Bytes: op.bytes, Descs: uint64(op.descs)}
	if r.hasTelem {
		if t, err := op.x.Telemetry(); err == nil {
			stat = TransferStat{Xfer: t.Xfer, Post: t.Post, Bytes: t.Bytes, Descs: t.Descs}
		} else {
			r.log.Warn("no telemetry for a completed READ", "request_id", op.load.req.RequestID, "err", err)
		}
	}
	if err := op.x.Close(); err != nil {
		r.log.Warn("releasing a completed READ", "request_id", op.load.req.RequestID, "err", err)
	}
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

// failOp releases a READ that failed (or is abandoned) and fails its load.
func (r *Receiver) failOp(op *readOp, err error) {
	if cerr := op.x.Close(); cerr != nil {
		r.log.Warn("releasing a failed READ", "request_id", op.load.req.RequestID, "err", cerr)
	}
	r.fail(op.load, err, !errors.Is(err, ErrClosed))
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
	res.RequestID = l.req.RequestID
	res.Latency = time.Since(l.start)
	l.res = res
	r.pendingLoads.Add(-1)
	close(l.done)
}

// Pending returns the loads started and not finished yet (waiting for a
// handshake or reading): a gauge for metrics.
func (r *Receiver) Pending() int { return int(r.pendingLoads.Load()) }

// BlockIDsWithLoadErrors returns, sorted, and forgets the local blocks
// that failed to load since the last call (the reference's
// get_block_ids_with_load_errors).
func (r *Receiver) BlockIDsWithLoadErrors() []int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := slices.Sorted(maps.Keys(r.invalid))
	clear(r.invalid)
	return out
}

// TakeStats returns the statistics recorded since the last call and
// resets them (the reference's get_kv_connector_stats).
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

// releasePeer releases a peer's remote list and remote agent. The local
// list is shared and released by Close.
func (r *Receiver) releasePeer(pr *peer) {
	if pr.remoteDL != nil {
		if err := pr.remoteDL.Close(); err != nil {
			r.log.Warn("releasing a remote descriptor list", "remote_engine_id", pr.engineID, "err", err)
		}
		pr.remoteDL = nil
	}
	if pr.name != "" {
		if err := r.cfg.Agent.RemoveRemote(pr.name); err != nil {
			r.log.Warn("removing a remote agent", "agent", pr.name, "err", err)
		}
		pr.name = ""
	}
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
	r.wg.Wait() // the poller released its READs, handshakes failed their waiters
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
	return errors.Join(errs...)
}
