package plugin

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"pgregory.net/rapid"
)

// block is one plain copy: len bytes between a local and a remote address.
type block struct{ local, remote, len uint64 }

func TestExtent(t *testing.T) {
	for _, tc := range []struct {
		start, length, stride, count uint64
		end                          uint64
		ok                           bool
	}{
		{100, 10, 0, 1, 110, true},
		{100, 10, 999, 1, 110, true}, // stride ignored for one block
		{0, 10, 100, 3, 210, true},
		{0, 10, 4, 3, 18, true}, // overlapping blocks
		{0, 0, 1, 1, 0, false},
		{0, 1, 1, 0, 0, false},
		{math.MaxUint64 - 10, 11, 0, 1, 0, false},
		{math.MaxUint64 - 10, 10, 0, 1, math.MaxUint64, true},
		{0, 1, math.MaxUint64 / 2, 4, 0, false},
	} {
		end, ok := extent(tc.start, tc.length, tc.stride, tc.count)
		if ok != tc.ok || (ok && end != tc.end) {
			t.Errorf("extent(%d, %d, %d, %d) = %d, %v; want %d, %v", tc.start, tc.length, tc.stride, tc.count, end, ok, tc.end, tc.ok)
		}
	}
}

func TestCoverIndex(t *testing.T) {
	sorted := []memRange{
		{0x1000, 0x2000, 0, abi.DRAM},
		{0x2000, 0x3000, 0, abi.DRAM},
		{0x2000, 0x8000, 1, abi.VRAM},
		{0x9000, 0xa000, 0, abi.DRAM},
	}
	for _, tc := range []struct {
		q    memRange
		want int
	}{
		{memRange{0x1000, 0x2000, 0, abi.DRAM}, 0},
		{memRange{0x1fff, 0x2000, 0, abi.DRAM}, 0},
		{memRange{0x1fff, 0x2001, 0, abi.DRAM}, -1}, // spans two registrations
		{memRange{0x2000, 0x2800, 0, abi.DRAM}, 1},
		{memRange{0x2800, 0x7000, 1, abi.VRAM}, 2},
		{memRange{0x2800, 0x2900, 0, abi.VRAM}, -1}, // wrong device
		{memRange{0x2800, 0x2900, 1, abi.DRAM}, -1}, // wrong kind
		{memRange{0x0, 0x10, 0, abi.DRAM}, -1},
		{memRange{0x9000, 0xa001, 0, abi.DRAM}, -1},
		{memRange{0xa000, 0xa001, 0, abi.DRAM}, -1},
	} {
		if got := coverIndex(sorted, tc.q); got != tc.want {
			t.Errorf("coverIndex(%+v) = %d, want %d", tc.q, got, tc.want)
		}
	}
}

func TestMergeRanges(t *testing.T) {
	in := []memRange{
		{300, 400, 0, abi.DRAM},
		{100, 200, 0, abi.DRAM},
		{150, 250, 0, abi.DRAM},
		{250, 260, 0, abi.DRAM}, // touches the previous
		{100, 200, 1, abi.DRAM}, // another device
		{120, 130, 0, abi.VRAM},
	}
	got := mergeRanges(slices.Clone(in), false)
	want := []memRange{{100, 250, 0, abi.DRAM}, {250, 260, 0, abi.DRAM}, {300, 400, 0, abi.DRAM}, {100, 200, 1, abi.DRAM}, {120, 130, 0, abi.VRAM}}
	if !slices.Equal(got, want) {
		t.Errorf("overlapping only: %v, want %v", got, want)
	}
	got = mergeRanges(slices.Clone(in), true)
	want = []memRange{{100, 260, 0, abi.DRAM}, {300, 400, 0, abi.DRAM}, {100, 200, 1, abi.DRAM}, {120, 130, 0, abi.VRAM}}
	if !slices.Equal(got, want) {
		t.Errorf("with touching: %v, want %v", got, want)
	}
}

func TestExpandDescs(t *testing.T) {
	plain := []abi.XferDesc{{Addr: 1, Len: 2, Count: 1}, {Addr: 10, Len: 2, Stride: 77, Count: 1}}
	out, first, err := expandDescs(plain)
	if err != nil || first != nil || &out[0] != &plain[0] {
		t.Errorf("plain list: first %v err %v, want the input back", first, err)
	}
	strided := []abi.XferDesc{{Addr: 0, Len: 4, Count: 1, DevID: 2}, {Addr: 100, Len: 8, Stride: 16, Count: 3, DevID: 2}, {Addr: 7, Len: 1, Count: 1}}
	out, first, err = expandDescs(strided)
	if err != nil {
		t.Fatal(err)
	}
	wantOut := []abi.XferDesc{xd(0, 4, 0, 1, 2), xd(100, 8, 0, 1, 2), xd(116, 8, 0, 1, 2), xd(132, 8, 0, 1, 2), xd(7, 1, 0, 1, 0)}
	if !slices.Equal(out, wantOut) || !slices.Equal(first, []int32{0, 1, 4, 5}) {
		t.Errorf("expanded %v first %v", out, first)
	}
	if _, _, err := expandDescs([]abi.XferDesc{{Addr: 1, Len: 0, Count: 1}}); err == nil || err.code != abi.ErrInvalidParam {
		t.Errorf("zero length: %v", err)
	}
}

// TestExpansionIsBounded feeds strided descriptors of 2^40 blocks (stride 0
// keeps them inside a tiny region) to every expansion: each must refuse
// with ErrInvalidParam before it allocates, not try to make 2^40 entries.
func TestExpansionIsBounded(t *testing.T) {
	const huge = 1 << 40
	isBound := func(what string, err *codedError) {
		t.Helper()
		if err == nil || err.code != abi.ErrInvalidParam {
			t.Errorf("%s: %v, want ErrInvalidParam", what, err)
		}
	}
	_, _, err := expandDescs([]abi.XferDesc{{Addr: 64, Len: 8, Count: huge}})
	isBound("expandDescs", err)
	_, _, err = expandDescs([]abi.XferDesc{{Addr: 64, Len: 8, Count: maxExpandedBlocks}, {Addr: 64, Len: 8, Count: 2}})
	isBound("expandDescs summing past the bound", err)
	var s scratch
	_, err = s.expandEntries([]abi.BatchEntry{{Len: 8, Count: huge}})
	isBound("expandEntries", err)
	side := []batchSide{{addr: 4096, len: 4096}}
	_, _, err = s.buildBatchDescs(side, side, []abi.BatchEntry{{Len: 8, Count: huge}}, true)
	isBound("buildBatchDescs", err)
	l := &emuList{handles: []uint64{1}, descs: []emuDesc{{len: 8, count: huge}}}
	isBound("buildPreppedBatch", s.buildPreppedBatch(l, l, []int32{0}, []int32{0}, true))
	// Indices repeating a strided descriptor add up too.
	first := []int32{0, 1 << 20}
	idx := make([]int32, 17)
	isBound("expandIndices", s.expandIndices(first, 1, idx, first, 1, idx))
	// Within the bound, expansion works (the caller's native list stays untouched).
	if out, _, err := expandDescs([]abi.XferDesc{{Addr: 64, Len: 8, Count: 3}}); err != nil || len(out) != 3 {
		t.Errorf("small strided list: %d descriptors, %v", len(out), err)
	}
}

func TestExpandIndicesErrors(t *testing.T) {
	lfirst := []int32{0, 1, 4} // descriptor 1 has 3 blocks
	var s scratch
	if err := s.expandIndices(lfirst, 2, []int32{1, 0}, nil, 5, []int32{0, 1}); err == nil || err.code != abi.ErrMismatch {
		t.Errorf("3 blocks against 1: %v", err)
	}
	if err := s.expandIndices(lfirst, 2, []int32{2}, nil, 5, []int32{0}); err == nil || err.code != abi.ErrInvalidParam {
		t.Errorf("local index 2 of 2: %v", err)
	}
	if err := s.expandIndices(lfirst, 2, []int32{0}, nil, 5, []int32{-1}); err == nil || err.code != abi.ErrInvalidParam {
		t.Errorf("remote index -1: %v", err)
	}
	if err := s.expandIndices(lfirst, 2, []int32{0}, nil, 5, nil); err == nil || err.code != abi.ErrInvalidParam {
		t.Errorf("length mismatch: %v", err)
	}
	rfirst := []int32{0, 3}
	if err := s.expandIndices(lfirst, 2, []int32{0, 1}, rfirst, 1, []int32{0, 0}); err == nil || err.code != abi.ErrMismatch {
		t.Errorf("1 block against 3: %v", err)
	}
	if err := s.expandIndices(lfirst, 2, []int32{1, 1}, rfirst, 1, []int32{0, 0}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(s.local, []int32{1, 2, 3, 1, 2, 3}) || !slices.Equal(s.remote, []int32{0, 1, 2, 0, 1, 2}) {
		t.Errorf("expanded %v %v", s.local, s.remote)
	}
}

func TestBuildPreppedBatchErrors(t *testing.T) {
	l := &emuList{handles: []uint64{11}, descs: []emuDesc{{ref: 0, off: 0, len: 8, count: 1}, {ref: 0, off: 64, len: 8, stride: 16, count: 2}}}
	r := &emuList{handles: []uint64{22}, descs: []emuDesc{{ref: 0, off: 0, len: 8, count: 1}, {ref: 0, off: 8, len: 4, count: 1}, {ref: 0, off: 32, len: 8, stride: 8, count: 2}}}
	var s scratch
	for _, tc := range []struct {
		li, ri []int32
		code   abi.Status
	}{
		{[]int32{0}, []int32{1}, abi.ErrMismatch}, // len 8 vs 4
		{[]int32{1}, []int32{0}, abi.ErrMismatch}, // count 2 vs 1
		{[]int32{2}, []int32{0}, abi.ErrInvalidParam},
		{[]int32{0}, []int32{3}, abi.ErrInvalidParam},
		{[]int32{0}, []int32{-1}, abi.ErrInvalidParam},
		{[]int32{0, 0}, []int32{0}, abi.ErrInvalidParam},
	} {
		if err := s.buildPreppedBatch(l, r, tc.li, tc.ri, false); err == nil || err.code != tc.code {
			t.Errorf("%v -> %v: %v, want %v", tc.li, tc.ri, err, tc.code)
		}
		assertSlotsClear(t, &s)
	}
	if err := s.buildPreppedBatch(l, r, []int32{1, 0, 0}, []int32{2, 0, 0}, true); err != nil {
		t.Fatal(err)
	}
	wantEntries := []abi.BatchEntry{
		{Pair: 0, LocalOffset: 64, RemoteOffset: 32, Len: 8, Count: 1},
		{Pair: 0, LocalOffset: 80, RemoteOffset: 40, Len: 8, Count: 1},
		{Pair: 0, LocalOffset: 0, RemoteOffset: 0, Len: 8, Count: 1},
		{Pair: 0, LocalOffset: 0, RemoteOffset: 0, Len: 8, Count: 1},
	}
	if !slices.Equal(s.entries, wantEntries) || !slices.Equal(s.pairs, []abi.RegionPair{{Local: 11, Remote: 22}}) {
		t.Errorf("entries %+v pairs %+v", s.entries, s.pairs)
	}
	assertSlotsClear(t, &s)
}

func assertSlotsClear(t *testing.T, s *scratch) {
	t.Helper()
	for i, v := range s.slots {
		if v != -1 {
			t.Fatalf("pair slot %d left at %d after a build", i, v)
		}
	}
	if len(s.pairMap) != 0 {
		t.Fatalf("pair map left with %d entries", len(s.pairMap))
	}
}

func TestBuildBatchDescsErrors(t *testing.T) {
	local := []batchSide{{addr: 1000, len: 100, kind: abi.DRAM}, {addr: 5000, len: 100, dev: 1, kind: abi.VRAM}}
	remote := []batchSide{{addr: 9000, len: 50, kind: abi.DRAM}, {addr: 7000, len: 100, kind: abi.DRAM}}
	var s scratch
	for _, tc := range []struct {
		name    string
		entries []abi.BatchEntry
		code    abi.Status
	}{
		{"pair out of range", []abi.BatchEntry{{Pair: 2, Len: 1, Count: 1}}, abi.ErrInvalidParam},
		{"local beyond region", []abi.BatchEntry{{Pair: 0, LocalOffset: 95, Len: 10, Count: 1}}, abi.ErrInvalidParam},
		{"strided local beyond", []abi.BatchEntry{{Pair: 0, Len: 10, LocalStride: 50, Count: 3}}, abi.ErrInvalidParam},
		{"remote beyond region", []abi.BatchEntry{{Pair: 0, RemoteOffset: 45, Len: 10, Count: 1}}, abi.ErrInvalidParam},
		{"zero length", []abi.BatchEntry{{Pair: 0, Len: 0, Count: 1}}, abi.ErrInvalidParam},
		{"zero count", []abi.BatchEntry{{Pair: 0, Len: 1, Count: 0}}, abi.ErrInvalidParam},
		{"reserved", []abi.BatchEntry{{Pair: 0, Reserved: 1, Len: 1, Count: 1}}, abi.ErrInvalidParam},
		{"mixed kinds", []abi.BatchEntry{{Pair: 0, Len: 1, Count: 1}, {Pair: 1, Len: 1, Count: 1}}, abi.ErrNotSupported},
	} {
		if _, _, err := s.buildBatchDescs(local, remote, tc.entries, false); err == nil || err.code != tc.code {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.code)
		}
	}
	lk, rk, err := s.buildBatchDescs(local, remote, []abi.BatchEntry{{Pair: 0, LocalOffset: 10, RemoteOffset: 20, Len: 5, LocalStride: 30, RemoteStride: 10, Count: 2}}, false)
	if err != nil || lk != abi.DRAM || rk != abi.DRAM {
		t.Fatal(err)
	}
	if !slices.Equal(s.ldescs, []abi.XferDesc{xd(1010, 5, 30, 2, 0)}) || !slices.Equal(s.rdescs, []abi.XferDesc{xd(9020, 5, 10, 2, 0)}) {
		t.Errorf("descs %v %v", s.ldescs, s.rdescs)
	}
}

// The properties below check that every emulation moves exactly the blocks
// the caller asked for, in order, by comparing block lists computed two
// ways: directly from the caller's descriptors, and from what the plugin is
// given.

type genRegion struct {
	addr, len uint64
	handle    uint64
}

// genRegions draws n disjoint regions with distinct handles.
func genRegions(t *rapid.T, label string, n int, handleBase uint64) []genRegion {
	out := make([]genRegion, n)
	addr := uint64(rapid.IntRange(1, 1<<20).Draw(t, label+"_base"))
	for i := range out {
		addr += uint64(rapid.IntRange(0, 4096).Draw(t, label+"_gap"))
		l := uint64(rapid.IntRange(256, 8192).Draw(t, label+"_len")) // fits 4 blocks of 48 bytes
		out[i] = genRegion{addr: addr, len: l, handle: handleBase + uint64(i)}
		addr += l
	}
	return out
}

// genDesc draws a descriptor of blocks of length len, count count inside one
// of regions.
func genDesc(t *rapid.T, label string, regions []genRegion, length, count uint64) abi.XferDesc {
	r := regions[rapid.IntRange(0, len(regions)-1).Draw(t, label+"_region")]
	stride := length
	if count > 1 {
		maxStride := (r.len - length) / (count - 1)
		stride = uint64(rapid.IntRange(int(length), int(max(length, maxStride))).Draw(t, label+"_stride"))
	}
	span := (count-1)*stride + length
	off := uint64(rapid.IntRange(0, int(r.len-span)).Draw(t, label+"_off"))
	d := abi.XferDesc{Addr: r.addr + off, Len: length, Count: count}
	if count > 1 {
		d.Stride = stride
	}
	return d
}

func sortedRanges(regions []genRegion) []memRange {
	out := make([]memRange, len(regions))
	for i, r := range regions {
		out[i] = memRange{addr: r.addr, end: r.addr + r.len, kind: abi.DRAM}
	}
	return out
}

func descBlocks(ld, rd abi.XferDesc) []block {
	var out []block
	for k := range ld.Count {
		out = append(out, block{ld.Addr + k*ld.Stride, rd.Addr + k*rd.Stride, ld.Len})
	}
	return out
}

// genTransfer draws two lists of compatible descriptor pairs and index
// arrays naming some of them, possibly repeated.
func genTransfer(t *rapid.T, lregs, rregs []genRegion, strided bool) (ldescs, rdescs []abi.XferDesc, li, ri []int32) {
	n := rapid.IntRange(1, 12).Draw(t, "ndescs")
	for range n {
		length := uint64(rapid.IntRange(1, 48).Draw(t, "len"))
		count := uint64(1)
		if strided {
			count = uint64(rapid.IntRange(1, 4).Draw(t, "count"))
		}
		ldescs = append(ldescs, genDesc(t, "l", lregs, length, count))
		rdescs = append(rdescs, genDesc(t, "r", rregs, length, count))
	}
	// The remote list is a permutation of the pairing, so indices differ.
	perm := rapid.Permutation(seq(n)).Draw(t, "perm")
	permuted := make([]abi.XferDesc, n)
	where := make([]int32, n)
	for i, p := range perm {
		permuted[i] = rdescs[p]
		where[p] = int32(i)
	}
	m := rapid.IntRange(0, 2*n).Draw(t, "nidx")
	for range m {
		k := rapid.IntRange(0, n-1).Draw(t, "idx")
		li = append(li, int32(k))
		ri = append(ri, where[k])
	}
	return ldescs, permuted, li, ri
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

func expectedBlocks(ldescs, rdescs []abi.XferDesc, li, ri []int32) []block {
	var out []block
	for k := range li {
		out = append(out, descBlocks(ldescs[li[k]], rdescs[ri[k]])...)
	}
	return out
}

// emuListFor builds an emulated list the way Agent.prep does.
func emuListFor(t *rapid.T, descs []abi.XferDesc, regions []genRegion) *emuList {
	e := &emuList{}
	var missing []int
	var err *codedError
	e.descs, missing, err = resolveDescs(descs, abi.DRAM, sortedRanges(regions), nil)
	if err != nil || len(missing) > 0 {
		t.Fatalf("resolveDescs: %v, missing %v", err, missing)
	}
	for _, old := range compactRefs(e.descs) {
		e.handles = append(e.handles, regions[old].handle)
	}
	return e
}

func TestPropertyPreppedOverBatch(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lregs := genRegions(t, "lreg", rapid.IntRange(1, 4).Draw(t, "nl"), 100)
		rregs := genRegions(t, "rreg", rapid.IntRange(1, 4).Draw(t, "nr"), 200)
		ldescs, rdescs, li, ri := genTransfer(t, lregs, rregs, true)
		l, r := emuListFor(t, ldescs, lregs), emuListFor(t, rdescs, rregs)
		expand := rapid.Bool().Draw(t, "expand")
		var s scratch
		if err := s.buildPreppedBatch(l, r, li, ri, expand); err != nil {
			t.Fatal(err)
		}
		assertSlotsClearRapid(t, &s)
		base := map[uint64]uint64{}
		for _, g := range append(slices.Clone(lregs), rregs...) {
			base[g.handle] = g.addr
		}
		var got []block
		seen := map[abi.RegionPair]bool{}
		for _, p := range s.pairs {
			if seen[p] {
				t.Fatalf("pair %v listed twice", p)
			}
			seen[p] = true
		}
		for _, e := range s.entries {
			if expand && e.Count != 1 {
				t.Fatalf("entry %+v not expanded", e)
			}
			p := s.pairs[e.Pair]
			for k := range e.Count {
				got = append(got, block{base[uint64(p.Local)] + e.LocalOffset + k*e.LocalStride, base[uint64(p.Remote)] + e.RemoteOffset + k*e.RemoteStride, e.Len})
			}
		}
		if want := expectedBlocks(ldescs, rdescs, li, ri); !slices.Equal(got, want) {
			t.Fatalf("blocks\n got %v\nwant %v", got, want)
		}
	})
}

func assertSlotsClearRapid(t *rapid.T, s *scratch) {
	for i, v := range s.slots {
		if v != -1 {
			t.Fatalf("pair slot %d left at %d", i, v)
		}
	}
}

func TestPropertyStridesExpandedForNativeLists(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lregs := genRegions(t, "lreg", 2, 100)
		rregs := genRegions(t, "rreg", 2, 200)
		ldescs, rdescs, li, ri := genTransfer(t, lregs, rregs, true)
		lplain, lfirst, err := expandDescs(ldescs)
		if err != nil {
			t.Fatal(err)
		}
		rplain, rfirst, err := expandDescs(rdescs)
		if err != nil {
			t.Fatal(err)
		}
		var s scratch
		if err := s.expandIndices(lfirst, len(ldescs), li, rfirst, len(rdescs), ri); err != nil {
			t.Fatal(err)
		}
		var got []block
		for k := range s.local {
			ld, rd := lplain[s.local[k]], rplain[s.remote[k]]
			if ld.Count != 1 || rd.Count != 1 || ld.Len != rd.Len {
				t.Fatalf("plain pair %+v %+v", ld, rd)
			}
			got = append(got, block{ld.Addr, rd.Addr, ld.Len})
		}
		if want := expectedBlocks(ldescs, rdescs, li, ri); !slices.Equal(got, want) {
			t.Fatalf("blocks\n got %v\nwant %v", got, want)
		}
	})
}

func TestPropertyBatchOverPrepped(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lregs := genRegions(t, "lreg", rapid.IntRange(1, 3).Draw(t, "nl"), 100)
		rregs := genRegions(t, "rreg", rapid.IntRange(1, 3).Draw(t, "nr"), 200)
		npairs := rapid.IntRange(1, 4).Draw(t, "npairs")
		var lsides, rsides []batchSide
		for range npairs {
			lr := lregs[rapid.IntRange(0, len(lregs)-1).Draw(t, "lp")]
			rr := rregs[rapid.IntRange(0, len(rregs)-1).Draw(t, "rp")]
			lsides = append(lsides, batchSide{addr: lr.addr, len: lr.len, kind: abi.DRAM})
			rsides = append(rsides, batchSide{addr: rr.addr, len: rr.len, kind: abi.DRAM})
		}
		var entries []abi.BatchEntry
		var want []block
		for range rapid.IntRange(0, 10).Draw(t, "nentries") {
			p := rapid.IntRange(0, npairs-1).Draw(t, "pair")
			length := uint64(rapid.IntRange(1, 32).Draw(t, "len"))
			count := uint64(rapid.IntRange(1, 3).Draw(t, "count"))
			ld := genDesc(t, "l", []genRegion{{addr: lsides[p].addr, len: lsides[p].len}}, length, count)
			rd := genDesc(t, "r", []genRegion{{addr: rsides[p].addr, len: rsides[p].len}}, length, count)
			entries = append(entries, abi.BatchEntry{Pair: uint32(p), LocalOffset: ld.Addr - lsides[p].addr, RemoteOffset: rd.Addr - rsides[p].addr,
				Len: length, LocalStride: ld.Stride, RemoteStride: rd.Stride, Count: count})
			want = append(want, descBlocks(ld, rd)...)
		}
		expand := rapid.Bool().Draw(t, "expand")
		var s scratch
		if _, _, err := s.buildBatchDescs(lsides, rsides, entries, expand); err != nil {
			t.Fatal(err)
		}
		if len(s.ldescs) != len(s.rdescs) {
			t.Fatalf("%d local descs, %d remote", len(s.ldescs), len(s.rdescs))
		}
		var got []block
		for k := range s.ldescs {
			if expand && s.ldescs[k].Count != 1 {
				t.Fatalf("desc %+v not expanded", s.ldescs[k])
			}
			got = append(got, descBlocks(s.ldescs[k], s.rdescs[k])...)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("blocks\n got %v\nwant %v", got, want)
		}
		// And the native-batch expansion of the same entries.
		var got2 []block
		expanded, cerr := s.expandEntries(entries)
		if cerr != nil {
			t.Fatal(cerr)
		}
		for _, e := range expanded {
			if e.Count != 1 {
				t.Fatalf("entry %+v not expanded", e)
			}
			got2 = append(got2, block{lsides[e.Pair].addr + e.LocalOffset, rsides[e.Pair].addr + e.RemoteOffset, e.Len})
		}
		if !slices.Equal(got2, want) {
			t.Fatalf("expanded entries\n got %v\nwant %v", got2, want)
		}
	})
}

func TestPairTableLargeProductUsesMap(t *testing.T) {
	n := 1100 // 1100*1100 > maxDenseSlots
	l := &emuList{descs: []emuDesc{{ref: 1099, len: 4, count: 1}, {ref: 5, len: 4, count: 1}}}
	r := &emuList{descs: []emuDesc{{ref: 1098, len: 4, count: 1}}}
	for i := range n {
		l.handles = append(l.handles, uint64(1000+i))
		r.handles = append(r.handles, uint64(5000+i))
	}
	var s scratch
	if err := s.buildPreppedBatch(l, r, []int32{0, 1, 0}, []int32{0, 0, 0}, false); err != nil {
		t.Fatal(err)
	}
	if len(s.slots) != 0 {
		t.Errorf("dense table of %d slots allocated", len(s.slots))
	}
	wantPairs := []abi.RegionPair{{Local: 2099, Remote: 6098}, {Local: 1005, Remote: 6098}}
	if !slices.Equal(s.pairs, wantPairs) || s.entries[0].Pair != 0 || s.entries[1].Pair != 1 || s.entries[2].Pair != 0 {
		t.Errorf("pairs %v entries %+v", s.pairs, s.entries)
	}
	assertSlotsClear(t, &s)
}

func TestBuildPreppedBatchAllocatesNothing(t *testing.T) {
	l := &emuList{handles: []uint64{1, 2}}
	r := &emuList{handles: []uint64{3, 4}}
	var li, ri []int32
	for i := range 1000 {
		l.descs = append(l.descs, emuDesc{ref: int32(i % 2), off: uint64(i) * 64, len: 64, count: 1})
		r.descs = append(r.descs, emuDesc{ref: int32(i / 500), off: uint64(i) * 64, len: 64, count: 1})
		li, ri = append(li, int32(i)), append(ri, int32(999-i))
	}
	var s scratch
	if err := s.buildPreppedBatch(l, r, li, ri, false); err != nil { // warm the buffers
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(20, func() {
		if err := s.buildPreppedBatch(l, r, li, ri, false); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("%v allocations per build of 1000 entries, want 0", allocs)
	}
	if len(s.pairs) != 4 || len(s.entries) != 1000 {
		t.Errorf("%d pairs %d entries", len(s.pairs), len(s.entries))
	}
}

func TestResolveDescs(t *testing.T) {
	sorted := []memRange{{0x1000, 0x2000, 0, abi.DRAM}, {0x4000, 0x5000, 0, abi.DRAM}}
	descs := []abi.XferDesc{
		{Addr: 0x4010, Len: 16, Count: 1},
		{Addr: 0x1000, Len: 16, Stride: 0x100, Count: 16}, // ends exactly at 0x2000
		{Addr: 0x1000, Len: 16, Stride: 0x100, Count: 17}, // one block past
		{Addr: 0x3000, Len: 1, Count: 1},
	}
	got, missing, err := resolveDescs(descs, abi.DRAM, sorted, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(missing, []int{2, 3}) {
		t.Errorf("missing %v", missing)
	}
	if got[0].ref != 1 || got[0].off != 0x10 || got[1].ref != 0 || got[1].off != 0 || got[1].stride != 0x100 || got[1].count != 16 {
		t.Errorf("resolved %+v", got)
	}
	if _, _, err := resolveDescs([]abi.XferDesc{{Addr: 0x1000, Len: 0, Count: 1}}, abi.DRAM, sorted, nil); err == nil || err.code != abi.ErrInvalidParam {
		t.Errorf("zero length: %v", err)
	}
	refs := []emuDesc{{ref: 5}, {ref: 2}, {ref: 5}}
	if used := compactRefs(refs); !slices.Equal(used, []int{5, 2}) || refs[0].ref != 0 || refs[1].ref != 1 || refs[2].ref != 0 {
		t.Errorf("compactRefs: %v %+v", used, refs)
	}
}

func encodeNotifs(ns []Notif) []byte {
	var b []byte
	for _, n := range ns {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(n.From)))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(n.Msg)))
		b = append(b, n.From...)
		b = append(b, n.Msg...)
	}
	return b
}

func TestDecodeNotifs(t *testing.T) {
	in := []Notif{{"a", []byte("hello")}, {"a", []byte{}}, {"peer-b", []byte{0, 1, 2}}}
	buf := encodeNotifs(in)
	senders := map[string]string{}
	got, err := decodeNotifs(buf, 3, nil, senders)
	if err != nil || len(got) != 3 {
		t.Fatalf("%v %v", got, err)
	}
	for i := range in {
		if got[i].From != in[i].From || string(got[i].Msg) != string(in[i].Msg) {
			t.Errorf("record %d: %+v", i, got[i])
		}
	}
	buf[9] = 'x' // decoded messages are copies
	if got[0].Msg[0] != 'h' {
		t.Error("message aliases the buffer")
	}
	// Messages share one block but not their capacity: appending to one
	// leaves the next alone.
	_ = append(got[0].Msg, '!')
	if string(got[2].Msg) != "\x00\x01\x02" || got[1].Msg == nil {
		t.Errorf("append to a message changed another: %q %v", got[2].Msg, got[1].Msg)
	}
	// Sender names are kept: decoded again, the same string data.
	again, err := decodeNotifs(encodeNotifs(in), 3, nil, senders)
	if err != nil || unsafe.StringData(again[2].From) != unsafe.StringData(got[2].From) || len(senders) != 2 {
		t.Errorf("sender names not reused (%d kept): %v", len(senders), err)
	}
	for _, tc := range []struct {
		name  string
		buf   []byte
		count int
	}{
		{"short header", buf[:5], 1},
		{"body past end", buf[:12], 1},
		{"trailing bytes", append(slices.Clone(buf), 0), 3},
		{"count too high", buf, 4},
		{"count too low", buf, 2},
	} {
		if _, err := decodeNotifs(tc.buf, tc.count, nil, nil); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
	if got, err := decodeNotifs(nil, 0, nil, nil); err != nil || len(got) != 0 {
		t.Errorf("empty: %v %v", got, err)
	}
}

func FuzzDecodeNotifs(f *testing.F) {
	f.Add(encodeNotifs([]Notif{{"a", []byte("x")}, {"bb", nil}}), 2)
	f.Add([]byte{1, 0, 0, 0, 255, 255, 255, 255, 'a'}, 1)
	f.Fuzz(func(t *testing.T, buf []byte, count int) {
		if count < 0 || count > 1<<16 {
			return
		}
		got, err := decodeNotifs(buf, count, nil, map[string]string{})
		if err != nil {
			return
		}
		if len(got) != count || !slices.Equal(encodeNotifs(got), buf) {
			t.Fatalf("decode(%x, %d) = %+v does not re-encode", buf, count, got)
		}
	})
}

func TestCodedErrorWrap(t *testing.T) {
	a := &Agent{p: &Plugin{info: Info{Name: "fake"}}, name: "x"}
	err := a.wrap("prep_dlist", errf(abi.ErrNotFound, "descriptor %d", 4))
	var pe *Error
	if !errors.As(err, &pe) || !pe.Host || pe.Code != abi.ErrNotFound || pe.Op != "prep_dlist" || pe.Message != "descriptor 4" || !errors.Is(err, ErrNotFound) {
		t.Errorf("%+v", pe)
	}
}

func xd(addr, length, stride, count, dev uint64) abi.XferDesc {
	return abi.XferDesc{Addr: addr, Len: length, Stride: stride, Count: count, DevID: dev}
}
