package pull

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() || os.Getenv("KVHOST_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(discard{}, nil))
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

var agentSeq struct {
	sync.Mutex
	n int
}

func newAgent(t testing.TB, name string, params ...plugin.Param) *plugin.Agent {
	t.Helper()
	agentSeq.Lock()
	agentSeq.n++
	n := agentSeq.n
	agentSeq.Unlock()
	a, err := faketest.Plugin(t).NewAgent(fmt.Sprintf("%s-%d-%d", name, os.Getpid(), n), params...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// geom is a test scenario's shared model shape plus one side's engine.
type geom struct {
	mla, blocksFirst bool
	hnd              bool
	layers, heads    int
	headBytes        int
	tp, blockSize    int
	blocks           int
}

func (g geom) pool(t testing.TB, rank int) *kvpool.Pool {
	t.Helper()
	kg := kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.Interleaved, HeadMajor: g.hnd, Layers: g.layers,
		Pages: g.blocks, PageSize: g.blockSize, TotalHeads: g.heads, TPSize: g.tp, TPRank: rank, HeadBytes: g.headBytes}
	if g.mla {
		kg.Attention = kvpool.MLA
	}
	if g.blocksFirst {
		kg.Order = kvpool.BlocksFirst
	}
	p, err := kvpool.New(kg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func (g geom) layout() string {
	if g.hnd {
		return LayoutHND
	}
	return LayoutNHD
}

// cacheOf describes a pool as the runtime registers it.
func cacheOf(p *kvpool.Pool, layout string) Cache {
	g := p.Geometry()
	mem := p.Bytes()
	base := p.Regions()[0].Addr
	c := Cache{NumBlocks: g.Pages, BlockSize: g.PageSize, Layout: layout}
	for _, r := range p.Regions() {
		c.Regions = append(c.Regions, Region{Addr: r.Addr, Len: r.Len})
		off := r.Addr - base
		c.Host = append(c.Host, mem[off:off+r.Len:off+r.Len])
	}
	return c
}

const testHash = "test-compat-hash"

// prefillSide is a Sender over TP ranks of pools, in this process.
type prefillSide struct {
	g        geom
	pools    []*kvpool.Pool
	agents   []*plugin.Agent
	sender   *Sender
	releases chan Release
}

func newPrefillSide(t testing.TB, g geom, engineID string, mod func(*SenderConfig)) *prefillSide {
	t.Helper()
	ps := &prefillSide{g: g, releases: make(chan Release, 1024)}
	cfg := SenderConfig{EngineID: engineID, TPSize: g.tp, CompatHash: testHash, Listen: "tcp://127.0.0.1:0",
		AbortTimeout: time.Minute, Logger: testLogger(t), OnRelease: func(r Release) { ps.releases <- r }}
	for rank := 0; rank < g.tp; rank++ {
		p := g.pool(t, rank)
		a := newAgent(t, fmt.Sprintf("p%d", rank))
		ps.pools = append(ps.pools, p)
		ps.agents = append(ps.agents, a)
		cfg.Ranks = append(cfg.Ranks, SenderRank{TPRank: rank, Agent: a, Cache: cacheOf(p, g.layout())})
	}
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewSender(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ps.sender = s
	return ps
}

// decodeSide is one Receiver per TP rank of pools, in this process.
type decodeSide struct {
	g     geom
	pools []*kvpool.Pool
	rx    []*Receiver
}

func newDecodeSide(t testing.TB, g geom, mod func(*ReceiverConfig), params ...plugin.Param) *decodeSide {
	t.Helper()
	ds := &decodeSide{g: g}
	for rank := 0; rank < g.tp; rank++ {
		p := g.pool(t, rank)
		a := newAgent(t, fmt.Sprintf("d%d", rank), params...)
		cfg := ReceiverConfig{EngineID: "decode", TPRank: rank, TPSize: g.tp, Agent: a, Cache: cacheOf(p, g.layout()),
			MLA: g.mla, BlocksFirst: g.blocksFirst, TotalKVHeads: g.heads, CompatHash: testHash, Logger: testLogger(t)}
		if mod != nil {
			mod(&cfg)
		}
		rx, err := NewReceiver(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { rx.Close() })
		ds.pools = append(ds.pools, p)
		ds.rx = append(ds.rx, rx)
	}
	return ds
}

// randBlocks returns n distinct random blocks of [0, total).
func randBlocks(rng *rand.Rand, n, total int) []int32 {
	perm := rng.Perm(total)[:n]
	out := make([]int32, n)
	for i, b := range perm {
		out[i] = int32(b)
	}
	return out
}

// fetchPayload fetches a rank's handshake without validation (for tests
// that look at the bytes).
func fetchPayload(t testing.TB, endpoint string, rank int) *vllm.AgentMetadata {
	t.Helper()
	md, err := FetchHandshake(t.Context(), endpoint, rank, FetchOptions{
		Expect: vllm.Expect{LocalHash: testHash, EnforceHash: true, EngineID: "prefill"}})
	if err != nil {
		t.Fatal(err)
	}
	return md
}
