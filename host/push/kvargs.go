package push

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/memkind"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/planner"
)

// Buffer is one registered memory range: a KV region of one layer (K or V,
// or the MLA latent), or a state tensor. Addr is an address in this process;
// the memory belongs to the caller and must stay mapped until the manager is
// closed. Len and ItemLen are bytes; ItemLen is the size of one page (KV)
// or one slot (state).
type Buffer struct {
	Addr    uint64
	Len     uint64
	ItemLen uint64
	Kind    abi.MemKind // DRAM or VRAM
}

// AuxBuffer is one aux (request metadata) buffer: host memory the runtime
// reads (prefill) or writes (decode, MORI's ZeroMQ aux path) itself, so it
// is given as a Go slice (which may view memory outside the Go heap).
// ItemLen is bytes per slot.
type AuxBuffer struct {
	Mem     []byte
	ItemLen uint64
}

func (b AuxBuffer) addr() uint64 {
	if len(b.Mem) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b.Mem[0])))
}

// StateComponent is one hybrid-model state component (SGLang
// kv_args.state_*[i]): its type and tensors.
type StateComponent struct {
	Type    planner.StateType
	Tensors []Buffer
	// DimPerTensor is the per-rank size of each tensor's TP-sharded axis
	// (Mamba); empty disables TP slicing.
	DimPerTensor []int
}

// KVArgs is what one rank registers: SGLang's KVArgs.
type KVArgs struct {
	// KV regions in SGLang's kv_data_ptrs order: K of every layer then V of
	// every layer (MLA: one region per layer). Every region holds the same
	// number of pages (Len / ItemLen).
	KV []Buffer
	// PageSize is tokens per page.
	PageSize int
	// KVHeadNum is the KV heads this rank holds; TotalKVHeads the model's
	// (0: KVHeadNum * attention TP size).
	KVHeadNum    int
	TotalKVHeads int
	// StartLayer is the first model layer this rank holds (prefill PP).
	StartLayer int
	// GPUID is the device ordinal sent to peers (gpu_id).
	GPUID int
	Aux   []AuxBuffer
	State []StateComponent
}

// Parallel is a rank's place in its deployment.
type Parallel struct {
	TPSize, TPRank int // attention TP (engine_rank is TPRank)
	PPSize, PPRank int
	DPSize, DPRank int // attention DP (1, 0 when unused)
	CPSize, CPRank int // attention CP; kvhost supports 1 only
}

func (p Parallel) withDefaults() Parallel {
	if p.PPSize <= 0 {
		p.PPSize = 1
	}
	if p.DPSize <= 0 {
		p.DPSize = 1
	}
	if p.CPSize <= 0 {
		p.CPSize = 1
	}
	return p
}

func (p Parallel) check() error {
	switch {
	case p.TPSize < 1 || p.TPRank < 0 || p.TPRank >= p.TPSize:
		return fmt.Errorf("push: TP rank %d of size %d", p.TPRank, p.TPSize)
	case p.PPRank < 0 || p.PPRank >= p.PPSize:
		return fmt.Errorf("push: PP rank %d of size %d", p.PPRank, p.PPSize)
	case p.DPRank < 0 || p.DPRank >= p.DPSize:
		return fmt.Errorf("push: DP rank %d of size %d", p.DPRank, p.DPSize)
	case p.CPSize != 1 || p.CPRank != 0:
		return fmt.Errorf("push: attention context parallelism (CP size %d) is not supported", p.CPSize)
	}
	return nil
}

// uniqueRank is the prefill rank's id on the wire: MORI's
// prefill_unique_rank, also used as the rank field of notification tags so
// that every prefill rank answering one decode rank (TP fan-in, PP stages)
// is counted apart.
func (p Parallel) uniqueRank() int {
	return p.TPRank*(p.PPSize*p.CPSize) + p.PPRank*p.CPSize + p.CPRank
}

// numPages returns the pages of every KV region, checking that they agree.
func (a *KVArgs) numPages() (uint64, error) {
	if len(a.KV) == 0 {
		return 0, errors.New("push: no KV regions")
	}
	var n uint64
	for i, b := range a.KV {
		if b.Addr == 0 || b.Len == 0 || b.ItemLen == 0 || b.Len%b.ItemLen != 0 {
			return 0, fmt.Errorf("push: KV region %d (addr %#x, len %d, item len %d) is not a whole number of pages", i, b.Addr, b.Len, b.ItemLen)
		}
		if b.Kind != abi.DRAM && b.Kind != abi.VRAM {
			return 0, fmt.Errorf("push: KV region %d: memory kind %d", i, b.Kind)
		}
		p := b.Len / b.ItemLen
		if i == 0 {
			n = p
		} else if p != n {
			return 0, fmt.Errorf("push: KV region %d holds %d pages, region 0 holds %d", i, p, n)
		}
	}
	return n, nil
}

func (a *KVArgs) check(mla bool) error {
	if _, err := a.numPages(); err != nil {
		return err
	}
	if a.PageSize < 1 {
		return fmt.Errorf("push: page size %d", a.PageSize)
	}
	if !mla && len(a.KV)%2 != 0 {
		return fmt.Errorf("push: MHA needs K and V regions, got %d regions", len(a.KV))
	}
	for i, b := range a.Aux {
		if b.ItemLen == 0 || uint64(len(b.Mem)) < b.ItemLen {
			return fmt.Errorf("push: aux buffer %d: %d bytes, item len %d", i, len(b.Mem), b.ItemLen)
		}
	}
	for i, c := range a.State {
		if c.Type == "" {
			return fmt.Errorf("push: state component %d has no type", i)
		}
		for j, t := range c.Tensors {
			if t.Addr == 0 || t.Len == 0 || t.ItemLen == 0 {
				return fmt.Errorf("push: state component %d tensor %d (addr %#x, len %d, item len %d)", i, j, t.Addr, t.Len, t.ItemLen)
			}
		}
	}
	return nil
}

// kvSide is this rank's KV in the planner's terms.
func (a *KVArgs) kvSide(p Parallel) planner.KVSide {
	n, _ := a.numPages()
	s := planner.KVSide{
		TPSize: p.TPSize, TPRank: p.TPRank, KVHeadNum: a.KVHeadNum,
		NumPages: n, StartLayer: a.StartLayer,
	}
	for _, b := range a.KV {
		s.Ptrs = append(s.Ptrs, b.Addr)
		s.ItemLens = append(s.ItemLens, b.ItemLen)
		s.Kinds = append(s.Kinds, memkind.ToPlanner(b.Kind))
	}
	return s
}

func (a *KVArgs) auxBuffers() planner.AuxBuffers {
	var s planner.AuxBuffers
	for _, b := range a.Aux {
		s.Ptrs = append(s.Ptrs, b.addr())
		s.DataLens = append(s.DataLens, uint64(len(b.Mem)))
		s.ItemLens = append(s.ItemLens, b.ItemLen)
	}
	return s
}

func (a *KVArgs) stateBuffers() (planner.StateBuffers, []planner.StateType) {
	var s planner.StateBuffers
	var types []planner.StateType
	for _, c := range a.State {
		types = append(types, c.Type)
		var ptrs, lens, items []uint64
		for _, t := range c.Tensors {
			ptrs = append(ptrs, t.Addr)
			lens = append(lens, t.Len)
			items = append(items, t.ItemLen)
		}
		s.Ptrs = append(s.Ptrs, ptrs)
		s.DataLens = append(s.DataLens, lens)
		s.ItemLens = append(s.ItemLens, items)
		s.DimPerTensor = append(s.DimPerTensor, append([]int(nil), c.DimPerTensor...))
	}
	return s, types
}

// registered holds the plugin regions of one rank's buffers, in KVArgs
// order.
type registered struct {
	kv    []*plugin.Region
	aux   []*plugin.Region
	state [][]*plugin.Region
}

// register registers every buffer of a with agent, in one call.
func register(agent *plugin.Agent, a *KVArgs) (*registered, error) {
	dev := func(k abi.MemKind) uint64 {
		if k == abi.VRAM {
			return uint64(a.GPUID)
		}
		return 0
	}
	var descs []abi.MemDesc
	for _, b := range a.KV {
		descs = append(descs, abi.MemDesc{Addr: b.Addr, Len: b.Len, DevID: dev(b.Kind), MemKind: b.Kind})
	}
	for _, b := range a.Aux {
		descs = append(descs, abi.MemDesc{Addr: b.addr(), Len: uint64(len(b.Mem)), MemKind: abi.DRAM})
	}
	for _, c := range a.State {
		for _, t := range c.Tensors {
			descs = append(descs, abi.MemDesc{Addr: t.Addr, Len: t.Len, DevID: dev(t.Kind), MemKind: t.Kind})
		}
	}
	regs, err := agent.Register(descs)
	if err != nil {
		return nil, fmt.Errorf("push: register memory: %w", err)
	}
	r := &registered{kv: regs[:len(a.KV)]}
	regs = regs[len(a.KV):]
	r.aux, regs = regs[:len(a.Aux)], regs[len(a.Aux):]
	for _, c := range a.State {
		r.state = append(r.state, regs[:len(c.Tensors)])
		regs = regs[len(c.Tensors):]
	}
	return r, nil
}
