package planner

// vLLM NIXL pull plans (vllm_nixl_connector.py.txt, vLLM 0.13.0).
//
// In vLLM's model the decode worker READs KV blocks out of the prefill
// worker's registered memory. Each side registers one region per KV cache
// tensor (K and V of each layer apart; one per layer for MLA and for
// blocks-first backends such as FlashInfer, whose tensors are
// [num_blocks, 2, heads, block_size, head_dim]). At handshake time the decode
// worker prepares two NIXL descriptor lists, one block descriptor per
// (region, block):
//
//   - the local (decode) list over its own regions
//     (register_local_xfer_handler), cut into prefill-sized sub-blocks when the
//     prefill's block size is smaller;
//   - the remote (prefill) list over the prefill rank's regions
//     (add_remote_agent), each descriptor covering only the slice of KV heads
//     this decode rank owns when decode TP is a multiple of prefill TP.
//
// Blocks-first layouts hold K and V in one region, so both lists split each
// region into a K and a V "virtual region". A descriptor's id is
// virtual region × blocks per region + block. Per request the decode worker
// turns block ids into two equally long id arrays and makes one prepped READ.
//
// VLLMReader does all of that as pure computation: NewVLLMReader is the
// handshake (validation with vLLM's kv_connector/v1/nixl_connector.py's rules plus both lists), and
// Read / Plan are the per-request steps (prepped ids, or the same bytes as a
// coalesced strided Plan).
//
// Where kvhost deliberately differs from vLLM's kv_connector/v1/nixl_connector.py:
//   - Per-layer local-attention windows: vLLM 0.13.0 computes the windowed
//     layers' local ids with the prefill's block count and the remote ids with
//     the decode's (the engine ids are swapped in _read_blocks). kvhost uses
//     each list's own block count, which is what the non-windowed path does
//     and what the descriptor lists hold. Both agree whenever
//     decode blocks × block-size ratio equals prefill blocks.
//   - Inputs vLLM's kv_connector/v1/nixl_connector.py would turn into out-of-range NIXL indices,
//     negative ids or Python exceptions (IndexError, ZeroDivisionError) are
//     *Error values here.

import (
	"math"
	"math/bits"
)

// VLLMAgent is the geometry part of one vLLM worker's NixlAgentMetadata:
// what a prefill worker advertises in the handshake, or what a decode worker
// registered itself. Field names follow vLLM's kv_connector/v1/nixl_connector.py.
type VLLMAgent struct {
	// BaseAddrs is kv_caches_base_addr: one region base address per
	// registered KV tensor, in registration order (per layer K then V when K
	// and V are separate tensors; one per layer for MLA and blocks-first).
	BaseAddrs []uint64
	// BlockLens is block_lens: bytes of one block in each region (K and V
	// together for blocks-first layouts). A region is NumBlocks × BlockLens[i]
	// bytes long.
	BlockLens []uint64
	// NumBlocks is num_blocks, the blocks in every region.
	NumBlocks int
	// BlockSize is block_size: tokens per (kernel) block.
	BlockSize int
	// KVCacheLayout is kv_cache_layout ("HND" or "NHD"), compared as a
	// string like vLLM's kv_connector/v1/nixl_connector.py does.
	KVCacheLayout string
	// DeviceID is device_id, the GPU ordinal every descriptor carries.
	DeviceID uint64
	// Kind is the memory kind of every region (vLLM registers all KV
	// regions of a worker with one NIXL memory type). Not part of
	// NixlAgentMetadata: the caller knows it and must set it (VRAM for GPU
	// caches); the zero value is DRAM.
	Kind MemKind
}

// VLLMDecode is the decode worker's own side of a pull: its registration
// plus the model facts vLLM's kv_connector/v1/nixl_connector.py takes from its own config.
type VLLMDecode struct {
	Agent  VLLMAgent
	TPRank int
	TPSize int
	// MLA: one latent cache per layer, the same on every rank.
	MLA bool
	// BlocksFirst: the attention backend's tensors are num_blocks first with
	// K and V in one region (FlashInfer); vLLM's kv_connector/v1/nixl_connector.py's
	// kv_topo.is_kv_layout_blocks_first. Both sides use the same backend
	// (the compatibility hash covers it).
	BlocksFirst bool
	// TotalKVHeads is the model's total KV head count
	// (get_total_num_kv_heads); unused for MLA.
	TotalKVHeads int
	// BlockWindows is block_window_per_layer: for each layer, how many of
	// the request's last blocks that layer reads (local-attention layers of
	// Llama 4), or 0 for a global-attention layer that reads all of them.
	// nil: every layer is global.
	BlockWindows []int
	// EnablePermuteLocalKV accepts a prefill with kv_cache_layout "HND"
	// when this side uses another layout; the decode then permutes received
	// blocks locally (kv_transfer_config.enable_permute_local_kv).
	EnablePermuteLocalKV bool
	// PhysicalBlocksPerLogical is how many kernel blocks make one logical
	// (scheduler) block when the attention kernel's block size is smaller
	// than the configured one (_physical_blocks_per_logical_kv_block).
	// Block ids given to Read and Plan are logical and expand by this
	// factor, on both sides, as _logical_to_kernel_block_ids does. 0 means 1.
	PhysicalBlocksPerLogical int
}

// VLLMDesc is one descriptor of a prepared list: Len bytes at Addr.
type VLLMDesc struct {
	Addr uint64
	Len  uint64
}

// VLLMListRegion is one (virtual) region of a prepared descriptor list: its
// descriptor b is [Addr + b*Stride, Addr + b*Stride + Len).
type VLLMListRegion struct {
	// Region indexes the registered region (Plan.Src for the prefill list,
	// Plan.Dst for the decode list) the descriptors lie in.
	Region int
	// Off is the offset of descriptor 0 inside that region; Addr is the
	// region base plus Off.
	Off    uint64
	Addr   uint64
	Stride uint64
	Len    uint64
}

// VLLMDescList is a prepared descriptor list in closed form, in vLLM's
// nixl_connector.py order: Regions[j] contributes Blocks descriptors, and the
// descriptor with id j*Blocks + b is block b of Regions[j].
type VLLMDescList struct {
	Blocks   int
	DeviceID uint64
	Kind     MemKind
	Regions  []VLLMListRegion
}

// Len returns the number of descriptors in the list.
func (l *VLLMDescList) Len() int { return len(l.Regions) * l.Blocks }

// Desc returns descriptor id, and false when id is outside the list.
func (l *VLLMDescList) Desc(id int) (VLLMDesc, bool) {
	if id < 0 || l.Blocks <= 0 || id >= l.Len() {
		return VLLMDesc{}, false
	}
	r := l.Regions[id/l.Blocks]
	return VLLMDesc{Addr: r.Addr + uint64(id%l.Blocks)*r.Stride, Len: r.Len}, true
}

// Append appends every descriptor of the list, in id order, to dst and
// returns the extended slice: the array to hand prep_dlist once per
// handshake. It allocates at most once (when dst lacks capacity).
func (l *VLLMDescList) Append(dst []VLLMDesc) []VLLMDesc {
	if n := l.Len(); cap(dst)-len(dst) < n {
		grown := make([]VLLMDesc, len(dst), len(dst)+n)
		copy(grown, dst)
		dst = grown
	}
	for _, r := range l.Regions {
		addr := r.Addr
		for b := 0; b < l.Blocks; b++ {
			dst = append(dst, VLLMDesc{Addr: addr, Len: r.Len})
			addr += r.Stride
		}
	}
	return dst
}

// VLLMReader is the result of one decode rank's handshake with one prefill
// engine: both prepared descriptor lists and everything per-request planning
// needs. It is immutable after NewVLLMReader and safe for concurrent use.
//
// Argument order: Plan takes the prefill's (remote) block ids first, as
// every planner's Plan does; Read, ReadLen and AppendRead speak vLLM's
// prepared-transfer terms and take and return local (decode) ids first, as
// make_prepped_xfer("READ", local, local_ids, remote, remote_ids) does.
type VLLMReader struct {
	tpRatio        int
	blockSizeRatio int
	remoteRank     int
	replicated     bool
	rankOffset     uint64
	permuteLocalKV bool
	postProcess    bool
	kernelFactor   int

	local, remote VLLMDescList
	src, dst      []Region

	// windows[j] is the block window of virtual region j (0: all blocks).
	windows []int
	// regionsPerLayer is 1 or 2 (K and V) when windows are set, and the
	// virtual regions of layer l are l*regionsPerLayer ... +regionsPerLayer-1.
	regionsPerLayer int
}

// TPRatio is tp_ratio: decode TP size / prefill TP size, the number of
// decode ranks that read from each prefill rank. It is the consumer count of
// every prefill request and the number after the colon of the notification.
func (r *VLLMReader) TPRatio() int { return r.tpRatio }

// BlockSizeRatio is decode block size / prefill block size (≥ 1).
func (r *VLLMReader) BlockSizeRatio() int { return r.blockSizeRatio }

// RemoteRank is the prefill TP rank this decode rank reads from (and
// handshakes with): decode rank / TPRatio.
func (r *VLLMReader) RemoteRank() int { return r.remoteRank }

// Replicated reports whether this rank reads whole blocks because the KV
// cache is replicated (MLA, or prefill TP ≥ total KV heads) rather than its
// slice of the prefill rank's heads.
func (r *VLLMReader) Replicated() bool { return r.replicated }

// RankOffset is the byte offset of this rank's head slice inside each
// prefill K (or V) block; 0 when Replicated.
func (r *VLLMReader) RankOffset() uint64 { return r.rankOffset }

// PermuteLocalKV reports that the layouts differ and the decode must permute
// received blocks from HND to its own layout (vLLM's kv_connector/v1/nixl_connector.py's
// permute_device_kv after the read completes). The transfer itself is the
// same.
func (r *VLLMReader) PermuteLocalKV() bool { return r.permuteLocalKV }

// BlockSizePostProcess reports that received decode blocks hold
// BlockSizeRatio prefill blocks one after another and must be permuted into
// the decode block layout after the read (vLLM's kv_connector/v1/nixl_connector.py's
// blocksize_post_process: non-MLA, block-size ratio > 1, decode layout HND).
func (r *VLLMReader) BlockSizePostProcess() bool { return r.postProcess }

// LocalList returns the decode-side descriptor list (vLLM's kv_connector/v1/nixl_connector.py's
// src_xfer_side_handles[prefill block size]). The returned value shares no
// memory with the reader.
func (r *VLLMReader) LocalList() VLLMDescList { return cloneList(r.local) }

// RemoteList returns the prefill-side descriptor list (vLLM's kv_connector/v1/nixl_connector.py's
// dst_xfer_side_handles[engine]). The returned value shares no memory with
// the reader.
func (r *VLLMReader) RemoteList() VLLMDescList { return cloneList(r.remote) }

// PrefillRegions returns the prefill rank's registered regions (Plan.Src):
// region i is kv_caches_base_addr[i], num_blocks × block_lens[i] bytes.
func (r *VLLMReader) PrefillRegions() []Region { return append([]Region(nil), r.src...) }

// DecodeRegions returns this decode rank's registered regions (Plan.Dst).
func (r *VLLMReader) DecodeRegions() []Region { return append([]Region(nil), r.dst...) }

func cloneList(l VLLMDescList) VLLMDescList {
	l.Regions = append([]VLLMListRegion(nil), l.Regions...)
	return l
}

// VLLMTPRatio returns tp_ratio for a decode TP size and a prefill TP size:
// how many decode ranks read each prefill rank. vLLM's kv_connector/v1/nixl_connector.py refuses decode
// TP smaller than, or not a multiple of, prefill TP.
func VLLMTPRatio(decodeTP, prefillTP int) (int, error) {
	if decodeTP <= 0 {
		return 0, errorf("decode.tp_size", "must be positive, got %d", decodeTP)
	}
	if prefillTP <= 0 {
		return 0, errorf("prefill.tp_size", "must be positive, got %d", prefillTP)
	}
	if decodeTP < prefillTP {
		return 0, errorf("prefill.tp_size", "decode TP %d is smaller than prefill TP %d: decode TP cannot be smaller than prefill TP", decodeTP, prefillTP)
	}
	if decodeTP%prefillTP != 0 {
		return 0, errorf("prefill.tp_size", "local tensor parallel size %d is not divisible by remote tensor parallel size %d", decodeTP, prefillTP)
	}
	return decodeTP / prefillTP, nil
}

// VLLMTargetRemoteRank returns the prefill TP rank a decode rank reads from
// and handshakes with (get_target_remote_rank): decode rank / tp_ratio.
func VLLMTargetRemoteRank(decodeRank, decodeTP, prefillTP int) (int, error) {
	ratio, err := VLLMTPRatio(decodeTP, prefillTP)
	if err != nil {
		return 0, err
	}
	if decodeRank < 0 || decodeRank >= decodeTP {
		return 0, errorf("decode.tp_rank", "%d outside [0, %d)", decodeRank, decodeTP)
	}
	return decodeRank / ratio, nil
}

// NewVLLMReader performs the geometry part of the decode rank's handshake
// with one prefill rank: it checks the decode's own registration
// (register_kv_caches), validates the prefill's advertised metadata with
// vLLM's nixl_connector.py rules (_nixl_handshake, _validate_remote_agent_handshake), and
// builds both prepared descriptor lists (register_local_xfer_handler,
// add_remote_agent). remote is the prefill rank's metadata and remoteTPSize
// the prefill TP size from kv_transfer_params.
func NewVLLMReader(local VLLMDecode, remote VLLMAgent, remoteTPSize int) (*VLLMReader, error) {
	if err := checkVLLMAgent("decode", local.Agent); err != nil {
		return nil, err
	}
	if err := checkVLLMAgent("prefill", remote); err != nil {
		return nil, err
	}
	if err := checkVLLMLocal(local); err != nil {
		return nil, err
	}
	la, ra := &local.Agent, &remote
	r := &VLLMReader{kernelFactor: max(local.PhysicalBlocksPerLogical, 1)}

	// _nixl_handshake: "nP > nD is not supported yet."
	if ra.BlockSize > la.BlockSize {
		return nil, errorf("prefill.block_size", "%d is larger than decode block_size %d: prefill blocks larger than decode blocks are not supported", ra.BlockSize, la.BlockSize)
	}
	if la.BlockSize%ra.BlockSize != 0 {
		return nil, errorf("prefill.block_size", "decode block_size %d is not a multiple of prefill block_size %d", la.BlockSize, ra.BlockSize)
	}
	r.blockSizeRatio = la.BlockSize / ra.BlockSize
	bsr := uint64(r.blockSizeRatio)
	if r.kernelFactor > math.MaxInt32/r.blockSizeRatio {
		return nil, errorf("physical_blocks_per_logical", "%d × block-size ratio %d exceeds 2^31", r.kernelFactor, r.blockSizeRatio)
	}

	ratio, err := VLLMTPRatio(local.TPSize, remoteTPSize)
	if err != nil {
		return nil, err
	}
	r.tpRatio = ratio
	r.remoteRank = local.TPRank / ratio

	// Layout: MLA caches have no head dimension to disagree on.
	if !local.MLA && ra.KVCacheLayout != la.KVCacheLayout {
		if local.EnablePermuteLocalKV && ra.KVCacheLayout == "HND" {
			r.permuteLocalKV = true
		} else {
			return nil, errorf("prefill.kv_cache_layout", "%q differs from decode %q: heterogeneous TP expects the same kv_cache_layout (or enable_permute_local_kv with an HND prefill)", ra.KVCacheLayout, la.KVCacheLayout)
		}
	}

	// Block lengths. vLLM's kv_connector/v1/nixl_connector.py checks them over the decode's regions,
	// so both sides must register the same number of regions.
	if len(ra.BaseAddrs) != len(la.BlockLens) {
		return nil, errorf("prefill.kv_caches_base_addr", "prefill registers %d regions, decode %d: both must register one per KV cache tensor", len(ra.BaseAddrs), len(la.BlockLens))
	}
	// is_kv_replicated looks at the prefill's TP size.
	r.replicated = local.MLA || remoteTPSize/local.TotalKVHeads >= 1
	if r.replicated {
		for i, l := range la.BlockLens {
			if l/bsr != ra.BlockLens[i] {
				return nil, errorf("prefill.block_lens", "region %d: prefill block is %d bytes, decode %d / block-size ratio %d = %d: KV cache sizes must match between prefill and decode when replicated", i, ra.BlockLens[i], l, bsr, l/bsr)
			}
		}
	} else {
		for i, l := range ra.BlockLens {
			if l != ra.BlockLens[0] {
				return nil, errorf("prefill.block_lens", "region %d is %d bytes per block, region 0 %d: all remote layers must have the same block size", i, l, ra.BlockLens[0])
			}
		}
		hi, lo := bits.Mul64(la.BlockLens[0], uint64(ratio))
		if hi != 0 || ra.BlockLens[0] != lo/bsr {
			return nil, errorf("prefill.block_lens", "prefill block is %d bytes, want decode %d × tp_ratio %d / block-size ratio %d: the prefill cache must be [2, N, decode_kv_heads*tp_ratio, block_size, head_dim] of the same dtype", ra.BlockLens[0], la.BlockLens[0], ratio, bsr)
		}
	}

	// This rank's head slice: tp_rank % tp_ratio units into each prefill
	// K (or V) block. Without replication every region has the same unit.
	if !r.replicated {
		r.rankOffset = uint64(local.TPRank%ratio) * vllmUnit(la.BlockLens[0], local.BlocksFirst, bsr)
	}
	r.postProcess = !local.MLA && r.blockSizeRatio > 1 && la.KVCacheLayout == "HND"

	if err := r.buildLists(local, remote); err != nil {
		return nil, err
	}
	if err := r.setWindows(local.BlockWindows); err != nil {
		return nil, err
	}
	return r, nil
}

// checkVLLMAgent checks one side's metadata on its own: counts positive,
// one block length per region, regions without address overflow.
func checkVLLMAgent(side string, a VLLMAgent) error {
	if len(a.BaseAddrs) == 0 {
		return errorf(side+".kv_caches_base_addr", "no regions")
	}
	if len(a.BlockLens) != len(a.BaseAddrs) {
		return errorf(side+".block_lens", "%d block lengths for %d regions", len(a.BlockLens), len(a.BaseAddrs))
	}
	if a.NumBlocks <= 0 {
		return errorf(side+".num_blocks", "must be positive, got %d", a.NumBlocks)
	}
	if a.BlockSize <= 0 {
		return errorf(side+".block_size", "must be positive, got %d", a.BlockSize)
	}
	if a.Kind != VRAM && a.Kind != DRAM {
		return errorf(side+".mem_kind", "unknown memory kind %d", a.Kind)
	}
	for i, l := range a.BlockLens {
		if l == 0 {
			return errorf(side+".block_lens", "region %d: 0 bytes per block", i)
		}
		hi, size := bits.Mul64(l, uint64(a.NumBlocks))
		if hi != 0 {
			return errorf(side+".block_lens", "region %d: %d blocks of %d bytes overflow", i, a.NumBlocks, l)
		}
		if _, ok := (Region{Addr: a.BaseAddrs[i], Len: size}).End(); !ok {
			return errorf(side+".kv_caches_base_addr", "region %d at %#x, %d bytes, wraps the address space", i, a.BaseAddrs[i], size)
		}
	}
	return nil
}

// checkVLLMLocal applies register_kv_caches' rules to the decode's own
// registration, plus the config facts vLLM's kv_connector/v1/nixl_connector.py takes for granted.
func checkVLLMLocal(d VLLMDecode) error {
	if d.TPSize <= 0 {
		return errorf("decode.tp_size", "must be positive, got %d", d.TPSize)
	}
	if d.TPRank < 0 || d.TPRank >= d.TPSize {
		return errorf("decode.tp_rank", "%d outside [0, %d)", d.TPRank, d.TPSize)
	}
	if !d.MLA && d.TotalKVHeads <= 0 {
		return errorf("total_num_kv_heads", "must be positive, got %d", d.TotalKVHeads)
	}
	if d.PhysicalBlocksPerLogical < 0 {
		return errorf("physical_blocks_per_logical", "must not be negative, got %d", d.PhysicalBlocksPerLogical)
	}
	a := d.Agent
	// Two decode regions sharing bytes would let one read overwrite
	// another's (vLLM registers each distinct tensor once).
	if err := checkDisjoint("decode.kv_caches_base_addr", a); err != nil {
		return err
	}
	if !d.MLA {
		for i, l := range a.BlockLens {
			if l != a.BlockLens[0] {
				return errorf("decode.block_lens", "region %d is %d bytes per block, region 0 %d: all kv cache tensors must have the same size", i, l, a.BlockLens[0])
			}
		}
	}
	if d.BlocksFirst {
		for i, l := range a.BlockLens {
			if slot := l / uint64(a.BlockSize); slot%2 != 0 {
				return errorf("decode.block_lens", "region %d: %d bytes per slot cannot hold K and V halves (blocks-first)", i, slot)
			}
		}
	}
	return nil
}

// checkDisjoint refuses regions that share bytes. Regions are few (one or
// two per layer), so a quadratic scan at handshake time is cheap and
// allocation-free.
func checkDisjoint(field string, a VLLMAgent) error {
	n := uint64(a.NumBlocks)
	for i := range a.BaseAddrs {
		lo, hi := a.BaseAddrs[i], a.BaseAddrs[i]+a.BlockLens[i]*n
		for j := i + 1; j < len(a.BaseAddrs); j++ {
			lo2, hi2 := a.BaseAddrs[j], a.BaseAddrs[j]+a.BlockLens[j]*n
			if lo < hi2 && lo2 < hi {
				return errorf(field, "regions %d [%#x, %#x) and %d [%#x, %#x) overlap", i, lo, hi, j, lo2, hi2)
			}
		}
	}
	return nil
}

// buildLists lays out both prepared lists and the registered regions.
func (r *VLLMReader) buildLists(local VLLMDecode, remote VLLMAgent) error {
	la := &local.Agent
	bsr := uint64(r.blockSizeRatio)
	halves := 1
	if local.BlocksFirst {
		halves = 2
	}
	n := len(la.BaseAddrs)

	r.dst = make([]Region, n)
	r.src = make([]Region, n)
	for i := range n {
		r.dst[i] = Region{Addr: la.BaseAddrs[i], Len: la.BlockLens[i] * uint64(la.NumBlocks), Kind: la.Kind}
		r.src[i] = Region{Addr: remote.BaseAddrs[i], Len: remote.BlockLens[i] * uint64(remote.NumBlocks), Kind: remote.Kind}
	}

	// Local: every decode block becomes bsr sub-blocks of block_len/bsr
	// bytes; blocks-first puts V kv_block_len after K in each sub-block.
	localBlocks := uint64(la.NumBlocks) * bsr
	// Remote: every prefill block, at this rank's head slice; blocks-first
	// V sits half a prefill block after K.
	if err := checkListSize("decode", localBlocks, n*halves); err != nil {
		return err
	}
	if err := checkListSize("prefill", uint64(remote.NumBlocks), n*halves); err != nil {
		return err
	}
	r.local = VLLMDescList{Blocks: int(localBlocks), DeviceID: la.DeviceID, Kind: la.Kind, Regions: make([]VLLMListRegion, 0, n*halves)}
	r.remote = VLLMDescList{Blocks: remote.NumBlocks, DeviceID: remote.DeviceID, Kind: remote.Kind, Regions: make([]VLLMListRegion, 0, n*halves)}
	for i := range n {
		// The transfer unit is the decode's K (or V) block of this region
		// (get_backend_aware_kv_block_len) cut by the block-size ratio; it
		// differs per region only for MLA.
		unit := vllmUnit(la.BlockLens[i], local.BlocksFirst, bsr)
		if unit == 0 {
			return errorf("decode.block_lens", "region %d: a %d-byte block cut into %d prefill-sized blocks leaves 0 bytes per descriptor", i, la.BlockLens[i], bsr)
		}
		lStride := la.BlockLens[i] / bsr
		rStride := remote.BlockLens[i]
		for h := range halves {
			lOff := uint64(h) * unit
			rOff := r.rankOffset + uint64(h)*(rStride/2)
			r.local.Regions = append(r.local.Regions, VLLMListRegion{Region: i, Off: lOff, Addr: la.BaseAddrs[i] + lOff, Stride: lStride, Len: unit})
			r.remote.Regions = append(r.remote.Regions, VLLMListRegion{Region: i, Off: rOff, Addr: remote.BaseAddrs[i] + rOff, Stride: rStride, Len: unit})
		}
	}
	// No descriptor may leave its region. The rules above guarantee it for
	// geometries vLLM's kv_connector/v1/nixl_connector.py accepts; check anyway, per region, so a
	// geometry they miss is an error rather than a wild read.
	if err := checkListInside("decode", &r.local, r.dst); err != nil {
		return err
	}
	return checkListInside("prefill", &r.remote, r.src)
}

// vllmUnit is the bytes of one descriptor for a decode region whose blocks
// are blockLen bytes: the K (or V) part, cut into bsr prefill-sized blocks.
func vllmUnit(blockLen uint64, blocksFirst bool, bsr uint64) uint64 {
	if blocksFirst {
		blockLen /= 2
	}
	return blockLen / bsr
}

// checkListSize refuses lists whose descriptor ids would not fit the int32
// indices of make_prepped_xfer.
func checkListSize(side string, blocks uint64, regions int) error {
	hi, total := bits.Mul64(blocks, uint64(regions))
	if hi != 0 || total > math.MaxInt32 {
		return errorf(side+".num_blocks", "%d blocks × %d regions = %d descriptors exceed the int32 descriptor ids", blocks, regions, total)
	}
	return nil
}

func checkListInside(side string, l *VLLMDescList, regions []Region) error {
	for j, lr := range l.Regions {
		if err := checkSide(regions, int32(lr.Region), lr.Off, lr.Len, lr.Stride, uint64(l.Blocks)); err != nil {
			return errorf(side+".block_lens", "descriptor list region %d: %v", j, err)
		}
	}
	return nil
}

// setWindows maps block_window_per_layer onto virtual regions the way
// _get_block_descs_ids selects a layer's regions.
func (r *VLLMReader) setWindows(windows []int) error {
	if windows == nil {
		return nil
	}
	nv := len(r.local.Regions)
	nl := len(windows)
	switch {
	case nl < nv && 2*nl == nv:
		r.regionsPerLayer = 2
	case nl == nv:
		r.regionsPerLayer = 1
	default:
		return errorf("block_window_per_layer", "%d layers for %d descriptor regions: want one window per layer, with 1 or 2 (K, V) regions per layer", nl, nv)
	}
	r.windows = make([]int, nv)
	for l, w := range windows {
		if w < 0 {
			return errorf("block_window_per_layer", "layer %d: window %d is negative", l, w)
		}
		for k := range r.regionsPerLayer {
			r.windows[l*r.regionsPerLayer+k] = w
		}
	}
	return nil
}
