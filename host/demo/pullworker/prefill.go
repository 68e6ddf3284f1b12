package pullworker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/demo/synth"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
)

// PrefillConfig configures a prefill worker: one engine, all of its TP
// ranks in this process (a vLLM engine allocates the same blocks on every
// rank and serves all ranks' handshakes from one side channel).
type PrefillConfig struct {
	Plugin *plugin.Plugin
	// AgentParams are every rank's agent parameters; the host's defaults
	// for the side that is read from (pull.SenderSide) complete them.
	AgentParams []plugin.Param
	Model       Model
	Engine      Engine
	EngineID    string
	// SideChannel is the handshake endpoint, tcp://host:port (port 0: any).
	SideChannel string
	// AdvertiseHost is the remote_host told to decodes ("" : SideChannel's).
	AdvertiseHost string
	// APIAddr is the HTTP API's host:port (port 0: any).
	APIAddr      string
	AbortTimeout time.Duration // 0: pull.DefaultAbortTimeout
	// MemKind is the kind every KV region registers as (vLLM: VRAM, or
	// DRAM with a host buffer). The synthetic caches are host memory.
	MemKind abi.MemKind
	// Workload, when Requests > 0, is the request stream to expect: other
	// requests are refused, and Wait returns once each was released.
	Workload Workload
	// BlockWait bounds how long a request waits for free blocks before the
	// API answers 503; 0 means 30 s.
	BlockWait time.Duration
	Logger    *slog.Logger
	Observer  pull.Observer
	// Report, when set, gets one JSON line per released request
	// (ReleaseReport), as it is released.
	Report io.Writer
	// OnReady, when set, is called once, when the side channel and the API
	// listen, before StartPrefill returns.
	OnReady func()
	// MeasureCPU says the worker is alone in its process (the kvhost prefill
	// command): its summary's CPU then reports the process's threads over
	// the requests phase (from ready until Wait returns).
	MeasureCPU bool
}

// ReleaseReport is one line of PrefillConfig.Report.
type ReleaseReport struct {
	RequestID string `json:"request_id"`
	// Released is "notified" (every decode reader notified), "expired"
	// (the abort timeout passed first) or "aborted".
	Released      string  `json:"released"`
	Notifications int     `json:"notifications"`
	HeldMs        float64 `json:"held_ms"`
}

// PrefillSummary is the prefill worker's report.
type PrefillSummary struct {
	Role     string `json:"role"`  // "prefill"
	Style    string `json:"style"` // "vllm"
	EngineID string `json:"engine_id"`
	TPSize   int    `json:"tp_size"`
	// ExpectedRequests is the workload size (0: serving any request).
	ExpectedRequests int `json:"expected_requests"`
	RequestsServed   int `json:"requests_served"`
	ReleasedNotified int `json:"released_notified"`
	ReleasedExpired  int `json:"released_expired"`
	// ExpiredRequests are the (proxy) request ids released on expiry.
	ExpiredRequests        []string `json:"expired_requests,omitempty"`
	StillHeld              int      `json:"still_held"`
	UnknownNotifications   int      `json:"unknown_notifications"`
	MalformedNotifications int      `json:"malformed_notifications"`
	// FilledBytes is the KV written over all ranks.
	FilledBytes     uint64  `json:"filled_bytes"`
	Seconds         float64 `json:"seconds"`
	API             string  `json:"api"`
	SideChannelPort int     `json:"side_channel_port"`
	// Done is true when every expected request was released.
	Done bool `json:"done"`
	// CPU is what this process's threads did over the requests phase
	// (schedstat: run time and time waiting for a core), set by the kvhost
	// prefill command, where the worker is alone in its process; nil when
	// not measured.
	CPU *schedstat.Usage `json:"cpu,omitempty"`
}

// Prefill is a running prefill worker.
type Prefill struct {
	cfg    PrefillConfig
	log    *slog.Logger
	agents []*plugin.Agent
	pools  []*kvpool.Pool
	sender *pull.Sender
	alloc  *synth.Allocator
	report *synth.Lines // ReleaseReport lines
	ln     net.Listener
	srv    *http.Server
	start  time.Time
	cpu    *schedstat.Window // MeasureCPU's, from ready (nil: not measured)
	// tokenBytes is KV bytes per token over all ranks.
	tokenBytes uint64
	expected   map[string]int // proxy id -> tokens; nil when serving anything

	mu         sync.Mutex
	reqs       map[string]*prefillReq // by proxy request id
	byPrefill  map[string]string      // prefill request id -> proxy id
	served     int
	notified   int
	expired    []string
	releasedOf int // expected requests released
	filled     uint64
	allDone    chan struct{}
	closeOnce  sync.Once
}

type prefillReq struct {
	ready    chan struct{} // closed once params or err is set
	params   pull.KVTransferParams
	status   int // HTTP status of err
	err      error
	released pull.ReleaseReason
}

// StartPrefill sets up the engine's ranks (agent, synthetic KV cache), the
// pull Sender and the HTTP API, and returns once both listen.
func StartPrefill(cfg PrefillConfig) (_ *Prefill, err error) {
	if err := cfg.Model.Validate(); err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	if err := cfg.Engine.Validate(); err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	if cfg.Workload.Requests > 0 {
		if err := cfg.Workload.Validate(); err != nil {
			return nil, fmt.Errorf("prefill: %w", err)
		}
	}
	if cfg.EngineID == "" {
		return nil, errors.New("prefill: engine id is empty")
	}
	if cfg.BlockWait <= 0 {
		cfg.BlockWait = 30 * time.Second
	}
	p := &Prefill{
		cfg:       cfg,
		log:       cfg.Logger,
		alloc:     synth.NewAllocator(cfg.Engine.NumBlocks, cfg.Workload.Seed),
		reqs:      make(map[string]*prefillReq),
		byPrefill: make(map[string]string),
		allDone:   make(chan struct{}),
		start:     time.Now(),
	}
	if p.log == nil {
		p.log = slog.Default()
	}
	p.log = p.log.With("role", "prefill", "engine_id", cfg.EngineID)
	p.report = synth.NewLines(cfg.Report, p.log)
	if cfg.Workload.Requests > 0 {
		p.expected = make(map[string]int)
		for _, r := range cfg.Workload.Generate() {
			p.expected[r.ID] = r.Tokens
		}
	}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	ranks, err := p.setupRanks()
	if err != nil {
		return nil, err
	}
	p.sender, err = pull.NewSender(pull.SenderConfig{
		EngineID:      cfg.EngineID,
		TPSize:        cfg.Engine.TPSize,
		Ranks:         ranks,
		CompatHash:    cfg.Model.CompatHash(),
		Listen:        cfg.SideChannel,
		AdvertiseHost: cfg.AdvertiseHost,
		AbortTimeout:  cfg.AbortTimeout,
		OnRelease:     p.onRelease,
		Logger:        p.log,
		Observer:      cfg.Observer,
	})
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	p.ln, err = net.Listen("tcp", cfg.APIAddr)
	if err != nil {
		return nil, fmt.Errorf("prefill: API: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc(PrefillPath, p.handlePrefill)
	mux.HandleFunc(HealthPath, func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "OK") })
	mux.HandleFunc(SummaryPath, func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, p.Summary()) })
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := p.srv.Serve(p.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			p.log.Error("API server stopped", "err", err)
		}
	}()
	p.log.Info("prefill worker ready", "api", p.ln.Addr().String(), "side_channel", p.sender.Endpoint(),
		"tp_size", cfg.Engine.TPSize, "block_size", cfg.Engine.BlockSize, "num_blocks", cfg.Engine.NumBlocks,
		"layout", cfg.Engine.Layout, "expected_requests", len(p.expected))
	if cfg.MeasureCPU {
		p.cpu = schedstat.Begin(0)
	}
	if cfg.OnReady != nil {
		cfg.OnReady()
	}
	return p, nil
}

// agentName makes a name unique across processes and runs, as vLLM's
// uuid4 agent names are.
func agentName(engineID string, rank int) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-tp%d-%d-%s", engineID, rank, os.Getpid(), hex.EncodeToString(b[:]))
}

func (p *Prefill) setupRanks() ([]pull.SenderRank, error) {
	var ranks []pull.SenderRank
	for rank := 0; rank < p.cfg.Engine.TPSize; rank++ {
		g := geometry(p.cfg.Model, p.cfg.Engine, rank)
		pool, err := kvpool.New(g)
		if err != nil {
			return nil, fmt.Errorf("prefill: TP rank %d pool: %w", rank, err)
		}
		p.pools = append(p.pools, pool)
		p.tokenBytes += uint64(g.NumRegions()) * g.ItemLen() / uint64(g.PageSize)
		a, err := p.cfg.Plugin.NewAgent(agentName(p.cfg.EngineID, rank), p.cfg.Plugin.ForSide(pull.SenderSide, p.cfg.AgentParams)...)
		if err != nil {
			return nil, fmt.Errorf("prefill: TP rank %d agent: %w", rank, err)
		}
		p.agents = append(p.agents, a)
		ranks = append(ranks, pull.SenderRank{TPRank: rank, Agent: a, Cache: cacheOf(pool, p.cfg.Engine, p.cfg.MemKind)})
	}
	return ranks, nil
}

// APIAddr is the HTTP API's address.
func (p *Prefill) APIAddr() string { return p.ln.Addr().String() }

// SideChannelPort is the handshake port.
func (p *Prefill) SideChannelPort() int { return p.sender.Port() }

func (p *Prefill) handlePrefill(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		writeError(w, http.StatusMethodNotAllowed, "use POST")
		return
	}
	var req PrefillRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "request body: %v", err)
		return
	}
	capacity := p.cfg.Engine.NumBlocks * p.cfg.Engine.BlockSize
	switch {
	case !req.KVTransferParams.DoRemoteDecode:
		writeError(w, http.StatusBadRequest, "kv_transfer_params.do_remote_decode must be true: this worker only prefills for a remote decode")
		return
	case req.RequestID == "":
		writeError(w, http.StatusBadRequest, "request_id is empty")
		return
	case req.NumTokens <= 0 || req.NumTokens > capacity:
		writeError(w, http.StatusBadRequest, "num_tokens %d outside [1, %d] (the cache's capacity)", req.NumTokens, capacity)
		return
	}
	if p.expected != nil {
		tokens, ok := p.expected[req.RequestID]
		if !ok {
			writeError(w, http.StatusBadRequest, "request %s is not in this worker's workload (seed %d, %d requests): do both workers use the same workload flags?",
				req.RequestID, p.cfg.Workload.Seed, p.cfg.Workload.Requests)
			return
		}
		if tokens != req.NumTokens {
			writeError(w, http.StatusBadRequest, "request %s has %d tokens in this worker's workload, not %d: do both workers use the same workload flags?",
				req.RequestID, tokens, req.NumTokens)
			return
		}
	}
	p.mu.Lock()
	e, seen := p.reqs[req.RequestID]
	if !seen {
		e = &prefillReq{ready: make(chan struct{})}
		p.reqs[req.RequestID] = e
	}
	p.mu.Unlock()
	if !seen {
		// Several decode processes of one engine ask for the same request:
		// the first prefills, the others get the same params.
		p.prefillOne(r.Context(), e, req.RequestID, req.NumTokens)
		close(e.ready)
	} else {
		select {
		case <-e.ready:
		case <-r.Context().Done():
			return
		}
	}
	p.mu.Lock()
	released, status, err := e.released, e.status, e.err
	p.mu.Unlock()
	switch {
	case err != nil:
		writeError(w, status, "%v", err)
	case released != "":
		writeError(w, http.StatusGone, "request %s was already released (%s)", req.RequestID, released)
	default:
		writeJSON(w, http.StatusOK, PrefillResponse{RequestID: req.RequestID, KVTransferParams: e.params})
	}
}

// prefillOne allocates, fills and holds one request's blocks.
func (p *Prefill) prefillOne(ctx context.Context, e *prefillReq, id string, tokens int) {
	fail := func(status int, err error) {
		p.mu.Lock()
		e.status, e.err = status, err
		delete(p.reqs, id) // a later call may try again
		p.mu.Unlock()
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.BlockWait)
	defer cancel()
	n := (tokens + p.cfg.Engine.BlockSize - 1) / p.cfg.Engine.BlockSize
	blocks, err := p.alloc.Get(ctx, n)
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	t := kvpool.Tokens{Request: KVSeed(id), Pages: blocks, Count: tokens}
	for rank, pool := range p.pools {
		if err := pool.Fill(t); err != nil {
			p.alloc.Put(blocks)
			fail(http.StatusInternalServerError, fmt.Errorf("fill TP rank %d: %w", rank, err))
			return
		}
	}
	prefillID := "prefill-" + id
	p.mu.Lock()
	p.byPrefill[prefillID] = id
	p.mu.Unlock()
	params, err := p.sender.Hold(prefillID, blocks)
	if err != nil {
		p.mu.Lock()
		delete(p.byPrefill, prefillID)
		p.mu.Unlock()
		p.alloc.Put(blocks)
		fail(http.StatusInternalServerError, err)
		return
	}
	p.mu.Lock()
	e.params = params
	p.served++
	p.filled += uint64(tokens) * p.tokenBytes
	p.mu.Unlock()
}

func (p *Prefill) onRelease(rel pull.Release) {
	p.alloc.Put(rel.BlockIDs)
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.byPrefill[rel.RequestID]
	if !ok {
		p.log.Error("released a request this worker does not know", "request_id", rel.RequestID)
		return
	}
	delete(p.byPrefill, rel.RequestID)
	switch rel.Reason {
	case pull.ReleaseNotified:
		p.notified++
	case pull.ReleaseExpired:
		p.expired = append(p.expired, id)
	}
	p.report.Write(ReleaseReport{RequestID: id, Released: string(rel.Reason), Notifications: rel.Notified,
		HeldMs: float64(rel.Held.Microseconds()) / 1e3})
	if e := p.reqs[id]; e != nil {
		e.released = rel.Reason
		if p.expected == nil {
			delete(p.reqs, id) // serving forever: keep nothing
		}
	}
	if _, ok := p.expected[id]; ok {
		p.releasedOf++
		if p.releasedOf == len(p.expected) {
			close(p.allDone)
		}
	}
}

// Summary returns the worker's report so far.
func (p *Prefill) Summary() PrefillSummary {
	c := p.sender.Counts()
	p.mu.Lock()
	defer p.mu.Unlock()
	s := PrefillSummary{
		Role: "prefill", Style: "vllm", EngineID: p.cfg.EngineID, TPSize: p.cfg.Engine.TPSize,
		ExpectedRequests: len(p.expected), RequestsServed: p.served,
		ReleasedNotified: p.notified, ReleasedExpired: len(p.expired), ExpiredRequests: sortedCopy(p.expired),
		StillHeld: c.Held, UnknownNotifications: c.UnknownNotifications, MalformedNotifications: c.MalformedNotifications,
		FilledBytes: p.filled, Seconds: time.Since(p.start).Seconds(), API: p.ln.Addr().String(),
		SideChannelPort: p.sender.Port(),
	}
	s.Done = p.expected != nil && p.releasedOf == len(p.expected)
	return s
}

// Wait returns the summary once every expected request was released, or
// when ctx ends (serving without a workload, only then); with MeasureCPU,
// its CPU is the process's threads from ready until now.
func (p *Prefill) Wait(ctx context.Context) PrefillSummary {
	if p.expected != nil {
		select {
		case <-p.allDone:
		case <-ctx.Done():
		}
	} else {
		<-ctx.Done()
	}
	s := p.Summary()
	s.CPU = p.cpu.Measure(p.log)
	return s
}

// Close stops the API and the Sender and releases agents and caches.
func (p *Prefill) Close() error {
	var errs []error
	p.closeOnce.Do(func() {
		if p.srv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if err := p.srv.Shutdown(ctx); err != nil {
				p.srv.Close()
			}
			cancel()
		} else if p.ln != nil {
			p.ln.Close()
		}
		if p.sender != nil {
			errs = append(errs, p.sender.Close())
		}
		for _, a := range p.agents {
			errs = append(errs, a.Close())
		}
		for _, pool := range p.pools {
			errs = append(errs, pool.Close())
		}
	})
	return errors.Join(errs...)
}
