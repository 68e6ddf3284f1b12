package planner

import (
	"reflect"
	"testing"
)

func TestCPRankPageBounds(t *testing.T) {
	// 10 pages over 3 ranks: 4, 3, 3.
	for rank, want := range [][2]int{{0, 4}, {4, 7}, {7, 10}} {
		s, e, err := CPRankPageBounds(10, rank, 3)
		if err != nil || s != want[0] || e != want[1] {
			t.Fatalf("rank %d: [%d, %d) %v, want %v", rank, s, e, err, want)
		}
	}
	for _, tc := range []struct{ total, rank, size int }{{10, 0, 0}, {10, 3, 3}, {10, -1, 3}, {-1, 0, 2}} {
		if _, _, err := CPRankPageBounds(tc.total, tc.rank, tc.size); err == nil {
			t.Fatalf("%+v accepted", tc)
		}
	}
}

func TestFilterKVIndicesForCPRank(t *testing.T) {
	chunk := []int32{30, 31, 32, 33, 34} // pages [3, 8) of a 10-page request
	for _, tc := range []struct {
		rank      int
		want      []int32
		wantSlice IndexSlice
	}{
		{0, []int32{30}, IndexSlice{3, 4}},
		{1, []int32{31, 32, 33}, IndexSlice{4, 7}},
		{2, []int32{34}, IndexSlice{7, 8}},
	} {
		got, sl, err := FilterKVIndicesForCPRank(chunk, IndexSlice{3, 8}, 10, tc.rank, 3)
		if err != nil || !reflect.DeepEqual(got, tc.want) || sl != tc.wantSlice {
			t.Fatalf("rank %d: %v %v %v", tc.rank, got, sl, err)
		}
	}
	// A chunk outside the rank's share is empty, positioned at its start.
	got, sl, err := FilterKVIndicesForCPRank([]int32{80, 90}, IndexSlice{8, 10}, 10, 0, 3)
	if err != nil || len(got) != 0 || sl != (IndexSlice{8, 8}) {
		t.Fatalf("outside: %v %v %v", got, sl, err)
	}
	// Without CP the chunk passes unchanged.
	got, sl, err = FilterKVIndicesForCPRank(chunk, IndexSlice{3, 8}, 10, 0, 1)
	if err != nil || !reflect.DeepEqual(got, chunk) || sl != (IndexSlice{3, 8}) {
		t.Fatalf("cp 1: %v %v %v", got, sl, err)
	}
	// The result aliases the input (no copy).
	got, _, _ = FilterKVIndicesForCPRank(chunk, IndexSlice{3, 8}, 10, 1, 3)
	if &got[0] != &chunk[1] {
		t.Fatal("filtered indices were copied")
	}
	if _, _, err := FilterKVIndicesForCPRank(chunk, IndexSlice{-1, 4}, 10, 1, 3); err == nil {
		t.Fatal("negative slice accepted")
	}
}
