package bench

import (
	"context"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/quantile"
	"github.com/kvhost/kvhost/host/plugin"
)

// Row is one measured configuration. Times are in µs, rates in GB/s (1e9
// bytes per second). Columns follow nixlbench and bench_direct.cc.
type Row struct {
	Procs   int    `json:"procs"`
	Op      string `json:"op"`
	Path    Path   `json:"path"`
	Threads int    `json:"threads"`
	Block   uint64 `json:"block_size"`
	Batch   int    `json:"batch_size"`
	// Scattered: the descriptors went in a shuffled order (Config.Scatter).
	Scattered bool `json:"scattered,omitempty"`
	// Sweep names the variant of Config.Sweep the row ran with, e.g.
	// "num_threads=4" (empty without a sweep); InitiatorParams are all the
	// initiator agent's parameters, the host's defaults included.
	Sweep           string   `json:"sweep,omitempty"`
	InitiatorParams []string `json:"initiator_params,omitempty"`

	GBps      float64 `json:"gb_per_s"`
	AvgLatUs  float64 `json:"avg_lat_us"`
	AvgPrepUs float64 `json:"avg_prep_us"`
	P99PrepUs float64 `json:"p99_prep_us"`
	AvgPostUs float64 `json:"avg_post_us"`
	P99PostUs float64 `json:"p99_post_us"`
	AvgTxUs   float64 `json:"avg_tx_us"`
	P99TxUs   float64 `json:"p99_tx_us"`
	// CPUUs is the CPU time (user + system) the posting thread spent per
	// transfer, as bench_direct.cc's CPU/op: unlike wall time it hardly
	// moves when other processes compete for the cores. A plugin's own
	// threads (the fake's workers) are not in it.
	CPUUs float64 `json:"cpu_us_per_op"`
	Iters int     `json:"iters"` // timed transfers, all threads

	Baseline     string  `json:"baseline"` // memcpy, process_vm_writev or process_vm_readv
	BaselineGBps float64 `json:"baseline_gb_per_s"`
	// Efficiency is the median, over every iteration of every round and
	// thread, of the paired ratio: the time the best baseline copy of the
	// same blocks took in that iteration over the transfer's latency. A
	// hiccup that hits one side of one iteration moves the median not at
	// all, so on a loaded machine it is steadier than GBps/BaselineGBps.
	Efficiency float64 `json:"efficiency"`
	Verified   bool    `json:"verified"`

	// The plugin's own view (Config.Telemetry only): post_xfer time and
	// post-to-completion time from its telemetry, averaged.
	PluginPostUs float64 `json:"plugin_post_us"`
	PluginXferUs float64 `json:"plugin_xfer_us"`

	Rounds []Round `json:"rounds"`
}

// Round is one round of a row: the subject's rate and each baseline's. In a
// round every thread alternates one transfer with one run of each baseline
// copier over the same blocks; a rate is the bytes over the time spent in
// that kind of iteration, summed over threads.
type Round struct {
	GBps     float64            `json:"gb_per_s"`
	Baseline map[string]float64 `json:"baseline_gb_per_s"` // by copier: go-copy, libc-memcpy, process_vm_*
	// Efficiency is the median over the round's iterations of the paired
	// ratio: the best baseline copy's time over the transfer's time.
	Efficiency float64 `json:"efficiency"`
}

// Label names the row's configuration (without the block size), e.g.
// "1p WRITE prepped x1 t1", followed by its sweep variant if any.
func (r *Row) Label() string {
	return withSweep(fmt.Sprintf("%dp %s %s%s x%d t%d", r.Procs, r.Op, r.Path, r.scatterTag(), r.Batch, r.Threads), r.Sweep)
}

// scatterTag marks a row of shuffled descriptors in its label.
func (r *Row) scatterTag() string {
	if r.Scattered {
		return " scattered"
	}
	return ""
}

// Group names the row's table section: its configuration without the block
// and batch sizes, e.g. "1p WRITE prepped t1", and its sweep variant.
func (r *Row) Group() string {
	return withSweep(fmt.Sprintf("%dp %s %s%s t%d", r.Procs, r.Op, r.Path, r.scatterTag(), r.Threads), r.Sweep)
}

func withSweep(label, sweep string) string {
	if sweep == "" {
		return label
	}
	return label + " " + sweep
}

// Result is a whole sweep.
type Result struct {
	Plugin        string   `json:"plugin"`
	PluginVersion string   `json:"plugin_version"`
	PluginPath    string   `json:"plugin_path"`
	Caps          []string `json:"caps"`     // native on the initiator agent
	Emulated      []string `json:"emulated"` // provided by the host
	Params        []string `json:"params,omitempty"`
	// TargetParams are the parameters of a target agent in another
	// process (--procs 2), the host's defaults included (each row has the
	// initiator's); LocalTargetParams those of one in this process
	// (--procs 1), which keeps the first-touch pass its initiator's copies
	// need (plugin.WithLocalPeers).
	TargetParams      []string  `json:"target_params,omitempty"`
	LocalTargetParams []string  `json:"local_target_params,omitempty"`
	GOMAXPROCS        int       `json:"gomaxprocs"`
	CPUs              int       `json:"cpus"`
	Rounds            int       `json:"rounds"`
	Started           time.Time `json:"started"`
	Rows              []Row     `json:"rows"`
	Skipped           []string  `json:"skipped,omitempty"`
	Err               string    `json:"error,omitempty"`
}

// OnRow, when set on the Runner, sees each row as soon as it is measured.
type Runner struct {
	Config
	OnRow func(Row)
}

// Run runs the sweep. On error (a failed transfer, a failed verification,
// ctx cancelled) it returns the rows measured so far with the error; the
// plugin's handles and the target process are released either way.
func (r *Runner) Run(ctx context.Context) (*Result, error) {
	cfg := &r.Config
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p, err := plugin.Load(cfg.Plugin, cfg.Dirs)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	defer p.Close()
	memcpyFn, err := libcMemcpy()
	if err != nil {
		return nil, err
	}
	size := cfg.bufferSize()
	e := &engine{cfg: cfg, p: p, memcpy: memcpyFn, onRow: r.OnRow}
	res := &Result{
		Plugin: p.Name(), PluginVersion: p.Info().Version, PluginPath: p.Path(),
		GOMAXPROCS: runtime.GOMAXPROCS(0), CPUs: runtime.NumCPU(), Rounds: cfg.Rounds,
		Started: time.Now(),
	}
	for _, kv := range cfg.Params {
		res.Params = append(res.Params, kv.Key+"="+kv.Value)
	}
	e.res = res
	e.targetParams = p.ForSide(plugin.Target, cfg.Params)
	e.localTargetParams = p.ForSide(plugin.Target, p.WithLocalPeers(cfg.Params))
	res.TargetParams = paramStrings(e.targetParams)
	res.LocalTargetParams = paramStrings(e.localTargetParams)
	vars := variants(cfg.Sweep)
	e.total = e.countRows() * cfg.Rounds * len(vars)
	for _, v := range vars {
		if err := e.runVariant(ctx, v, size); err != nil {
			res.Err = err.Error()
			return res, err
		}
	}
	return res, nil
}

// runVariant runs every row with an initiator agent of its own, made with
// the variant's parameters over Config.Params.
func (e *engine) runVariant(ctx context.Context, variant []plugin.Param, size uint64) error {
	params := e.p.ForSide(plugin.Initiator, plugin.MergeParams(e.cfg.Params, variant))
	e.sweep, e.initParams = strings.Join(paramStrings(variant), " "), paramStrings(params)
	err := e.openInitiator(size, params)
	defer e.closeInitiator()
	if err != nil {
		return err
	}
	if e.res.Caps == nil {
		e.res.Caps = e.ag.Caps().Names()
		e.res.Emulated = e.ag.Emulated().Names()
	}
	for _, procs := range e.cfg.Procs {
		if err := e.runProcs(ctx, procs, size); err != nil {
			return err
		}
	}
	return nil
}

func paramStrings(params []plugin.Param) []string {
	var out []string
	for _, kv := range params {
		out = append(out, kv.Key+"="+kv.Value)
	}
	return out
}

// engine is the state of one Run.
type engine struct {
	cfg    *Config
	p      *plugin.Plugin
	memcpy uintptr
	onRow  func(Row)
	res    *Result

	ag *plugin.Agent // initiator
	// The running variant (runVariant) and the targets' parameters (in
	// another process, in this one).
	sweep                           string
	initParams                      []string
	targetParams, localTargetParams []plugin.Param
	buf                             buffer
	reg                             *plugin.Region
	seed                            uint64

	done, total int
}

func (e *engine) openInitiator(size uint64, params []plugin.Param) error {
	var err error
	e.buf, e.reg = nil, nil
	if e.ag, err = e.p.NewAgent(initiatorAgentName, params...); err != nil {
		return fmt.Errorf("bench: initiator agent: %w", err)
	}
	if e.buf, err = mapBuffer(size); err != nil {
		return err
	}
	regs, err := e.ag.Register([]abi.MemDesc{{Addr: e.buf.addr(), Len: size, MemKind: abi.DRAM}})
	if err != nil {
		return fmt.Errorf("bench: initiator register: %w", err)
	}
	e.reg = regs[0]
	return nil
}

// closeInitiator closes what openInitiator opened, also after it failed
// half way, so the next variant starts afresh.
func (e *engine) closeInitiator() {
	if e.ag != nil {
		e.ag.Close()
	}
	if e.buf != nil {
		e.buf.free()
	}
	e.ag, e.buf, e.reg = nil, nil, nil
}

func (e *engine) fits(block uint64, batch, threads int) bool {
	n := rowBytes(block, batch, threads)
	return n != 0 && n <= e.cfg.MaxBuffer
}

func (e *engine) countRows() int {
	c := e.cfg
	n := 0
	for range c.Procs {
		for range c.Ops {
			for range c.Paths {
				for _, t := range c.Threads {
					for _, b := range c.Blocks {
						for _, k := range c.Batches {
							if e.fits(b, k, t) {
								n++
							}
						}
					}
				}
			}
		}
	}
	return n
}

// peerSide is a connected target: its agent's name as the initiator knows
// it, and the remote region for batch transfers.
type peerSide struct {
	t      *target
	name   string
	meta   targetMeta
	remote *plugin.RemoteRegion // nil until a batch row needs it
	dst    buffer               // the target's buffer when it is in this process
}

func (e *engine) runProcs(ctx context.Context, procs int, size uint64) (err error) {
	var t *target
	if procs == 1 {
		t, err = newLocalTarget(e.p, e.localTargetParams, size)
	} else {
		t, err = startProcTarget(e.cfg, e.targetParams, size)
	}
	if err != nil {
		return err
	}
	defer func() {
		if cerr := t.close(); err == nil && cerr != nil {
			err = cerr
		}
	}()
	ps := &peerSide{t: t, meta: t.meta(), dst: t.local()}
	if ps.name, err = e.ag.LoadRemote(ps.meta.Metadata); err != nil {
		return fmt.Errorf("bench: loading the target's metadata: %w", err)
	}
	defer func() {
		if rerr := e.ag.RemoveRemote(ps.name); err == nil && rerr != nil {
			err = fmt.Errorf("bench: removing the target: %w", rerr)
		}
	}()
	c := e.cfg
	for _, op := range c.Ops {
		for _, path := range c.Paths {
			for _, threads := range c.Threads {
				for _, block := range c.Blocks {
					for _, batch := range c.Batches {
						spec := Row{Procs: procs, Op: op.String(), Path: path, Threads: threads, Block: block, Batch: batch,
							Sweep: e.sweep, InitiatorParams: e.initParams}
						if !e.fits(block, batch, threads) {
							e.res.Skipped = append(e.res.Skipped, fmt.Sprintf("%s %s: %d threads x %d x %s is over --max-buffer %s",
								spec.Label(), FormatSize(block), threads, batch, FormatSize(block), FormatSize(c.MaxBuffer)))
							continue
						}
						if err := ctx.Err(); err != nil {
							return err
						}
						row, err := e.runRow(ctx, ps, op, spec)
						if err != nil {
							return fmt.Errorf("bench: %s %s: %w", spec.Label(), FormatSize(block), err)
						}
						e.res.Rows = append(e.res.Rows, row)
						if e.onRow != nil {
							e.onRow(row)
						}
					}
				}
			}
		}
	}
	return nil
}

// remoteRegion imports the target's whole buffer once, by address where
// the agent can, else from the region blob.
func (e *engine) remoteRegion(ps *peerSide) (*plugin.RemoteRegion, error) {
	if ps.remote != nil {
		return ps.remote, nil
	}
	var err error
	switch {
	case e.ag.Caps()&abi.CapRemoteAddr != 0:
		ps.remote, err = e.ag.ImportRange(ps.name, ps.meta.Addr, ps.meta.Size, 0, abi.DRAM)
	case len(ps.meta.Blob) > 0:
		ps.remote, err = e.ag.ImportRegion(ps.name, ps.meta.Blob)
	default:
		return nil, errors.New("the plugin imports remote regions neither by address nor by blob: no batch path")
	}
	if err != nil {
		return nil, fmt.Errorf("importing the target's region: %w", err)
	}
	return ps.remote, nil
}

// worker is one thread of a row: its transfer description, its baseline
// copiers and its samples.
type worker struct {
	ag        *plugin.Agent
	op        abi.Op
	path      Path
	ldl, rdl  *plugin.DList
	idx       []int32
	pairs     []plugin.Pair
	entries   []abi.BatchEntry
	telemetry bool
	wait      bool // Xfer.Wait (backoff) instead of polling back to back

	copiers []namedCopier

	prep, post, tx, lat phase
	plugPost, plugXfer  time.Duration
	plugN               int
	cpu                 time.Duration // thread CPU time of recorded transfers

	// Per round: iterations done, time spent in the subject's iterations
	// (latency, i.e. make to release) and in each copier's, and the paired
	// ratio of each iteration (best copier time over transfer time).
	iters      int
	subject    time.Duration
	base       []time.Duration // by copier index
	ratio      phase           // in parts per million (ratioScale)
	start, end time.Time
}

type namedCopier struct {
	name string
	copier
}

// transfer runs one iteration: submit (make and post in one call), poll to
// completion with the poll that releases the transfer (PollRelease: its
// telemetry comes with it), and returns its latency: one plugin call to
// start and one to finish on a plugin with CapSubmit. With Config.Wait the
// agent's completion engine finishes it (Engine.Finish: polls in this
// goroutine for a moment, then waits for the engine, as the runtimes do).
// A recorded iteration adds it to w.subject.
func (w *worker) transfer(record bool) (time.Duration, error) {
	cpu0 := threadCPU()
	t0 := time.Now()
	var x *plugin.Xfer
	var done bool
	var err error
	if w.path == Prepped {
		x, done, err = w.ag.SubmitPrepped(w.op, w.ldl, w.idx, w.rdl, w.idx, nil)
	} else {
		x, done, err = w.ag.SubmitBatch(w.op, w.pairs, w.entries, nil)
	}
	if err != nil {
		return 0, fmt.Errorf("submitting the transfer: %w", err)
	}
	t1 := time.Now()
	var tel plugin.Telemetry
	if w.wait {
		ev := w.ag.Engine().Finish(context.Background(), x, t0, t1.Sub(t0), plugin.Watch{})
		err = ev.Err
		tel = plugin.Telemetry{Post: ev.Post, Xfer: ev.Xfer}
	} else if w.ag.Caps().Has(abi.CapSubmit) || w.telemetry {
		// Also when done at submit: the poll releases it (and brings the
		// telemetry).
		for {
			if done, tel, err = x.PollRelease(); done || err != nil {
				break
			}
		}
	} else {
		// Without native submit the emulated PollRelease also reads the
		// telemetry, a plugin call the run did not ask for: poll, then
		// release, as before submit existed.
		for !done && err == nil {
			done, err = x.Poll()
		}
		if err == nil {
			err = x.Close()
		}
	}
	t3 := time.Now()
	if err != nil {
		x.Close()
		return 0, fmt.Errorf("transfer: %w", err)
	}
	if w.telemetry && record {
		w.plugPost += tel.Post
		w.plugXfer += tel.Xfer
		w.plugN++
	}
	if record {
		w.cpu += threadCPU() - cpu0
		w.prep.add(t1.Sub(t0)) // make and post: one submit call
		w.post.add(0)
		w.tx.add(t3.Sub(t0))
		w.lat.add(t3.Sub(t0))
		w.subject += t3.Sub(t0)
	}
	return t3.Sub(t0), nil
}

// interleaved runs iterations until it has done at least minIters and
// spent at least d; each iteration is one transfer and one run of every
// copier, in an order that rotates, so that whatever slows the machine
// down slows the subject and the baselines alike.
func (w *worker) interleaved(rr *rowRun, minIters int, d time.Duration) {
	w.iters, w.subject = 0, 0
	w.ratio = phase{keep: w.ratio.keep[:0]}
	w.base = w.base[:0]
	for range w.copiers {
		w.base = append(w.base, 0)
	}
	n := len(w.copiers) + 1
	for w.iters < minIters || time.Since(w.start) < d {
		var subject, best time.Duration
		for k := range n {
			if rr.stop.Load() {
				return
			}
			j := (k + w.iters) % n
			if j == 0 {
				lat, err := w.transfer(true)
				if err != nil {
					rr.fail(err)
					return
				}
				subject = lat
				continue
			}
			t0 := time.Now()
			err := w.copiers[j-1].run()
			took := time.Since(t0)
			w.base[j-1] += took
			if err != nil {
				rr.fail(fmt.Errorf("baseline %s: %w", w.copiers[j-1].name, err))
				return
			}
			if best == 0 || took < best {
				best = took
			}
		}
		w.ratio.add(time.Duration(float64(best) / float64(max(subject, 1)) * ratioScale))
		w.iters++
	}
}

// rowRun is the state of one row.
type rowRun struct {
	workers []*worker
	stop    atomic.Bool // set with the first error: threads stop
	mu      sync.Mutex
	err     error // the first error (a thread's, or ctx's)
}

func (rr *rowRun) fail(err error) {
	rr.mu.Lock()
	if rr.err == nil {
		rr.err = err
	}
	rr.mu.Unlock()
	rr.stop.Store(true)
}

func (rr *rowRun) firstErr() error {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	return rr.err
}

// parallel runs f on every worker at once and returns the wall time from
// the first start to the last end.
func (rr *rowRun) parallel(f func(w *worker)) time.Duration {
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for _, w := range rr.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// One OS thread per worker, so that its thread CPU time is
			// the worker's.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			<-gate
			w.start = time.Now()
			f(w)
			w.end = time.Now()
		}()
	}
	close(gate)
	wg.Wait()
	first, last := rr.workers[0].start, rr.workers[0].end
	for _, w := range rr.workers[1:] {
		if w.start.Before(first) {
			first = w.start
		}
		if w.end.After(last) {
			last = w.end
		}
	}
	return last.Sub(first)
}

func (e *engine) runRow(ctx context.Context, ps *peerSide, op abi.Op, spec Row) (Row, error) {
	c := e.cfg
	block, batch, threads := spec.Block, spec.Batch, spec.Threads
	n := rowBytes(block, batch, threads)
	e.seed++
	seed := e.seed

	// The source holds the row's pattern; the destination is checked at the
	// end.
	if op == abi.Write {
		fill(e.buf, n, seed)
	} else if err := ps.t.fill(n, seed); err != nil {
		return spec, err
	}

	rr := &rowRun{}
	// Cancelling ctx stops the threads between iterations.
	defer context.AfterFunc(ctx, func() { rr.fail(ctx.Err()) })()
	var ldl, rdl *plugin.DList
	defer func() {
		if ldl != nil {
			ldl.Close()
		}
		if rdl != nil {
			rdl.Close()
		}
	}()
	if spec.Path == Prepped {
		ld := make([]abi.XferDesc, threads*batch)
		rd := make([]abi.XferDesc, threads*batch)
		for i := range ld {
			o := uint64(i) * block
			ld[i] = abi.XferDesc{Addr: e.buf.addr() + o, Len: block, Count: 1}
			rd[i] = abi.XferDesc{Addr: ps.meta.Addr + o, Len: block, Count: 1}
		}
		var err error
		if ldl, err = e.ag.PrepLocal(abi.DRAM, ld); err != nil {
			return spec, fmt.Errorf("preparing the local list: %w", err)
		}
		if rdl, err = e.ag.PrepRemote(ps.name, abi.DRAM, rd); err != nil {
			return spec, fmt.Errorf("preparing the remote list: %w", err)
		}
	}
	var pairs []plugin.Pair
	if spec.Path == Batch {
		rem, err := e.remoteRegion(ps)
		if err != nil {
			return spec, err
		}
		pairs = []plugin.Pair{{Local: e.reg, Remote: rem}}
	}
	// Source and destination as this process sees them (for memcpy).
	src, dst := e.buf, ps.dst
	if op == abi.Read {
		src, dst = dst, src
	}
	var orderRng *rand.Rand
	if c.Scatter {
		spec.Scattered = true
		orderRng = rand.New(rand.NewPCG(uint64(block), uint64(batch)))
	}
	for t := range threads {
		span := blockSpan{off: uint64(t*batch) * block, block: block, count: batch}
		w := &worker{ag: e.ag, op: op, path: spec.Path, ldl: ldl, rdl: rdl, pairs: pairs, telemetry: c.Telemetry, wait: c.Wait}
		order := blockOrder(t*batch, batch, orderRng)
		if spec.Path == Prepped {
			w.idx = order
		} else {
			w.entries = make([]abi.BatchEntry, batch)
			for i, b := range order {
				o := uint64(b) * block
				w.entries[i] = abi.BatchEntry{LocalOffset: o, RemoteOffset: o, Len: block, Count: 1}
			}
		}
		if ps.dst != nil {
			spec.Baseline = BaselineMemcpy
			w.copiers = []namedCopier{
				{"go-copy", newGoCopier(src, dst, span)},
				{"libc-memcpy", newLibcCopier(e.memcpy, src, dst, span)},
			}
		} else {
			spec.Baseline = BaselineReadv
			if op == abi.Write {
				spec.Baseline = BaselineWritev
			}
			w.copiers = []namedCopier{{spec.Baseline, newPVMCopier(ps.meta.Pid, op == abi.Write, e.buf, ps.meta.Addr, span)}}
		}
		rr.workers = append(rr.workers, w)
	}

	// Warm-up: page faults, caches, the plugin's workers.
	rr.parallel(func(w *worker) {
		for range c.Warmup {
			if rr.stop.Load() {
				return
			}
			if _, err := w.transfer(false); err != nil {
				rr.fail(err)
				return
			}
			for _, cp := range w.copiers {
				if err := cp.run(); err != nil {
					rr.fail(err)
					return
				}
			}
		}
	})
	if err := rr.firstErr(); err != nil {
		return spec, err
	}

	perRound := c.Time / time.Duration(c.Rounds)
	minIters := (c.Iters + c.Rounds - 1) / c.Rounds
	rowBytes := float64(block) * float64(batch)
	var rates, baseRates []float64
	var ratios phase // every iteration's paired ratio, all rounds and threads
	for range c.Rounds {
		rr.parallel(func(w *worker) { w.interleaved(rr, minIters, perRound) })
		if err := rr.firstErr(); err != nil {
			return spec, err
		}
		// Rates are per thread, summed: each thread's bytes over the time
		// its own iterations took.
		rd := Round{Baseline: map[string]float64{}}
		base := make([]float64, len(rr.workers[0].copiers))
		for _, w := range rr.workers {
			b := float64(w.iters) * rowBytes / 1e9
			rd.GBps += b / w.subject.Seconds()
			for j, d := range w.base {
				base[j] += b / d.Seconds()
			}
		}
		best := 0.0
		for j, r := range base {
			rd.Baseline[rr.workers[0].copiers[j].name] = r
			best = max(best, r)
		}
		var rs []*phase
		for _, w := range rr.workers {
			rs = append(rs, &w.ratio)
		}
		round := merge(rs...)
		rd.Efficiency = float64(round.quantile(0.5)) / ratioScale
		ratios.keep = append(ratios.keep, round.keep...)
		spec.Rounds = append(spec.Rounds, rd)
		rates = append(rates, rd.GBps)
		baseRates = append(baseRates, best)
		e.done++
		if c.Progress != nil {
			c.Progress(e.done, e.total, fmt.Sprintf("%s %s", spec.Label(), FormatSize(block)))
		}
		if err := ctx.Err(); err != nil {
			return spec, err
		}
	}
	spec.GBps = quantile.Median(rates)
	spec.BaselineGBps = quantile.Median(baseRates)
	spec.Efficiency = float64(ratios.quantile(0.5)) / ratioScale

	var prepS, postS, txS, latS []*phase
	var plugPost, plugXfer, cpu time.Duration
	var plugN int
	for _, w := range rr.workers {
		cpu += w.cpu
		prepS, postS, txS, latS = append(prepS, &w.prep), append(postS, &w.post), append(txS, &w.tx), append(latS, &w.lat)
		plugPost += w.plugPost
		plugXfer += w.plugXfer
		plugN += w.plugN
	}
	prep, post, tx, lat := merge(prepS...), merge(postS...), merge(txS...), merge(latS...)
	spec.Iters = int(lat.n)
	if lat.n > 0 {
		spec.CPUUs = float64(cpu.Nanoseconds()) / float64(lat.n) / 1e3
	}
	spec.AvgLatUs = lat.avgUs()
	spec.AvgPrepUs, spec.P99PrepUs = prep.avgUs(), prep.pctUs(0.99)
	spec.AvgPostUs, spec.P99PostUs = post.avgUs(), post.pctUs(0.99)
	spec.AvgTxUs, spec.P99TxUs = tx.avgUs(), tx.pctUs(0.99)
	if plugN > 0 {
		spec.PluginPostUs = float64(plugPost.Nanoseconds()) / float64(plugN) / 1e3
		spec.PluginXferUs = float64(plugXfer.Nanoseconds()) / float64(plugN) / 1e3
	}

	// Verification: clear the destination, one transfer per thread, check.
	var bad int64
	var err error
	if op == abi.Write {
		err = ps.t.clear(n)
	} else {
		clear0(e.buf, n)
	}
	if err != nil {
		return spec, err
	}
	for _, w := range rr.workers {
		if _, err := w.transfer(false); err != nil {
			return spec, fmt.Errorf("verification transfer: %w", err)
		}
	}
	if op == abi.Write {
		bad, err = ps.t.verify(n, seed)
	} else {
		bad = verify(e.buf, n, seed)
	}
	if err != nil {
		return spec, err
	}
	if bad >= 0 {
		return spec, fmt.Errorf("verification failed: byte %d of the destination differs from the source", bad)
	}
	spec.Verified = true
	return spec, nil
}

// blockOrder returns the indices of the n blocks from first on, in the
// order a transfer lists them: ascending, or shuffled with rng (Scatter;
// of n shuffled blocks about one pair stays adjacent on average, which
// leaves NIXL next to nothing to merge).
func blockOrder(first, n int, rng *rand.Rand) []int32 {
	idx := make([]int32, n)
	for i := range idx {
		idx[i] = int32(first + i)
	}
	if rng != nil {
		rng.Shuffle(n, func(i, j int) { idx[i], idx[j] = idx[j], idx[i] })
	}
	return idx
}

// threadCPU returns the CPU time the calling OS thread has used (the
// goroutine must be locked to it).
func threadCPU() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
