package serve

// The vLLM (pull) side of the sidecar: docs/engine-api.md's "Ranks" vLLM
// fields, "vLLM pull requests" and "Lifecycle".
//
// A vLLM engine runs one worker process per TP rank and a scheduler that
// owns no KV (vLLM's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py:
// NixlConnectorScheduler and NixlConnectorWorker). So the prefill side is
// an engine group: the prefill ranks of one engine_id, opened from any
// connections, share one pull.Sender, which serves the single handshake
// side channel of the engine once all tp_size ranks are open. The
// scheduler's request_finished becomes hold, its abort release; the
// workers' get_finished learns finished_sending from the released events.
// A decode rank is one pull.Receiver on its own agent; the worker's
// start_load_kv becomes read, and get_finished (finished_recving) and
// get_block_ids_with_load_errors learn from the read events.
//
// Scoping: a connection names at most one vLLM engine id (bound by its
// first vLLM open_rank or hold that succeeds). Holds are scoped to the
// engine: any connection bound to the engine may release them; a
// connection bound to another engine sees them as unknown. A connection
// that has not named an engine may name any (the scheduler owns no rank);
// the socket's mode (0600) is what keeps other users out, as the doc's
// Transport says.

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// Release reasons of the released event.
const (
	vllmReleasedNotified = "notified"
	vllmReleasedTimeout  = "timeout"
	vllmReleasedAborted  = "aborted"
	vllmReleasedClosed   = "closed"
)

// vllmMaxHolds bounds the requests one engine holds at once. vLLM holds a
// finished request per decode that has not read it yet; a scheduler past
// this many is leaking requests.
const vllmMaxHolds = 1 << 16

// vllmMaxReads bounds the reads in flight on one decode rank.
const vllmMaxReads = 1 << 14

// vllmEvent is one event of the vLLM ops (docs/engine-api.md: released,
// read, engine_ready).
type vllmEvent struct {
	Kind string // "released", "read", "engine_ready"

	EngineID  string // released, engine_ready
	RequestID string // released, read
	Reason    string // released; read when !OK
	Endpoint  string // engine_ready

	// read
	Rank          uint64
	OK            bool
	InvalidBlocks []int32
	Bytes         uint64
	Seconds       float64
}

// vllmConn is a control connection as the vLLM ops see it. Connections
// are compared by identity.
type vllmConn interface {
	// vllmEmit queues one event on the connection, after everything
	// queued on it before. It must not block; a closed connection drops it.
	vllmEmit(ev vllmEvent)
}

// vllmError is a refusal with its docs/engine-api.md error code.
type vllmError struct {
	Code string
	Msg  string
}

func (e *vllmError) Error() string { return e.Code + ": " + e.Msg }

func vllmErrf(code, format string, args ...any) error {
	return &vllmError{Code: code, Msg: fmt.Sprintf(format, args...)}
}

// vllmConfig is what the sidecar gives the vLLM ops.
type vllmConfig struct {
	Logger *slog.Logger
	// AbortTimeout is the hold timeout when open_rank gives none
	// (pull.AbortTimeoutFromEnv: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
	AbortTimeout time.Duration
	// HandshakeTimeout and ReadTimeout of decode ranks (0: pull's
	// defaults; a READ then waits forever, as vLLM's).
	HandshakeTimeout time.Duration
	ReadTimeout      time.Duration
	// Transport of side channels and handshakes; nil: ZMQ.
	Transport pull.Transport
	Clock     clock.Clock
	Observer  pull.Observer
}

// vllmHub holds the sidecar's vLLM engine groups and the engine each
// connection is bound to.
type vllmHub struct {
	cfg vllmConfig
	log *slog.Logger

	mu      sync.Mutex
	engines map[string]*vllmEngine
	bound   map[vllmConn]string
	// watched are the connections whose close calls connClosed.
	watched map[vllmConn]bool
}

func newVLLMHub(cfg vllmConfig) *vllmHub {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.AbortTimeout <= 0 {
		cfg.AbortTimeout = pull.DefaultAbortTimeout
	}
	return &vllmHub{
		cfg:     cfg,
		log:     cfg.Logger.With("component", "serve_vllm"),
		engines: make(map[string]*vllmEngine),
		bound:   make(map[vllmConn]string),
		watched: make(map[vllmConn]bool),
	}
}

// checkBindLocked refuses an engine id c may not name: c is bound to
// another one. It binds nothing: bindLocked does, once the request that
// names id succeeded, so a refused request leaves c as it was.
func (h *vllmHub) checkBindLocked(c vllmConn, id string) error {
	if id == "" {
		return vllmErrf("bad_request", "engine_id: empty")
	}
	if b, ok := h.bound[c]; ok && b != id {
		return vllmErrf("unknown", "engine %q: this connection belongs to engine %q (one engine per connection)", id, b)
	}
	return nil
}

// bindLocked binds c to engine id (checked by checkBindLocked).
func (h *vllmHub) bindLocked(c vllmConn, id string) { h.bound[c] = id }

// vllmEngine is one prefill engine's group.
type vllmEngine struct {
	id string
	// fixed by the first rank; later ranks must agree
	tpSize     int
	compatHash string
	wire       *vllm.Generation // the connector generation it speaks
	attn       string
	sideHost   string
	sidePort   int
	abort      time.Duration
	lease      time.Duration

	ranks    map[int]*vllmPrefillRank
	sender   *pull.Sender
	gen      uint64 // of sender: one more per Sender opened
	endpoint string // tcp://host:port while sender is open
	holds    map[string]*vllmHold
}

// vllmHold is one request an engine holds.
type vllmHold struct {
	holder vllmConn
	sender *pull.Sender
	gen    uint64 // the engine's gen when held
	// reason, when set, overrides the Sender's (release: aborted;
	// holder closed: closed).
	reason string
}

// vllmPrefillSpec is a prefill rank's open_rank fields.
type vllmPrefillSpec struct {
	EngineID     string
	TPSize       int
	TPRank       int
	CompatHash   string
	Gen          *vllm.Generation // the engine's connector generation (nil: 2)
	AttnBackend  string           // attn_backend_name, advertised from version 6
	Lease        time.Duration    // kv_lease_duration (0: vllm.DefaultLease), with leases
	SideHost     string
	SidePort     int
	AbortTimeout time.Duration // 0: the sidecar's
}

// vllmPrefillRank is one open prefill rank of a group.
type vllmPrefillRank struct {
	hub    *vllmHub
	conn   vllmConn
	engine string
	tpRank int
	agent  *plugin.Agent
	cache  pull.Cache
	left   bool
}

// joinPrefill adds a prefill rank to its engine's group, starting the
// group's Sender (side channel) when it completes. It returns the side
// channel's endpoint, or "" while ranks are missing. The caller owns the
// agent and the memory and must call leave before releasing either.
func (h *vllmHub) joinPrefill(c vllmConn, spec vllmPrefillSpec, agent *plugin.Agent, cache pull.Cache) (*vllmPrefillRank, string, error) {
	if spec.TPSize <= 0 || spec.TPSize > 1<<16 {
		return nil, "", vllmErrf("bad_request", "tp_size: %d is not a TP size", spec.TPSize)
	}
	if spec.TPRank < 0 || spec.TPRank >= spec.TPSize {
		return nil, "", vllmErrf("bad_request", "tp_rank: %d outside [0, %d)", spec.TPRank, spec.TPSize)
	}
	if spec.SidePort < 0 || spec.SidePort > 65535 {
		return nil, "", vllmErrf("bad_request", "side_channel_port: %d is not a TCP port", spec.SidePort)
	}
	if spec.SideHost == "" {
		return nil, "", vllmErrf("bad_request", "side_channel_host: a prefill rank needs the host decodes connect to")
	}
	if spec.AbortTimeout < 0 {
		return nil, "", vllmErrf("bad_request", "abort_timeout: negative")
	}
	if spec.AbortTimeout == 0 {
		spec.AbortTimeout = h.cfg.AbortTimeout
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.checkBindLocked(c, spec.EngineID); err != nil {
		return nil, "", err
	}
	e := h.engines[spec.EngineID]
	if e == nil {
		e = &vllmEngine{
			id:         spec.EngineID,
			tpSize:     spec.TPSize,
			compatHash: spec.CompatHash,
			wire:       vllm.Or(spec.Gen),
			attn:       spec.AttnBackend,
			sideHost:   spec.SideHost,
			sidePort:   spec.SidePort,
			abort:      spec.AbortTimeout,
			lease:      spec.Lease,
			ranks:      make(map[int]*vllmPrefillRank),
			holds:      make(map[string]*vllmHold),
		}
	} else {
		switch {
		case e.tpSize != spec.TPSize:
			return nil, "", vllmErrf("bad_request", "tp_size: %d, but engine %q's open ranks say %d", spec.TPSize, e.id, e.tpSize)
		case e.compatHash != spec.CompatHash:
			return nil, "", vllmErrf("bad_request", "compat: the compatibility hash differs from engine %q's open ranks'", e.id)
		case e.sideHost != spec.SideHost || e.sidePort != spec.SidePort:
			return nil, "", vllmErrf("bad_request", "side_channel_host/side_channel_port: %s, but engine %q's open ranks say %s",
				net.JoinHostPort(spec.SideHost, strconv.Itoa(spec.SidePort)), e.id, net.JoinHostPort(e.sideHost, strconv.Itoa(e.sidePort)))
		case e.abort != spec.AbortTimeout:
			return nil, "", vllmErrf("bad_request", "abort_timeout: %v, but engine %q's open ranks say %v", spec.AbortTimeout, e.id, e.abort)
		case e.lease != spec.Lease:
			return nil, "", vllmErrf("bad_request", "kv_lease_duration: %v, but engine %q's open ranks say %v", spec.Lease, e.id, e.lease)
		}
		if _, ok := e.ranks[spec.TPRank]; ok {
			return nil, "", vllmErrf("exists", "engine %q: TP rank %d is already open", e.id, spec.TPRank)
		}
	}
	r := &vllmPrefillRank{hub: h, conn: c, engine: e.id, tpRank: spec.TPRank, agent: agent, cache: cache}
	e.ranks[spec.TPRank] = r
	h.engines[e.id] = e
	if len(e.ranks) == e.tpSize {
		if err := h.startSenderLocked(e); err != nil {
			delete(e.ranks, spec.TPRank)
			if len(e.ranks) == 0 {
				delete(h.engines, e.id)
			}
			return nil, "", err
		}
	}
	h.bindLocked(c, e.id)
	return r, e.endpoint, nil
}

// startSenderLocked opens the complete group's Sender and tells every
// connection of the group.
func (h *vllmHub) startSenderLocked(e *vllmEngine) error {
	ranks := make([]pull.SenderRank, 0, len(e.ranks))
	for _, tp := range slices.Sorted(mapsKeys(e.ranks)) {
		r := e.ranks[tp]
		ranks = append(ranks, pull.SenderRank{TPRank: tp, Agent: r.agent, Cache: r.cache})
	}
	e.gen++
	gen := e.gen
	s, err := pull.NewSender(pull.SenderConfig{
		EngineID:        e.id,
		TPSize:          e.tpSize,
		Ranks:           ranks,
		CompatHash:      e.compatHash,
		Listen:          "tcp://" + net.JoinHostPort(e.sideHost, strconv.Itoa(e.sidePort)),
		AdvertiseHost:   e.sideHost,
		AbortTimeout:    e.abort,
		Gen:             e.wire,
		Lease:           e.lease,
		AttnBackendName: e.attn,
		OnRelease:       func(rel pull.Release) { h.onRelease(e, gen, rel) },
		Logger:          h.cfg.Logger,
		Observer:        h.cfg.Observer,
		Transport:       h.cfg.Transport,
		Clock:           h.cfg.Clock,
	})
	if err != nil {
		return vllmErrf("backend", "engine %q: side channel: %v", e.id, err)
	}
	e.sender = s
	e.endpoint = "tcp://" + net.JoinHostPort(s.Host(), strconv.Itoa(s.Port()))
	h.log.Info("vLLM prefill engine ready", "engine_id", e.id, "tp_size", e.tpSize, "side_channel", e.endpoint,
		"nixl_connector_version", e.wire.Version)
	for _, c := range e.connsLocked(nil) {
		c.vllmEmit(vllmEvent{Kind: "engine_ready", EngineID: e.id, Endpoint: e.endpoint})
	}
	return nil
}

func mapsKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// connsLocked returns the connections with a rank of e, and extra when
// it is not nil, each once, in TP rank order.
func (e *vllmEngine) connsLocked(extra vllmConn) []vllmConn {
	var out []vllmConn
	for _, tp := range slices.Sorted(mapsKeys(e.ranks)) {
		if c := e.ranks[tp].conn; !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	if extra != nil && !slices.Contains(out, extra) {
		out = append(out, extra)
	}
	return out
}

// leave takes the rank out of its group. An open Sender closes (its side
// channel serves every rank's metadata, and this rank's agent is about to
// go): every request it held is released with "closed". The group keeps
// its other ranks; it opens again when the missing ranks are opened.
// Calling leave again is a no-op.
func (r *vllmPrefillRank) leave() error {
	h := r.hub
	h.mu.Lock()
	if r.left {
		h.mu.Unlock()
		return nil
	}
	r.left = true
	e := h.engines[r.engine]
	if e == nil || e.ranks[r.tpRank] != r {
		h.mu.Unlock()
		return nil
	}
	s := e.sender
	if s != nil {
		// Tell first (this rank's connection too, while it still has a
		// rank of the engine), then close.
		for _, id := range slices.Sorted(mapsKeys(e.holds)) {
			hd := e.holds[id]
			for _, c := range e.connsLocked(hd.holder) {
				c.vllmEmit(vllmEvent{Kind: "released", EngineID: e.id, RequestID: id, Reason: vllmReleasedClosed})
			}
		}
		clear(e.holds)
		e.sender = nil
		e.endpoint = ""
		h.log.Info("vLLM prefill engine closed: a rank left", "engine_id", e.id, "tp_rank", r.tpRank)
	}
	delete(e.ranks, r.tpRank)
	if len(e.ranks) == 0 {
		delete(h.engines, e.id)
	}
	h.mu.Unlock()
	if s != nil {
		// Outside h.mu: Close waits for the Sender's goroutine, which may
		// be waiting for h.mu in onRelease.
		return s.Close()
	}
	return nil
}

// hold is the scheduler's request_finished: hold blockIDs of requestID
// for decode readers and return vLLM's kv_transfer_params and the
// generation the engine speaks (their shape).
func (h *vllmHub) hold(c vllmConn, engineID, requestID string, blockIDs []int32) (pull.KVTransferParams, *vllm.Generation, error) {
	if requestID == "" {
		return pull.KVTransferParams{}, nil, vllmErrf("bad_request", "request_id: empty")
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.checkBindLocked(c, engineID); err != nil {
		return pull.KVTransferParams{}, nil, err
	}
	e := h.engines[engineID]
	switch {
	case e == nil:
		return pull.KVTransferParams{}, nil, vllmErrf("unknown", "engine %q has no prefill rank on this sidecar", engineID)
	case e.sender == nil:
		return pull.KVTransferParams{}, nil, vllmErrf("out_of_order", "engine %q: %d of its %d TP ranks are open; hold after engine_ready", engineID, len(e.ranks), e.tpSize)
	case e.holds[requestID] != nil:
		return pull.KVTransferParams{}, nil, vllmErrf("exists", "engine %q already holds request %q", engineID, requestID)
	case len(e.holds) >= vllmMaxHolds:
		return pull.KVTransferParams{}, nil, vllmErrf("limit", "engine %q holds %d requests already", engineID, len(e.holds))
	}
	// Sender.Hold takes only the Sender's lock, which is never held while
	// its OnRelease waits for h.mu.
	p, err := e.sender.Hold(requestID, blockIDs)
	if err != nil {
		return pull.KVTransferParams{}, nil, vllmErrf("bad_request", "block_ids: %v", err)
	}
	if len(blockIDs) > 0 {
		e.holds[requestID] = &vllmHold{holder: c, sender: e.sender, gen: e.gen}
	}
	h.bindLocked(c, engineID)
	return p, e.wire, nil
}

// release is the scheduler's abort of a held request (vLLM's
// reqs_not_processed): the blocks are freed at once, "aborted".
func (h *vllmHub) release(c vllmConn, engineID, requestID string) error {
	h.mu.Lock()
	if err := h.checkBindLocked(c, engineID); err != nil {
		h.mu.Unlock()
		return err
	}
	e := h.engines[engineID]
	var hd *vllmHold
	if e != nil {
		hd = e.holds[requestID]
	}
	if hd == nil || hd.reason != "" {
		h.mu.Unlock()
		return vllmErrf("unknown", "engine %q holds no request %q", engineID, requestID)
	}
	hd.reason = vllmReleasedAborted
	s := hd.sender
	h.mu.Unlock()
	h.abort(e, s, requestID, hd)
	return nil
}

// abort releases a hold marked with its reason: Sender.Abort calls
// onRelease, which reports it. When the Sender released it meanwhile,
// onRelease already reported it; when the Sender was closed, leave did.
func (h *vllmHub) abort(e *vllmEngine, s *pull.Sender, requestID string, hd *vllmHold) {
	if s.Abort(requestID) {
		return
	}
	// The Sender no longer held it: onRelease has run or leave reported
	// it, unless the hold is still ours (cannot happen: a held request is
	// in the Sender until onRelease). Drop it defensively.
	h.mu.Lock()
	if e.holds[requestID] == hd {
		delete(e.holds, requestID)
		for _, c := range e.connsLocked(hd.holder) {
			c.vllmEmit(vllmEvent{Kind: "released", EngineID: e.id, RequestID: requestID, Reason: hd.reason})
		}
	}
	h.mu.Unlock()
}

// onRelease is a Sender's OnRelease: report the release to every
// connection with a rank of the engine and to the holder.
func (h *vllmHub) onRelease(e *vllmEngine, gen uint64, rel pull.Release) {
	h.mu.Lock()
	defer h.mu.Unlock()
	hd := e.holds[rel.RequestID]
	if hd == nil || hd.gen != gen {
		return
	}
	delete(e.holds, rel.RequestID)
	reason := hd.reason
	if reason == "" {
		switch rel.Reason {
		case pull.ReleaseNotified:
			reason = vllmReleasedNotified
		case pull.ReleaseExpired:
			reason = vllmReleasedTimeout
		default:
			reason = vllmReleasedAborted
		}
	}
	for _, c := range e.connsLocked(hd.holder) {
		c.vllmEmit(vllmEvent{Kind: "released", EngineID: e.id, RequestID: rel.RequestID, Reason: reason})
	}
}

// connClosed releases the holds c made ("closed") and unbinds it. The
// connection's ranks are closed by their own leave/close.
func (h *vllmHub) connClosed(c vllmConn) {
	type pending struct {
		e  *vllmEngine
		s  *pull.Sender
		id string
		hd *vllmHold
	}
	var todo []pending
	h.mu.Lock()
	delete(h.bound, c)
	delete(h.watched, c)
	for _, e := range h.engines {
		for id, hd := range e.holds {
			if hd.holder == c && hd.reason == "" {
				hd.reason = vllmReleasedClosed
				todo = append(todo, pending{e, hd.sender, id, hd})
			}
		}
	}
	h.mu.Unlock()
	for _, p := range todo {
		h.abort(p.e, p.s, p.id, p.hd)
	}
}

// close releases every group (the sidecar stops): every hold is released
// "closed" and every Sender closed.
func (h *vllmHub) close() error {
	h.mu.Lock()
	var ranks []*vllmPrefillRank
	for _, e := range h.engines {
		for _, r := range e.ranks {
			ranks = append(ranks, r)
		}
	}
	h.mu.Unlock()
	var errs []error
	for _, r := range ranks {
		errs = append(errs, r.leave())
	}
	return errors.Join(errs...)
}

// vllmDecodeSpec is a decode rank's open_rank fields beyond the cache.
type vllmDecodeSpec struct {
	EngineID     string
	TPSize       int
	TPRank       int
	CompatHash   string
	Gen          *vllm.Generation // nil: version 2
	Lease        time.Duration    // the prefill's lease, for heartbeats (0: vllm.DefaultLease)
	MLA          bool
	BlocksFirst  bool
	TotalKVHeads int
	BlockWindows []int
}

// vllmDecodeRank is one decode rank: a pull.Receiver on the rank's agent.
type vllmDecodeRank struct {
	hub  *vllmHub
	conn vllmConn
	id   uint64 // the rank id events carry
	rcv  *pull.Receiver
	gen  *vllm.Generation

	mu     sync.Mutex
	reads  map[string]struct{}
	closed bool
	// why is the reason of the reads close fails ("rank closed",
	// "engine disconnected").
	why string
	wg  sync.WaitGroup
}

// openDecode binds c to the engine and starts the rank's Receiver, which
// registers cache on agent. close undoes it; the caller owns both.
func (h *vllmHub) openDecode(c vllmConn, rankID uint64, spec vllmDecodeSpec, agent *plugin.Agent, cache pull.Cache) (*vllmDecodeRank, error) {
	if spec.TPSize <= 0 || spec.TPSize > 1<<16 {
		return nil, vllmErrf("bad_request", "tp_size: %d is not a TP size", spec.TPSize)
	}
	if spec.TPRank < 0 || spec.TPRank >= spec.TPSize {
		return nil, vllmErrf("bad_request", "tp_rank: %d outside [0, %d)", spec.TPRank, spec.TPSize)
	}
	h.mu.Lock()
	err := h.checkBindLocked(c, spec.EngineID)
	h.mu.Unlock()
	if err != nil {
		return nil, err
	}
	rcv, err := pull.NewReceiver(pull.ReceiverConfig{
		EngineID:         spec.EngineID,
		TPRank:           spec.TPRank,
		TPSize:           spec.TPSize,
		Agent:            agent,
		Cache:            cache,
		MLA:              spec.MLA,
		BlocksFirst:      spec.BlocksFirst,
		TotalKVHeads:     spec.TotalKVHeads,
		BlockWindows:     spec.BlockWindows,
		CompatHash:       spec.CompatHash,
		Gen:              spec.Gen,
		Lease:            spec.Lease,
		HandshakeTimeout: h.cfg.HandshakeTimeout,
		ReadTimeout:      h.cfg.ReadTimeout,
		Logger:           h.cfg.Logger,
		Observer:         h.cfg.Observer,
		Transport:        h.cfg.Transport,
		Clock:            h.cfg.Clock,
	})
	if err != nil {
		return nil, vllmErrf("geometry", "%v", err)
	}
	// The connection's requests run one at a time (the session), so no
	// other request of c bound it meanwhile.
	h.mu.Lock()
	h.bindLocked(c, spec.EngineID)
	h.mu.Unlock()
	return &vllmDecodeRank{hub: h, conn: c, id: rankID, rcv: rcv, gen: vllm.Or(spec.Gen), reads: make(map[string]struct{})}, nil
}

// read is the worker's start_load_kv for one request: it starts the pull
// and reports it with a read event. paramsErr, when set, is why the
// kv_transfer_params could not be read: the read then fails with it (all
// blocks invalid), as vLLM refuses to pull with invalid params.
func (d *vllmDecodeRank) read(requestID string, params pull.KVTransferParams, paramsErr error, blockIDs []int32) error {
	if requestID == "" {
		return vllmErrf("bad_request", "request_id: empty")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	switch _, dup := d.reads[requestID]; {
	case d.closed:
		return vllmErrf("unknown", "rank %d is closed", d.id)
	case dup:
		return vllmErrf("exists", "rank %d is already reading request %q", d.id, requestID)
	case len(d.reads) >= vllmMaxReads:
		return vllmErrf("limit", "rank %d has %d reads in flight", d.id, len(d.reads))
	}
	d.reads[requestID] = struct{}{}
	blocks := slices.Clone(blockIDs)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		var res pull.LoadResult
		if paramsErr != nil {
			res = pull.LoadResult{RequestID: requestID, Err: fmt.Errorf("%w: %v", pull.ErrInvalidParams, paramsErr), InvalidBlocks: blocks}
		} else {
			res = d.rcv.Load(pull.LoadRequest{RequestID: requestID, LocalBlockIDs: blocks, Params: params}).Result()
		}
		// The Receiver remembers failed blocks for its own
		// BlockIDsWithLoadErrors; every read event carries its own, so
		// forget them (the set is bounded by the blocks anyway).
		if res.Err != nil {
			d.rcv.BlockIDsWithLoadErrors()
		}
		ev := vllmEvent{Kind: "read", Rank: d.id, RequestID: requestID, OK: res.Err == nil, InvalidBlocks: res.InvalidBlocks,
			Bytes: res.Stat.Bytes, Seconds: res.Latency.Seconds()}
		if res.Err != nil {
			ev.Reason = res.Err.Error()
			if errors.Is(res.Err, pull.ErrClosed) {
				d.mu.Lock()
				if d.why != "" {
					ev.Reason = d.why
				}
				d.mu.Unlock()
			}
			if len(ev.InvalidBlocks) == 0 {
				ev.InvalidBlocks = blocks
			}
		}
		d.mu.Lock()
		delete(d.reads, requestID)
		d.conn.vllmEmit(ev)
		d.mu.Unlock()
	}()
	return nil
}

// close fails the reads in flight (their read events say why), waits
// for their events and releases the Receiver (everything it registered
// and loaded on the agent). Calling it again is a no-op.
func (d *vllmDecodeRank) close(why string) error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.why = why
	d.mu.Unlock()
	err := d.rcv.Close()
	d.wg.Wait()
	return err
}
