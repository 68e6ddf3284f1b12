package pushworker

import (
	"fmt"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/demo/synth"
	"github.com/kvhost/kvhost/host/push"
)

// Shape is the model and pool shape of a worker (the same on both sides,
// except Pages and MemKinds, which each side chooses).
type Shape struct {
	MLA        bool
	Layers     int // the model's layers
	KVHeads    int // the model's KV heads (MHA)
	HeadBytes  int // bytes of one head of one token (MLA: the latent row)
	PageSize   int // tokens per page
	Pages      int // pages per rank (0: enough for Concurrency requests of MaxTokens)
	AuxItemLen int // bytes of one request's aux (metadata) slot (0: 64)
	// MemKinds places the KV regions: "vram" (default), "dram", or
	// "mixed" (MHA: K regions VRAM, V regions DRAM; MLA: the second half of
	// the layers DRAM). The fake plugin treats both as host memory.
	MemKinds string
}

// Check reports the first unusable field.
func (s Shape) Check() error {
	switch {
	case s.Layers < 1:
		return fmt.Errorf("shape: %d layers", s.Layers)
	case !s.MLA && s.KVHeads < 1:
		return fmt.Errorf("shape: %d KV heads", s.KVHeads)
	case s.HeadBytes < 1:
		return fmt.Errorf("shape: head of %d bytes", s.HeadBytes)
	case s.PageSize < 1:
		return fmt.Errorf("shape: page size %d", s.PageSize)
	case s.Pages < 0 || s.AuxItemLen < 0:
		return fmt.Errorf("shape: %d pages, aux item %d bytes", s.Pages, s.AuxItemLen)
	}
	switch strings.ToLower(s.MemKinds) {
	case "", "vram", "dram", "mixed":
	default:
		return fmt.Errorf("shape: memory kinds %q (want vram, dram or mixed)", s.MemKinds)
	}
	return nil
}

// rank is one rank's pool and what the runtime needs to know about it.
type rank struct {
	tp, pp int
	pool   *kvpool.Pool
	args   push.KVArgs
	par    push.Parallel
	pages  *synth.Allocator // KV pages
	aux    *synth.Allocator // aux slots
}

func (r *rank) String() string { return fmt.Sprintf("tp%d/pp%d", r.tp, r.pp) }

// stageLayers returns the layers [start, start+n) PP stage pp of ppSize
// holds: an even split, earlier stages taking the remainder.
func stageLayers(layers, ppSize, pp int) (start, n int) {
	base, extra := layers/ppSize, layers%ppSize
	start = pp*base + min(pp, extra)
	n = base
	if pp < extra {
		n++
	}
	return start, n
}

// newRank maps one rank's pool.
func newRank(s Shape, prefill bool, tpSize, tp, ppSize, pp, pages, auxSlots int, seed uint64) (*rank, error) {
	start, n := stageLayers(s.Layers, ppSize, pp)
	if n < 1 {
		return nil, fmt.Errorf("PP stage %d of %d holds no layer of %d", pp, ppSize, s.Layers)
	}
	aux := s.AuxItemLen
	if aux == 0 {
		aux = 64
	}
	g := kvpool.Geometry{
		Attention: kvpool.MHA, Order: kvpool.KThenV,
		Layers: n, StartLayer: start, Pages: pages, PageSize: s.PageSize,
		TotalHeads: s.KVHeads, TPSize: tpSize, TPRank: tp, HeadBytes: s.HeadBytes,
		AuxItems: auxSlots, AuxItemLen: aux,
	}
	if s.MLA {
		g.Attention = kvpool.MLA
		g.TotalHeads = 1
	}
	pool, err := kvpool.New(g)
	if err != nil {
		return nil, err
	}
	r := &rank{tp: tp, pp: pp, pool: pool,
		pages: synth.NewAllocator(pages, seed^uint64(tp)<<32^uint64(pp)<<48),
		aux:   synth.NewAllocator(auxSlots, seed^0xa0a0^uint64(tp)<<32^uint64(pp)<<48)}
	r.par = push.Parallel{TPSize: tpSize, TPRank: tp, PPSize: ppSize, PPRank: pp}
	regions := pool.Regions()
	kinds := strings.ToLower(s.MemKinds)
	if prefill && kinds == "mixed" {
		// SGLang NIXL needs one memory kind on the prefill side; mixed
		// pools are a decode feature (HiSparse host pools).
		kinds = "vram"
	}
	for i, reg := range regions {
		kind := abi.VRAM
		switch kinds {
		case "dram":
			kind = abi.DRAM
		case "mixed":
			if i >= len(regions)/2 {
				kind = abi.DRAM
			}
		}
		r.args.KV = append(r.args.KV, push.Buffer{Addr: reg.Addr, Len: reg.Len, ItemLen: g.ItemLen(), Kind: kind})
	}
	r.args.PageSize = s.PageSize
	r.args.KVHeadNum = g.HeadsLocal()
	r.args.TotalKVHeads = g.TotalHeads
	r.args.StartLayer = start
	if a := pool.Aux(); a.Len > 0 {
		mem := pool.Bytes()
		off := a.Addr - regions[0].Addr
		r.args.Aux = []push.AuxBuffer{{Mem: mem[off : off+a.Len : off+a.Len], ItemLen: uint64(aux)}}
	}
	return r, nil
}

func (r *rank) close() {
	if r.pool != nil {
		r.pool.Close()
	}
}

// parseRanks parses "0,1,3" or "0-3" (empty: all of 0..size-1).
func parseRanks(s string, size int) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		out := make([]int, size)
		for i := range out {
			out[i] = i
		}
		return out, nil
	}
	var out []int
	seen := map[int]bool{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		var lo, hi int
		if a, b, ok := strings.Cut(part, "-"); ok {
			if _, err := fmt.Sscanf(a+" "+b, "%d %d", &lo, &hi); err != nil {
				return nil, fmt.Errorf("rank range %q", part)
			}
		} else if _, err := fmt.Sscanf(part, "%d", &lo); err != nil {
			return nil, fmt.Errorf("rank %q", part)
		} else {
			hi = lo
		}
		if lo < 0 || hi < lo || hi >= size {
			return nil, fmt.Errorf("ranks %q outside [0, %d)", part, size)
		}
		for i := lo; i <= hi; i++ {
			if !seen[i] {
				seen[i] = true
				out = append(out, i)
			}
		}
	}
	return out, nil
}

// ParseRanks is parseRanks for the CLI: a comma list or ranges of ranks
// below size; empty means all.
func ParseRanks(s string, size int) ([]int, error) { return parseRanks(s, size) }
