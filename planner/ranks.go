package planner

// Rank mapping on the decode side: which prefill ranks a decode rank talks
// to, how many decode ranks each prefill rank waits for, and how many
// prefill answers a decode rank waits for (SGLang's disaggregation/common/conn.py's
// CommonKVManager._resolve_rank_mapping and
// CommonKVReceiver._setup_bootstrap_infos).

// RankMappingInput is the decode rank's view of both deployments.
type RankMappingInput struct {
	// Decode side (this engine).
	DecodeTPSize     int // attn_tp_size
	DecodeEngineRank int // kv_args.engine_rank; only its remainder by DecodeTPSize matters
	DecodeCPSize     int // attn_cp_size; must be 1 (0 is taken as 1)
	DecodeCPRank     int // attn_cp_rank; must be 0
	DecodePPSize     int // pp_size (0 is taken as 1)
	DecodePPRank     int // pp_rank

	// Prefill side, from the bootstrap server's parallel info.
	PrefillTPSize int // attn_tp_size
	PrefillCPSize int // attn_cp_size (0 is taken as 1)
	PrefillPPSize int // pp_size (0 is taken as 1)

	// MLA is the decode engine's is_mla_backend: MLA KV is identical on
	// every TP rank, so only one prefill rank per decode rank sends it.
	MLA bool
	// AllCPRanks is the decode engine's enable_all_cp_ranks_for_transfer
	// (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, or a hybrid MLA model);
	// PrefillDSACacheLayerSplit is the prefill's enable_dsa_cache_layer_split.
	// Either makes the decode rank pull from every prefill CP rank instead of
	// CP rank 0 only.
	AllCPRanks                bool
	PrefillDSACacheLayerSplit bool
}

// RankMapping is the result of MapRanks.
type RankMapping struct {
	// TargetTPRank is the prefill TP rank that sends real data when only
	// one does (MLA with decode TP < prefill TP); the first target otherwise.
	TargetTPRank  int
	TargetTPRanks []int
	TargetCPRanks []int
	TargetPPRanks []int
	// RequiredDstInfoNum is how many decode ranks each targeted prefill rank
	// waits for before it starts sending (sent to prefill with the request).
	RequiredDstInfoNum int
	// RequiredPrefillResponseNum is how many prefill ranks will answer this
	// decode rank with data (and therefore notifications/status messages).
	RequiredPrefillResponseNum int
}

// BootstrapTarget is one prefill rank a decode rank connects to. Dummy
// targets receive the request with empty page indices and no state indices
// (they send nothing but still have to see the room).
type BootstrapTarget struct {
	CPRank, TPRank, PPRank int
	Dummy                  bool
}

// MapRanks computes the rank mapping for one decode rank. TP sizes must
// divide one another (SGLang's disaggregation/{nixl,mori}/conn.py silently targets nonexistent prefill
// ranks otherwise, and the request hangs); decode CP must be 1 and decode
// PP must equal prefill PP or be 1, as in SGLang's disaggregation/{nixl,mori}/conn.py.
func MapRanks(in RankMappingInput) (RankMapping, error) {
	var m RankMapping
	d, p := in.DecodeTPSize, in.PrefillTPSize
	if d <= 0 {
		return m, errorf("decode.tp_size", "must be positive, got %d", d)
	}
	if p <= 0 {
		return m, errorf("prefill.tp_size", "must be positive, got %d", p)
	}
	if in.DecodeEngineRank < 0 {
		return m, errorf("decode.tp_rank", "negative engine rank %d", in.DecodeEngineRank)
	}
	dcp, pcp := sizeOrOne(in.DecodeCPSize), sizeOrOne(in.PrefillCPSize)
	dpp, ppp := sizeOrOne(in.DecodePPSize), sizeOrOne(in.PrefillPPSize)
	if dcp < 0 || pcp < 0 || dpp < 0 || ppp < 0 {
		return m, errorf("pp_size", "negative CP or PP size (decode cp %d pp %d, prefill cp %d pp %d)", dcp, dpp, pcp, ppp)
	}
	for _, s := range []struct {
		field string
		n     int
	}{{"decode.tp_size", d}, {"prefill.tp_size", p}, {"prefill.cp_size", pcp}, {"decode.pp_size", dpp}, {"prefill.pp_size", ppp}} {
		if s.n > maxParallelSize {
			return m, errorf(s.field, "%d ranks: more than %d", s.n, maxParallelSize)
		}
	}
	if dcp != 1 {
		return m, errorf("decode.cp_size", "decode attn_cp_size (%d) should be equal to 1", dcp)
	}
	if in.DecodeCPRank != 0 {
		return m, errorf("decode.cp_rank", "must be 0 with decode attn_cp_size 1, got %d", in.DecodeCPRank)
	}
	if dpp != ppp && dpp != 1 {
		return m, errorf("decode.pp_size", "decode pp size (%d) should be equal to prefill pp size (%d) or 1", dpp, ppp)
	}
	if dpp == ppp && (in.DecodePPRank < 0 || in.DecodePPRank >= dpp) {
		return m, errorf("decode.pp_rank", "%d out of range for pp size %d", in.DecodePPRank, dpp)
	}
	r := in.DecodeEngineRank % d

	switch {
	case d == p:
		m.TargetTPRank = r
		m.TargetTPRanks = []int{r}
		m.RequiredDstInfoNum = 1
		m.RequiredPrefillResponseNum = 1
	case d > p:
		if d%p != 0 {
			return m, errorf("decode.tp_size", "decode attn TP size %d is not a multiple of prefill attn TP size %d", d, p)
		}
		m.TargetTPRank = r / (d / p)
		m.TargetTPRanks = []int{m.TargetTPRank}
		m.RequiredDstInfoNum = d / p
		m.RequiredPrefillResponseNum = 1
	default:
		if p%d != 0 {
			return m, errorf("prefill.tp_size", "prefill attn TP size %d is not a multiple of decode attn TP size %d", p, d)
		}
		ratio := p / d
		m.TargetTPRanks = make([]int, ratio)
		for i := range m.TargetTPRanks {
			m.TargetTPRanks[i] = r*ratio + i
		}
		m.TargetTPRank = m.TargetTPRanks[0]
		m.RequiredDstInfoNum = 1
		if in.MLA {
			m.RequiredPrefillResponseNum = 1
		} else {
			m.RequiredPrefillResponseNum = ratio
		}
	}

	if pcp == 1 {
		m.TargetCPRanks = []int{0} // the decode CP rank, which is 0
	} else if in.AllCPRanks || in.PrefillDSACacheLayerSplit {
		m.TargetCPRanks = rankSeq(pcp)
		m.RequiredPrefillResponseNum *= pcp / dcp
	} else {
		m.TargetCPRanks = []int{0}
	}

	if ppp == dpp {
		m.TargetPPRanks = []int{in.DecodePPRank}
	} else {
		m.TargetPPRanks = rankSeq(ppp)
		m.RequiredPrefillResponseNum *= ppp / dpp
	}
	return m, nil
}

// Targets lists the prefill ranks to bootstrap with, in SGLang's disaggregation/{nixl,mori}/conn.py's
// order: CP ranks, then TP ranks, then PP ranks from the last stage down
// (later stages bootstrap first). With MLA only TargetTPRank sends real
// data; the other TP targets are dummies.
func (m RankMapping) Targets(mla bool) []BootstrapTarget {
	out := make([]BootstrapTarget, 0, len(m.TargetCPRanks)*len(m.TargetTPRanks)*len(m.TargetPPRanks))
	for _, cp := range m.TargetCPRanks {
		for _, tp := range m.TargetTPRanks {
			for k := len(m.TargetPPRanks) - 1; k >= 0; k-- {
				out = append(out, BootstrapTarget{
					CPRank: cp, TPRank: tp, PPRank: m.TargetPPRanks[k],
					Dummy: mla && tp != m.TargetTPRank,
				})
			}
		}
	}
	return out
}

// maxParallelSize bounds TP, CP and PP sizes (the target lists are built
// in full).
const maxParallelSize = 1 << 16

func sizeOrOne(n int) int {
	if n == 0 {
		return 1
	}
	return n
}

func rankSeq(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}
