package planner

import (
	"reflect"
	"testing"
)

func TestMapRanks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      RankMappingInput
		want    RankMapping
		targets []BootstrapTarget
	}{
		{
			name: "equal tp",
			in:   RankMappingInput{DecodeTPSize: 2, PrefillTPSize: 2, DecodeEngineRank: 3},
			want: RankMapping{TargetTPRank: 1, TargetTPRanks: []int{1}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 1},
		},
		{
			// Decode TP 4 over prefill TP 2: two decode ranks share a
			// prefill rank, which waits for both.
			name: "decode larger",
			in:   RankMappingInput{DecodeTPSize: 4, PrefillTPSize: 2, DecodeEngineRank: 3},
			want: RankMapping{TargetTPRank: 1, TargetTPRanks: []int{1}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 2, RequiredPrefillResponseNum: 1},
		},
		{
			// Decode TP 2 under prefill TP 8: rank 1 gathers heads from
			// prefill ranks 4..7, all of which answer.
			name: "prefill larger mha",
			in:   RankMappingInput{DecodeTPSize: 2, PrefillTPSize: 8, DecodeEngineRank: 1},
			want: RankMapping{TargetTPRank: 4, TargetTPRanks: []int{4, 5, 6, 7}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 4},
		},
		{
			// MLA: only prefill rank 2 sends; rank 3 gets a dummy request.
			name:    "prefill larger mla",
			in:      RankMappingInput{DecodeTPSize: 2, PrefillTPSize: 4, DecodeEngineRank: 1, MLA: true},
			want:    RankMapping{TargetTPRank: 2, TargetTPRanks: []int{2, 3}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 1},
			targets: []BootstrapTarget{{0, 2, 0, false}, {0, 3, 0, true}},
		},
		{
			// Prefill PP 2 into decode PP 1: both stages answer, the last
			// stage bootstrapped first.
			name:    "pp fan-in",
			in:      RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, PrefillPPSize: 2},
			want:    RankMapping{TargetTPRank: 0, TargetTPRanks: []int{0}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0, 1}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 2},
			targets: []BootstrapTarget{{0, 0, 1, false}, {0, 0, 0, false}},
		},
		{
			name: "pp equal",
			in:   RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, PrefillPPSize: 2, DecodePPSize: 2, DecodePPRank: 1},
			want: RankMapping{TargetTPRank: 0, TargetTPRanks: []int{0}, TargetCPRanks: []int{0}, TargetPPRanks: []int{1}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 1},
		},
		{
			// Prefill CP 2, pulling from every CP rank: both answer.
			name:    "cp all ranks",
			in:      RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 2, PrefillCPSize: 2, AllCPRanks: true, MLA: true},
			want:    RankMapping{TargetTPRank: 0, TargetTPRanks: []int{0, 1}, TargetCPRanks: []int{0, 1}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 2},
			targets: []BootstrapTarget{{0, 0, 0, false}, {0, 1, 0, true}, {1, 0, 0, false}, {1, 1, 0, true}},
		},
		{
			name: "cp rank 0 only",
			in:   RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, PrefillCPSize: 4},
			want: RankMapping{TargetTPRank: 0, TargetTPRanks: []int{0}, TargetCPRanks: []int{0}, TargetPPRanks: []int{0}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 1},
		},
		{
			name: "cp dsa layer split",
			in:   RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, PrefillCPSize: 4, PrefillDSACacheLayerSplit: true, PrefillPPSize: 2},
			want: RankMapping{TargetTPRank: 0, TargetTPRanks: []int{0}, TargetCPRanks: []int{0, 1, 2, 3}, TargetPPRanks: []int{0, 1}, RequiredDstInfoNum: 1, RequiredPrefillResponseNum: 8},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MapRanks(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %+v\nwant %+v", got, tc.want)
			}
			if tc.targets != nil {
				if ts := got.Targets(tc.in.MLA); !reflect.DeepEqual(ts, tc.targets) {
					t.Fatalf("targets %+v, want %+v", ts, tc.targets)
				}
			}
		})
	}
}

func TestMapRanksErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    RankMappingInput
		field string
	}{
		{"no decode tp", RankMappingInput{PrefillTPSize: 1}, "decode.tp_size"},
		{"no prefill tp", RankMappingInput{DecodeTPSize: 1}, "prefill.tp_size"},
		{"not a multiple", RankMappingInput{DecodeTPSize: 3, PrefillTPSize: 2}, "decode.tp_size"},
		{"not a divisor", RankMappingInput{DecodeTPSize: 2, PrefillTPSize: 3}, "prefill.tp_size"},
		{"decode cp", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, DecodeCPSize: 2}, "decode.cp_size"},
		{"decode cp rank", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, DecodeCPRank: 1}, "decode.cp_rank"},
		{"huge cp", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, PrefillCPSize: 1 << 20}, "prefill.cp_size"},
		{"decode pp", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, DecodePPSize: 2, PrefillPPSize: 4}, "decode.pp_size"},
		{"pp rank", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, DecodePPSize: 2, PrefillPPSize: 2, DecodePPRank: 2}, "decode.pp_rank"},
		{"negative rank", RankMappingInput{DecodeTPSize: 1, PrefillTPSize: 1, DecodeEngineRank: -1}, "decode.tp_rank"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := MapRanks(tc.in)
			bFieldErr(t, err, tc.field, "")
		})
	}
}
