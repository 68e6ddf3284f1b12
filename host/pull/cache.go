package pull

import (
	"fmt"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/memkind"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/planner"
)

// Layouts of a vLLM KV cache block (kv_cache_layout).
const (
	LayoutHND = "HND" // [heads][tokens][head bytes]: what the NIXL connector asks vLLM for
	LayoutNHD = "NHD" // [tokens][heads][head bytes]
)

// Region is one KV cache tensor's memory: Len bytes at Addr in this
// process.
type Region struct {
	Addr uint64
	Len  uint64
}

// Cache is one TP rank's KV cache as vLLM registers it with NIXL
// (register_kv_caches): one region per KV cache tensor, every region
// NumBlocks blocks long. The caller owns the memory and keeps it mapped
// until the Sender or Receiver using it is closed.
type Cache struct {
	// Regions in kv_caches_base_addr order: per layer K then V when they are
	// separate tensors, one per layer for MLA and blocks-first layouts.
	Regions   []Region
	NumBlocks int
	// BlockSize is tokens per block.
	BlockSize int
	// Layout is LayoutHND or LayoutNHD (kv_cache_layout).
	Layout   string
	Kind     abi.MemKind
	DeviceID uint64
	// Names, when set, are the regions' layer names (vLLM's kv_caches
	// keys), which version 11's region_names advertise; otherwise each
	// region is named by its index.
	Names []string
	// Host, when set, is Regions as byte slices of this process (host
	// memory). A Receiver needs it only to reorder blocks received from a
	// prefill with a smaller block size; it never retains more than the
	// slices themselves.
	Host [][]byte
}

// blockLens returns block_lens: each region's length over NumBlocks.
func (c *Cache) blockLens() []uint64 {
	lens := make([]uint64, len(c.Regions))
	for i, r := range c.Regions {
		lens[i] = r.Len / uint64(c.NumBlocks)
	}
	return lens
}

func (c *Cache) check() error {
	if len(c.Regions) == 0 {
		return fmt.Errorf("pull: cache has no regions")
	}
	if c.NumBlocks <= 0 {
		return fmt.Errorf("pull: cache num_blocks %d must be positive", c.NumBlocks)
	}
	if c.BlockSize <= 0 {
		return fmt.Errorf("pull: cache block_size %d must be positive", c.BlockSize)
	}
	if c.Layout != LayoutHND && c.Layout != LayoutNHD {
		return fmt.Errorf("pull: cache layout %q, want %q or %q", c.Layout, LayoutHND, LayoutNHD)
	}
	for i, r := range c.Regions {
		if r.Len == 0 || r.Len%uint64(c.NumBlocks) != 0 {
			return fmt.Errorf("pull: cache region %d is %d bytes, not a positive multiple of %d blocks", i, r.Len, c.NumBlocks)
		}
	}
	if c.Host != nil {
		if len(c.Host) != len(c.Regions) {
			return fmt.Errorf("pull: cache has %d host views for %d regions", len(c.Host), len(c.Regions))
		}
		for i, h := range c.Host {
			if uint64(len(h)) != c.Regions[i].Len {
				return fmt.Errorf("pull: cache host view %d is %d bytes, region %d", i, len(h), c.Regions[i].Len)
			}
		}
	}
	return nil
}

// agent returns the geometry planner.VLLMAgent describes.
func (c *Cache) agent() planner.VLLMAgent {
	addrs := make([]uint64, len(c.Regions))
	for i, r := range c.Regions {
		addrs[i] = r.Addr
	}
	return planner.VLLMAgent{
		BaseAddrs:     addrs,
		BlockLens:     c.blockLens(),
		NumBlocks:     c.NumBlocks,
		BlockSize:     c.BlockSize,
		KVCacheLayout: c.Layout,
		DeviceID:      c.DeviceID,
		Kind:          memkind.ToPlanner(c.Kind),
	}
}

// register registers every region of c on a in one call.
func register(a *plugin.Agent, c *Cache) ([]*plugin.Region, error) {
	descs := make([]abi.MemDesc, len(c.Regions))
	for i, r := range c.Regions {
		descs[i] = abi.MemDesc{Addr: r.Addr, Len: r.Len, DevID: c.DeviceID, MemKind: c.Kind}
	}
	regs, err := a.Register(descs)
	if err != nil {
		return nil, fmt.Errorf("pull: register KV cache on agent %s: %w", a.Name(), err)
	}
	return regs, nil
}
