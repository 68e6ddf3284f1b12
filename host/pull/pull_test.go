package pull

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// pullCase is one geometry pairing, run in this process (both agents of
// the fake plugin copy with memcpy here; the two-process runs are in
// ./demo).
type pullCase struct {
	name            string
	prefill, decode geom
	params          []plugin.Param // decode agent params
}

func pullCases() []pullCase {
	base := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 1, blockSize: 8, blocks: 256}
	with := func(g geom, f func(*geom)) geom { f(&g); return g }
	return []pullCase{
		{name: "equal-tp", prefill: with(base, func(g *geom) { g.tp = 2 }), decode: with(base, func(g *geom) { g.tp = 2 })},
		{name: "decode-tp-2x", prefill: with(base, func(g *geom) { g.tp = 2 }), decode: with(base, func(g *geom) { g.tp = 4 })},
		{name: "nhd-equal-tp", prefill: with(base, func(g *geom) { g.hnd = false }), decode: with(base, func(g *geom) { g.hnd = false })},
		{name: "mla", prefill: with(base, func(g *geom) { g.mla = true; g.headBytes = 72 }),
			decode: with(base, func(g *geom) { g.mla = true; g.headBytes = 72; g.tp = 2 })},
		{name: "replicated-kv", prefill: with(base, func(g *geom) { g.heads = 2; g.tp = 2 }),
			decode: with(base, func(g *geom) { g.heads = 2; g.tp = 4 })},
		{name: "block-size-2x-hnd", prefill: base, decode: with(base, func(g *geom) { g.blockSize = 16 })},
		{name: "block-size-4x-nhd", prefill: with(base, func(g *geom) { g.hnd = false; g.blockSize = 4 }),
			decode: with(base, func(g *geom) { g.hnd = false; g.blockSize = 16 })},
		{name: "block-size-2x-tp-2x", prefill: base, decode: with(base, func(g *geom) { g.tp = 2; g.blockSize = 16 })},
		{name: "blocks-first", prefill: with(base, func(g *geom) { g.blocksFirst = true }),
			decode: with(base, func(g *geom) { g.blocksFirst = true; g.tp = 2 })},
		{name: "blocks-first-nhd-block-size-2x", prefill: with(base, func(g *geom) { g.blocksFirst = true; g.hnd = false }),
			decode: with(base, func(g *geom) { g.blocksFirst = true; g.hnd = false; g.blockSize = 16 })},
		{name: "emulated-prepped-no-telemetry", prefill: base, decode: base,
			params: []plugin.Param{{Key: "caps_off", Value: "prepped,telemetry"}}},
	}
}

// TestPullInProcess pulls requests with partial and full prefix hits for
// every geometry pairing and checks every byte on every decode rank, and
// that the prefill releases each request on notification.
func TestPullInProcess(t *testing.T) {
	for _, c := range pullCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			runPull(t, c, 12, 90)
		})
	}
}

// TestPullInProcessGenerations: the same pairings in every other wire
// generation: each side speaks it (handshake, metadata, notification
// count), every byte checked, every request released on notification.
func TestPullInProcessGenerations(t *testing.T) {
	for _, v := range vllm.Versions() {
		if v == vllm.DefaultVersion {
			continue // TestPullInProcess
		}
		g, _ := vllm.Lookup(v)
		for _, c := range pullCases() {
			t.Run(fmt.Sprintf("v%d/%s", v, c.name), func(t *testing.T) {
				t.Parallel()
				runPullGen(t, c, 8, 90, g)
			})
		}
	}
}

func runPull(t *testing.T, c pullCase, requests, maxTokens int) {
	runPullGen(t, c, requests, maxTokens, nil)
}

func runPullGen(t *testing.T, c pullCase, requests, maxTokens int, gen *vllm.Generation) {
	rng := rand.New(rand.NewPCG(uint64(len(c.name)), 1))
	ps := newPrefillSide(t, c.prefill, "prefill", func(cfg *SenderConfig) { cfg.Gen = gen })
	ds := newDecodeSide(t, c.decode, func(cfg *ReceiverConfig) { cfg.Gen = gen }, c.params...)

	type req struct {
		id          string
		tokens, hit int
		local       []int32
		loads       []*Load
		pblocks     []int32
	}
	pFree := rng.Perm(c.prefill.blocks)
	dFree := rng.Perm(c.decode.blocks)
	take := func(free *[]int, n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32((*free)[i])
		}
		*free = (*free)[n:]
		return out
	}
	var reqs []*req
	partial, full := 0, 0
	for i := 0; i < requests; i++ {
		r := &req{id: fmt.Sprintf("r%d", i), tokens: 1 + rng.IntN(maxTokens)}
		r.pblocks = take(&pFree, (r.tokens+c.prefill.blockSize-1)/c.prefill.blockSize)
		dn := (r.tokens + c.decode.blockSize - 1) / c.decode.blockSize
		r.local = take(&dFree, dn)
		switch i % 4 {
		case 1: // partial prefix hit
			if dn > 1 {
				r.hit = 1 + rng.IntN(dn-1)
				partial++
			}
		case 3:
			r.hit = dn
			full++
		}
		seed := uint64(1000 + i)
		for _, p := range ps.pools {
			if err := p.Fill(kvpool.Tokens{Request: seed, Pages: r.pblocks, Count: r.tokens}); err != nil {
				t.Fatal(err)
			}
		}
		for _, p := range ds.pools { // the decode's own prefix cache
			if err := p.Fill(kvpool.Tokens{Request: seed, Pages: r.local, Count: min(r.hit*c.decode.blockSize, r.tokens)}); err != nil {
				t.Fatal(err)
			}
		}
		params, err := ps.sender.Hold("prefill-"+r.id, r.pblocks)
		if err != nil {
			t.Fatal(err)
		}
		for _, rx := range ds.rx {
			r.loads = append(r.loads, rx.Load(LoadRequest{RequestID: r.id, LocalBlockIDs: r.local[r.hit:], Params: params}))
		}
		reqs = append(reqs, r)
	}
	if partial == 0 || full == 0 {
		t.Fatalf("the case needs partial (%d) and full (%d) prefix hits", partial, full)
	}
	for i, r := range reqs {
		for rank, l := range r.loads {
			res, err := l.Wait(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if res.Err != nil {
				t.Fatalf("%s rank %d: %v", r.id, rank, res.Err)
			}
			if res.NotifyOnly != (r.hit == len(r.local)) {
				t.Fatalf("%s rank %d: notify-only %v with %d of %d blocks hit", r.id, rank, res.NotifyOnly, r.hit, len(r.local))
			}
			if !res.NotifyOnly && (res.Stat.Bytes == 0 || res.Stat.Descs == 0) {
				t.Fatalf("%s rank %d: READ without bytes or descriptors: %+v", r.id, rank, res.Stat)
			}
			// vLLM's kv_connector/v1/nixl_connector.py's READ: one descriptor per (virtual region, block read).
			if !res.NotifyOnly && c.decode.blockSize == c.prefill.blockSize {
				regions := len(ds.pools[rank].Regions())
				if c.decode.blocksFirst {
					regions *= 2
				}
				if want := uint64(regions * (len(r.local) - r.hit)); res.Stat.Descs != want {
					t.Fatalf("%s rank %d: %d descriptors, vLLM's kv_connector/v1/nixl_connector.py's READ has %d", r.id, rank, res.Stat.Descs, want)
				}
			}
		}
		for rank, p := range ds.pools {
			if err := p.Verify(kvpool.Tokens{Request: uint64(1000 + i), Pages: r.local, Count: r.tokens}); err != nil {
				t.Fatalf("%s (%d tokens, %d of %d blocks hit) rank %d: %v", r.id, r.tokens, r.hit, len(r.local), rank, err)
			}
		}
	}
	released := map[string]bool{}
	deadline := time.After(10 * time.Second)
	for len(released) < len(reqs) {
		select {
		case rel := <-ps.releases:
			if rel.Reason != ReleaseNotified {
				t.Fatalf("%s released %s", rel.RequestID, rel.Reason)
			}
			if want := c.decode.tp; rel.Notified != want {
				t.Fatalf("%s released after %d notifications, want %d (one per decode rank)", rel.RequestID, rel.Notified, want)
			}
			released[rel.RequestID] = true
		case <-deadline:
			t.Fatalf("prefill released %d of %d requests", len(released), len(reqs))
		}
	}
	if got := ps.sender.Counts(); got.UnknownNotifications+got.MalformedNotifications != 0 || got.Held != 0 {
		t.Fatalf("sender counts %+v", got)
	}
	for rank, rx := range ds.rx {
		if bad := rx.BlockIDsWithLoadErrors(); len(bad) != 0 {
			t.Fatalf("rank %d reports invalid blocks %v", rank, bad)
		}
		st := rx.TakeStats()
		if st.FailedTransfers != 0 || st.FailedNotifications != 0 || len(st.Transfers) != requests-full {
			t.Fatalf("rank %d stats: %d transfers (want %d), %d failed, %d failed notifications",
				rank, len(st.Transfers), requests-full, st.FailedTransfers, st.FailedNotifications)
		}
		for i, tr := range st.Transfers {
			if tr.Plan <= 0 {
				t.Fatalf("rank %d: transfer %d without planning time: %+v", rank, i, tr)
			}
		}
		if n := rx.Pending(); n != 0 {
			t.Fatalf("rank %d: %d loads still pending", rank, n)
		}
		if peers := rx.Peers(); len(peers) != 1 {
			t.Fatalf("rank %d: %d handshakes, want 1", rank, len(peers))
		}
	}
}
