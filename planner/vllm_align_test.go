package planner

import (
	"reflect"
	"testing"
)

// VLLMAlignRemote (moved from host/pull, where the runtime calls it).
func TestVLLMAlignRemote(t *testing.T) {
	r := []int32{10, 11, 12, 13, 14}
	for _, c := range []struct {
		nLocal, bsr int
		want        []int32
	}{
		{3, 2, r},     // spans 3 decode blocks, all read
		{2, 2, r[2:]}, // first decode block hit: skip 2 prefill blocks
		{1, 2, r[4:]}, // two hit
		{0, 2, r[5:]}, // full hit: nothing
		{4, 2, r},     // more local blocks than spanned: the reader clips
		{1, 4, r[4:]}, // 4x: spans 2, one hit
		{2, 1, r},     // equal sizes: untouched, the reader reads the tail
		{5, 1, r},     // equal sizes, no hit
		{1, 8, r},     // one decode block holds all
		{0, 8, r[5:]}, // and is hit
		{2, 3, r},     // 3x: spans 2
		{1, 3, []int32{13, 14}},
	} {
		if got := VLLMAlignRemote(c.nLocal, r, c.bsr); !reflect.DeepEqual(got, c.want) && !(len(got) == 0 && len(c.want) == 0) {
			t.Errorf("VLLMAlignRemote(%d, 5 blocks, %d) = %v, want %v", c.nLocal, c.bsr, got, c.want)
		}
	}
}
