package planner

import (
	"math"
	"slices"
	"testing"
)

// FuzzPlanAdd: the coalescing appender never changes the bytes moved.
func FuzzPlanAdd(f *testing.F) {
	f.Add([]byte{0, 0, 4, 0, 0, 16, 32, 4, 0, 0, 32, 64, 4, 0, 0})
	f.Add([]byte{0, 100, 8, 1, 1, 8, 108, 8, 1, 1, 16, 116, 4, 1, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		var p Plan
		var want []block
		for len(data) >= 5 {
			c := Copy{
				SrcRegion: int32(data[0] >> 7), SrcOff: uint64(data[0] & 0x7f), DstOff: uint64(data[1]),
				Len: uint64(data[2]%16) + 1, SrcStride: uint64(data[3] % 32), DstStride: uint64(data[4] % 32),
				Count: uint64(data[3]%4) + 1,
			}
			data = data[5:]
			q := Plan{Src: make([]Region, 2), Dst: make([]Region, 2), Copies: []Copy{c}}
			for i := range q.Src {
				q.Src[i].Len, q.Dst[i].Len = math.MaxUint32, math.MaxUint32
			}
			want = append(want, planBlocks(&q, -1)...)
			p.Add(c)
		}
		p.Src, p.Dst = make([]Region, 2), make([]Region, 2)
		for i := range p.Src {
			p.Src[i].Len, p.Dst[i].Len = math.MaxUint32, math.MaxUint32
		}
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		got := planBlocks(&p, -1)
		// Same blocks, same order, modulo merging of adjacent ones.
		if g, w := mergeAdjacent(got), mergeAdjacent(want); !slices.Equal(g, w) {
			t.Fatalf("Add changed the bytes:\n got  %v\n want %v", g, w)
		}
	})
}

// FuzzValidate: Validate never panics and accepts only plans whose blocks
// all lie inside their regions.
func FuzzValidate(f *testing.F) {
	f.Add(uint64(0), uint64(8), uint64(8), uint64(3), uint64(100))
	f.Fuzz(func(t *testing.T, off, length, stride, count, regionLen uint64) {
		count %= 1 << 12
		p := Plan{Src: []Region{{Len: regionLen}}, Dst: []Region{{Len: math.MaxUint64}},
			Copies: []Copy{{SrcOff: off, Len: length, SrcStride: stride, Count: count}}}
		if p.Validate() != nil {
			return
		}
		p.ForEachBlock(func(s, _, l uint64) bool {
			if end, ok := add64(s, l); !ok || end > regionLen {
				t.Fatalf("Validate accepted block [%d, +%d) of a %d-byte region", s, l, regionLen)
			}
			return true
		})
	})
}
