package pushworker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/demo/synth"
	"github.com/kvhost/kvhost/host/internal/quantile"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// Common are the options both sides share.
type Common struct {
	Plugin      *plugin.Plugin
	AgentParams []plugin.Param
	Variant     push.Variant
	Completion  push.Completion
	Shape       Shape
	Workload    Workload
	// TPSize is this side's attention TP size; TPRanks the ranks this
	// process hosts (nil: all). PPSize and PPRanks likewise.
	TPSize  int
	TPRanks []int
	PPSize  int
	PPRanks []int
	// Host is the IP this worker's sockets bind to and advertise.
	Host string
	// Concurrency is how many requests each rank works on at once
	// (default 16).
	Concurrency int
	Settings    push.Settings
	// Observer, if set, also sees every runtime event (metrics).
	Observer push.Observer
	Logger   *slog.Logger
	// Report, if set, receives one JSON line per request (RequestResult)
	// as soon as the request finished on every rank of the worker.
	Report io.Writer
	// Progress, if set, is called after each request finishes on this
	// worker (all its ranks), with the number finished so far.
	Progress func(done int)
	// NoBytes skips writing the synthetic KV on prefill and checking it on
	// decode, to measure the runtime alone (benchmarks). The summary then
	// says Checked false.
	NoBytes bool
	// OnReady, if set, is called once, when every rank of the worker is
	// set up and serving (prefill: registered with the bootstrap server),
	// before the first request starts. rooms counts the rooms the worker
	// holds at each call (for a metrics gauge); it may be called from any
	// goroutine, also after the run (it then counts none).
	OnReady func(rooms RoomCounter)
	// MeasureCPU says the worker is alone in its process (the kvhost
	// prefill and decode commands): its summary's CPU then reports the
	// process's threads over the requests phase.
	MeasureCPU bool
}

// beginCPU starts measuring this process's threads where MeasureCPU
// says they are the worker's (nil otherwise: Measure gives nil).
func (c *Common) beginCPU() *schedstat.Window {
	if !c.MeasureCPU {
		return nil
	}
	return schedstat.Begin(0)
}

// ready calls OnReady, if set.
func (c *Common) ready(live *liveRooms) {
	if c.OnReady != nil {
		c.OnReady(live.count)
	}
}

func (c *Common) check() error {
	if c.Plugin == nil {
		return errors.New("worker: no plugin")
	}
	if err := c.Shape.Check(); err != nil {
		return err
	}
	if err := c.Workload.Check(c.Shape.PageSize); err != nil {
		return err
	}
	if c.TPSize < 1 {
		return fmt.Errorf("worker: TP size %d", c.TPSize)
	}
	if c.PPSize < 1 {
		c.PPSize = 1
	}
	if c.Concurrency < 1 {
		c.Concurrency = 16
	}
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	var err error
	if c.TPRanks == nil {
		c.TPRanks, _ = parseRanks("", c.TPSize)
	}
	if c.PPRanks == nil {
		c.PPRanks, _ = parseRanks("", c.PPSize)
	}
	for _, r := range c.TPRanks {
		if r < 0 || r >= c.TPSize {
			err = fmt.Errorf("worker: TP rank %d of %d", r, c.TPSize)
		}
	}
	for _, r := range c.PPRanks {
		if r < 0 || r >= c.PPSize {
			err = fmt.Errorf("worker: PP rank %d of %d", r, c.PPSize)
		}
	}
	return err
}

// poolPages is the page count of a rank's pool.
func (c *Common) poolPages() int {
	if c.Shape.Pages > 0 {
		return c.Shape.Pages
	}
	return c.Concurrency*pagesFor(c.Workload.MaxTokens, c.Shape.PageSize) + 1
}

func (c *Common) ranks(prefill bool) ([]*rank, error) {
	var out []*rank
	for _, pp := range c.PPRanks {
		for _, tp := range c.TPRanks {
			r, err := newRank(c.Shape, prefill, c.TPSize, tp, c.PPSize, pp, c.poolPages(), c.Concurrency+1, c.Workload.Seed)
			if err != nil {
				for _, o := range out {
					o.close()
				}
				return nil, fmt.Errorf("rank tp%d/pp%d: %w", tp, pp, err)
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// PrefillOptions configures a prefill worker.
type PrefillOptions struct {
	Common
	XferMode push.XferMode
	// BootstrapAddr is the bootstrap server the ranks register with.
	BootstrapAddr string
}

// prefillRank is one rank of a prefill worker.
type prefillRank struct {
	*rank
	m *push.Prefill
}

// RunPrefill runs a prefill worker's ranks over the whole workload: for
// each request, wait for decode's metadata, fill the pages decode does not
// hold with the synthetic KV, send them in chunks (aux on the last), wait
// for the transfer. It returns when every request finished.
func RunPrefill(ctx context.Context, o PrefillOptions) (*Summary, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	st := &stats{extra: o.Observer}
	rks, err := o.ranks(true)
	if err != nil {
		return nil, err
	}
	var prs []*prefillRank
	defer func() {
		for _, p := range prs {
			p.m.Close()
		}
		for _, r := range rks {
			r.close()
		}
	}()
	for _, r := range rks {
		m, err := push.NewPrefill(ctx, push.PrefillConfig{
			Plugin: o.Plugin, AgentParams: o.AgentParams,
			Variant: o.Variant, Completion: o.Completion, XferMode: o.XferMode,
			KV: r.args, Parallel: r.par, MLA: o.Shape.MLA,
			Host: o.Host, BootstrapAddr: o.BootstrapAddr,
			Settings: o.Settings, Observer: st, Logger: o.Logger,
		})
		if err != nil {
			return nil, fmt.Errorf("prefill rank %s: %w", r, err)
		}
		prs = append(prs, &prefillRank{rank: r, m: m})
	}
	live := newLiveRooms()
	o.ready(live)
	reqs := o.Workload.List(o.Shape.PageSize)
	t := newTally()
	cpu := o.beginCPU()
	start := time.Now()
	runRanks(ctx, len(prs), reqs, o.Concurrency, o.finished(t), func(i int, req Request) {
		prs[i].serve(ctx, &o, req, t, live)
	})
	elapsed := time.Since(start)
	cpuUsed := cpu.Measure(o.Logger)

	s := &Summary{Role: "prefill", Variant: o.Variant.String(), Completion: prs[0].m.Completion().String(), XferMode: prs[0].m.XferMode().String(), Checked: !o.NoBytes}
	for _, p := range prs {
		s.Ranks = append(s.Ranks, p.String())
		s.Dropped += p.m.Dropped()
		// Only rooms this worker opened count: transfer infos or ABORTs a
		// decode sent for rooms the worker never held (Pending) are a
		// peer's, and expire with the bootstrap timeout.
		s.Leaked += p.m.Rooms()
	}
	t.finish(s, reqs, elapsed)
	s.CPU = cpuUsed
	st.mu.Lock()
	s.Bytes, s.Transfers, s.Descriptors, s.RefDescriptors = st.bytes, st.transfers, st.descs, st.refDescs
	s.XferP50us, s.XferP99us, s.PostP50us = quantile.Percentile(st.xfer, 50), quantile.Percentile(st.xfer, 99), quantile.Percentile(st.post, 50)
	s.TransferSec = st.busy.Total().Seconds()
	st.mu.Unlock()
	if s.TransferSec > 0 {
		s.TransferGBps = float64(s.Bytes) / s.TransferSec / 1e9
	}
	if elapsed > 0 {
		s.GBps = float64(s.Bytes) / elapsed.Seconds() / 1e9
	}
	return s, ctx.Err()
}

// finished returns what runRanks calls when a request finished on every
// rank: it writes the request's report line and reports progress.
func (c *Common) finished(t *tally) func(req Request, done int) {
	rep := synth.NewLines(c.Report, c.Logger)
	return func(req Request, done int) {
		rep.Write(t.result(req))
		if c.Progress != nil {
			c.Progress(done)
		}
	}
}

// serve runs one request on one prefill rank.
func (p *prefillRank) serve(ctx context.Context, o *PrefillOptions, req Request, t *tally, live *liveRooms) {
	fail := func(reason string) {
		t.fail(RequestFailure{Room: req.Room, Rank: p.String(), Reason: reason, Abort: req.Abort}, false)
	}
	s, err := p.m.NewSender(req.Room)
	if err != nil {
		fail(err.Error())
		return
	}
	defer s.Close()
	defer live.hold(s)()
	st, err := s.WaitReady(ctx)
	if err != nil {
		fail(err.Error())
		return
	}
	if st == sglang.KVPollFailed {
		fail(s.Failure().Error())
		return
	}
	ps := o.Shape.PageSize
	prefix := int(s.DecodePrefixLen())
	if prefix < 0 || prefix > req.Tokens || prefix%ps != 0 {
		s.Abort()
		fail(fmt.Sprintf("decode prefix %d tokens is not a page-aligned part of the %d-token prompt", prefix, req.Tokens))
		return
	}
	total := pagesFor(req.Tokens, ps)
	send := total - prefix/ps
	pages, err := p.pages.Get(ctx, send)
	if err != nil {
		s.Abort()
		fail(err.Error())
		return
	}
	defer p.pages.Put(pages)
	auxSlot, err := p.aux.Get(ctx, 1)
	if err != nil {
		s.Abort()
		fail(err.Error())
		return
	}
	defer p.aux.Put(auxSlot)
	if !o.NoBytes {
		if err := p.pool.FillAux(req.Room, int(auxSlot[0])); err != nil {
			s.Abort()
			fail(err.Error())
			return
		}
	}
	if err := s.Init(send, int64(auxSlot[0])); err != nil {
		fail(err.Error())
		return
	}
	// Pages indexed by request page: the prefix pages are decode's, never
	// touched here.
	full := make([]int32, total)
	copy(full[prefix/ps:], pages)
	chunk := o.Workload.ChunkPages
	if chunk <= 0 {
		chunk = max(send, 1)
	}
	begin := time.Now()
	for sent := 0; sent < send || (send == 0 && sent == 0); {
		n := min(chunk, send-sent)
		first := prefix + sent*ps
		count := min((sent+n)*ps+prefix, req.Tokens) - first
		if n > 0 && !o.NoBytes {
			if err := p.pool.Fill(kvpool.Tokens{Request: req.Room, Pages: full, First: first, Count: count}); err != nil {
				s.Abort()
				fail(err.Error())
				return
			}
		}
		if err := s.Send(pages[sent:sent+n], nil); err != nil {
			s.Abort()
			fail(err.Error())
			return
		}
		if send == 0 {
			break
		}
		sent += n
	}
	st, err = s.Wait(ctx)
	switch {
	case err != nil:
		fail(err.Error())
	case st != sglang.KVPollSuccess:
		fail(s.Failure().Error())
	default:
		t.ok(time.Since(begin), 0)
	}
}

// runRanks runs fn for every request on every rank, each rank working on
// up to conc requests at once, in workload order. finished is called, one
// call at a time, when a request finished on every rank, with the number
// of requests finished so far.
func runRanks(ctx context.Context, nRanks int, reqs []Request, conc int, finished func(req Request, done int), fn func(rank int, req Request)) {
	remaining := make([]int, len(reqs))
	for i := range remaining {
		remaining[i] = nRanks
	}
	var mu sync.Mutex
	done := 0
	var wg sync.WaitGroup
	for rk := 0; rk < nRanks; rk++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem := make(chan struct{}, conc)
			var inner sync.WaitGroup
			for i, req := range reqs {
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
				}
				if ctx.Err() != nil {
					break
				}
				inner.Add(1)
				go func() {
					defer inner.Done()
					defer func() { <-sem }()
					fn(rk, req)
					mu.Lock()
					remaining[i]--
					if remaining[i] == 0 {
						done++
						finished(req, done)
					}
					mu.Unlock()
				}()
			}
			inner.Wait()
		}()
	}
	wg.Wait()
}
