package planner

import "testing"

// FuzzStateHelpers: the numeric helpers (rank mapping, CP filtering, layer
// pairing, Mamba slicing, DSA tail, DSV4 indices) never panic, whatever
// the integers, and what they return is consistent.
func FuzzStateHelpers(f *testing.F) {
	f.Add(4, 2, 3, 1, 2, 1, 10, 3, 8, 2, int64(1), true)
	f.Add(2, 8, 1, 4, 1, 2, 0, 0, 16, 4, int64(-5), false)
	f.Add(1<<40, -3, 7, 0, 1<<62, -1<<62, 1<<31, 5, -8, 3, int64(1<<62), true)
	f.Fuzz(func(t *testing.T, a, b, c, d, e, g, h, k, m, n int, x int64, flag bool) {
		if mp, err := MapRanks(RankMappingInput{DecodeTPSize: a, PrefillTPSize: b, DecodeEngineRank: c, PrefillCPSize: d,
			PrefillPPSize: e, DecodePPSize: g, DecodePPRank: h, MLA: flag, AllCPRanks: !flag}); err == nil {
			if mp.RequiredDstInfoNum < 1 || mp.RequiredPrefillResponseNum < 1 || len(mp.Targets(flag)) == 0 {
				t.Fatalf("mapping %+v", mp)
			}
		}
		if s, end, err := CPRankPageBounds(a, b, c); err == nil && (s < 0 || end < s || end > a) {
			t.Fatalf("bounds [%d, %d) of %d", s, end, a)
		}
		idx := []int32{1, 2, 3, 4, 5}
		if got, sl, err := FilterKVIndicesForCPRank(idx, IndexSlice{d, e}, g, h, k); err == nil && len(got) > len(idx) {
			t.Fatalf("filter %v %v", got, sl)
		}
		_, _ = BuildTransferEntryPairs(nil, nil, a, b, flag)
		_, _ = BuildTransferEntryPairs([]int{c, d}, []int{d, c, e}, 2, 3, flag)
		_, _ = BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, LayerIDs: []int{a}, Draft: &DraftPool{LayerNum: b}, NumDraftEntries: c, NumHiddenLayers: d})
		_, _ = ResolveDCPDstEntryIndices(nil, nil, a, b)
		_, _ = PairCompressedMLARegions(nil, a, b, PPLayout{StartLayer: c, EndLayer: d, HasEnd: flag, CompressionRatios: []int{0, 4, 128, 4}}, StateSWARing)
		_, _ = PairCompressedMLARegions(nil, a%64, b%64, PPLayout{StartLayer: c, EndLayer: d, HasEnd: true, CompressionRatios: []int{e, 4, 128}}, StateSWA)
		in := MambaSliceInput{SrcDim: a, DstDim: b, SrcTPSize: c, DstTPSize: d, DstTPRank: e, LocalTPRank: g,
			ConvShardGroups: []int{h, k}, SrcItemLen: uint64(x), DstItemLen: uint64(m), OuterCount: n}
		_, _ = MambaStateSliceBlocks(in)
		if bs, err := MambaStateSliceByteBlocks(in); err == nil && len(bs) > maxMambaOuterRows*2 {
			t.Fatalf("%d blocks", len(bs))
		}
		si, _ := DSATailStateIndices(DSATailPool{KPoolUseCompress: true, PoolSize: a, TailExtraSlots: b}, c, d)
		di, _ := DSATailStateIndices(DSATailPool{KPoolUseCompress: true, PoolSize: a, TailExtraSlots: e}, g, d)
		sel, _ := SliceDSATailDstForPP(2, h%1024, k, m, flag)
		p, err := PlanDSATail(DSATailBuffers{Ptrs: []uint64{uint64(x), 64}, ItemLens: []uint64{uint64(n), uint64(m)}},
			DSATailBuffers{Ptrs: make([]uint64, max(0, h%1024))}, sel, si, di)
		if err == nil {
			if err := p.Validate(); err != nil {
				t.Fatal(err)
			}
		}
		_, _ = DSV4C4StateIndices(a, b, c)
		_, _ = DSV4C128StateIndices(a, b, flag, c)
	})
}
