package planner

import (
	"math/rand/v2"
	"testing"
	"time"
)

// vLLM pull plans at realistic shapes. Every benchmark plans one request
// with warm buffers (what the runtime does per request) and reports ns per
// descriptor, allocations per request and the descriptor counts. The
// baseline, measured in the same run, is vLLM's kv_connector/v1/nixl_connector.py's own per-request
// work: the prepped descriptor id arrays of _read_blocks (AppendRead).

type vllmBenchCase struct {
	name          string
	local         VLLMDecode
	remote        VLLMAgent
	remoteTP      int
	localIDs      []int32
	remoteIDs     []int32
	wantCopiesMax int // regression guard on coalescing
}

// vllmBenchAgent: n regions laid out one after another from base.
func vllmBenchAgent(base uint64, n int, blockLen uint64, numBlocks, blockSize int) VLLMAgent {
	a := VLLMAgent{NumBlocks: numBlocks, BlockSize: blockSize, KVCacheLayout: "HND"}
	for i := range n {
		a.BaseAddrs = append(a.BaseAddrs, base+uint64(i)*blockLen*uint64(numBlocks))
		a.BlockLens = append(a.BlockLens, blockLen)
	}
	return a
}

func vllmConsecutive(start, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(start + i)
	}
	return out
}

func vllmBenchCases() []vllmBenchCase {
	r := rand.New(rand.NewPCG(7, 7))
	// 32-layer MHA (Llama-8B: 8 KV heads of 128 bf16), block 16 tokens:
	// prefill TP 1 blocks hold 8 heads (32 KiB), decode TP 2 blocks 4.
	mhaLocal := VLLMDecode{Agent: vllmBenchAgent(1<<40, 64, 16384, 4000, 16), TPRank: 1, TPSize: 2, TotalKVHeads: 8}
	mhaRemote := vllmBenchAgent(2<<40, 64, 32768, 2000, 16)
	// 61-layer MLA (576 bf16 per token), block 64, TP 1 -> 8.
	mlaLocal := VLLMDecode{Agent: vllmBenchAgent(1<<40, 61, 64*576*2, 8192, 64), TPRank: 5, TPSize: 8, MLA: true}
	mlaRemote := vllmBenchAgent(2<<40, 61, 64*576*2, 8192, 64)
	// 32-layer FlashInfer (blocks-first), decode block 32 tokens, prefill
	// 16: block-size ratio 2 and TP 1 -> 2.
	bfLocal := VLLMDecode{Agent: vllmBenchAgent(1<<40, 32, 2*4*32*256, 2000, 32), TPRank: 0, TPSize: 2, TotalKVHeads: 8, BlocksFirst: true}
	bfRemote := vllmBenchAgent(2<<40, 32, 2*8*16*256, 4000, 16)
	return []vllmBenchCase{
		{"MHA-32-layers-2000-blocks-TP1-to-2-consecutive", mhaLocal, mhaRemote, 1,
			vllmConsecutive(1000, 2000), vllmConsecutive(0, 2000), 64},
		{"MHA-32-layers-2000-blocks-TP1-to-2-scattered", mhaLocal, mhaRemote, 1,
			vllmScattered(r, 2000, 4000), vllmScattered(r, 2000, 2000), 64 * 2000},
		{"MLA-61-layers-4096-blocks-TP1-to-8-scattered", mlaLocal, mlaRemote, 1,
			vllmScattered(r, 4096, 8192), vllmScattered(r, 4096, 8192), 61 * 4096},
		{"FlashInfer-32-layers-1000-blocks-ratio-2-TP1-to-2", bfLocal, bfRemote, 1,
			vllmScattered(r, 1000, 2000), vllmConsecutive(0, 2000), 2 * 32 * 1000},
	}
}

func vllmScattered(r *rand.Rand, n, pool int) []int32 {
	out := make([]int32, n)
	for i, p := range r.Perm(pool)[:n] {
		out[i] = int32(p)
	}
	return out
}

func BenchmarkVLLMPlan(b *testing.B) {
	for _, bc := range vllmBenchCases() {
		b.Run(bc.name, func(b *testing.B) {
			rd, err := NewVLLMReader(bc.local, bc.remote, bc.remoteTP)
			if err != nil {
				b.Fatal(err)
			}
			baseNs := vllmBaselineNs(b, rd, bc)
			p := benchPlan(b, rd, bc.remoteIDs, bc.localIDs, baseNs, "x-vs-reference-ids")
			if len(p.Copies) > bc.wantCopiesMax {
				b.Fatalf("%d copies, want at most %d", len(p.Copies), bc.wantCopiesMax)
			}
		})
	}
}

// BenchmarkVLLMRead is the prepped form itself: the id arrays of one READ
// into reused buffers.
func BenchmarkVLLMRead(b *testing.B) {
	for _, bc := range vllmBenchCases() {
		b.Run(bc.name, func(b *testing.B) {
			rd, err := NewVLLMReader(bc.local, bc.remote, bc.remoteTP)
			if err != nil {
				b.Fatal(err)
			}
			n, _, err := rd.ReadLen(bc.localIDs, bc.remoteIDs)
			if err != nil {
				b.Fatal(err)
			}
			l, r := make([]int32, 0, n), make([]int32, 0, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if l, r, _, err = rd.AppendRead(l[:0], r[:0], bc.localIDs, bc.remoteIDs); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/descriptor")
		})
	}
}

// BenchmarkVLLMHandshake builds both prepped lists once per peer: the
// reader plus the materialized descriptor arrays handed to prep_dlist.
func BenchmarkVLLMHandshake(b *testing.B) {
	bc := vllmBenchCases()[0]
	var ld, rd []VLLMDesc
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		r, err := NewVLLMReader(bc.local, bc.remote, bc.remoteTP)
		if err != nil {
			b.Fatal(err)
		}
		ll, rl := r.LocalList(), r.RemoteList()
		ld, rd = ll.Append(ld[:0]), rl.Append(rd[:0])
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(ld)+len(rd)), "ns/descriptor")
}

// vllmBaselineNs times vLLM's kv_connector/v1/nixl_connector.py's per-request work (the prepped id
// arrays) for about 200 ms.
func vllmBaselineNs(b *testing.B, rd *VLLMReader, bc vllmBenchCase) float64 {
	n, _, err := rd.ReadLen(bc.localIDs, bc.remoteIDs)
	if err != nil {
		b.Fatal(err)
	}
	l, r := make([]int32, 0, n), make([]int32, 0, n)
	start, runs := time.Now(), 0
	for time.Since(start) < 200*time.Millisecond {
		l, r, _, _ = rd.AppendRead(l[:0], r[:0], bc.localIDs, bc.remoteIDs)
		runs++
	}
	return float64(time.Since(start).Nanoseconds()) / float64(runs)
}
