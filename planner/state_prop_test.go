package planner

import (
	"cmp"
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// Property tests for planner B's plans. The models here know only the
// meaning of the buffers (which page, slot, channel or token lives where),
// not the planner's formulas.

// bDstOverlap fails if two blocks of the plan write the same decode byte.
func bDstOverlap(t *rapid.T, p *Plan) {
	var bs [][2]uint64
	p.ForEachBlock(func(_, d, n uint64) bool {
		bs = append(bs, [2]uint64{d, d + n})
		return true
	})
	slices.SortFunc(bs, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	for i := 1; i < len(bs); i++ {
		if bs[i-1][1] > bs[i][0] {
			t.Fatalf("two copies write decode bytes [%#x, %#x)", bs[i][0], bs[i-1][1])
		}
	}
}

// TestPropPagedStateMovesEachPage: for a paged component (MLA per-layer
// tensors, PP stage against a PP-1 decode) every byte of every listed
// prefill page lands at the same byte of the decode page at the same list
// position, in the decode tensor of the same layer, exactly once; nothing
// else is written; every copy is inside the exactly sized buffers.
func TestPropPagedStateMovesEachPage(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		mori := rapid.Bool().Draw(t, "mori")
		st := rapid.SampledFrom([]StateType{StateSWA, StateDSA, StateSWARing, StateC128State, StateMiniMaxIndexK}).Draw(t, "type")
		models := rapid.IntRange(1, 6).Draw(t, "model_layers")
		start, layers := 0, models
		pp := 1
		if !mori && st != StateMiniMaxIndexK && rapid.Bool().Draw(t, "pp") {
			pp = 2
			start = rapid.IntRange(0, models-1).Draw(t, "start_layer")
			layers = rapid.IntRange(1, models-start).Draw(t, "stage_layers")
		}
		srcPages := rapid.IntRange(1, 40).Draw(t, "prefill_pages")
		dstPages := rapid.IntRange(1, 40).Draw(t, "decode_pages")
		n := rapid.IntRange(1, min(srcPages, dstPages)).Draw(t, "n")
		si := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(srcPages-1)), n, n, rapid.ID[int32]).Draw(t, "si")
		di := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(dstPages-1)), n, n, rapid.ID[int32]).Draw(t, "di")
		if rapid.Bool().Draw(t, "sorted") { // realistic: runs of consecutive pages
			slices.Sort(si)
			slices.Sort(di)
		}
		req := &StateRequest{Types: []StateType{st}, SrcIndices: [][]int32{si}, DstIndices: [][]int32{di},
			Topology: StateTopology{PrefillTPSize: 1, DecodeTPSize: 1, MLA: true, PrefillPPSize: pp, PP: PPLayout{StartLayer: start}}}
		var sp, sl, sd, dp, dd []uint64
		items := make([]uint64, models)
		for l := range items {
			items[l] = uint64(rapid.SampledFrom([]int{8, 24, 64}).Draw(t, "item"))
		}
		for l := 0; l < models; l++ {
			dp = append(dp, uint64(l+100)<<32)
			dd = append(dd, items[l]*uint64(dstPages))
		}
		for l := start; l < start+layers; l++ {
			sp = append(sp, uint64(l+1)<<32)
			sl = append(sl, items[l])
			sd = append(sd, items[l]*uint64(srcPages))
		}
		req.Src = StateBuffers{Ptrs: [][]uint64{sp}, ItemLens: [][]uint64{sl}, DataLens: [][]uint64{sd}}
		req.Dst = StateBuffers{Ptrs: [][]uint64{dp}, DataLens: [][]uint64{dd}}
		if mori {
			// MORI pairs tensor by tensor: decode holds the same layers.
			req.Dst.Ptrs[0], req.Dst.DataLens[0] = dp[start:start+layers], dd[start:start+layers]
		}
		var sps []StatePlan
		var err error
		if mori {
			sps, err = PlanStateMORI(req)
		} else {
			sps, err = PlanStateNIXL(req)
		}
		if err != nil {
			t.Fatal(err)
		}
		p := &sps[0].Plan
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		bDstOverlap(t, p)
		// Expected: each (layer, list position) page copied whole.
		want := map[[3]uint64]bool{}
		var wantBytes uint64
		for l := start; l < start+layers; l++ {
			srcBase, dstBase := uint64(l+1)<<32, uint64(l+100)<<32
			for k := range si {
				want[[3]uint64{srcBase + uint64(si[k])*items[l], dstBase + uint64(di[k])*items[l], items[l]}] = true
				wantBytes += items[l]
			}
		}
		if p.Bytes() != wantBytes {
			t.Fatalf("plan moves %d bytes, want %d", p.Bytes(), wantBytes)
		}
		// Split the plan's blocks back into pages and check each.
		p.ForEachBlock(func(s, d, length uint64) bool {
			l := int(s>>32) - 1
			for off := uint64(0); off < length; off += items[l] {
				key := [3]uint64{s + off, d + off, items[l]}
				if !want[key] {
					t.Fatalf("unexpected page copy %#x -> %#x (%d bytes)", key[0], key[1], key[2])
				}
				delete(want, key)
			}
			return true
		})
		if len(want) != 0 {
			t.Fatalf("%d pages not copied", len(want))
		}
	})
}

// bChannels returns the global channel of each local channel of TP rank r
// when a tensor's sharded axis is the concatenation of independently
// head-sharded groups (one group: a plain sharded axis).
func bChannels(groups []int, tp, r int) []int {
	var out []int
	base := 0
	for _, g := range groups {
		per := g / tp
		for c := 0; c < per; c++ {
			out = append(out, base+r*per+c)
		}
		base += g
	}
	return out
}

// TestPropMambaSliceChannels: across all prefill and decode ranks, every
// channel of every decode rank's slot (each outer row) is written exactly
// once, with the same global channel (same row) of the prefill rank that
// holds it. GDN conv states shard q, k and v independently; other states
// have one sharded axis.
func TestPropMambaSliceChannels(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p := rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "prefill_tp")
		d := rapid.SampledFrom([]int{1, 2, 4, 8}).Filter(func(d int) bool { return d != p }).Draw(t, "decode_tp")
		unit := 8 // every group divisible by both TP sizes
		var groups []int
		conv := rapid.Bool().Draw(t, "conv")
		if conv {
			for g := rapid.IntRange(1, 3).Draw(t, "groups"); g > 0; g-- {
				groups = append(groups, unit*rapid.IntRange(1, 3).Draw(t, "group"))
			}
		} else {
			groups = []int{unit * rapid.IntRange(1, 4).Draw(t, "dims")}
		}
		full := 0
		for _, g := range groups {
			full += g
		}
		outer := rapid.IntRange(1, 3).Draw(t, "outer")
		bpd := uint64(rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "bytes_per_dim"))
		srcDim, dstDim := full/p, full/d
		// written[decode rank][row*dstDim + local channel] = global channel + 1
		written := make([][]int, d)
		for r := range written {
			written[r] = make([]int, outer*dstDim)
		}
		// The rank mapping decides which prefill rank feeds which decode rank.
		for r := 0; r < d; r++ {
			var writers []int
			if p > d {
				for w := r * (p / d); w < (r+1)*(p/d); w++ {
					writers = append(writers, w)
				}
			} else {
				writers = []int{r / (d / p)}
			}
			for _, w := range writers {
				in := MambaSliceInput{SrcDim: srcDim, DstDim: dstDim, SrcTPSize: p, DstTPSize: d, DstTPRank: r, LocalTPRank: w,
					SrcItemLen: uint64(srcDim*outer) * bpd, DstItemLen: uint64(dstDim*outer) * bpd, OuterCount: outer}
				if conv {
					in.ConvShardGroups = groups
				}
				blocks, err := MambaStateSliceByteBlocks(in)
				if err != nil {
					t.Fatal(err)
				}
				srcCh := bChannels(groups, p, w)
				for _, b := range blocks {
					if b.SrcOff%bpd != 0 || b.DstOff%bpd != 0 || b.Len%bpd != 0 {
						t.Fatalf("block %+v cuts a channel", b)
					}
					for k := uint64(0); k < b.Len/bpd; k++ {
						s, dpos := int(b.SrcOff/bpd+k), int(b.DstOff/bpd+k)
						row, sc := s/srcDim, s%srcDim
						if dpos/dstDim != row {
							t.Fatalf("row %d lands in decode row %d", row, dpos/dstDim)
						}
						if dpos >= len(written[r]) || written[r][dpos] != 0 {
							t.Fatalf("decode rank %d channel %d written twice or out of slot", r, dpos)
						}
						written[r][dpos] = srcCh[sc] + 1
					}
				}
			}
			dstCh := bChannels(groups, d, r)
			for pos, g := range written[r] {
				if g-1 != dstCh[pos%dstDim] {
					t.Fatalf("decode rank %d row %d channel %d holds global channel %d, want %d (p=%d d=%d groups=%v)",
						r, pos/dstDim, pos%dstDim, g-1, dstCh[pos%dstDim], p, d, groups)
				}
			}
		}
	})
}

// TestPropRankMappingCoversHeads: every decode rank's KV heads come from
// exactly one of its real (non-dummy) targets; every prefill rank is
// targeted by exactly RequiredDstInfoNum decode ranks per (CP, PP) rank;
// and a decode rank waits for exactly as many answers as it has real
// targets.
func TestPropRankMappingCoversHeads(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		in := RankMappingInput{
			DecodeTPSize:  rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "decode_tp"),
			PrefillTPSize: rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "prefill_tp"),
			PrefillCPSize: rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "prefill_cp"),
			PrefillPPSize: rapid.SampledFrom([]int{1, 2, 3}).Draw(t, "prefill_pp"),
			MLA:           rapid.Bool().Draw(t, "mla"),
			AllCPRanks:    rapid.Bool().Draw(t, "all_cp"),
		}
		in.DecodePPSize = rapid.SampledFrom([]int{1, in.PrefillPPSize}).Draw(t, "decode_pp")
		heads := 8 // divisible by every TP size drawn
		connections := map[[3]int]int{}
		for r := 0; r < in.DecodeTPSize; r++ {
			for ppr := 0; ppr < in.DecodePPSize; ppr++ {
				in.DecodeEngineRank, in.DecodePPRank = r, ppr
				m, err := MapRanks(in)
				if err != nil {
					t.Fatal(err)
				}
				covered := map[[3]int]int{} // (cp, pp, head) -> sources
				real := 0
				for _, tg := range m.Targets(in.MLA) {
					connections[[3]int{tg.CPRank, tg.PPRank, tg.TPRank}]++
					if tg.Dummy {
						continue
					}
					real++
					per := heads / in.PrefillTPSize
					for h := tg.TPRank * per; h < (tg.TPRank+1)*per; h++ {
						covered[[3]int{tg.CPRank, tg.PPRank, h}]++
					}
				}
				if real != m.RequiredPrefillResponseNum {
					t.Fatalf("rank %d: %d real targets, waits for %d answers", r, real, m.RequiredPrefillResponseNum)
				}
				per := heads / in.DecodeTPSize
				for _, cp := range m.TargetCPRanks {
					for _, pp := range m.TargetPPRanks {
						for h := r * per; h < (r+1)*per; h++ {
							want := 1
							if in.MLA {
								// MLA KV is whole on every rank: the one real
								// target covers its own heads only.
								continue
							}
							if covered[[3]int{cp, pp, h}] != want {
								t.Fatalf("decode rank %d head %d (cp %d pp %d) covered %d times", r, h, cp, pp, covered[[3]int{cp, pp, h}])
							}
						}
					}
				}
				// With decode PP 1 every prefill stage answers.
				if in.DecodePPSize == 1 && len(m.TargetPPRanks) != in.PrefillPPSize {
					t.Fatalf("decode PP 1 targets stages %v of %d", m.TargetPPRanks, in.PrefillPPSize)
				}
			}
		}
		// Each targeted prefill rank hears from RequiredDstInfoNum decode ranks.
		m, _ := MapRanks(RankMappingInput{DecodeTPSize: in.DecodeTPSize, PrefillTPSize: in.PrefillTPSize})
		for key, n := range connections {
			if n != m.RequiredDstInfoNum {
				t.Fatalf("prefill (cp %d pp %d tp %d) hears from %d decode ranks, expects %d", key[0], key[1], key[2], n, m.RequiredDstInfoNum)
			}
		}
		if len(connections) == 0 || (in.DecodePPSize == in.PrefillPPSize && len(connections)%in.PrefillTPSize != 0) {
			t.Fatalf("connections %v", connections)
		}
	})
}

// TestPropCPFilterPartitions: over any chunking of a request, the CP ranks'
// filtered chunks together hold every page exactly once, in order, and
// each rank's pages are its contiguous share.
func TestPropCPFilterPartitions(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		total := rapid.IntRange(0, 60).Draw(t, "total")
		size := rapid.IntRange(1, 6).Draw(t, "cp_size")
		pages := make([]int32, total)
		for i := range pages {
			pages[i] = int32(1000 + i)
		}
		var cuts []int
		for at := 0; at < total; {
			n := rapid.IntRange(1, total-at).Draw(t, "chunk")
			cuts = append(cuts, at)
			at += n
		}
		cuts = append(cuts, total)
		var all []int32
		for r := 0; r < size; r++ {
			var mine []int32
			for c := 0; c+1 < len(cuts); c++ {
				chunk := IndexSlice{cuts[c], cuts[c+1]}
				got, sl, err := FilterKVIndicesForCPRank(pages[chunk.Start:chunk.Stop], chunk, total, r, size)
				if err != nil {
					t.Fatal(err)
				}
				if sl.Stop-sl.Start != len(got) || (len(got) > 0 && got[0] != pages[sl.Start]) {
					t.Fatalf("slice %v does not describe %v", sl, got)
				}
				mine = append(mine, got...)
			}
			lo, hi, _ := CPRankPageBounds(total, r, size)
			if !slices.Equal(mine, pages[lo:hi]) {
				t.Fatalf("rank %d got %v, want pages [%d, %d)", r, mine, lo, hi)
			}
			all = append(all, mine...)
		}
		if !slices.Equal(all, pages) {
			t.Fatalf("ranks together hold %v", all)
		}
	})
}

// TestPropDSATailKeepsTokenOrder: whatever the two ring sizes, after the
// remap the decode ring holds the request's live tail tokens in order,
// starting where decode's own tail indices say, in every tensor.
func TestPropDSATailKeepsTokenOrder(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		pool := rapid.IntRange(2, 16).Draw(t, "pool")
		sp := DSATailPool{KPoolUseCompress: true, PoolSize: pool, TailExtraSlots: rapid.IntRange(0, 8).Draw(t, "src_extra")}
		dp := DSATailPool{KPoolUseCompress: true, PoolSize: pool, TailExtraSlots: rapid.IntRange(0, 8).Draw(t, "dst_extra")}
		seq := rapid.IntRange(0, 200).Draw(t, "seq")
		srow, drow := rapid.IntRange(0, 3).Draw(t, "src_row"), rapid.IntRange(0, 3).Draw(t, "dst_row")
		si, err := DSATailStateIndices(sp, srow, seq)
		if err != nil {
			t.Fatal(err)
		}
		di, err := DSATailStateIndices(dp, drow, seq)
		if err != nil {
			t.Fatal(err)
		}
		slot := uint64(rapid.SampledFrom([]int{1, 4, 16}).Draw(t, "slot"))
		sTail, dTail := uint64(pool+sp.TailExtraSlots), uint64(pool+dp.TailExtraSlots)
		src := DSATailBuffers{Ptrs: []uint64{0}, ItemLens: []uint64{slot * sTail}, DataLens: []uint64{4 * slot * sTail}}
		dst := DSATailBuffers{Ptrs: []uint64{1 << 40}, ItemLens: []uint64{slot * dTail}, DataLens: []uint64{4 * slot * dTail}}
		p, err := PlanDSATail(src, dst, nil, si, di)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		nValid := seq % pool
		// Label the prefill ring by token: slot (first + k) % ring of row
		// srow holds live token k.
		label := map[uint64]int{}
		first := uint64(seq-nValid) % sTail
		for k := 0; k < nValid; k++ {
			label[uint64(srow)*sTail+(first+uint64(k))%sTail] = k + 1
		}
		got := map[uint64]int{}
		p.ForEachBlock(func(s, d, n uint64) bool {
			for off := uint64(0); off < n; off += slot {
				got[(d+off-(1<<40))/slot] = label[(s+off)/slot]
			}
			return true
		})
		dFirst := uint64(seq-nValid) % dTail
		if len(got) != nValid {
			t.Fatalf("%d decode slots written, want %d", len(got), nValid)
		}
		for k := 0; k < nValid; k++ {
			at := uint64(drow)*dTail + (dFirst+uint64(k))%dTail
			if got[at] != k+1 {
				t.Fatalf("decode slot %d holds token %d, want %d (src %v dst %v)", at, got[at]-1, k, si, di)
			}
		}
	})
}

// TestPropEntryPairsMatchIDs: layer-id pairing pairs equal ids, never uses
// a decode entry twice, and keeps the order of repeated ids.
func TestPropEntryPairsMatchIDs(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		dst := rapid.SliceOfN(rapid.IntRange(0, 5), 1, 12).Draw(t, "dst_ids")
		// The prefill stage: a sub-multiset of decode's ids, in order.
		var src []int
		for _, id := range dst {
			if rapid.Bool().Draw(t, "keep") {
				src = append(src, id)
			}
		}
		pairs, err := BuildTransferEntryPairs(src, dst, len(src), len(dst), false)
		if len(src) == 0 {
			if err != nil || len(pairs) != 0 {
				t.Fatalf("empty stage: %v %v", pairs, err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		used := map[int]bool{}
		last := map[int]int{}
		for _, pr := range pairs {
			if src[pr.Src] != dst[pr.Dst] || used[pr.Dst] {
				t.Fatalf("pair %v: ids %d/%d, reused %v", pr, src[pr.Src], dst[pr.Dst], used[pr.Dst])
			}
			if prev, ok := last[src[pr.Src]]; ok && pr.Dst < prev {
				t.Fatalf("repeated id %d paired out of order", src[pr.Src])
			}
			used[pr.Dst] = true
			last[src[pr.Src]] = pr.Dst
		}
	})
}
