package planner

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sort"
	"strings"
	"testing"
)

// Hand-checked tables for vLLM pull plans. Addresses: decode regions start
// at 0x1000_0000 + i<<20, prefill regions at 0x2000_0000 + i<<20, so every
// expected offset below is small and region-relative.

const (
	vDecodeBase  = 0x1000_0000
	vPrefillBase = 0x2000_0000
)

// vAgent builds an agent with n regions of blockLen-byte blocks (blockLens
// overrides per region when non-nil).
func vAgent(base uint64, n int, blockLen uint64, blockLens []uint64, numBlocks, blockSize int) VLLMAgent {
	a := VLLMAgent{NumBlocks: numBlocks, BlockSize: blockSize, KVCacheLayout: "HND", Kind: VRAM}
	for i := range n {
		a.BaseAddrs = append(a.BaseAddrs, base+uint64(i)<<20)
		if blockLens != nil {
			a.BlockLens = append(a.BlockLens, blockLens[i])
		} else {
			a.BlockLens = append(a.BlockLens, blockLen)
		}
	}
	return a
}

type vCase struct {
	name       string
	local      VLLMDecode
	remote     VLLMAgent
	remoteTP   int
	localIDs   []int32
	remoteIDs  []int32
	wantLocal  []int32 // prepped ids
	wantRemote []int32
	wantCopies []Copy
	wantNotify bool
	wantRatio  int
	wantRank   int
}

// vRegionIDs returns j*blocks + ids for j in regions, concatenated.
func vRegionIDs(regions []int, blocks int32, ids ...int32) []int32 {
	var out []int32
	for _, j := range regions {
		for _, id := range ids {
			out = append(out, int32(j)*blocks+id)
		}
	}
	return out
}

func vSpan(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

func TestVLLMTable(t *testing.T) {
	cases := []vCase{
		{
			// TP 1 -> 1, 2 layers (K0 V0 K1 V1), 64-byte blocks: whole
			// blocks, one contiguous copy per region.
			name:       "homogeneous TP",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 4, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 4},
			remote:     vAgent(vPrefillBase, 4, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{1, 2, 3},
			remoteIDs:  []int32{4, 5, 6},
			wantLocal:  vRegionIDs(vSpan(4), 8, 1, 2, 3),
			wantRemote: vRegionIDs(vSpan(4), 10, 4, 5, 6),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 256, DstOff: 64, Len: 192, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 256, DstOff: 64, Len: 192, Count: 1},
				{SrcRegion: 2, DstRegion: 2, SrcOff: 256, DstOff: 64, Len: 192, Count: 1},
				{SrcRegion: 3, DstRegion: 3, SrcOff: 256, DstOff: 64, Len: 192, Count: 1},
			},
			wantRatio: 1,
		},
		{
			// Prefill TP 1 holds 4 heads (64-byte blocks), decode TP 2
			// rank 1 holds heads 2-3 (32-byte blocks): every prefill block
			// contributes its second half.
			name:       "decode TP 2x prefill TP, rank 1",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{0, 1},
			remoteIDs:  []int32{2, 3},
			wantLocal:  vRegionIDs(vSpan(2), 8, 0, 1),
			wantRemote: vRegionIDs(vSpan(2), 10, 2, 3),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 2*64 + 32, DstOff: 0, Len: 32, SrcStride: 64, DstStride: 32, Count: 2},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 2*64 + 32, DstOff: 0, Len: 32, SrcStride: 64, DstStride: 32, Count: 2},
			},
			wantRatio: 2,
		},
		{
			// Decode TP 4 reads prefill TP 2: rank 2 reads prefill rank 1,
			// first half of its heads.
			name:       "decode TP 4 from prefill TP 2, rank 2",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 16), TPRank: 2, TPSize: 4, TotalKVHeads: 8},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 16),
			remoteTP:   2,
			localIDs:   []int32{3},
			remoteIDs:  []int32{9},
			wantLocal:  vRegionIDs(vSpan(2), 8, 3),
			wantRemote: vRegionIDs(vSpan(2), 10, 9),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 9 * 64, DstOff: 3 * 32, Len: 32, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 9 * 64, DstOff: 3 * 32, Len: 32, Count: 1},
			},
			wantRatio: 2,
			wantRank:  1,
		},
		{
			// MLA, per-layer block lengths 48 and 80, decode TP 2 rank 1:
			// the latent cache is replicated, so whole blocks, no offset.
			name:       "MLA",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 0, []uint64{48, 80}, 8, 16), TPRank: 1, TPSize: 2, MLA: true},
			remote:     vAgent(vPrefillBase, 2, 0, []uint64{48, 80}, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{5, 6},
			remoteIDs:  []int32{7, 2},
			wantLocal:  vRegionIDs(vSpan(2), 8, 5, 6),
			wantRemote: vRegionIDs(vSpan(2), 10, 7, 2),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 7 * 48, DstOff: 5 * 48, Len: 48, Count: 1},
				{SrcRegion: 0, DstRegion: 0, SrcOff: 2 * 48, DstOff: 6 * 48, Len: 48, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 7 * 80, DstOff: 5 * 80, Len: 80, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 2 * 80, DstOff: 6 * 80, Len: 80, Count: 1},
			},
			wantRatio: 2,
		},
		{
			// Decode block 16 tokens (64 bytes), prefill block 8 tokens (32
			// bytes): decode blocks [1, 3] map to sub-blocks [2 3 6 7],
			// clipped to the 3 prefill blocks [0 1 2].
			name:       "block size ratio 2",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2},
			remote:     vAgent(vPrefillBase, 2, 32, nil, 10, 8),
			remoteTP:   1,
			localIDs:   []int32{1, 3},
			remoteIDs:  []int32{0, 1, 2},
			wantLocal:  vRegionIDs(vSpan(2), 16, 2, 3, 6),
			wantRemote: vRegionIDs(vSpan(2), 10, 0, 1, 2),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 0, DstOff: 2 * 32, Len: 64, Count: 1},
				{SrcRegion: 0, DstRegion: 0, SrcOff: 2 * 32, DstOff: 6 * 32, Len: 32, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 0, DstOff: 2 * 32, Len: 64, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 2 * 32, DstOff: 6 * 32, Len: 32, Count: 1},
			},
			wantRatio: 1,
		},
		{
			// Block size ratio 2 with decode TP 2 from TP 1 (2-byte head
			// slices per token): decode block = 16 tokens x 2 heads = 64
			// bytes, prefill block = 8 tokens x 4 heads = 64 bytes. Unit =
			// 64 / 2 = 32 bytes, rank 1 at offset 32 of each prefill block.
			name:       "block size ratio 2 with TP ratio 2",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 8),
			remoteTP:   1,
			localIDs:   []int32{4},
			remoteIDs:  []int32{6, 7},
			wantLocal:  vRegionIDs(vSpan(2), 16, 8, 9),
			wantRemote: vRegionIDs(vSpan(2), 10, 6, 7),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 6*64 + 32, DstOff: 8 * 32, Len: 32, SrcStride: 64, DstStride: 32, Count: 2},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 6*64 + 32, DstOff: 8 * 32, Len: 32, SrcStride: 64, DstStride: 32, Count: 2},
			},
			wantRatio: 2,
		},
		{
			// Blocks-first (FlashInfer), 2 layers, one region each; decode
			// TP 2 rank 1 from TP 1. Prefill block = [K 2 heads | V 2 heads]
			// = 64 bytes, decode [K 1 head | V 1 head] = 32 bytes. K desc at
			// +16 (rank offset), V desc at +32+16.
			name:       "blocks-first, TP ratio 2",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 8), TPRank: 1, TPSize: 2, TotalKVHeads: 2, BlocksFirst: true},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 8),
			remoteTP:   1,
			localIDs:   []int32{0, 1},
			remoteIDs:  []int32{3, 4},
			wantLocal:  vRegionIDs(vSpan(4), 8, 0, 1),
			wantRemote: vRegionIDs(vSpan(4), 10, 3, 4),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 3*64 + 16, DstOff: 0, Len: 16, SrcStride: 64, DstStride: 32, Count: 2},
				{SrcRegion: 0, DstRegion: 0, SrcOff: 3*64 + 48, DstOff: 16, Len: 16, SrcStride: 64, DstStride: 32, Count: 2},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 3*64 + 16, DstOff: 0, Len: 16, SrcStride: 64, DstStride: 32, Count: 2},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 3*64 + 48, DstOff: 16, Len: 16, SrcStride: 64, DstStride: 32, Count: 2},
			},
			wantRatio: 2,
		},
		{
			// Blocks-first, equal TP: K and V halves touch on both sides, so
			// each run is one contiguous copy of whole blocks.
			name:       "blocks-first, equal TP",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 8), TPSize: 1, TotalKVHeads: 2, BlocksFirst: true},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 8),
			remoteTP:   1,
			localIDs:   []int32{0, 1, 5},
			remoteIDs:  []int32{3, 4, 5},
			wantLocal:  vRegionIDs(vSpan(4), 8, 0, 1, 5),
			wantRemote: vRegionIDs(vSpan(4), 10, 3, 4, 5),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 3 * 64, DstOff: 0, Len: 128, Count: 1},
				{SrcRegion: 0, DstRegion: 0, SrcOff: 5 * 64, DstOff: 5 * 64, Len: 64, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 3 * 64, DstOff: 0, Len: 128, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 5 * 64, DstOff: 5 * 64, Len: 64, Count: 1},
			},
			wantRatio: 1,
		},
		{
			// 2 KV heads, prefill TP 2 (one head per rank: replicated since
			// 2 // 2 >= 1), decode TP 4 rank 3 reads prefill rank 1 whole.
			name:       "replicated KV",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 16), TPRank: 3, TPSize: 4, TotalKVHeads: 2},
			remote:     vAgent(vPrefillBase, 2, 32, nil, 10, 16),
			remoteTP:   2,
			localIDs:   []int32{2, 3},
			remoteIDs:  []int32{8, 9},
			wantLocal:  vRegionIDs(vSpan(2), 8, 2, 3),
			wantRemote: vRegionIDs(vSpan(2), 10, 8, 9),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 8 * 32, DstOff: 2 * 32, Len: 64, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 8 * 32, DstOff: 2 * 32, Len: 64, Count: 1},
			},
			wantRatio: 2,
			wantRank:  1,
		},
		{
			// Layer 0 global, layer 1 local attention with a 2-block window:
			// regions 2 and 3 read only the last 2 blocks.
			name:       "local-attention windows",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 4, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2, BlockWindows: []int{0, 2}},
			remote:     vAgent(vPrefillBase, 4, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{0, 1, 2},
			remoteIDs:  []int32{5, 6, 7},
			wantLocal:  append(vRegionIDs([]int{0, 1}, 8, 0, 1, 2), vRegionIDs([]int{2, 3}, 8, 1, 2)...),
			wantRemote: append(vRegionIDs([]int{0, 1}, 10, 5, 6, 7), vRegionIDs([]int{2, 3}, 10, 6, 7)...),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 5 * 64, DstOff: 0, Len: 192, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 5 * 64, DstOff: 0, Len: 192, Count: 1},
				{SrcRegion: 2, DstRegion: 2, SrcOff: 6 * 64, DstOff: 64, Len: 128, Count: 1},
				{SrcRegion: 3, DstRegion: 3, SrcOff: 6 * 64, DstOff: 64, Len: 128, Count: 1},
			},
			wantRatio: 1,
		},
		{
			// Windows with different block counts per side: ids use each
			// list's own count (8 decode, 10 prefill). vLLM 0.13.0 swaps
			// them here (see vllm.go); kvhost does not.
			name:       "windows use each list's block count",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2, MLA: true, BlockWindows: []int{1, 0}},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{6, 7},
			remoteIDs:  []int32{2, 9},
			wantLocal:  []int32{7, 8 + 6, 8 + 7},
			wantRemote: []int32{9, 10 + 2, 10 + 9},
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 9 * 64, DstOff: 7 * 64, Len: 64, Count: 1},
				// Plan.Add joins the two equal blocks into one strided copy.
				{SrcRegion: 1, DstRegion: 1, SrcOff: 2 * 64, DstOff: 6 * 64, Len: 64, SrcStride: 7 * 64, DstStride: 64, Count: 2},
			},
			wantRatio: 1,
		},
		{
			// Partial prefix hit: decode already holds the first 2 of 4
			// blocks and reads only the prefill's last 2.
			name:       "partial prefix hit",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2},
			remote:     vAgent(vPrefillBase, 2, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{4, 5},
			remoteIDs:  []int32{0, 1, 2, 3},
			wantLocal:  vRegionIDs(vSpan(2), 8, 4, 5),
			wantRemote: vRegionIDs(vSpan(2), 10, 2, 3),
			wantCopies: []Copy{
				{SrcRegion: 0, DstRegion: 0, SrcOff: 2 * 64, DstOff: 4 * 64, Len: 128, Count: 1},
				{SrcRegion: 1, DstRegion: 1, SrcOff: 2 * 64, DstOff: 4 * 64, Len: 128, Count: 1},
			},
			wantRatio: 1,
		},
		{
			// Partial hit with block size ratio 2: decode block 1 maps to
			// sub-blocks [2 3], which read the last 2 of 5 prefill blocks.
			name:       "partial prefix hit, block size ratio 2",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 1, 64, nil, 8, 16), MLA: true, TPSize: 1},
			remote:     vAgent(vPrefillBase, 1, 32, nil, 10, 8),
			remoteTP:   1,
			localIDs:   []int32{1},
			remoteIDs:  []int32{0, 1, 2, 3, 4},
			wantLocal:  []int32{2, 3},
			wantRemote: []int32{3, 4},
			wantCopies: []Copy{{SrcRegion: 0, DstRegion: 0, SrcOff: 3 * 32, DstOff: 2 * 32, Len: 64, Count: 1}},
			wantRatio:  1,
		},
		{
			name:       "full prefix hit",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4},
			remote:     vAgent(vPrefillBase, 2, 128, nil, 10, 16),
			remoteTP:   1,
			localIDs:   nil,
			remoteIDs:  []int32{0, 1, 2},
			wantNotify: true,
			wantRatio:  2,
		},
		{
			// Logical block = 2 kernel blocks on both sides.
			name:       "kernel blocks per logical block",
			local:      VLLMDecode{Agent: vAgent(vDecodeBase, 1, 64, nil, 8, 16), MLA: true, TPSize: 1, PhysicalBlocksPerLogical: 2},
			remote:     vAgent(vPrefillBase, 1, 64, nil, 10, 16),
			remoteTP:   1,
			localIDs:   []int32{3},
			remoteIDs:  []int32{1},
			wantLocal:  []int32{6, 7},
			wantRemote: []int32{2, 3},
			wantCopies: []Copy{{SrcRegion: 0, DstRegion: 0, SrcOff: 2 * 64, DstOff: 6 * 64, Len: 128, Count: 1}},
			wantRatio:  1,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := NewVLLMReader(tc.local, tc.remote, tc.remoteTP)
			if err != nil {
				t.Fatalf("NewVLLMReader: %v", err)
			}
			if r.TPRatio() != tc.wantRatio || r.RemoteRank() != tc.wantRank {
				t.Errorf("tp_ratio %d remote rank %d, want %d %d", r.TPRatio(), r.RemoteRank(), tc.wantRatio, tc.wantRank)
			}
			rd, err := r.Read(tc.localIDs, tc.remoteIDs)
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			if rd.NotifyOnly != tc.wantNotify {
				t.Fatalf("NotifyOnly %v, want %v", rd.NotifyOnly, tc.wantNotify)
			}
			if !reflect.DeepEqual(rd.LocalIDs, tc.wantLocal) || !reflect.DeepEqual(rd.RemoteIDs, tc.wantRemote) {
				t.Errorf("ids\n local  %v\n remote %v\nwant\n local  %v\n remote %v", rd.LocalIDs, rd.RemoteIDs, tc.wantLocal, tc.wantRemote)
			}
			p, err := planRead(r, tc.localIDs, tc.remoteIDs)
			if err != nil {
				t.Fatalf("Plan: %v", err)
			}
			if err := p.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if !reflect.DeepEqual(p.Copies, tc.wantCopies) {
				t.Errorf("copies\n got  %+v\n want %+v", p.Copies, tc.wantCopies)
			}
			if tc.wantNotify {
				if p.Path != PathVLLMNotifyOnly || len(p.Copies) != 0 {
					t.Errorf("full hit: path %q, %d copies", p.Path, len(p.Copies))
				}
				return
			}
			// The plan and the prepped form move the same bytes.
			vAssertSameBytes(t, r, rd, p)
			if p.ReferenceDescriptors != uint64(len(rd.LocalIDs)) {
				t.Errorf("ReferenceDescriptors %d, want %d", p.ReferenceDescriptors, len(rd.LocalIDs))
			}
		})
	}
}

// byteMap is a list of (dst, src, len) ranges, normalized by sorting on dst
// and merging ranges that continue each other on both sides.
type vByteRange struct{ dst, src, n uint64 }

func vNormalize(rs []vByteRange) []vByteRange {
	vSortRanges(rs)
	out := rs[:0]
	for _, r := range rs {
		if k := len(out) - 1; k >= 0 && out[k].dst+out[k].n == r.dst && out[k].src+out[k].n == r.src {
			out[k].n += r.n
			continue
		}
		out = append(out, r)
	}
	return out
}

func vSortRanges(rs []vByteRange) {
	sort.Slice(rs, func(i, j int) bool {
		if rs[i].dst != rs[j].dst {
			return rs[i].dst < rs[j].dst
		}
		return rs[i].src < rs[j].src
	})
}

func vPlanRanges(p *Plan) []vByteRange {
	var out []vByteRange
	p.ForEachBlock(func(src, dst, n uint64) bool {
		out = append(out, vByteRange{dst: dst, src: src, n: n})
		return true
	})
	return vNormalize(out)
}

// vFataler is what the byte-range helpers need of *testing.T and *rapid.T.
type vFataler interface {
	Helper()
	Fatalf(format string, args ...any)
}

func vPreppedRanges(t vFataler, r *VLLMReader, rd VLLMRead) []vByteRange {
	t.Helper()
	ll, rl := r.LocalList(), r.RemoteList()
	var out []vByteRange
	for k := range rd.LocalIDs {
		l, ok1 := ll.Desc(int(rd.LocalIDs[k]))
		m, ok2 := rl.Desc(int(rd.RemoteIDs[k]))
		if !ok1 || !ok2 || l.Len != m.Len {
			t.Fatalf("pair %d: ids %d %d outside lists or lengths differ (%v %v)", k, rd.LocalIDs[k], rd.RemoteIDs[k], l, m)
		}
		out = append(out, vByteRange{dst: l.Addr, src: m.Addr, n: l.Len})
	}
	return vNormalize(out)
}

func vAssertSameBytes(t vFataler, r *VLLMReader, rd VLLMRead, p *Plan) {
	t.Helper()
	a, b := vPlanRanges(p), vPreppedRanges(t, r, rd)
	if reflect.DeepEqual(a, b) {
		return
	}
	// Ranges vNormalize canonically only when no decode byte is written
	// twice (duplicate block ids); compare byte by byte then.
	if pa, pb := vBytePairs(a), vBytePairs(b); pa != nil && reflect.DeepEqual(pa, pb) {
		return
	}
	t.Fatalf("plan and prepped descriptors move different bytes:\n plan    %v\n prepped %v", a, b)
}

// vBytePairs expands ranges into sorted (dst, src) byte pairs, or nil when
// they are too many to expand.
func vBytePairs(rs []vByteRange) [][2]uint64 {
	var total uint64
	for _, r := range rs {
		total += r.n
	}
	if total > 1<<20 {
		return nil
	}
	out := make([][2]uint64, 0, total)
	for _, r := range rs {
		for o := range r.n {
			out = append(out, [2]uint64{r.dst + o, r.src + o})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i][0] != out[j][0] {
			return out[i][0] < out[j][0]
		}
		return out[i][1] < out[j][1]
	})
	return out
}

func TestVLLMDescLists(t *testing.T) {
	// Blocks-first, block size ratio 2, decode TP 2 rank 1 from TP 1.
	// Decode block 64 bytes = [K 32 | V 32], prefill block 8 tokens.
	local := VLLMDecode{Agent: vAgent(vDecodeBase, 1, 64, nil, 2, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4, BlocksFirst: true}
	local.Agent.DeviceID = 3
	remote := vAgent(vPrefillBase, 1, 64, nil, 2, 8)
	remote.DeviceID = 5
	r, err := NewVLLMReader(local, remote, 1)
	if err != nil {
		t.Fatal(err)
	}
	// Local: 4 sub-blocks of 32 bytes, K 16 bytes then V at +16.
	ll := r.LocalList()
	got := ll.Append(nil)
	want := []VLLMDesc{
		{vDecodeBase + 0, 16}, {vDecodeBase + 32, 16}, {vDecodeBase + 64, 16}, {vDecodeBase + 96, 16},
		{vDecodeBase + 16, 16}, {vDecodeBase + 48, 16}, {vDecodeBase + 80, 16}, {vDecodeBase + 112, 16},
	}
	if !reflect.DeepEqual(got, want) || ll.DeviceID != 3 {
		t.Errorf("local list %v dev %d\nwant %v dev 3", got, ll.DeviceID, want)
	}
	// Remote: unit 16 at rank offset 16; V half a prefill block (32) later.
	rl := r.RemoteList()
	got = rl.Append(nil)
	want = []VLLMDesc{
		{vPrefillBase + 16, 16}, {vPrefillBase + 64 + 16, 16},
		{vPrefillBase + 32 + 16, 16}, {vPrefillBase + 64 + 48, 16},
	}
	if !reflect.DeepEqual(got, want) || rl.DeviceID != 5 {
		t.Errorf("remote list %v dev %d\nwant %v dev 5", got, rl.DeviceID, want)
	}
	if _, ok := rl.Desc(4); ok {
		t.Error("Desc(4) of a 4-descriptor list succeeded")
	}
	if _, ok := rl.Desc(-1); ok {
		t.Error("Desc(-1) succeeded")
	}
	if !r.BlockSizePostProcess() || r.PermuteLocalKV() || r.Replicated() || r.RankOffset() != 16 {
		t.Errorf("flags: post %v permute %v replicated %v offset %d", r.BlockSizePostProcess(), r.PermuteLocalKV(), r.Replicated(), r.RankOffset())
	}
	// Returned lists are copies.
	ll.Regions[0].Addr = 0
	if r.LocalList().Regions[0].Addr == 0 {
		t.Error("LocalList shares memory with the reader")
	}
}

func TestVLLMErrors(t *testing.T) {
	okLocal := func() VLLMDecode {
		return VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4}
	}
	okRemote := func() VLLMAgent { return vAgent(vPrefillBase, 2, 64, nil, 10, 16) }
	cases := []struct {
		name     string
		mutate   func(l *VLLMDecode, r *VLLMAgent, rtp *int)
		field    string
		contains string
	}{
		{"prefill block larger", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BlockSize = 32 }, "prefill.block_size", "not supported"},
		{"block size not divisible", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.Agent.BlockSize = 12; r.BlockSize = 8 }, "prefill.block_size", "not a multiple"},
		{"decode TP smaller", func(l *VLLMDecode, r *VLLMAgent, rtp *int) { *rtp = 4 }, "prefill.tp_size", "cannot be smaller"},
		{"TP not divisible", func(l *VLLMDecode, r *VLLMAgent, rtp *int) { l.TPSize = 3; l.TPRank = 0; *rtp = 2 }, "prefill.tp_size", "not divisible"},
		{"layout mismatch", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.KVCacheLayout = "NHD" }, "prefill.kv_cache_layout", "same kv_cache_layout"},
		{"layout mismatch, permute needs HND prefill", func(l *VLLMDecode, r *VLLMAgent, _ *int) {
			l.Agent.KVCacheLayout = "HND"
			r.KVCacheLayout = "NHD"
			l.EnablePermuteLocalKV = true
		}, "prefill.kv_cache_layout", "enable_permute_local_kv"},
		{"remote block lens differ", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BlockLens[1] = 32 }, "prefill.block_lens", "same block size"},
		{"remote block not heads x tp_ratio", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BlockLens = []uint64{96, 96} }, "prefill.block_lens", "tp_ratio"},
		{"replicated sizes differ", func(l *VLLMDecode, r *VLLMAgent, rtp *int) {
			l.TotalKVHeads = 1 // prefill TP 1 >= 1 head: replicated
		}, "prefill.block_lens", "match between prefill and decode when replicated"},
		{"P TP < heads < D TP", func(l *VLLMDecode, r *VLLMAgent, rtp *int) {
			// 4 heads: prefill TP 2 holds 2 (64 bytes), decode TP 8 holds 1
			// replicated (32 bytes); tp_ratio 4 needs 128-byte prefill blocks.
			l.TPSize, l.TPRank = 8, 5
			*rtp = 2
		}, "prefill.block_lens", "tp_ratio"},
		{"MLA sizes differ", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.MLA = true }, "prefill.block_lens", "replicated"},
		{"region count differs", func(l *VLLMDecode, r *VLLMAgent, _ *int) { *r = vAgent(vPrefillBase, 4, 64, nil, 10, 16) }, "prefill.kv_caches_base_addr", "regions"},
		{"block lens count", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BlockLens = r.BlockLens[:1] }, "prefill.block_lens", "block lengths for 2 regions"},
		{"no regions", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.Agent.BaseAddrs, l.Agent.BlockLens = nil, nil }, "decode.kv_caches_base_addr", "no regions"},
		{"zero blocks", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.NumBlocks = 0 }, "prefill.num_blocks", "positive"},
		{"zero block len", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.Agent.BlockLens[0] = 0 }, "decode.block_lens", "0 bytes"},
		{"zero block size", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BlockSize = 0 }, "prefill.block_size", "positive"},
		{"local sizes differ", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.Agent.BlockLens[1] = 64 }, "decode.block_lens", "same size"},
		{"blocks-first odd slot", func(l *VLLMDecode, r *VLLMAgent, _ *int) {
			l.BlocksFirst = true
			l.Agent.BlockLens = []uint64{48, 48} // 3 bytes per slot
		}, "decode.block_lens", "halves"},
		{"rank outside TP", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.TPRank = 2 }, "decode.tp_rank", "outside"},
		{"no KV heads", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.TotalKVHeads = 0 }, "total_num_kv_heads", "positive"},
		{"region wraps", func(l *VLLMDecode, r *VLLMAgent, _ *int) { r.BaseAddrs[1] = ^uint64(0) - 100 }, "prefill.kv_caches_base_addr", "wraps"},
		{"windows count", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.BlockWindows = []int{1, 2, 3} }, "block_window_per_layer", "layers"},
		{"negative window", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.BlockWindows = []int{-1} }, "block_window_per_layer", "negative"},
		{"unit zero", func(l *VLLMDecode, r *VLLMAgent, _ *int) {
			// Blocks-first 6-byte blocks, replicated: K half 3 bytes cut
			// into 4 prefill-sized blocks.
			l.BlocksFirst = true
			l.TotalKVHeads = 1
			l.Agent.BlockLens = []uint64{6, 6}
			r.BlockSize = 4
			r.BlockLens = []uint64{1, 1}
		}, "decode.block_lens", "0 bytes per descriptor"},
		{"list too long for int32 ids", func(l *VLLMDecode, r *VLLMAgent, _ *int) {
			l.Agent.NumBlocks = 1 << 30
			r.NumBlocks = 1 << 30
			l.Agent.BaseAddrs[1] = 1 << 40
			r.BaseAddrs[1] = 1 << 40
		}, "decode.num_blocks", "int32"},
		{"decode regions overlap", func(l *VLLMDecode, r *VLLMAgent, _ *int) { l.Agent.BaseAddrs[1] = l.Agent.BaseAddrs[0] + 100 }, "decode.kv_caches_base_addr", "overlap"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l, r, rtp := okLocal(), okRemote(), 1
			tc.mutate(&l, &r, &rtp)
			_, err := NewVLLMReader(l, r, rtp)
			var pe *Error
			if !errors.As(err, &pe) {
				t.Fatalf("want *Error, got %v", err)
			}
			if pe.Field != tc.field || !strings.Contains(pe.Msg, tc.contains) {
				t.Fatalf("got %q, want field %q containing %q", err, tc.field, tc.contains)
			}
		})
	}
}

func TestVLLMPermuteLocalKV(t *testing.T) {
	l := VLLMDecode{Agent: vAgent(vDecodeBase, 2, 32, nil, 8, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4, EnablePermuteLocalKV: true}
	l.Agent.KVCacheLayout = "NHD"
	r, err := NewVLLMReader(l, vAgent(vPrefillBase, 2, 64, nil, 10, 16), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !r.PermuteLocalKV() || r.BlockSizePostProcess() {
		t.Errorf("permute %v post %v", r.PermuteLocalKV(), r.BlockSizePostProcess())
	}
	// MLA ignores the layout.
	m := VLLMDecode{Agent: vAgent(vDecodeBase, 1, 32, nil, 8, 16), TPSize: 1, MLA: true}
	m.Agent.KVCacheLayout = "NHD"
	if _, err := NewVLLMReader(m, vAgent(vPrefillBase, 1, 32, nil, 10, 16), 1); err != nil {
		t.Errorf("MLA with different layouts: %v", err)
	}
}

func TestVLLMRequestErrors(t *testing.T) {
	r, err := NewVLLMReader(VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2}, vAgent(vPrefillBase, 2, 32, nil, 10, 8), 1)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name          string
		local, remote []int32
		field         string
	}{
		{"more local than remote", []int32{0, 1, 2, 3, 4, 5}, []int32{0}, ""},
		{"local id too big", []int32{8}, []int32{0, 1}, "local_block_ids[0]"},
		{"local id negative", []int32{1, -1}, []int32{0, 1, 2, 3}, "local_block_ids[1]"},
		{"remote id too big", []int32{1}, []int32{0, 10}, "remote_block_ids[1]"},
		{"remote id negative", []int32{1}, []int32{-5, 1}, "remote_block_ids[0]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "more local than remote" {
				// With a block-size ratio the local list is clipped, so use
				// an equal-block reader.
				r2, _ := NewVLLMReader(VLLMDecode{Agent: vAgent(vDecodeBase, 2, 64, nil, 8, 16), TPSize: 1, TotalKVHeads: 2}, vAgent(vPrefillBase, 2, 64, nil, 10, 16), 1)
				_, err := r2.Read([]int32{0, 1}, []int32{0})
				if err == nil || !strings.Contains(err.Error(), "local_block_ids") {
					t.Fatalf("got %v", err)
				}
				return
			}
			_, err := r.Read(tc.local, tc.remote)
			var pe *Error
			if !errors.As(err, &pe) || pe.Field != tc.field {
				t.Fatalf("got %v, want field %s", err, tc.field)
			}
			if _, err := planRead(r, tc.local, tc.remote); err == nil {
				t.Fatal("Plan accepted what Read refused")
			}
		})
	}
	// Ids beyond the clip are never read, so never checked: decode block 7
	// maps to sub-blocks 14, 15, but only 1 prefill block is read.
	if _, err := r.Read([]int32{7, 100}, []int32{3}); err != nil {
		t.Fatalf("clipped-away id refused: %v", err)
	}
}

func TestVLLMAppendReadReuse(t *testing.T) {
	r, err := NewVLLMReader(VLLMDecode{Agent: vAgent(vDecodeBase, 4, 64, nil, 64, 16), TPSize: 1, TotalKVHeads: 2}, vAgent(vPrefillBase, 4, 64, nil, 64, 16), 1)
	if err != nil {
		t.Fatal(err)
	}
	local := []int32{1, 2, 3, 9}
	remote := []int32{4, 5, 6, 7}
	n, notify, err := r.ReadLen(local, remote)
	if err != nil || notify || n != 16 {
		t.Fatalf("ReadLen = %d %v %v", n, notify, err)
	}
	lb, rb := make([]int32, 0, n), make([]int32, 0, n)
	allocs := testing.AllocsPerRun(100, func() {
		lb, rb, _, err = r.AppendRead(lb[:0], rb[:0], local, remote)
	})
	if err != nil || allocs != 0 {
		t.Fatalf("AppendRead: %v, %v allocs", err, allocs)
	}
	var p Plan
	if err := r.Plan(&p, remote, local); err != nil {
		t.Fatal(err)
	}
	allocs = testing.AllocsPerRun(100, func() { err = r.Plan(&p, remote, local) })
	if err != nil || allocs != 0 {
		t.Fatalf("Plan: %v, %v allocs", err, allocs)
	}
	// On error the buffers come back at their original lengths.
	lb2, rb2, _, err := r.AppendRead(lb[:3], rb[:3], []int32{99}, []int32{0})
	if err == nil || len(lb2) != 3 || len(rb2) != 3 {
		t.Fatalf("error path: %v, lens %d %d", err, len(lb2), len(rb2))
	}
}

func TestVLLMTPHelpers(t *testing.T) {
	for _, tc := range []struct{ rank, d, p, want int }{{0, 1, 1, 0}, {3, 4, 2, 1}, {7, 8, 1, 0}, {5, 8, 4, 2}} {
		got, err := VLLMTargetRemoteRank(tc.rank, tc.d, tc.p)
		if err != nil || got != tc.want {
			t.Errorf("VLLMTargetRemoteRank(%d, %d, %d) = %d, %v; want %d", tc.rank, tc.d, tc.p, got, err, tc.want)
		}
	}
	for _, bad := range [][3]int{{0, 2, 4}, {0, 3, 2}, {0, 0, 1}, {0, 1, 0}, {4, 4, 2}, {-1, 4, 2}} {
		if _, err := VLLMTargetRemoteRank(bad[0], bad[1], bad[2]); err == nil {
			t.Errorf("VLLMTargetRemoteRank%v accepted", bad)
		}
	}
}

// More runs than Plan's stack batch: runs spill over batches, windows
// cut across them, and the plan still moves exactly the prepped bytes.
func TestVLLMManyRuns(t *testing.T) {
	for _, windows := range [][]int{nil, {0, 700}, {1999, 3}} {
		local := VLLMDecode{Agent: vAgent(vDecodeBase, 4, 64, nil, 4096, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4, BlockWindows: windows}
		r, err := NewVLLMReader(local, vAgent(vPrefillBase, 4, 128, nil, 4096, 16), 1)
		if err != nil {
			t.Fatal(err)
		}
		// Pairs of consecutive blocks, so runs have length 2 and the
		// batches really hold runs, not single blocks.
		perm := rand.New(rand.NewPCG(1, 2)).Perm(2048)
		var lids, rids []int32
		for i, b := range perm[:1000] {
			lids = append(lids, int32(2*b), int32(2*b+1))
			rids = append(rids, int32(4*i), int32(4*i+1))
		}
		rd, err := r.Read(lids, rids)
		if err != nil {
			t.Fatal(err)
		}
		p, err := planRead(r, lids, rids)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		vAssertSameBytes(t, r, rd, p)
		// One strided copy per run of 2 (a window may cut one run per
		// region in half).
		if p.Descriptors() > len(rd.LocalIDs)/2+4 || p.ExpandedDescriptors() != uint64(len(rd.LocalIDs)) {
			t.Errorf("windows %v: %d copies standing for %d blocks, for %d prepped descriptors", windows, p.Descriptors(), p.ExpandedDescriptors(), len(rd.LocalIDs))
		}
	}
}

// A reader is shared by every request to its prefill engine: concurrent
// Read and Plan calls must not interfere (run with -race).
func TestVLLMReaderConcurrent(t *testing.T) {
	r, err := NewVLLMReader(VLLMDecode{Agent: vAgent(vDecodeBase, 4, 32, nil, 64, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 4, BlockWindows: []int{0, 3}},
		vAgent(vPrefillBase, 4, 64, nil, 64, 16), 1)
	if err != nil {
		t.Fatal(err)
	}
	want, err := planRead(r, []int32{1, 2, 3, 9, 10}, []int32{5, 6, 7, 8, 20})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 8)
	for g := range 8 {
		go func() {
			var p Plan
			for range 200 {
				if err := r.Plan(&p, []int32{5, 6, 7, 8, 20}, []int32{1, 2, 3, 9, 10}); err != nil {
					done <- err
					return
				}
				if !reflect.DeepEqual(p.Copies, want.Copies) {
					done <- fmt.Errorf("goroutine %d: plan differs", g)
					return
				}
				if _, err := r.Read([]int32{1, 2}, []int32{3, 4}); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	for range 8 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// planRead plans one request into a new Plan. Its arguments are in the
// tables' vLLM order, local (decode) ids first; Plan takes prefill first.
func planRead(r *VLLMReader, local, remote []int32) (*Plan, error) {
	return planNew(r, remote, local)
}

// planNew plans one request into a new Plan, with any planner of the
// index-list shape (NIXLKV, MORIKV, VLLMReader).
func planNew(pl interface {
	Plan(p *Plan, prefill, decode []int32) error
}, prefill, decode []int32) (*Plan, error) {
	p := new(Plan)
	if err := pl.Plan(p, prefill, decode); err != nil {
		return nil, err
	}
	return p, nil
}
