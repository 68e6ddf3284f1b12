package pull

import (
	"container/heap"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/ratelog"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// DefaultAbortTimeout is how long a prefill holds a request's blocks for
// decode readers that never notify (VLLM_NIXL_ABORT_REQUEST_TIMEOUT's
// default, 480 s).
const DefaultAbortTimeout = 480 * time.Second

// EnvAbortTimeout is vLLM's variable for the abort timeout, in seconds.
const EnvAbortTimeout = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"

// AbortTimeoutFromEnv returns the abort timeout from EnvAbortTimeout
// (seconds, integer or decimal), or DefaultAbortTimeout when it is unset.
func AbortTimeoutFromEnv() (time.Duration, error) {
	v, ok := os.LookupEnv(EnvAbortTimeout)
	if !ok || v == "" {
		return DefaultAbortTimeout, nil
	}
	return ParseSeconds(EnvAbortTimeout, v)
}

// ParseSeconds parses a positive number of seconds, as vLLM's timeout
// variables are given; name is used in the error.
func ParseSeconds(name, v string) (time.Duration, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || f <= 0 || f > 1e9 {
		return 0, fmt.Errorf("%s=%q: want a positive number of seconds", name, v)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// SenderRank is one TP rank of the prefill engine: its agent and KV cache.
type SenderRank struct {
	TPRank int
	Agent  *plugin.Agent
	Cache  Cache
}

// SenderConfig configures a Sender.
type SenderConfig struct {
	// EngineID is this prefill engine's id (remote_engine_id for decodes).
	EngineID string
	// TPSize is the engine's TP size (kv_transfer_params tp_size).
	TPSize int
	// Ranks are the TP ranks this process hosts. The side channel serves
	// their handshakes; requests are released once every one of them is.
	// A vLLM engine allocates the same block ids on all its ranks, so one
	// process normally hosts all of them.
	Ranks []SenderRank
	// CompatHash is this engine's compatibility hash (vllm.CompatibilityHash).
	CompatHash string
	// Listen is the side channel's ZeroMQ endpoint, tcp://host:port (port 0
	// picks a free one; vLLM uses VLLM_NIXL_SIDE_CHANNEL_HOST:PORT).
	Listen string
	// AdvertiseHost is the remote_host decodes connect to; empty means the
	// host of Listen, which must then be a concrete address.
	AdvertiseHost string
	// AbortTimeout is how long blocks stay held without every notification
	// in a generation without leases; 0 means DefaultAbortTimeout. The
	// Sender reads no environment: pass AbortTimeoutFromEnv() to honour
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT.
	AbortTimeout time.Duration
	// Gen is the engine's connector generation (nil: version 2): the
	// handshake and metadata it serves, the notifications it counts, and
	// whether holds are leases.
	Gen *vllm.Generation
	// Lease is a hold's initial lease in a generation with leases
	// (kv_lease_duration; 0 means vllm.DefaultLease). A decode's heartbeat
	// naming a held request extends it to at least now + Lease*2//3.
	Lease time.Duration
	// AttnBackendName is the attention backend the metadata advertises
	// (version 6: attn_backend_name; the compat factor of the same name).
	AttnBackendName string
	// OnRelease is called exactly once per held request when the Sender
	// stops holding it (from the Sender's goroutine; do not block in it).
	OnRelease func(Release)
	Logger    *slog.Logger // nil: slog.Default()
	Observer  Observer     // nil: NopObserver
	// ZMQ options for the side-channel socket (of the default Transport).
	ZMQ []ZMQOption
	// Transport serves the side channel; nil means ZMQ{Options: ZMQ}.
	Transport Transport
	// Clock times holds and the abort timeout; nil means the wall clock.
	Clock clock.Clock
}

// ReleaseReason says why a prefill freed a request's blocks.
type ReleaseReason string

// Release reasons.
const (
	// ReleaseNotified: every decode rank reading the request notified.
	ReleaseNotified ReleaseReason = "notified"
	// ReleaseExpired: the abort timeout or the lease passed first.
	ReleaseExpired ReleaseReason = "expired"
	// ReleaseAborted: the caller aborted the request (Abort).
	ReleaseAborted ReleaseReason = "aborted"
)

// Release is one request the Sender stopped holding.
type Release struct {
	RequestID string
	// BlockIDs are the blocks given to Hold; the caller may reuse them now.
	BlockIDs []int32
	Reason   ReleaseReason
	// Notified counts the notifications received for it, over all ranks.
	Notified int
	// Held is how long the request was held.
	Held time.Duration
}

// SenderCounts are a Sender's running totals.
type SenderCounts struct {
	Held             int `json:"held"` // held now
	ReleasedNotified int `json:"released_notified"`
	ReleasedExpired  int `json:"released_expired"`
	Aborted          int `json:"aborted"`
	// Notifications counts every notification received.
	Notifications int `json:"notifications"`
	// UnknownNotifications named no held request (or were surplus).
	UnknownNotifications int `json:"unknown_notifications"`
	// Of those naming no held request, EarlyKept were kept for a hold to
	// come (see early.go), EarlyApplied then counted by their hold and
	// EarlyExpired dropped unused when their time passed.
	EarlyKept    int `json:"early_kept"`
	EarlyApplied int `json:"early_applied"`
	EarlyExpired int `json:"early_expired"`
	// MalformedNotifications were not "{request_id}:{count}" (nor a
	// heartbeat, in a generation with leases).
	MalformedNotifications int `json:"malformed_notifications"`
	// Heartbeats counts the heartbeats received; Renewed the held
	// requests whose lease one of them extended.
	Heartbeats int `json:"heartbeats"`
	Renewed    int `json:"renewed"`
}

// Sender is the prefill side of the pull model. It is safe for concurrent
// use.
type Sender struct {
	cfg    SenderConfig
	log    *slog.Logger    // rate-limited: peers can trigger its lines
	rlog   *ratelog.Logger // log's limiter, flushed by Close
	obs    Observer
	ranks  []senderRank
	server HandshakeListener
	clock  clock.Clock // nil: the wall clock (see now)
	host   string
	port   int

	gen    *vllm.Generation
	start  time.Time // the origin of the clock a version-6 reply carries
	hold   time.Duration
	extend time.Duration // a heartbeat's extension (leases)

	mu       sync.Mutex
	held     map[string]*heldReq
	expiries expiryHeap // one entry per held request, by deadline; stale entries skipped
	seq      uint64
	counts   SenderCounts
	closed   bool

	// Notifications for requests not held yet (early.go).
	early         map[string]*earlyReq
	earlyExpiries expiryHeap // one entry per early request
	earlyBytes    int
	earlyMax      int // MaxEarlyRequests (tests lower the bounds)
	earlyMaxBytes int // maxEarlyBytes

	stop    chan struct{}
	done    chan struct{}
	runWake chan struct{} // a request was held: run watches expiries
	unsubs  []func()      // the ranks' notification subscriptions
}

type senderRank struct {
	tpRank  int
	agent   *plugin.Agent
	regions []*plugin.Region
}

type heldReq struct {
	seq       uint64
	blocks    []int32
	since     time.Time
	deadline  time.Time     // heartbeats move it later
	perRank   []rankReaders // by hosted rank (index into Sender.ranks)
	ranksDone int
	notified  int
	// done: every rank was notified before the hold (early.go); the
	// Sender's goroutine releases it, as Hold's caller may hold locks
	// OnRelease takes.
	done bool
}

// rankReaders are the agents that notified one hosted rank of one request,
// each with the tp_ratio it claimed. Each agent counts once; a rank is
// done when, for some tp_ratio k, k distinct agents claimed k. So one
// agent, whatever it sends, can neither fill another claim's readers nor
// make the real readers' notifications surplus.
type rankReaders struct {
	claims map[string]int // agent name -> tp_ratio it claimed
	done   bool
}

// MaxNotifiers bounds the distinct agents counted per request and hosted
// rank (and so the tp_ratio a notification may claim): a rank is read by
// tp_ratio decode ranks, and no TP size comes near it. Notifications from
// further agents are surplus.
const MaxNotifiers = 256

func newHeldReq(seq uint64, blocks []int32, since time.Time, ranks int) *heldReq {
	return &heldReq{seq: seq, blocks: blocks, since: since, perRank: make([]rankReaders, ranks)}
}

type expiry struct {
	id  string
	seq uint64
	at  time.Time
}

// expiryHeap is a min-heap of expiries by time. A heartbeat does not
// push: the entry popped at the old deadline is pushed again at the new
// one, so the heap holds one entry per held request whatever peers send.
type expiryHeap []expiry

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(expiry)) }
func (h *expiryHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// senderExpiryPeriod is how often (wall clock) the Sender's goroutine
// looks for expired requests while it holds any; holding none it sleeps.
const senderExpiryPeriod = 2 * time.Millisecond

// NewSender registers every rank's KV cache, publishes the handshake
// payloads on the side channel and starts watching notifications and
// expiries. Close undoes all of it.
func NewSender(cfg SenderConfig) (_ *Sender, err error) {
	if err := checkSenderConfig(&cfg); err != nil {
		return nil, err
	}
	s := &Sender{
		cfg:           cfg,
		gen:           vllm.Or(cfg.Gen),
		clock:         cfg.Clock,
		log:           cfg.Logger,
		obs:           cfg.Observer,
		held:          make(map[string]*heldReq),
		early:         make(map[string]*earlyReq),
		earlyMax:      MaxEarlyRequests,
		earlyMaxBytes: maxEarlyBytes,
		stop:          make(chan struct{}),
		done:          make(chan struct{}),
		runWake:       make(chan struct{}, 1),
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.rlog = ratelog.New(s.log)
	s.log = s.rlog.With("component", "pull_sender", "engine_id", cfg.EngineID)
	if s.obs == nil {
		s.obs = NopObserver{}
	}
	s.start = s.now()
	s.hold = cfg.AbortTimeout
	if s.gen.Lease {
		s.hold = cfg.Lease
		_, s.extend = vllm.LeaseTimes(cfg.Lease)
	}
	defer func() {
		if err != nil {
			s.deregister()
		}
	}()
	payloads := make(map[int][]byte, len(cfg.Ranks))
	for _, r := range cfg.Ranks {
		regs, err := register(r.Agent, &r.Cache)
		if err != nil {
			return nil, err
		}
		s.ranks = append(s.ranks, senderRank{tpRank: r.TPRank, agent: r.Agent, regions: regs})
		blob, err := r.Agent.LocalMetadata()
		if err != nil {
			return nil, fmt.Errorf("pull: agent metadata of TP rank %d: %w", r.TPRank, err)
		}
		md := metadataOf(cfg.EngineID, blob, &r.Cache)
		md.AttnBackendName = cfg.AttnBackendName
		payloads[r.TPRank] = s.gen.NewHandshakePayload(cfg.CompatHash, md).Encode()
	}
	svc := HandshakeService{Gen: s.gen, Payloads: payloads, Clock: func() float64 { return s.now().Sub(s.start).Seconds() }}
	s.server, err = transportOr(cfg.Transport, cfg.ZMQ).ListenHandshake(cfg.Listen, svc, s.log)
	if err != nil {
		return nil, fmt.Errorf("pull: side channel: %w", err)
	}
	s.port = s.server.Port()
	s.host = cfg.AdvertiseHost
	if s.host == "" {
		s.host = endpointHost(s.server.Endpoint())
	}
	s.log.Info("serving vLLM handshakes", "endpoint", s.server.Endpoint(), "advertise", net.JoinHostPort(s.host, strconv.Itoa(s.port)),
		"tp_ranks", len(s.ranks), "nixl_connector_version", s.gen.Version, "hold", s.hold, "lease", s.gen.Lease)
	// Every rank's notifications come from its agent's completion engine.
	for i := range s.ranks {
		unsub, err := s.ranks[i].agent.Engine().Subscribe(func(ns []plugin.Notif) { s.applyNotifs(i, ns) })
		if err != nil {
			s.unsubscribe()
			s.server.Close()
			return nil, fmt.Errorf("pull: notifications of TP rank %d: %w", s.ranks[i].tpRank, err)
		}
		s.unsubs = append(s.unsubs, unsub)
	}
	go s.run()
	return s, nil
}

func (s *Sender) unsubscribe() {
	for _, u := range s.unsubs {
		u()
	}
	s.unsubs = nil
}

func checkSenderConfig(c *SenderConfig) error {
	if c.EngineID == "" {
		return errors.New("pull: sender needs an engine id")
	}
	if c.TPSize <= 0 {
		return fmt.Errorf("pull: sender TP size %d must be positive", c.TPSize)
	}
	if len(c.Ranks) == 0 {
		return errors.New("pull: sender hosts no TP rank")
	}
	seen := map[int]bool{}
	for _, r := range c.Ranks {
		if r.TPRank < 0 || r.TPRank >= c.TPSize {
			return fmt.Errorf("pull: sender TP rank %d outside [0, %d)", r.TPRank, c.TPSize)
		}
		if seen[r.TPRank] {
			return fmt.Errorf("pull: sender TP rank %d given twice", r.TPRank)
		}
		seen[r.TPRank] = true
		if r.Agent == nil {
			return fmt.Errorf("pull: sender TP rank %d has no agent", r.TPRank)
		}
		if r.Agent.Caps()&abi.CapNotif == 0 {
			return fmt.Errorf("pull: agent %s of TP rank %d has no notifications (plugin %s): a prefill could free blocks only on expiry",
				r.Agent.Name(), r.TPRank, r.Agent.Plugin().Name())
		}
		if err := r.Cache.check(); err != nil {
			return fmt.Errorf("TP rank %d: %w", r.TPRank, err)
		}
	}
	if c.Listen == "" {
		return errors.New("pull: sender needs a side-channel endpoint to listen on")
	}
	if c.AdvertiseHost == "" {
		switch h := endpointHost(c.Listen); h {
		case "", "*", "0.0.0.0", "::":
			return fmt.Errorf("pull: side channel %s listens on every address: set the host decodes should connect to", c.Listen)
		}
	}
	if c.AbortTimeout < 0 {
		return fmt.Errorf("pull: abort timeout %v is negative", c.AbortTimeout)
	}
	if c.AbortTimeout == 0 {
		c.AbortTimeout = DefaultAbortTimeout
	}
	if c.Lease < 0 {
		return fmt.Errorf("pull: lease %v is negative", c.Lease)
	}
	if c.Lease == 0 {
		c.Lease = vllm.DefaultLease
	}
	return nil
}

// endpointHost returns the host of tcp://host:port ("" if unparsable).
func endpointHost(ep string) string {
	host, _, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		return ""
	}
	return host
}

// metadataOf builds vLLM's NixlAgentMetadata of one rank (no Mamba
// state, logical blocks the kernel's).
func metadataOf(engineID string, blob []byte, c *Cache) *vllm.AgentMetadata {
	md := &vllm.AgentMetadata{
		EngineID:                 engineID,
		AgentMetadata:            blob,
		DeviceID:                 int(c.DeviceID),
		NumBlocks:                c.NumBlocks,
		KVCacheLayout:            c.Layout,
		BlockSize:                c.BlockSize,
		PhysicalBlocksPerLogical: 1,
		DCPSize:                  1,
		PCPSize:                  1,
	}
	for i, l := range c.blockLens() {
		md.KVCachesBaseAddr = append(md.KVCachesBaseAddr, c.Regions[i].Addr)
		md.BlockLens = append(md.BlockLens, int(l))
	}
	md.BlockStrides = slices.Clone(md.BlockLens) // blocks back to back
	// Version 11's per-region fields, as register_kv_caches fills them for
	// one KV cache group: the engine's layer names where it gave them,
	// else each region named by its index.
	names := c.Names
	if len(names) != len(md.KVCachesBaseAddr) {
		names = make([]string, len(md.KVCachesBaseAddr))
		for i := range names {
			names[i] = fmt.Sprintf("kvhost.region.%d", i)
		}
	}
	md.UniformRegions(names, c.Kind.String())
	return md
}

// Endpoint is the side channel's bound endpoint.
func (s *Sender) Endpoint() string { return s.server.Endpoint() }

// Host and Port are what decodes are told (remote_host, remote_port).
func (s *Sender) Host() string { return s.host }

// Port is the side channel's port (remote_port).
func (s *Sender) Port() int { return s.port }

// Hold starts holding a finished request's blocks for the decode ranks
// that will read them (vLLM's kv_connector/v1/nixl_connector.py's request_finished with delayed
// free) and returns the kv_transfer_params to hand the decode. The request
// is released (OnRelease) when every hosted rank got all its consumers'
// notifications, when the abort timeout expires, or on Abort. An empty
// blockIDs holds nothing and returns params without blocks, as the
// reference does.
func (s *Sender) Hold(requestID string, blockIDs []int32) (KVTransferParams, error) {
	p := s.params(requestID, blockIDs)
	if requestID == "" {
		return KVTransferParams{}, errors.New("pull: hold: empty request id")
	}
	for i, b := range blockIDs {
		for _, r := range s.cfg.Ranks {
			if b < 0 || int(b) >= r.Cache.NumBlocks {
				return KVTransferParams{}, fmt.Errorf("pull: hold %s: block_ids[%d] = %d outside [0, %d)", requestID, i, b, r.Cache.NumBlocks)
			}
		}
	}
	if len(blockIDs) == 0 {
		return p, nil
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return KVTransferParams{}, fmt.Errorf("pull: hold %s: %w", requestID, plugin.ErrClosed)
	}
	if _, ok := s.held[requestID]; ok {
		return KVTransferParams{}, fmt.Errorf("pull: hold %s: request already held", requestID)
	}
	s.seq++
	h := newHeldReq(s.seq, p.RemoteBlockIDs, now, len(s.ranks))
	h.deadline = now.Add(s.hold)
	s.held[requestID] = h
	at := h.deadline
	if s.takeEarlyLocked(requestID, h) {
		// Every reader notified before the hold: release it now, from
		// the Sender's goroutine (expire).
		h.done = true
		at = now
	}
	heap.Push(&s.expiries, expiry{id: requestID, seq: s.seq, at: at})
	s.counts.Held++
	s.wakeLocked()
	return p, nil
}

// wakeLocked tells run that there are deadlines to watch.
func (s *Sender) wakeLocked() {
	select {
	case s.runWake <- struct{}{}:
	default:
	}
}

// Params returns the kv_transfer_params of a request held now.
func (s *Sender) Params(requestID string) (KVTransferParams, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	h, ok := s.held[requestID]
	if !ok {
		return KVTransferParams{}, false
	}
	return s.params(requestID, h.blocks), true
}

// params is what decode needs to read a request's blocks from this
// prefill; it holds a copy of blockIDs.
func (s *Sender) params(requestID string, blockIDs []int32) KVTransferParams {
	return KVTransferParams{
		DoRemotePrefill: true,
		RemoteBlockIDs:  append([]int32(nil), blockIDs...),
		RemoteEngineID:  s.cfg.EngineID,
		RemoteRequestID: requestID,
		RemoteHost:      s.host,
		RemotePort:      s.port,
		TPSize:          s.cfg.TPSize,
	}
}

// Abort stops holding a request at once (vLLM's kv_connector/v1/nixl_connector.py's
// reqs_not_processed) and releases it with ReleaseAborted. It reports
// whether the request was held.
func (s *Sender) Abort(requestID string) bool {
	s.mu.Lock()
	h, ok := s.held[requestID]
	var rel Release
	if ok {
		rel = s.releaseLocked(requestID, h, ReleaseAborted, s.now())
	}
	s.mu.Unlock()
	if ok {
		s.deliver([]Release{rel})
	}
	return ok
}

// Counts returns the running totals.
func (s *Sender) Counts() SenderCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts
}

// now reads the Sender's clock.
func (s *Sender) now() time.Time { return clock.Or(s.clock).Now() }

// run expires requests until Close: every senderExpiryPeriod while any is
// held, asleep while none is. While it holds requests it tells the ranks'
// completion engines that notifications are expected, so engines without
// an event descriptor poll for them adaptively (see plugin.Engine.Expect).
func (s *Sender) run() {
	defer close(s.done)
	expecting := false
	expect := func(on bool) {
		if on == expecting {
			return
		}
		expecting = on
		d := -1
		if on {
			d = 1
		}
		for i := range s.ranks {
			s.ranks[i].agent.Engine().Expect(d)
		}
	}
	defer expect(false)
	// Expiry is timed on s.clock; the period is wall clock.
	t := clock.Real{}.NewTimer(time.Hour)
	defer t.Stop()
	for {
		s.expire(s.now())
		s.mu.Lock()
		held := len(s.held) > 0
		early := len(s.early) > 0
		s.mu.Unlock()
		expect(held)
		var tick <-chan time.Time
		if held || early {
			t.Reset(senderExpiryPeriod)
			tick = t.C()
		}
		select {
		case <-s.stop:
			return
		case <-s.runWake:
		case <-tick:
		}
	}
}

// applyNotifs applies notifications hosted rank i received (the rank's
// completion engine calls it).
func (s *Sender) applyNotifs(i int, notifs []plugin.Notif) {
	var rels []Release
	now := s.now()
	s.mu.Lock()
	for _, n := range notifs {
		if rel, ok := s.applyLocked(i, n, now); ok {
			rels = append(rels, rel)
		}
	}
	s.mu.Unlock()
	s.deliver(rels)
}

// applyLocked counts one notification received by hosted rank i. A
// request's notifications on a rank count once per sending agent (the
// name the plugin reports: on NIXL the sender's own claim, on the fake
// plugin checked against the sending process), and the rank is done when
// as many distinct agents as a tp_ratio claimed it (see rankReaders and the
// package doc for what a peer can still do).
func (s *Sender) applyLocked(i int, n plugin.Notif, now time.Time) (Release, bool) {
	s.counts.Notifications++
	if s.gen.Lease {
		if ids, ok, err := vllm.ParseHeartbeat(n.Msg); ok {
			s.heartbeatLocked(i, n, ids, err, now)
			return Release{}, false
		}
	}
	id, count, err := vllm.ParseReadNotif(n.Msg)
	consumers := s.gen.Consumers(count, s.cfg.TPSize)
	if err == nil && consumers > MaxNotifiers {
		err = fmt.Errorf("the count %d asks for %d readers, more than the %d a rank counts", count, consumers, MaxNotifiers)
	}
	if err != nil {
		s.counts.MalformedNotifications++
		s.log.Warn("ignoring a malformed notification", "tp_rank", s.ranks[i].tpRank, "from", n.From, "err", err)
		s.obs.BadNotification(NotifMalformed)
		return Release{}, false
	}
	h, ok := s.held[id]
	if !ok {
		s.counts.UnknownNotifications++
		if kept, why := s.keepEarlyLocked(i, n, id, consumers, now); !kept {
			s.log.Error("potentially invalid KV blocks for an unrecognized request were read by a decode worker; they may have expired",
				"request_id", id, "tp_rank", s.ranks[i].tpRank, "from", n.From, "not_kept", why)
			s.obs.BadNotification(NotifUnknown)
		}
		return Release{}, false
	}
	why, done := s.countLocked(i, n.From, consumers, h)
	if why != "" {
		s.counts.UnknownNotifications++
		s.log.Warn("surplus notification for a held request", "request_id", id, "tp_rank", s.ranks[i].tpRank,
			"from", n.From, "consumers", consumers, "why", why)
		s.obs.BadNotification(NotifUnknown)
		return Release{}, false
	}
	if !done {
		return Release{}, false
	}
	return s.releaseLocked(id, h, ReleaseNotified, now), true
}

// countLocked counts a notification of hosted rank i from agent from,
// claiming consumers readers, for held request h. why says why it did
// not count (surplus); done reports whether every hosted rank is now done.
func (s *Sender) countLocked(i int, from string, consumers int, h *heldReq) (why string, done bool) {
	rr := &h.perRank[i]
	switch _, dup := rr.claims[from]; {
	case rr.done:
		return "rank already notified by its readers", false
	case dup:
		return "agent already notified this request", false
	case len(rr.claims) >= MaxNotifiers:
		return "too many notifying agents", false
	}
	if rr.claims == nil {
		rr.claims = make(map[string]int, consumers)
	}
	rr.claims[from] = consumers
	h.notified++
	same := 0
	for _, c := range rr.claims {
		if c == consumers {
			same++
		}
	}
	if same < consumers {
		return "", false
	}
	rr.done = true
	rr.claims = nil
	h.ranksDone++
	return "", h.ranksDone == len(s.ranks)
}

// heartbeatLocked applies a heartbeat hosted rank i received (vLLM's
// _handle_heartbeat): every held request it names has its deadline moved
// to at least now + the extension. Unknown ids are ignored, as vLLM does
// (a decode keeps heartbeating requests the prefill released).
func (s *Sender) heartbeatLocked(i int, n plugin.Notif, ids []string, err error, now time.Time) {
	if err != nil {
		s.counts.MalformedNotifications++
		s.log.Warn("ignoring a malformed heartbeat", "tp_rank", s.ranks[i].tpRank, "from", n.From, "err", err)
		s.obs.BadNotification(NotifMalformed)
		return
	}
	s.counts.Heartbeats++
	at := now.Add(s.extend)
	for _, id := range ids {
		if h, ok := s.held[id]; ok && at.After(h.deadline) {
			h.deadline = at
			s.counts.Renewed++
		}
	}
}

// expire releases every request whose deadline (abort timeout or lease)
// passed. An entry whose request's deadline moved is pushed again at it.
func (s *Sender) expire(now time.Time) {
	var rels []Release
	s.mu.Lock()
	for len(s.expiries) > 0 && !now.Before(s.expiries[0].at) {
		e := heap.Pop(&s.expiries).(expiry)
		h, ok := s.held[e.id]
		switch {
		case !ok || h.seq != e.seq:
		case h.done:
			rels = append(rels, s.releaseLocked(e.id, h, ReleaseNotified, now))
		case now.Before(h.deadline):
			heap.Push(&s.expiries, expiry{id: e.id, seq: e.seq, at: h.deadline})
		default:
			rels = append(rels, s.releaseLocked(e.id, h, ReleaseExpired, now))
		}
	}
	s.expireEarlyLocked(now)
	s.mu.Unlock()
	s.deliver(rels)
}

func (s *Sender) releaseLocked(id string, h *heldReq, why ReleaseReason, now time.Time) Release {
	delete(s.held, id)
	s.counts.Held--
	switch why {
	case ReleaseNotified:
		s.counts.ReleasedNotified++
	case ReleaseExpired:
		s.counts.ReleasedExpired++
	case ReleaseAborted:
		s.counts.Aborted++
	}
	return Release{RequestID: id, BlockIDs: h.blocks, Reason: why, Notified: h.notified, Held: now.Sub(h.since)}
}

// deliver logs releases and hands them to the observer and OnRelease,
// outside the lock.
func (s *Sender) deliver(rels []Release) {
	for _, r := range rels {
		switch r.Reason {
		case ReleaseExpired:
			s.log.Warn("releasing expired KV blocks: not every decode reader notified before the hold expired",
				"request_id", r.RequestID, "notifications", r.Notified, "held", r.Held, "lease", s.gen.Lease)
		default:
			s.log.Debug("releasing KV blocks", "request_id", r.RequestID, "reason", r.Reason,
				"notifications", r.Notified, "held", r.Held)
		}
		s.obs.Released(r)
		if s.cfg.OnRelease != nil {
			s.cfg.OnRelease(r)
		}
	}
}

// Close stops serving handshakes and watching notifications, and
// deregisters the KV caches. Requests still held are dropped without
// OnRelease. Calling Close again is a no-op.
func (s *Sender) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	close(s.stop)
	<-s.done
	s.unsubscribe()
	err := s.server.Close()
	s.rlog.Close()
	return errors.Join(err, s.deregister())
}

func (s *Sender) deregister() error {
	var errs []error
	for _, r := range s.ranks {
		if err := r.agent.Deregister(r.regions...); err != nil {
			errs = append(errs, fmt.Errorf("pull: deregister TP rank %d: %w", r.tpRank, err))
		}
	}
	s.ranks = nil
	return errors.Join(errs...)
}
