package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
)

// lockedBuffer is a bytes.Buffer safe for the workers' concurrent writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) reader() io.Reader {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.NewReader(bytes.Clone(l.b.Bytes()))
}

// inProc is a demo in this process.
type inProc struct {
	cfg     *Config
	p       *plugin.Plugin
	params  []plugin.Param
	log     *slog.Logger
	logs    *lockedBuffer // the workers' logs when WorkerLog is nil
	done    atomic.Int64  // requests finished over all decode ranks
	reports []*lockedBuffer
	cpu     *cpuPhase
}

// cpuPhase measures this process's threads over the requests phase: from
// the moment the last of its workers is set up (ready) until the run
// stops it, once every worker returned.
type cpuPhase struct {
	mu   sync.Mutex
	left int // workers not ready yet
	w    *schedstat.Window
	used *schedstat.Usage
	err  error
}

// ready is a worker's OnReady.
func (c *cpuPhase) ready() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.left--; c.left == 0 {
		c.w = schedstat.Begin(0)
	}
}

// stop ends the phase: every worker returned.
func (c *cpuPhase) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.w != nil && c.used == nil && c.err == nil {
		u, err := c.w.End()
		c.used, c.err = &u, err
		if err != nil {
			c.used = nil
		}
	}
}

func (c *cpuPhase) report(s *Summary) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.err != nil:
		s.setCPU(nil, "not measured: "+c.err.Error())
	case c.used == nil:
		s.setCPU(nil, "not measured: not every worker got ready")
	default:
		s.setCPU(c.used, "this process's threads (every worker, with the synthetic KV's fill and check), "+
			"from every worker ready to the last one done")
	}
}

// rankProgress turns one decode rank's "done so far" callbacks, which the
// workers may make from several goroutines at once, into increments of the
// run's total.
func (r *inProc) rankProgress() func(done int) {
	var mu sync.Mutex
	last := 0
	return func(done int) {
		mu.Lock()
		delta := max(0, done-last)
		last = max(last, done)
		mu.Unlock()
		n := r.done.Add(int64(delta))
		if r.cfg.Progress != nil && delta > 0 {
			r.cfg.Progress(min(int(n), r.cfg.total()), r.cfg.total())
		}
	}
}

// inProcessParams are the agent parameters of every in-process worker:
// the user's, and, since both sides live in this process, the plugin's
// first-touch pass kept for the targets too (plugin.WithLocalPeers): the
// host's defaults drop it for targets whose initiators are elsewhere.
func inProcessParams(p *plugin.Plugin, given []string) ([]plugin.Param, error) {
	params, err := plugin.ParseParams(given)
	if err != nil {
		return nil, fmt.Errorf("demo: agent parameters: %w", err)
	}
	return p.WithLocalPeers(params), nil
}

func runInProcess(ctx context.Context, cfg *Config, p *plugin.Plugin, s *Summary) error {
	params, err := inProcessParams(p, cfg.AgentParams)
	if err != nil {
		return err
	}
	r := &inProc{cfg: cfg, p: p, params: params, logs: &lockedBuffer{}}
	level, out := slog.LevelWarn, io.Writer(r.logs)
	if cfg.WorkerLog != nil {
		level, out = slog.LevelInfo, cfg.WorkerLog
	}
	r.log = slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level}))
	for range cfg.DecodeTP {
		r.reports = append(r.reports, &lockedBuffer{})
	}
	s.Processes = 1
	r.cpu = &cpuPhase{left: 1 + cfg.DecodeTP}
	if cfg.Style == "sglang" {
		err = r.runPush(ctx, s)
	} else {
		err = r.runPull(ctx, s)
	}
	if err != nil {
		return err
	}
	r.cpu.report(s)
	t := newTally()
	for rank, rep := range r.reports {
		if err := t.addReport(rep.reader()); err != nil {
			s.addFailure(fmt.Sprintf("decode rank %d: %v", rank, err))
		}
	}
	t.apply(s, cfg.DecodeTP)
	if !s.Success() && cfg.WorkerLog == nil {
		s.addFailure("worker log: " + lastLines(r.logs, 6))
	}
	return nil
}

func lastLines(l *lockedBuffer, n int) string {
	b, _ := io.ReadAll(l.reader())
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n    ")))
}

func addRaw(s *Summary, v any) {
	if b, err := json.Marshal(v); err == nil {
		s.Workers = append(s.Workers, b)
	}
}

func (r *inProc) runPush(ctx context.Context, s *Summary) error {
	cfg := r.cfg
	srv, err := bootstrap.NewServer(bootstrap.WithLogger(r.log)).Start("127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("demo: bootstrap server: %w", err)
	}
	defer func() {
		// Decode heartbeats keep connections open: do not wait on them.
		c, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		srv.Close(c)
	}()
	var obs push.Observer
	if cfg.Metrics != nil {
		obs = cfg.Metrics.PushObserver()
	}
	common := func(tp int, ranks []int) pushworker.Common {
		return pushworker.Common{
			Plugin: r.p, AgentParams: r.params,
			Shape: pushworker.Shape{MLA: cfg.Attention == "mla", Layers: cfg.Layers, KVHeads: cfg.KVHeads,
				HeadBytes: cfg.HeadDim * cfg.DTypeBytes, PageSize: cfg.PageSize, MemKinds: cfg.MemKinds},
			Workload: pushworker.Workload{Seed: cfg.Seed, Requests: cfg.Requests, MinTokens: cfg.MinTokens,
				MaxTokens: cfg.MaxTokens, ChunkPages: cfg.ChunkPages},
			TPSize: tp, TPRanks: ranks, PPSize: 1, Host: "127.0.0.1", Concurrency: cfg.Concurrency,
			Observer: obs, Logger: r.log, OnReady: func(pushworker.RoomCounter) { r.cpu.ready() },
		}
	}
	type result struct {
		s   *pushworker.Summary
		err error
	}
	pch := make(chan result, 1)
	go func() {
		ps, err := pushworker.RunPrefill(ctx, pushworker.PrefillOptions{Common: common(cfg.PrefillTP, nil), BootstrapAddr: srv.Addr()})
		pch <- result{ps, err}
	}()
	decodes := runDecodeRanks(s, cfg.DecodeTP, func(rank int) (*pushworker.Summary, error) {
		o := pushworker.DecodeOptions{Common: common(cfg.DecodeTP, []int{rank}), BootstrapAddr: srv.Addr()}
		o.Report = r.reports[rank]
		o.Progress = r.rankProgress()
		return pushworker.RunDecode(ctx, o)
	})
	p := <-pch
	r.cpu.stop()
	if p.err != nil {
		s.addFailure(fmt.Sprintf("prefill: %v", p.err))
	}
	if p.s != nil {
		addRaw(s, p.s)
	}
	for _, d := range decodes {
		addRaw(s, d)
	}
	s.addPush(p.s, decodes)
	return nil
}

// runDecodeRanks runs one decode worker per rank at once and returns the
// summaries they made, in rank order; their errors go to s.
func runDecodeRanks[S any](s *Summary, ranks int, run func(rank int) (*S, error)) []*S {
	type result struct {
		s   *S
		err error
	}
	results := make([]chan result, ranks)
	for rank := range ranks {
		results[rank] = make(chan result, 1)
		go func() {
			sum, err := run(rank)
			results[rank] <- result{sum, err}
		}()
	}
	var out []*S
	for rank, ch := range results {
		r := <-ch
		if r.err != nil {
			s.addFailure(fmt.Sprintf("decode rank %d: %v", rank, r.err))
		}
		if r.s != nil {
			out = append(out, r.s)
		}
	}
	return out
}

// vllmModel is the model both vLLM-style workers share, as the CLI makes
// it from the same flags.
func vllmModel(cfg *Config) (pullworker.Model, error) {
	dtype, err := pullworker.DTypeOfBytes(cfg.DTypeBytes)
	if err != nil {
		return pullworker.Model{}, err
	}
	m := pullworker.Model{Name: pullworker.DefaultModelName, VLLMVersion: pullworker.DefaultVLLMVersion, DType: dtype, CacheDType: pullworker.DefaultCacheDType,
		MLA: cfg.Attention == "mla", Layers: cfg.Layers, KVHeads: cfg.KVHeads, HeadDim: cfg.HeadDim}
	return m, m.Validate()
}

// vllmEngine sizes an engine as the CLI does.
func vllmEngine(cfg *Config, tp int) pullworker.Engine {
	return pullworker.Engine{TPSize: tp, BlockSize: cfg.PageSize, Layout: pull.LayoutHND,
		NumBlocks: pullworker.DefaultNumBlocks(cfg.MaxTokens, cfg.PageSize, cfg.Concurrency)}
}

func (r *inProc) runPull(ctx context.Context, s *Summary) error {
	cfg := r.cfg
	var obs pull.Observer
	if cfg.Metrics != nil {
		obs = cfg.Metrics.PullObserver()
	}
	model, err := vllmModel(cfg)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	work := pullworker.Workload{Seed: cfg.Seed, Requests: cfg.Requests, MinTokens: cfg.MinTokens, MaxTokens: cfg.MaxTokens}
	pf, err := pullworker.StartPrefill(pullworker.PrefillConfig{
		Plugin: r.p, AgentParams: r.params, Model: model, Engine: vllmEngine(cfg, cfg.PrefillTP), EngineID: "demo-prefill",
		SideChannel: "tcp://127.0.0.1:0", APIAddr: "127.0.0.1:0", MemKind: pullMemKind(cfg), Workload: work,
		Logger: r.log, Observer: obs, OnReady: r.cpu.ready,
	})
	if err != nil {
		return fmt.Errorf("demo: prefill: %w", err)
	}
	defer pf.Close()
	decodes := runDecodeRanks(s, cfg.DecodeTP, func(rank int) (*pullworker.DecodeSummary, error) {
		progress := r.rankProgress()
		return pullworker.RunDecode(ctx, pullworker.DecodeConfig{
			Plugin: r.p, AgentParams: r.params, Model: model, Engine: vllmEngine(cfg, cfg.DecodeTP), Ranks: []int{rank},
			EngineID: "demo-decode", PrefillURL: "http://" + pf.APIAddr(), Workload: work, Concurrency: cfg.Concurrency,
			MemKind: pullMemKind(cfg), Logger: r.log, Observer: obs, Report: r.reports[rank],
			Progress: func(done, _ int) { progress(done) }, OnReady: r.cpu.ready,
		})
	})
	// Every decode rank notified (or failed): the prefill releases the rest
	// on its own; give it a moment, not the abort timeout.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	ps := pf.Wait(wctx)
	cancel()
	r.cpu.stop()
	addRaw(s, ps)
	for _, d := range decodes {
		addRaw(s, d)
	}
	s.addPull(&ps, decodes)
	return nil
}

// pullMemKind is the vLLM workers' memory kind (Validate refused mixed).
func pullMemKind(cfg *Config) abi.MemKind {
	if cfg.MemKinds == "dram" {
		return abi.DRAM
	}
	return abi.VRAM
}
