package pullworker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/demo/synth"
	"github.com/kvhost/kvhost/host/internal/quantile"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/internal/span"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
)

// DecodeConfig configures a decode worker: some or all TP ranks of one
// decode engine. Several processes may serve one engine (disjoint Ranks,
// same EngineID and workload); each allocates its own blocks.
type DecodeConfig struct {
	Plugin *plugin.Plugin
	// AgentParams are every rank's agent parameters; the host's defaults
	// for the side that reads (pull.ReceiverSide) complete them.
	AgentParams []plugin.Param
	Model       Model
	Engine      Engine
	// Ranks are the TP ranks this process hosts; nil means all.
	Ranks    []int
	EngineID string
	// PrefillURL is the prefill worker's API, e.g. http://127.0.0.1:8100.
	PrefillURL string
	Workload   Workload
	// Concurrency is how many requests are in flight at once (0: 16).
	Concurrency      int
	HandshakeTimeout time.Duration // 0: vLLM's 5 s
	ReadTimeout      time.Duration // 0: none
	// MemKind is the kind every KV region registers as.
	MemKind abi.MemKind
	// ConnectTimeout bounds the wait for the prefill API to come up and
	// each request's prefill call (0: 60 s); a prefill that stops answering
	// is given up after at most 5 s of it.
	ConnectTimeout  time.Duration
	SkipCompatCheck bool
	Logger          *slog.Logger
	Observer        pull.Observer
	// Progress, when set, is called after each request with the number
	// finished so far.
	Progress func(done, total int)
	// Report, when set, gets one JSON line per request (RequestReport), as
	// it finishes.
	Report io.Writer
	// OnReady, when set, is called once, when every rank is set up (agent,
	// registered cache, receiver), before the worker waits for the prefill
	// and starts the workload.
	OnReady func()
	// MeasureCPU says the worker is alone in its process (the kvhost decode
	// command): its summary's CPU then reports the process's threads over
	// the workload (its requests' prefill calls, READs and checks).
	MeasureCPU bool
}

// RequestReport is one line of DecodeConfig.Report.
type RequestReport struct {
	RequestID string  `json:"request_id"`
	OK        bool    `json:"ok"`
	Error     string  `json:"error,omitempty"`
	Tokens    int     `json:"tokens"`
	PrefixHit string  `json:"prefix_hit"` // none, partial or full
	Ms        float64 `json:"ms"`
}

// FailedRequest is one request that did not verify.
type FailedRequest struct {
	ID    string `json:"id"`
	Error string `json:"error"`
}

// Percentiles of a latency, in milliseconds.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// RankPeers lists one rank's handshakes.
type RankPeers struct {
	TPRank int             `json:"tp_rank"`
	Peers  []pull.PeerInfo `json:"peers"`
}

// DecodeSummary is the decode worker's report.
type DecodeSummary struct {
	Role     string `json:"role"`  // "decode"
	Style    string `json:"style"` // "vllm"
	EngineID string `json:"engine_id"`
	TPSize   int    `json:"tp_size"`
	Ranks    []int  `json:"ranks"`
	Requests int    `json:"requests"`
	// OK requests had every byte of every token verified on every rank.
	OK             int             `json:"ok"`
	Failed         int             `json:"failed"`
	FailedRequests []FailedRequest `json:"failed_requests,omitempty"`
	PartialHits    int             `json:"partial_prefix_hits"`
	FullHits       int             `json:"full_prefix_hits"`
	// Reads are completed READs over all ranks; NotifyOnly loads sent only
	// the notification.
	Reads      int `json:"reads"`
	NotifyOnly int `json:"notify_only"`
	// Bytes were read; VerifiedBytes were checked (prefix hits included).
	Bytes         uint64  `json:"bytes"`
	VerifiedBytes uint64  `json:"verified_bytes"`
	Seconds       float64 `json:"seconds"`
	// GBps is Bytes over the run's wall time (10^9 bytes per second): the
	// end-to-end rate, which includes filling and checking the synthetic
	// KV.
	GBps float64 `json:"gbps"`
	// TransferSeconds is the time this process's READs were in flight (the
	// union of their post-to-completion intervals) and TransferGBps Bytes
	// over it: the rate at which kvhost moved bytes.
	TransferSeconds float64 `json:"transfer_seconds,omitempty"`
	TransferGBps    float64 `json:"transfer_gbps,omitempty"`
	// InFlight is that union as disjoint [start, end) intervals (Unix ns,
	// span.Union.Merged), so that a demo running several decode processes
	// at once measures the time any of their READs was in flight.
	InFlight [][2]int64 `json:"in_flight_ns,omitempty"`
	// TransferMs is the READs' post-to-completion time (telemetry);
	// RequestMs each request's time from the prefill call to verified.
	TransferMs Percentiles `json:"transfer_ms"`
	RequestMs  Percentiles `json:"request_ms"`
	// DescriptorsPerRead is the average descriptor count of a READ: the
	// vLLM nixl_connector.py's prepped READ, block descriptor per region and block.
	DescriptorsPerRead float64 `json:"descriptors_per_read"`
	// InvalidBlocks is how many distinct local blocks the ranks reported
	// failing (BlockIDsWithLoadErrors); InvalidBlockReports counts every
	// block of every failed load.
	InvalidBlocks       int          `json:"invalid_blocks"`
	InvalidBlockReports int          `json:"invalid_block_reports"`
	Stats               pull.Summary `json:"stats"`
	Peers               []RankPeers  `json:"peers"`
	// CPU is what this process's threads did over the requests phase
	// (schedstat: run time and time waiting for a core), set by the kvhost
	// decode command, where the worker is alone in its process; nil when
	// not measured.
	CPU *schedstat.Usage `json:"cpu,omitempty"`
}

type decodeRank struct {
	rank int
	pool *kvpool.Pool
	rx   *pull.Receiver
	// tokenBytes is this rank's KV bytes per token.
	tokenBytes uint64
}

type decodeRun struct {
	cfg    DecodeConfig
	log    *slog.Logger
	ranks  []decodeRank
	agents []*plugin.Agent
	alloc  *synth.Allocator
	client *prefillClient

	mu        sync.Mutex
	sum       DecodeSummary
	xferMs    []float64
	busy      span.Union // the READs' post-to-completion intervals
	requestMs []float64
	descs     uint64
	finished  int

	report *synth.Lines // RequestReport lines
}

// RunDecode runs the decode worker over the whole workload and returns its
// summary. It returns an error only when the worker cannot run at all;
// failed requests are in the summary.
func RunDecode(ctx context.Context, cfg DecodeConfig) (*DecodeSummary, error) {
	if err := checkDecodeConfig(&cfg); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	d := &decodeRun{cfg: cfg, log: cfg.Logger, alloc: synth.NewAllocator(cfg.Engine.NumBlocks, cfg.Workload.Seed^0xdec0de),
		client: newPrefillClient(cfg.PrefillURL, cfg.ConnectTimeout)}
	if d.log == nil {
		d.log = slog.Default()
	}
	d.log = d.log.With("role", "decode", "engine_id", cfg.EngineID)
	d.report = synth.NewLines(cfg.Report, d.log)
	defer d.close()
	if err := d.setup(); err != nil {
		return nil, err
	}
	if cfg.OnReady != nil {
		cfg.OnReady()
	}
	hctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	err := d.client.waitHealthy(hctx)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	reqs := cfg.Workload.Generate()
	d.sum = DecodeSummary{Role: "decode", Style: "vllm", EngineID: cfg.EngineID, TPSize: cfg.Engine.TPSize,
		Ranks: slices.Clone(cfg.Ranks), Requests: len(reqs)}
	var cpu *schedstat.Window
	if cfg.MeasureCPU {
		cpu = schedstat.Begin(0)
	}
	start := time.Now()
	work := make(chan Request)
	var wg sync.WaitGroup
	for range min(cfg.Concurrency, max(len(reqs), 1)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range work {
				d.runOne(ctx, r)
			}
		}()
	}
feed:
	for _, r := range reqs {
		select {
		case work <- r:
		case <-ctx.Done():
			break feed
		}
	}
	close(work)
	wg.Wait()
	seconds := time.Since(start).Seconds()
	cpuUsed := cpu.Measure(d.log)
	d.collect(seconds)
	d.sum.CPU = cpuUsed
	if err := ctx.Err(); err != nil {
		return &d.sum, fmt.Errorf("decode: stopped after %d of %d requests: %w", d.finished, len(reqs), err)
	}
	return &d.sum, nil
}

func checkDecodeConfig(c *DecodeConfig) error {
	if err := c.Model.Validate(); err != nil {
		return err
	}
	if err := c.Engine.Validate(); err != nil {
		return err
	}
	if err := c.Workload.Validate(); err != nil {
		return err
	}
	if c.EngineID == "" {
		return errors.New("engine id is empty")
	}
	if c.PrefillURL == "" {
		return errors.New("prefill URL is empty")
	}
	if max := c.Engine.NumBlocks * c.Engine.BlockSize; c.Workload.MaxTokens > max {
		return fmt.Errorf("requests of up to %d tokens do not fit %d blocks of %d tokens", c.Workload.MaxTokens, c.Engine.NumBlocks, c.Engine.BlockSize)
	}
	if c.Ranks == nil {
		for r := range c.Engine.TPSize {
			c.Ranks = append(c.Ranks, r)
		}
	}
	if len(c.Ranks) == 0 {
		return errors.New("no TP rank to host")
	}
	seen := map[int]bool{}
	for _, r := range c.Ranks {
		if r < 0 || r >= c.Engine.TPSize || seen[r] {
			return fmt.Errorf("TP ranks %v: each must be distinct and in [0, %d)", c.Ranks, c.Engine.TPSize)
		}
		seen[r] = true
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 16
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = 60 * time.Second
	}
	return nil
}

func (d *decodeRun) setup() error {
	c := &d.cfg
	for _, rank := range c.Ranks {
		g := geometry(c.Model, c.Engine, rank)
		pool, err := kvpool.New(g)
		if err != nil {
			return fmt.Errorf("decode: TP rank %d pool: %w", rank, err)
		}
		a, err := c.Plugin.NewAgent(agentName(c.EngineID, rank), c.Plugin.ForSide(pull.ReceiverSide, c.AgentParams)...)
		if err != nil {
			pool.Close()
			return fmt.Errorf("decode: TP rank %d agent: %w", rank, err)
		}
		d.agents = append(d.agents, a)
		rx, err := pull.NewReceiver(pull.ReceiverConfig{
			EngineID: c.EngineID, TPRank: rank, TPSize: c.Engine.TPSize, Agent: a,
			Cache: cacheOf(pool, c.Engine, c.MemKind), MLA: c.Model.MLA, BlocksFirst: c.Model.BlocksFirst,
			TotalKVHeads: c.Model.KVHeads, CompatHash: c.Model.CompatHash(), SkipCompatCheck: c.SkipCompatCheck,
			HandshakeTimeout: c.HandshakeTimeout, ReadTimeout: c.ReadTimeout, Logger: d.log, Observer: c.Observer,
		})
		if err != nil {
			pool.Close()
			return fmt.Errorf("decode: TP rank %d: %w", rank, err)
		}
		d.ranks = append(d.ranks, decodeRank{rank: rank, pool: pool, rx: rx,
			tokenBytes: uint64(g.NumRegions()) * g.ItemLen() / uint64(g.PageSize)})
	}
	return nil
}

// runOne takes one request from prefill call to verified bytes.
func (d *decodeRun) runOne(ctx context.Context, req Request) {
	start := time.Now()
	err := d.pull(ctx, req)
	ms := float64(time.Since(start).Microseconds()) / 1e3
	d.mu.Lock()
	d.finished++
	done := d.finished
	switch req.Hit {
	case HitPartial:
		d.sum.PartialHits++
	case HitFull:
		d.sum.FullHits++
	}
	if err != nil {
		d.sum.Failed++
		d.sum.FailedRequests = append(d.sum.FailedRequests, FailedRequest{ID: req.ID, Error: err.Error()})
	} else {
		d.sum.OK++
		d.requestMs = append(d.requestMs, ms)
	}
	d.mu.Unlock()
	rep := RequestReport{RequestID: req.ID, OK: err == nil, Tokens: req.Tokens, PrefixHit: req.Hit.String(), Ms: ms}
	if err != nil {
		rep.Error = err.Error()
	}
	d.report.Write(rep)
	if err != nil {
		d.log.Warn("request failed", "request_id", req.ID, "err", err)
	} else {
		d.log.Debug("request verified", "request_id", req.ID, "tokens", req.Tokens, "hit", req.Hit, "ms", ms)
	}
	if d.cfg.Progress != nil {
		d.cfg.Progress(done, d.sum.Requests)
	}
}

func (d *decodeRun) pull(ctx context.Context, req Request) error {
	pctx, cancel := context.WithTimeout(ctx, d.cfg.ConnectTimeout)
	params, err := d.client.prefill(pctx, req.ID, req.Tokens)
	cancel()
	if err != nil {
		return fmt.Errorf("prefill: %w", err)
	}
	bs := d.cfg.Engine.BlockSize
	ids, err := d.alloc.Get(ctx, req.Blocks(bs))
	if err != nil {
		return err
	}
	defer func() {
		for _, r := range d.ranks {
			if err := r.pool.ClearPages(ids); err != nil {
				d.log.Error("clearing blocks", "tp_rank", r.rank, "err", err)
			}
		}
		d.alloc.Put(ids)
	}()
	seed := KVSeed(req.ID)
	hit := req.HitBlocks(bs)
	if hitTokens := min(hit*bs, req.Tokens); hitTokens > 0 {
		// Our prefix cache: these blocks were computed here before.
		for _, r := range d.ranks {
			if err := r.pool.Fill(kvpool.Tokens{Request: seed, Pages: ids, Count: hitTokens}); err != nil {
				return fmt.Errorf("fill prefix hit on TP rank %d: %w", r.rank, err)
			}
		}
	}
	loads := make([]*pull.Load, len(d.ranks))
	for i, r := range d.ranks {
		loads[i] = r.rx.Load(pull.LoadRequest{RequestID: req.ID, LocalBlockIDs: ids[hit:], Params: params})
	}
	var errs []error
	for i, l := range loads {
		res, err := l.Wait(ctx)
		if err != nil {
			return err
		}
		d.record(res)
		if res.Err != nil {
			errs = append(errs, fmt.Errorf("TP rank %d: %w", d.ranks[i].rank, res.Err))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	for _, r := range d.ranks {
		if err := r.pool.Verify(kvpool.Tokens{Request: seed, Pages: ids, Count: req.Tokens}); err != nil {
			return fmt.Errorf("verify TP rank %d: %w", r.rank, err)
		}
	}
	d.mu.Lock()
	for _, r := range d.ranks {
		d.sum.VerifiedBytes += uint64(req.Tokens) * r.tokenBytes
	}
	d.mu.Unlock()
	return nil
}

func (d *decodeRun) record(res pull.LoadResult) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sum.InvalidBlockReports += len(res.InvalidBlocks)
	switch {
	case res.Err != nil:
	case res.NotifyOnly:
		d.sum.NotifyOnly++
	default:
		d.sum.Reads++
		d.sum.Bytes += res.Stat.Bytes
		d.descs += res.Stat.Descs
		d.xferMs = append(d.xferMs, float64(res.Stat.Xfer.Microseconds())/1e3)
		d.busy.Add(res.Stat.Posted, res.Stat.Posted.Add(res.Stat.Xfer))
	}
}

// collect fills the summary's totals from the ranks.
func (d *decodeRun) collect(seconds float64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := &d.sum
	s.Seconds = seconds
	if seconds > 0 {
		s.GBps = float64(s.Bytes) / seconds / 1e9
	}
	s.TransferMs = percentiles(d.xferMs)
	s.InFlight = d.busy.Merged()
	if s.TransferSeconds = d.busy.Total().Seconds(); s.TransferSeconds > 0 {
		s.TransferGBps = float64(s.Bytes) / s.TransferSeconds / 1e9
	}
	s.RequestMs = percentiles(d.requestMs)
	if s.Reads > 0 {
		s.DescriptorsPerRead = float64(d.descs) / float64(s.Reads)
	}
	var stats pull.Stats
	for _, r := range d.ranks {
		stats.Aggregate(r.rx.TakeStats())
		s.InvalidBlocks += len(r.rx.BlockIDsWithLoadErrors())
		s.Peers = append(s.Peers, RankPeers{TPRank: r.rank, Peers: r.rx.Peers()})
	}
	s.Stats = stats.Reduce()
	slices.SortFunc(s.FailedRequests, func(a, b FailedRequest) int {
		if a.ID < b.ID {
			return -1
		}
		if a.ID > b.ID {
			return 1
		}
		return 0
	})
}

func percentiles(ms []float64) Percentiles {
	if len(ms) == 0 {
		return Percentiles{}
	}
	return Percentiles{P50: round3(quantile.Percentile(ms, 50)), P90: round3(quantile.Percentile(ms, 90)),
		P99: round3(quantile.Percentile(ms, 99)), Max: round3(slices.Max(ms))}
}

func round3(x float64) float64 { return float64(int64(x*1000+0.5)) / 1000 }

func (d *decodeRun) close() {
	// Unused keep-alive connections would hold the prefill's graceful
	// shutdown until they time out.
	d.client.http.CloseIdleConnections()
	for _, r := range d.ranks {
		if err := r.rx.Close(); err != nil {
			d.log.Error("closing receiver", "tp_rank", r.rank, "err", err)
		}
	}
	for _, a := range d.agents {
		if err := a.Close(); err != nil {
			d.log.Error("closing agent", "err", err)
		}
	}
	for _, r := range d.ranks {
		r.pool.Close()
	}
}
