package planner

import (
	"fmt"
	"slices"
	"sort"
	"testing"

	"pgregory.net/rapid"
)

// The SGLang styles of planjson's requests, as the properties draw them.
const (
	styleSGLangNIXL = "sglang-nixl"
	styleSGLangMORI = "sglang-mori"
)

// Property tests over random SGLang geometries. The model here is
// independent of the planner: it knows only how SGLang lays KV out (page ->
// token -> head, heads split across TP ranks, replicated when TP exceeds the
// head count) and which prefill ranks feed which decode rank.

// ownedHeads returns the global KV heads a rank of a TP group holds.
func ownedHeads(total, tp, rank int) []int {
	if total >= tp {
		per := total / tp
		out := make([]int, per)
		for i := range out {
			out[i] = rank*per + i
		}
		return out
	}
	return []int{rank / (tp / total)} // replicated: tp/total ranks share a head
}

// prefillSources returns the prefill ranks that push to decode rank r
// (SGLang's target prefill ranks; for MHA every one of them sends).
func prefillSources(p, d, r int) []int {
	if d >= p {
		return []int{r / (d / p)}
	}
	var out []int
	for k := r * (p / d); k < (r+1)*(p/d); k++ {
		out = append(out, k)
	}
	return out
}

// kvAddr is what one byte range of a KV region means: region, page, token
// and the global heads it covers.
type kvAddr struct {
	region, page, token int
	heads               string
}

// locate maps an absolute range to its meaning on a side whose regions
// hold tokens of len(heads)*headBytes bytes, pageSize tokens per page.
func locate(t *rapid.T, regions []Region, addr, length uint64, pageSize int, headBytes uint64, heads []int) kvAddr {
	for i, r := range regions {
		if addr < r.Addr || addr+length > r.Addr+r.Len {
			continue
		}
		tokenBytes := uint64(len(heads)) * headBytes
		item := tokenBytes * uint64(pageSize)
		off := addr - r.Addr
		page, within := off/item, off%item
		token, hoff := within/tokenBytes, within%tokenBytes
		if hoff%headBytes != 0 || length%headBytes != 0 || hoff+length > tokenBytes {
			t.Fatalf("range [%#x, +%d) cuts heads or tokens (offset %d in a %d-byte token)", addr, length, hoff, tokenBytes)
		}
		first, n := int(hoff/headBytes), int(length/headBytes)
		return kvAddr{i, int(page), int(token), fmt.Sprint(heads[first : first+n])}
	}
	t.Fatalf("range [%#x, +%d) is in no region", addr, length)
	return kvAddr{}
}

// tokenBlocks splits blocks into per-token pieces of tokenBytes on the
// destination side, so whole-token merges compare token by token.
func noOverlap(t *rapid.T, bs []block) {
	sort.Slice(bs, func(i, j int) bool { return bs[i].Dst < bs[j].Dst })
	for i := 1; i < len(bs); i++ {
		if bs[i-1].Dst+bs[i-1].Len > bs[i].Dst {
			t.Fatalf("two copies write decode bytes [%#x, %#x)", bs[i].Dst, bs[i-1].Dst+bs[i-1].Len)
		}
	}
}

func TestPropHeteroTPHeadsReachTheirOwners(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		style := rapid.SampledFrom([]string{styleSGLangNIXL, styleSGLangMORI}).Draw(t, "style")
		total := rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "total_kv_heads")
		p := rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "prefill_tp")
		d := rapid.SampledFrom([]int{1, 2, 4, 8}).Filter(func(d int) bool { return d != p }).Draw(t, "decode_tp")
		headBytes := uint64(rapid.SampledFrom([]int{2, 4, 16}).Draw(t, "head_bytes"))
		pageSize := rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "page_size")
		layers := rapid.IntRange(1, 3).Draw(t, "layers")
		srcPages := rapid.IntRange(1, 8).Draw(t, "prefill_pages")
		dstPages := rapid.IntRange(1, 8).Draw(t, "decode_pages")
		n := rapid.IntRange(1, min(srcPages, dstPages)).Draw(t, "chunk")
		src := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(srcPages-1)), n, n, rapid.ID[int32]).Draw(t, "src")
		dst := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(dstPages-1)), n, n, rapid.ID[int32]).Draw(t, "dst")

		side := func(tp, rank, pages int, base uint64) KVSide {
			heads := len(ownedHeads(total, tp, rank))
			item := uint64(pageSize*heads) * headBytes
			s := KVSide{TPSize: tp, TPRank: rank, KVHeadNum: heads, NumPages: uint64(pages)}
			for i := 0; i < 2*layers; i++ {
				s.Ptrs = append(s.Ptrs, base+uint64(i)*(item*uint64(pages)+64))
				s.ItemLens = append(s.ItemLens, item)
			}
			return s
		}
		for r := 0; r < d; r++ {
			want := map[kvAddr]bool{} // (region, page, token, head) r must receive
			for j := 0; j < 2*layers; j++ {
				for _, q := range dst {
					for tok := 0; tok < pageSize; tok++ {
						for _, h := range ownedHeads(total, d, r) {
							want[kvAddr{j, int(q), tok, fmt.Sprint([]int{h})}] = true
						}
					}
				}
			}
			got := map[kvAddr]bool{}
			for _, k := range prefillSources(p, d, r) {
				g := SGLangKV{PageSize: pageSize, TotalKVHeads: total,
					Prefill: side(p, k, srcPages, 1<<32), Decode: side(d, r, dstPages, 1<<40)}
				plan := new(Plan)
				var err error
				if style == styleSGLangNIXL {
					var nk *NIXLKV
					if nk, err = NewNIXLKV(g, true); err == nil {
						err = nk.Plan(plan, src, dst)
					}
				} else {
					var mk *MORIKV
					if mk, err = NewMORIKV(g); err == nil {
						err = mk.Plan(plan, src, dst)
					}
				}
				if err != nil {
					t.Fatalf("prefill rank %d -> decode rank %d: %v", k, r, err)
				}
				if err := plan.Validate(); err != nil {
					t.Fatal(err)
				}
				srcHeads, dstHeads := ownedHeads(total, p, k), ownedHeads(total, d, r)
				var common []int
				for _, h := range srcHeads {
					if slices.Contains(dstHeads, h) {
						common = append(common, h)
					}
				}
				blocks := planBlocks(plan, -1)
				noOverlap(t, slices.Clone(blocks))
				var moved uint64
				sent := map[int]bool{}
				for _, b := range blocks {
					// Split whole-token merges back into tokens.
					for off := uint64(0); off < b.Len; {
						sa := locate(t, plan.Src, b.Src+off, headBytes, pageSize, headBytes, srcHeads)
						da := locate(t, plan.Dst, b.Dst+off, headBytes, pageSize, headBytes, dstHeads)
						if sa.region != da.region || sa.token != da.token || sa.heads != da.heads {
							t.Fatalf("rank %d -> %d: prefill %+v lands on decode %+v", k, r, sa, da)
						}
						idx := slices.Index(src, int32(sa.page))
						if idx < 0 || dst[idx] != int32(da.page) {
							t.Fatalf("rank %d -> %d: prefill page %d lands on decode page %d", k, r, sa.page, da.page)
						}
						got[da] = true
						var h int
						fmt.Sscanf(sa.heads, "[%d]", &h)
						sent[h] = true
						off += headBytes
					}
					moved += b.Len
				}
				// Every head this prefill rank holds that decode rank r
				// owns reaches r, for every region, page and token.
				wantBytes := uint64(len(common)) * headBytes * uint64(pageSize*n*2*layers)
				if moved != wantBytes || len(sent) != len(common) {
					t.Fatalf("rank %d -> %d: moved %d bytes of heads %v, want %d bytes of heads %v", k, r, moved, sent, wantBytes, common)
				}
			}
			for a := range want {
				if !got[a] {
					t.Fatalf("decode rank %d never receives %+v", r, a)
				}
			}
			for a := range got {
				if !want[a] {
					t.Fatalf("decode rank %d receives %+v it does not own", r, a)
				}
			}
		}
	})
}

func TestPropWholePagePlans(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		style := rapid.SampledFrom([]string{styleSGLangNIXL, styleSGLangMORI}).Draw(t, "style")
		mla := rapid.Bool().Draw(t, "mla")
		prepped := style == styleSGLangNIXL && rapid.Bool().Draw(t, "prepped")
		layers := rapid.IntRange(1, 4).Draw(t, "layers")
		perLayer := 2
		if mla {
			perLayer = 1
		}
		item := uint64(rapid.SampledFrom([]int{8, 24, 64}).Draw(t, "item"))
		dstItem := item
		if prepped && rapid.Bool().Draw(t, "wide_decode_slots") {
			dstItem = item * 3
		}
		srcPages := rapid.IntRange(1, 10).Draw(t, "prefill_pages")
		dstPages := rapid.IntRange(1, 10).Draw(t, "decode_pages")
		n := rapid.IntRange(0, min(srcPages, dstPages)).Draw(t, "chunk")
		src := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(srcPages-1)), n, n, rapid.ID[int32]).Draw(t, "src")
		dst := rapid.SliceOfNDistinct(rapid.Int32Range(0, int32(dstPages-1)), n, n, rapid.ID[int32]).Draw(t, "dst")
		side := func(pages int, it uint64, base uint64, kinds bool) KVSide {
			s := KVSide{TPSize: 2, NumPages: uint64(pages), KVHeadNum: 1}
			for i := 0; i < perLayer*layers; i++ {
				s.Ptrs = append(s.Ptrs, base+uint64(i)*(it*uint64(pages)+8))
				s.ItemLens = append(s.ItemLens, it)
				if kinds {
					s.Kinds = append(s.Kinds, rapid.SampledFrom([]MemKind{VRAM, DRAM}).Draw(t, "kind"))
				}
			}
			return s
		}
		g := SGLangKV{MLA: mla, PageSize: 4,
			Prefill: side(srcPages, item, 1<<32, false),
			Decode:  side(dstPages, dstItem, 1<<40, prepped && rapid.Bool().Draw(t, "mixed"))}
		plan := new(Plan)
		var err error
		if style == styleSGLangNIXL {
			var nk *NIXLKV
			if nk, err = NewNIXLKV(g, prepped); err == nil {
				err = nk.Plan(plan, src, dst)
			}
		} else {
			var mk *MORIKV
			if mk, err = NewMORIKV(g); err == nil {
				err = mk.Plan(plan, src, dst)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := plan.Validate(); err != nil {
			t.Fatal(err)
		}
		// Bytes conserved: every page of every region, once.
		if want := uint64(n) * item * uint64(perLayer*layers); plan.Bytes() != want {
			t.Fatalf("moved %d bytes, want %d", plan.Bytes(), want)
		}
		blocks := planBlocks(plan, -1)
		noOverlap(t, slices.Clone(blocks))
		// Every byte of page src[i] of region j lands at the same offset of
		// page dst[i] of region j.
		for _, b := range blocks {
			for off := uint64(0); off < b.Len; off += item {
				si := regionOf(plan.Src, b.Src+off)
				di := regionOf(plan.Dst, b.Dst+off)
				so, do := b.Src+off-plan.Src[si].Addr, b.Dst+off-plan.Dst[di].Addr
				sp, dp := so/item, do/dstItem
				idx := slices.Index(src, int32(sp))
				if si != di || so%item != do%dstItem || idx < 0 || dst[idx] != int32(dp) {
					t.Fatalf("prefill region %d page %d +%d lands on decode region %d page %d +%d", si, sp, so%item, di, dp, do%dstItem)
				}
			}
		}
		// Parts, when present, are one per run of decode kinds.
		if len(plan.Parts) > 0 && plan.Path != PathNIXLPreppedMixed {
			t.Fatalf("%s has parts", plan.Path)
		}
	})
}

func regionOf(regions []Region, addr uint64) int {
	for i, r := range regions {
		if addr >= r.Addr && addr < r.Addr+r.Len {
			return i
		}
	}
	return -1
}
