// Package bootstrap is SGLang's disaggregation bootstrap service: the HTTP
// server a prefill deployment runs (every prefill rank registers where its
// ZeroMQ PULL socket is; decode ranks ask where to send) and the client
// both sides use. It matches CommonKVBootstrapServer and the queries of
// CommonKVManager/CommonKVReceiver in sglang/srt/disaggregation/common/
// conn.py, so SGLang and kvhost workers can use each other's servers.
//
// Routes:
//
//	PUT  /route              register a prefill rank (Registration JSON) -> 200 "OK"
//	GET  /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=
//	                         -> 200 RankInfo JSON; all four -1 -> ParallelInfo JSON;
//	                            503 until every rank registered; 404 unknown rank
//	POST /register_dp_rank   {"bootstrap_room", "dp_rank"} -> 200 "OK"
//	POST /query_dp_ranks     {"bootstrap_rooms": [...]} -> {"<room>": dp_rank, ...}
//	GET  /health             -> 200 "OK"; 503 while ranks of a deployment
//	                            that was whole are deregistered (Server.Deregister)
//
// Rank mapping (which prefill ranks a decode rank talks to) is the
// planner's job, not this package's.
package bootstrap

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// Registration is what each prefill rank PUTs to /route
// (CommonKVManager.register_to_bootstrap).
type Registration struct {
	AttnTPSize   int `json:"attn_tp_size"`
	AttnTPRank   int `json:"attn_tp_rank"`
	AttnCPSize   int `json:"attn_cp_size"`
	AttnCPRank   int `json:"attn_cp_rank"`
	AttnDPSize   int `json:"attn_dp_size"`
	AttnDPRank   int `json:"attn_dp_rank"`
	PPSize       int `json:"pp_size"`
	PPRank       int `json:"pp_rank"`
	SystemDPSize int `json:"system_dp_size"`
	SystemDPRank int `json:"system_dp_rank"`

	RankIP   string `json:"rank_ip"`   // where the rank's PULL socket listens
	RankPort int    `json:"rank_port"` // its port

	PageSize     int    `json:"page_size"`      // tokens per KV page
	KVCacheDType string `json:"kv_cache_dtype"` // SGLang's --kv-cache-dtype, e.g. "auto"

	// LoadBalanceMethod is SGLang's --load-balance-method;
	// "follow_bootstrap_room" (the default) means the prefill DP rank of a
	// request is bootstrap_room % dp_size.
	LoadBalanceMethod        string `json:"load_balance_method,omitempty"`
	EnableDSACacheLayerSplit bool   `json:"enable_dsa_cache_layer_split"`
	// PrefillHTTPPort is the prefill server's HTTP API port, or nil.
	PrefillHTTPPort *int `json:"prefill_http_port"`
}

// RankInfo is the answer to a rank query: where that prefill rank's PULL
// socket is.
type RankInfo struct {
	RankIP   string `json:"rank_ip"`
	RankPort int    `json:"rank_port"`
}

// ParallelInfo is the answer to the all -1 query: the prefill deployment's
// layout (SGLang's PrefillServerInfo as dataclasses.asdict writes it). The
// target_* and required_* fields are filled in by the decode side's rank
// mapping; the server always sends them as null, and SGLang's decode
// rebuilds PrefillServerInfo(**json), so the field set must stay exactly
// this.
type ParallelInfo struct {
	AttnTPSize               int     `json:"attn_tp_size"`
	AttnCPSize               int     `json:"attn_cp_size"`
	DPSize                   int     `json:"dp_size"`
	PPSize                   int     `json:"pp_size"`
	PageSize                 *int    `json:"page_size"`
	KVCacheDType             *string `json:"kv_cache_dtype"`
	FollowBootstrapRoom      bool    `json:"follow_bootstrap_room"`
	EnableDSACacheLayerSplit bool    `json:"enable_dsa_cache_layer_split"`
	PrefillHTTPPort          *int    `json:"prefill_http_port"`

	TargetTPRank               *int  `json:"target_tp_rank"`
	TargetTPRanks              []int `json:"target_tp_ranks"`
	TargetCPRanks              []int `json:"target_cp_ranks"`
	TargetPPRanks              []int `json:"target_pp_ranks"`
	RequiredDstInfoNum         *int  `json:"required_dst_info_num"`
	RequiredPrefillResponseNum *int  `json:"required_prefill_response_num"`
}

// pyInt decodes a JSON value the way Python's int() accepts it from
// request.json(): an integral number or a decimal string.
type pyInt struct {
	v   int64
	set bool // false for JSON null
}

func (p *pyInt) UnmarshalJSON(b []byte) error {
	s := strings.TrimSpace(string(b))
	if s == "null" {
		*p = pyInt{}
		return nil
	}
	if uq, err := strconv.Unquote(s); err == nil && strings.HasPrefix(s, `"`) {
		s = strings.TrimSpace(uq)
	}
	if v, err := strconv.ParseInt(s, 10, 64); err == nil {
		*p = pyInt{v: v, set: true}
		return nil
	}
	var f json.Number = json.Number(s)
	if fv, err := f.Float64(); err == nil && fv == float64(int64(fv)) {
		*p = pyInt{v: int64(fv), set: true}
		return nil
	}
	return fmt.Errorf("%s is not an integer", truncate(s))
}

func truncate(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}
