package pushworker

import (
	"context"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// DecodeOptions configures a decode worker.
type DecodeOptions struct {
	Common
	// BootstrapAddr is the prefill deployment's bootstrap server.
	BootstrapAddr string
	// InitTimeout bounds waiting for the prefill deployment to come up
	// (default 60 s).
	InitTimeout time.Duration
}

type decodeRank struct {
	*rank
	m *push.Decode
}

// RunDecode runs a decode worker's ranks over the whole workload: for each
// request, allocate pages, fill the prefix it already holds, send the
// metadata, wait for the transfer, then check every byte of every token
// (KV and aux) with kvpool's formula. It returns when every request
// finished.
func RunDecode(ctx context.Context, o DecodeOptions) (*Summary, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	if o.InitTimeout <= 0 {
		o.InitTimeout = 60 * time.Second
	}
	st := &stats{extra: o.Observer}
	rks, err := o.ranks(false)
	if err != nil {
		return nil, err
	}
	var drs []*decodeRank
	defer func() {
		for _, d := range drs {
			d.m.Close()
		}
		for _, r := range rks {
			r.close()
		}
	}()
	for _, r := range rks {
		m, err := push.NewDecode(ctx, push.DecodeConfig{
			Plugin: o.Plugin, AgentParams: o.AgentParams,
			Variant: o.Variant, Completion: o.Completion,
			KV: r.args, Parallel: r.par, MLA: o.Shape.MLA, Host: o.Host,
			Settings: o.Settings, Observer: st, Logger: o.Logger,
		})
		if err != nil {
			return nil, fmt.Errorf("decode rank %s: %w", r, err)
		}
		drs = append(drs, &decodeRank{rank: r, m: m})
	}
	live := newLiveRooms()
	o.ready(live)
	reqs := o.Workload.List(o.Shape.PageSize)
	t := newTally()
	cpu := o.beginCPU()
	start := time.Now()
	runRanks(ctx, len(drs), reqs, o.Concurrency, o.finished(t), func(i int, req Request) {
		drs[i].serve(ctx, &o, req, t, live)
	})
	elapsed := time.Since(start)
	cpuUsed := cpu.Measure(o.Logger)
	s := &Summary{Role: "decode", Variant: o.Variant.String(), Completion: o.Completion.String(), Checked: !o.NoBytes}
	for _, d := range drs {
		s.Ranks = append(s.Ranks, d.String())
		s.Dropped += d.m.Dropped()
		s.Leaked += d.m.Rooms()
	}
	t.finish(s, reqs, elapsed)
	s.CPU = cpuUsed
	s.Bytes = t.bytes
	if elapsed > 0 {
		s.GBps = float64(s.Bytes) / elapsed.Seconds() / 1e9
	}
	return s, ctx.Err()
}

// serve runs one request on one decode rank.
func (d *decodeRank) serve(ctx context.Context, o *DecodeOptions, req Request, t *tally, live *liveRooms) {
	fail := func(reason string, verify bool) {
		t.fail(RequestFailure{Room: req.Room, Rank: d.String(), Reason: reason, Abort: req.Abort}, verify)
	}
	r, err := d.m.NewReceiver(o.BootstrapAddr, req.Room)
	if err != nil {
		fail(err.Error(), false)
		return
	}
	defer r.Close()
	defer live.hold(r)()
	ictx, cancel := context.WithTimeout(ctx, o.InitTimeout)
	err = r.Init(ictx)
	cancel()
	if err != nil {
		fail(r.Failure().Error(), false)
		return
	}
	ps := o.Shape.PageSize
	total := pagesFor(req.Tokens, ps)
	pages, err := d.pages.Get(ctx, total)
	if err != nil {
		r.Abort()
		fail(err.Error(), false)
		return
	}
	defer d.pages.Put(pages)
	auxSlot, err := d.aux.Get(ctx, 1)
	if err != nil {
		r.Abort()
		fail(err.Error(), false)
		return
	}
	defer d.aux.Put(auxSlot)
	// Stale bytes of earlier requests must not pass the check.
	if !o.NoBytes {
		if err := d.pool.ClearPages(pages); err != nil {
			r.Abort()
			fail(err.Error(), false)
			return
		}
		aux := d.args.Aux[0]
		clear(aux.Mem[uint64(auxSlot[0])*aux.ItemLen : uint64(auxSlot[0]+1)*aux.ItemLen])
	}
	// The prefix is what this rank's cache already holds.
	if req.Prefix > 0 && !o.NoBytes {
		if err := d.pool.Fill(kvpool.Tokens{Request: req.Room, Pages: pages, First: 0, Count: req.Prefix}); err != nil {
			r.Abort()
			fail(err.Error(), false)
			return
		}
	}
	begin := time.Now()
	if err := r.SendMetadata(ctx, pages[req.Prefix/ps:], int64(auxSlot[0]), nil, int64(req.Prefix)); err != nil {
		fail(r.Failure().Error(), false)
		return
	}
	if req.Abort {
		r.Abort()
		fail(r.Failure().Error(), false)
		return
	}
	st, err := r.Wait(ctx)
	switch {
	case err != nil:
		fail(err.Error(), false)
		return
	case st != sglang.KVPollSuccess:
		fail(r.Failure().Error(), false)
		return
	}
	lat := time.Since(begin)
	bytes := uint64(req.Tokens-req.Prefix) * uint64(d.args.KVHeadNum) * uint64(o.Shape.HeadBytes) * uint64(len(d.args.KV))
	if o.NoBytes {
		t.ok(lat, bytes)
		return
	}
	if err := d.pool.Verify(kvpool.Tokens{Request: req.Room, Pages: pages, First: 0, Count: req.Tokens}); err != nil {
		fail("verify: "+err.Error(), true)
		return
	}
	if err := d.pool.VerifyAux(req.Room, int(auxSlot[0])); err != nil {
		fail("verify: "+err.Error(), true)
		return
	}
	t.ok(lat, bytes)
}
