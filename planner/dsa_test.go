package planner

import (
	"reflect"
	"testing"
)

func TestDSATailStateIndices(t *testing.T) {
	for _, tc := range []struct {
		pool      DSATailPool
		req, seq  int
		want      []int
		wantError bool
	}{
		// pool 4, 2 extra slots: ring 6. seq 10 leaves 2 tokens starting at
		// token 8, ring slot 8 % 6 = 2.
		{DSATailPool{true, 4, 2}, 1, 10, []int{1, 2, 2, 0, 0, 6}, false},
		// seq 19: 3 pending from token 16 at slot 4: 2 fit before the ring
		// end, 1 wraps to slot 0.
		{DSATailPool{true, 4, 2}, 7, 19, []int{7, 4, 2, 0, 1, 6}, false},
		{DSATailPool{true, 4, 0}, 2, 19, []int{2, 0, 3, 0, 0, 4}, false},
		{DSATailPool{true, 4, 2}, 1, 16, nil, false}, // nothing pending
		{DSATailPool{false, 4, 2}, 1, 10, nil, false},
		{DSATailPool{true, 1, 2}, 1, 10, nil, true},
		{DSATailPool{true, 4, -1}, 1, 10, nil, true},
	} {
		got, err := DSATailStateIndices(tc.pool, tc.req, tc.seq)
		if (err != nil) != tc.wantError || !reflect.DeepEqual(got, tc.want) {
			t.Fatalf("%+v req %d seq %d: got %v, %v; want %v", tc.pool, tc.req, tc.seq, got, err, tc.want)
		}
	}
}

func TestSliceDSATailDstForPP(t *testing.T) {
	got, err := SliceDSATailDstForPP(4, 8, 1, 0, false) // layers [1, 3) of 4
	if err != nil || !reflect.DeepEqual(got, []int{1, 2, 5, 6}) {
		t.Fatalf("got %v, %v", got, err)
	}
	got, err = SliceDSATailDstForPP(4, 4, 3, 0, false) // same layout: positional
	if err != nil || !reflect.DeepEqual(got, []int{0, 1, 2, 3}) {
		t.Fatalf("got %v, %v", got, err)
	}
	_, err = SliceDSATailDstForPP(3, 8, 0, 0, false)
	bFieldErr(t, err, "dsa_tail_ptrs", "key/score halves")
	_, err = SliceDSATailDstForPP(4, 8, 3, 5, true)
	bFieldErr(t, err, "start_layer", "count mismatch")
}

func TestPlanDSATail(t *testing.T) {
	// Prefill ring 6 (pool 4 + 2 extra), decode ring 4; seq 19 leaves 3
	// live tokens: prefill slots 4,5 then 0; decode slots 0..2. Slots are
	// 8 bytes, so rows are 48 and 32 bytes; rows 1 and 2.
	src := DSATailBuffers{Ptrs: []uint64{1 << 32, 2 << 32}, ItemLens: []uint64{48, 96}}
	dst := DSATailBuffers{Ptrs: []uint64{3 << 32, 4 << 32}, ItemLens: []uint64{32, 64}}
	si, di := []int{1, 4, 2, 0, 1, 6}, []int{2, 0, 3, 0, 0, 4}
	p, err := PlanDSATail(src, dst, nil, si, di)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, p, PathDSATail, []Copy{
		plain(0, 0, 48+32, 64, 16), plain(0, 0, 48, 64+16, 8),
		// Second tensor: 16-byte slots.
		plain(1, 1, 96+64, 128, 32), plain(1, 1, 96, 128+32, 16),
	})

	// A PP selection maps prefill tensors onto chosen decode tensors.
	p, err = PlanDSATail(DSATailBuffers{Ptrs: src.Ptrs[1:], ItemLens: src.ItemLens[1:]}, dst, []int{1}, si, di)
	if err != nil {
		t.Fatal(err)
	}
	if p.Copies[0].DstRegion != 1 {
		t.Fatalf("copies %+v", p.Copies)
	}

	if p, err := PlanDSATail(src, dst, nil, nil, nil); err != nil || len(p.Copies) != 0 {
		t.Fatalf("empty tuples: %v %v", p, err)
	}
	for _, tc := range []struct {
		name   string
		si, di []int
		dst    DSATailBuffers
		substr string
	}{
		{"one side empty", si, nil, dst, "missing"},
		{"not 6-tuple", si[:5], di, dst, "6-tuples"},
		{"count mismatch", si, []int{2, 0, 2, 0, 0, 4}, dst, "live-token count mismatch"},
		{"segment past ring", si, []int{2, 3, 3, 0, 0, 4}, dst, "exceeds ring size"},
		{"ring size", si, []int{2, 0, 3, 0, 0, 0}, dst, "positive"},
		{"slot mismatch", si, di, DSATailBuffers{Ptrs: dst.Ptrs, ItemLens: []uint64{64, 64}}, "slot-size mismatch"},
		{"row not divisible", si, di, DSATailBuffers{Ptrs: dst.Ptrs, ItemLens: []uint64{30, 64}}, "not divisible"},
		{"negative row", si, []int{-1, 0, 3, 0, 0, 4}, dst, "non-negative"},
		{"row past buffer", si, di, DSATailBuffers{Ptrs: dst.Ptrs, ItemLens: dst.ItemLens, DataLens: []uint64{64, 128}}, "leaves the decode buffers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := PlanDSATail(src, tc.dst, nil, tc.si, tc.di)
			bFieldErr(t, err, "", tc.substr)
		})
	}
}

func TestDSV4StateIndices(t *testing.T) {
	// seq 10: 10%4+4 = 6 live positions 4..9 in request 2's 8-row ring.
	got, err := DSV4C4StateIndices(2, 10, 8)
	if err != nil || !reflect.DeepEqual(got, []int32{20, 21, 22, 23, 16, 17}) {
		t.Fatalf("c4: %v %v", got, err)
	}
	if got, _ := DSV4C4StateIndices(2, 2, 8); !reflect.DeepEqual(got, []int32{16, 17}) {
		t.Fatalf("c4 short: %v", got)
	}
	if _, err := DSV4C4StateIndices(0, 10, 6); err == nil {
		t.Fatal("ring 6 accepted")
	}
	for _, tc := range []struct {
		req, seq, ring int
		online         bool
		want           []int32
	}{
		{3, 128, 256, false, []int32{}},
		{3, 0, 256, false, []int32{}},
		{3, 300, 256, true, []int32{3}},
		{3, 300, 256, false, []int32{6}}, // token 299 -> ring pos 43 -> page 0 of 2
		{3, 200, 256, false, []int32{7}}, // token 199 -> page 1
	} {
		got, err := DSV4C128StateIndices(tc.req, tc.seq, tc.online, tc.ring)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Fatalf("%+v: %v %v", tc, got, err)
		}
	}
	if _, err := DSV4C128StateIndices(0, 5, false, 100); err == nil {
		t.Fatal("ring 100 accepted")
	}
}
