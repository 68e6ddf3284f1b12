package planner

import (
	"reflect"
	"testing"
)

func TestBuildTransferEntryPairs(t *testing.T) {
	for _, tc := range []struct {
		name       string
		src, dst   []int
		nSrc, nDst int
		fallback   bool
		want       []EntryPair
		field      string
	}{
		// Ids repeat across K and V: occurrences pair in order.
		{name: "k then v", src: []int{3, 7, 3, 7}, dst: []int{3, 7, 11, 3, 7, 11}, nSrc: 4, nDst: 6,
			want: []EntryPair{{0, 0}, {1, 1}, {2, 3}, {3, 4}}},
		// A later PP stage against a PP-1 decode.
		{name: "stage", src: []int{4, 5, 8}, dst: []int{0, 1, 2, 3, 4, 5, 8}, nSrc: 3, nDst: 7,
			want: []EntryPair{{0, 4}, {1, 5}, {2, 6}}},
		{name: "positional", nSrc: 3, nDst: 3, want: []EntryPair{{0, 0}, {1, 1}, {2, 2}}},
		{name: "positional fallback", nSrc: 2, nDst: 3, fallback: true, want: []EntryPair{{0, 0}, {1, 1}}},
		{name: "one-sided with fallback", src: []int{1, 2}, nSrc: 2, nDst: 2, fallback: true, want: []EntryPair{{0, 0}, {1, 1}}},
		{name: "empty prefill", src: []int{1}, nSrc: 0, nDst: 2, want: nil},
		{name: "one-sided", src: []int{1, 2}, nSrc: 2, nDst: 2, field: "layer_ids"},
		{name: "length", src: []int{1}, dst: []int{1, 2}, nSrc: 2, nDst: 2, field: "layer_ids"},
		{name: "missing layer", src: []int{1, 9}, dst: []int{1, 2}, nSrc: 2, nDst: 2, field: "layer_ids"},
		{name: "repeated id runs out", src: []int{1, 1}, dst: []int{1, 2}, nSrc: 2, nDst: 2, field: "layer_ids"},
		{name: "unequal without ids", nSrc: 2, nDst: 3, field: "layer_ids"},
		{name: "decode shorter", nSrc: 3, nDst: 2, fallback: true, field: "layer_ids"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := BuildTransferEntryPairs(tc.src, tc.dst, tc.nSrc, tc.nDst, tc.fallback)
			if tc.field != "" {
				bFieldErr(t, err, tc.field, "")
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestBuildKVLayerIDs(t *testing.T) {
	target := []int{20, 24, 20, 24, 28, 32, 32, 38, 38}
	got, err := BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, LayerIDs: target,
		Draft: &DraftPool{Hybrid: true, LayerIDs: []int{0, 0, 1, 2, 2}}, NumDraftEntries: 5, NumHiddenLayers: 40})
	if err != nil {
		t.Fatal(err)
	}
	// Draft ids land in a band above the 40 target layers.
	if want := append(append([]int(nil), target...), 40, 40, 41, 42, 42); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	// A plain (non-hybrid) draft pool with 2 layers registers k0 k1 v0 v1.
	got, err = BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, LayerIDs: []int{5}, Draft: &DraftPool{LayerNum: 2}, NumDraftEntries: 4, NumHiddenLayers: 10})
	if err != nil || !reflect.DeepEqual(got, []int{5, 10, 11, 10, 11}) {
		t.Fatalf("got %v, %v", got, err)
	}
	// Band by first appearance, not by value.
	got, _ = BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, Draft: &DraftPool{Hybrid: true, LayerIDs: []int{7, 3, 7}}, NumDraftEntries: 3, NumHiddenLayers: 4})
	if !reflect.DeepEqual(got, []int{4, 5, 4}) {
		t.Fatalf("got %v", got)
	}
	if got, err := BuildKVLayerIDs(KVLayerIDsInput{LayerIDs: target}); err != nil || got != nil {
		t.Fatalf("non-hybrid pool: %v %v", got, err)
	}
	_, err = BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, Draft: &DraftPool{LayerNum: 3}, NumDraftEntries: 4})
	bFieldErr(t, err, "draft_layer_num", "whole number")
	_, err = BuildKVLayerIDs(KVLayerIDsInput{Hybrid: true, Draft: &DraftPool{Hybrid: true, LayerIDs: []int{1}}, NumDraftEntries: 2})
	bFieldErr(t, err, "draft_layer_ids", "cover every")
}

func TestResolveDCPDstEntryIndices(t *testing.T) {
	got, err := ResolveDCPDstEntryIndices(nil, nil, 3, 5)
	if err != nil || !reflect.DeepEqual(got, []int{0, 1, 2}) {
		t.Fatalf("got %v %v", got, err)
	}
	got, err = ResolveDCPDstEntryIndices([]int{4, 5}, []int{3, 4, 5}, 2, 3)
	if err != nil || !reflect.DeepEqual(got, []int{1, 2}) {
		t.Fatalf("got %v %v", got, err)
	}
	_, err = ResolveDCPDstEntryIndices([]int{4, 5}, nil, 2, 3)
	bFieldErr(t, err, "layer_ids", "both PD peers")
}
