package pull

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
)

// BenchmarkPullRead measures one request's pull through the whole runtime
// (plan the ids, make the prepped READ, post, poll, telemetry, release; the
// prefill then counts the notification) on the fake plugin in one process,
// beside a baseline measured in the same iterations: Go's copy of exactly
// the same blocks, block by block. It reports both rates and their ratio.
//
//	go test ./host/pull -run '^$' -bench PullRead -benchtime 200x
func BenchmarkPullRead(b *testing.B) {
	for _, c := range []struct {
		name   string
		g      geom
		blocks int
	}{
		// 16 layers, 8 KV heads of 256 bytes, 16-token blocks: 32 KiB per
		// region block, 32 regions; a 512-token request moves 32 MiB.
		{"llama-512tok", geom{hnd: true, layers: 16, heads: 8, headBytes: 256, tp: 1, blockSize: 16, blocks: 256}, 32},
		// Short requests: 4 blocks (2 MiB), where per-request costs show.
		{"llama-64tok", geom{hnd: true, layers: 16, heads: 8, headBytes: 256, tp: 1, blockSize: 16, blocks: 256}, 4},
	} {
		b.Run(c.name, func(b *testing.B) { benchPull(b, c.g, c.blocks) })
	}
}

func benchPull(b *testing.B, g geom, n int) {
	ps := newPrefillSide(b, g, "prefill", nil)
	ds := newDecodeSide(b, g, nil)
	rng := rand.New(rand.NewPCG(1, 2))
	src, dst := cacheOf(ps.pools[0], LayoutHND), cacheOf(ds.pools[0], LayoutHND)
	blockLen := src.Regions[0].Len / uint64(g.blocks)
	bytesPerReq := float64(uint64(n) * blockLen * uint64(len(src.Regions)))
	for _, p := range ps.pools {
		if err := p.Fill(kvpool.Tokens{Request: 1, Pages: randBlocks(rng, g.blocks, g.blocks), Count: g.blocks * g.blockSize}); err != nil {
			b.Fatal(err)
		}
	}
	// Handshake outside the timing.
	warm := randBlocks(rng, n, g.blocks)
	p, err := ps.sender.Hold("warm", warm)
	if err != nil {
		b.Fatal(err)
	}
	if res := ds.rx[0].Load(LoadRequest{RequestID: "warm", LocalBlockIDs: warm, Params: p}).Result(); res.Err != nil {
		b.Fatal(res.Err)
	}
	var pullT, copyT time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		pb, lb := randBlocks(rng, n, g.blocks), randBlocks(rng, n, g.blocks)
		t0 := time.Now()
		for r := range src.Regions {
			s, d := src.Host[r], dst.Host[r]
			for k := range pb {
				so, do := uint64(pb[k])*blockLen, uint64(lb[k])*blockLen
				copy(d[do:do+blockLen], s[so:so+blockLen])
			}
		}
		t1 := time.Now()
		id := fmt.Sprintf("r%d", i)
		params, err := ps.sender.Hold(id, pb)
		if err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		res := ds.rx[0].Load(LoadRequest{RequestID: id, LocalBlockIDs: lb, Params: params}).Result()
		t3 := time.Now()
		if res.Err != nil {
			b.Fatal(res.Err)
		}
		copyT += t1.Sub(t0)
		pullT += t3.Sub(t2)
	}
	b.StopTimer()
	pullGB := bytesPerReq * float64(b.N) / pullT.Seconds() / 1e9
	copyGB := bytesPerReq * float64(b.N) / copyT.Seconds() / 1e9
	b.ReportMetric(pullGB, "pull_GB/s")
	b.ReportMetric(copyGB, "copy_GB/s")
	b.ReportMetric(pullGB/copyGB, "ratio")
	b.ReportMetric(float64(pullT.Microseconds())/float64(b.N), "pull_µs/req")
	b.ReportMetric(float64(n*len(src.Regions)), "descs/req")
}

// BenchmarkIssue measures the runtime's own per-request work on the host
// side, without bytes: planning a request's ids and the allocations of a
// Load, for a 512-token request over 32 regions (1024 descriptors).
func BenchmarkIssue(b *testing.B) {
	g := geom{hnd: true, layers: 16, heads: 8, headBytes: 256, tp: 1, blockSize: 16, blocks: 256}
	ps := newPrefillSide(b, g, "prefill", nil)
	ds := newDecodeSide(b, g, nil)
	rng := rand.New(rand.NewPCG(1, 2))
	pb, lb := randBlocks(rng, 32, g.blocks), randBlocks(rng, 32, g.blocks)
	params, err := ps.sender.Hold("warm", pb)
	if err != nil {
		b.Fatal(err)
	}
	rx := ds.rx[0]
	if res := rx.Load(LoadRequest{RequestID: "warm", LocalBlockIDs: lb, Params: params}).Result(); res.Err != nil {
		b.Fatal(res.Err)
	}
	pr := rx.peers["prefill"]
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rx.scratchMu.Lock()
		l, r, _, err := pr.reader.AppendRead(rx.lids[:0], rx.rids[:0], lb, pb)
		rx.lids, rx.rids = l[:0], r[:0]
		rx.scratchMu.Unlock()
		if err != nil {
			b.Fatal(err)
		}
	}
}
