package vllm

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Generation is one wire generation of vLLM's NIXL connector, named by its
// NIXL_CONNECTOR_VERSION: everything that differs between generations
// (the handshake's shape, NixlAgentMetadata's required fields, the
// compatibility hash's factors, kv_transfer_params, what a READ
// notification counts, leases) as data. Adding a generation is one more
// entry in generations; the codecs read the entry and never switch on a
// version number.
//
// Sources, vllm-project/vllm:
//   - 2: vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py of
//     vLLM 0.13 (/work/shared/reference/vllm_nixl_connector.py.txt);
//   - 6: the nixl/ package: metadata.py with NIXL_CONNECTOR_VERSION = 6
//     (NixlAgentMetadata, compute_nixl_compatibility_hash with
//     cross_layers_blocks, is_hma_enabled and speculative_config),
//     base_scheduler.py (_nixl_handshake_listener answering
//     (GET_META_MSG, pp_rank, tp_rank) with [payload,
//     msgpack(perf_counter())]; kv_lease_duration 30 s, heartbeat
//     interval lease // 6), pull_scheduler.py (request_finished: one block
//     list per KV cache group, remote_num_tokens,
//     remote_blocks_expiry_time; held on FINISHED_LENGTH_CAPPED and
//     FINISHED_STOPPED), base_worker.py (_nixl_handshake keeps the clock
//     offset of the fastest round trip; _send_heartbeats sends
//     "HB:" + ",".join(ids) to every agent of the engine; _handle_heartbeat
//     extends known leases to now + lease*2//3) and pull_worker.py (the READ
//     notification "{remote_request_id}:{world_size}", counted by the
//     prefill as decode_tp // prefill_tp when the decode is larger, else 1).
//   - 10: metadata.py @ 0316d25ab5286b130d7663b57959cc8a740b3864
//     (NIXL_CONNECTOR_VERSION = 10; 7 added transfer_mode to the hash and
//     dropped cross_layers_blocks, 8 added dcp_size and pcp_size, 9
//     block_strides, 10 dense virtual pages for compressed MLA caches,
//     which change no field), base_scheduler.py at the same commit (the
//     handshake of version 6, unchanged; transfer_mode, dcp_size and
//     pp_size in kv_transfer_params) and pull_worker.py at the same commit
//     (_read_blocks' READ notification
//     "{remote_request_id}:{expected_consumers}", the decode ranks reading
//     that prefill rank, as in version 2; _get_new_notifs, which waits for
//     that many and extends leases on "HB:" notifications). The order of
//     kv_transfer_params is pull_scheduler.py's request_finished @
//     0050936b22adda2ef0197fa3bb2551fe6c5437dc and the heartbeat
//     base_worker.py's _send_heartbeats @
//     00bd51312724dc9984e7eaa16fa741863db25c97 (neither file is stored at
//     0316d25). base_worker.py there reads block_strides as the byte
//     stride from one block to the next (cache.stride(0)).
//   - 11 and 12: metadata.py @ 02cfb534df5674737558730b10f23d1b7aef9b7c
//     (NIXL_CONNECTOR_VERSION = 12; 11 added region_num_blocks,
//     region_group_ids, region_names and region_mem_types, each
//     "list | None = None", after physical_blocks_per_logical_kv_block and
//     before dcp_size; 12 added region_members, "list[list[str]]", default
//     empty, last; compute_nixl_compatibility_hash hashes version 10's
//     factors; NixlConnectorMetadata reads version 10's kv_transfer_params).
//     What a worker puts in the region fields and how a decode checks them
//     were read where the search index has them without a commit of their
//     own (vllm-project/vllm PR #53780, "[2/N][KV Connector][NIXL] Support
//     per-region transfer geometry", merged 2026-09): nixl/utils.py
//     (_REGION_FIELDS: per-region lists index-aligned with
//     kv_caches_base_addr, None or of its length; region_members: no layer
//     in two regions), pull_worker.py of version 12 (the READ notification
//     "{remote_request_id}:{expected_consumers}" as in 10; a pull peer's
//     region_group_ids are the local ones, region_members [] on a plain pull
//     worker, region_mem_types "VRAM"), and vllm-gaudi's copy of
//     base_worker.py's register_kv_caches after #53780 (per region:
//     num_blocks, the layer's transfer group index, the layer name, the
//     NIXL memory type).
type Generation struct {
	// Version is NIXL_CONNECTOR_VERSION, also the nixl_connector_version
	// hash factor.
	Version int
	// RequestPPRank: the handshake request is (get_meta_msg, pp_rank,
	// tp_rank); otherwise (get_meta_msg, tp_rank).
	RequestPPRank bool
	// ReplyClock: the reply has a second frame, the prefill's
	// msgpack-encoded perf_counter() (a float, seconds), from which the
	// decode keeps a clock offset; otherwise one frame, the payload.
	ReplyClock bool
	// MetadataFields are NixlAgentMetadata's fields without a default, in
	// declaration order: what an encoder writes and a decoder requires.
	MetadataFields []string
	// MetadataDefaults are NixlAgentMetadata's fields with a default, in
	// declaration order, after MetadataFields: msgspec encodes them, a
	// decoder takes the dataclass's default when one is absent (dcp_size and
	// pcp_size 1, the region lists None, region_members empty).
	MetadataDefaults []string
	// Factors are the compatibility hash factors every engine of the
	// generation hashes (by vLLM's names). Other known factors (allFactors)
	// are hashed when the engine gives them.
	Factors []string
	// ParamsFields are the keys of request_finished's kv_transfer_params,
	// in its order.
	ParamsFields []string
	// GroupedBlockIDs: remote_block_ids is one list per KV cache group
	// ([[...]]); otherwise one flat list.
	GroupedBlockIDs bool
	// NotifCount is what the number after a READ notification's last ':'
	// counts.
	NotifCount NotifCount
	// Lease: the prefill holds a request's blocks for a lease
	// (DefaultLease unless configured) that the decode renews with
	// heartbeats ("HB:id,id,..."); otherwise for the abort timeout
	// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
	Lease bool
}

// NotifCount says what the number in "{remote_request_id}:{n}" counts.
type NotifCount int

const (
	// NotifReaders: n is how many decode ranks read this prefill rank (the
	// TP ratio), the notifications the rank waits for.
	NotifReaders NotifCount = iota
	// NotifDecodeTP: n is the decode's TP size (its world size); a prefill
	// rank of TP size p waits for n / p notifications when n > p, else 1.
	NotifDecodeTP
)

// DefaultLease is kv_lease_duration's default (kv_connector_extra_config).
const DefaultLease = 30 * time.Second

// HeartbeatPrefix starts a heartbeat notification: "HB:" followed by the
// remote request ids, joined by ','.
const HeartbeatPrefix = "HB:"

var metadataV2 = []string{"engine_id", "agent_metadata", "kv_caches_base_addr", "device_id", "num_blocks",
	"block_lens", "kv_cache_layout", "block_size"}

var factorsV2 = []string{"vllm_version", "nixl_connector_version", "model", "dtype", "num_kv_heads", "head_size",
	"num_hidden_layers", "attn_backend_name", "cache_dtype"}

var factorsV6 = append(slices.Clone(factorsV2), "cross_layers_blocks", "is_hma_enabled", "speculative_config")

var metadataV6 = append(slices.Clone(metadataV2), "ssm_sizes", "attn_backend_name", "physical_blocks_per_logical_kv_block")

// metadataV10: block_strides follows block_lens (version 9).
var metadataV10 = slices.Insert(slices.Clone(metadataV6), slices.Index(metadataV6, "block_lens")+1, "block_strides")

// factorsV10: version 7 put transfer_mode in and took cross_layers_blocks
// out.
var factorsV10 = append(slices.Clone(factorsV2), "is_hma_enabled", "speculative_config", "transfer_mode")

// regionFields are version 11's per-region lists, declared between
// physical_blocks_per_logical_kv_block and dcp_size.
var regionFields = []string{"region_num_blocks", "region_group_ids", "region_names", "region_mem_types"}

var paramsV2 = []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
	"remote_request_id", "remote_host", "remote_port", "tp_size"}

// generations are the generations kvhost speaks, by version.
var generations = map[int]*Generation{
	2: {
		Version:        2,
		MetadataFields: metadataV2,
		Factors:        factorsV2,
		ParamsFields:   paramsV2,
		NotifCount:     NotifReaders,
	},
	6: {
		Version:         6,
		RequestPPRank:   true,
		ReplyClock:      true,
		MetadataFields:  metadataV6,
		Factors:         factorsV6,
		ParamsFields:    append(slices.Clone(paramsV2), "remote_num_tokens", "remote_blocks_expiry_time"),
		GroupedBlockIDs: true,
		NotifCount:      NotifDecodeTP,
		Lease:           true,
	},
	10: {
		Version:        10,
		RequestPPRank:  true,
		ReplyClock:     true,
		MetadataFields: metadataV10,
		// Version 8.
		MetadataDefaults: []string{"dcp_size", "pcp_size"},
		Factors:          factorsV10,
		ParamsFields:     paramsV10,
		GroupedBlockIDs:  true,
		NotifCount:       NotifReaders,
		Lease:            true,
	},
	11: {
		Version:          11,
		RequestPPRank:    true,
		ReplyClock:       true,
		MetadataFields:   metadataV10,
		MetadataDefaults: append(slices.Clone(regionFields), "dcp_size", "pcp_size"),
		Factors:          factorsV10,
		ParamsFields:     paramsV10,
		GroupedBlockIDs:  true,
		NotifCount:       NotifReaders,
		Lease:            true,
	},
	12: {
		Version:          12,
		RequestPPRank:    true,
		ReplyClock:       true,
		MetadataFields:   metadataV10,
		MetadataDefaults: append(slices.Clone(regionFields), "dcp_size", "pcp_size", "region_members"),
		Factors:          factorsV10,
		ParamsFields:     paramsV10,
		GroupedBlockIDs:  true,
		NotifCount:       NotifReaders,
		Lease:            true,
	},
}

var paramsV10 = append(slices.Clone(paramsV2), "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode")

// DefaultVersion is the generation of an engine that names none.
const DefaultVersion = 2

// G2 is generation 2 (vLLM 0.13).
var G2 = generations[2]

// Versions returns the supported versions, ascending.
func Versions() []int {
	var vs []int
	for v := range generations {
		vs = append(vs, v)
	}
	slices.Sort(vs)
	return vs
}

// VersionList is Versions as text: "2, 6, 10".
func VersionList() string {
	var s []string
	for _, v := range Versions() {
		s = append(s, strconv.Itoa(v))
	}
	return strings.Join(s, ", ")
}

// ErrUnsupported marks a generation kvhost does not speak.
var ErrUnsupported = fmt.Errorf("vllm: unsupported NIXL connector version")

// Lookup returns generation v, or an error naming v and the supported
// versions.
func Lookup(v int) (*Generation, error) {
	if g := generations[v]; g != nil {
		return g, nil
	}
	return nil, fmt.Errorf("%w %d: kvhost speaks versions %s", ErrUnsupported, v, VersionList())
}

// Or returns g, or generation DefaultVersion when g is nil (a config
// field's default).
func Or(g *Generation) *Generation {
	if g == nil {
		return generations[DefaultVersion]
	}
	return g
}

func (g *Generation) String() string { return "NIXL connector version " + strconv.Itoa(g.Version) }

// Consumers converts the count n of a READ notification into the
// notifications a prefill rank of an engine with TP size prefillTP waits
// for (0 if n cannot be one).
func (g *Generation) Consumers(n, prefillTP int) int {
	if n <= 0 {
		return 0
	}
	if g.NotifCount == NotifDecodeTP {
		if n > prefillTP && prefillTP > 0 {
			return n / prefillTP
		}
		return 1
	}
	return n
}

// NotifNumber is the number a decode puts in its READ notification:
// readers (the TP ratio) or its own TP size, as the generation counts.
func (g *Generation) NotifNumber(readers, decodeTP int) int {
	if g.NotifCount == NotifDecodeTP {
		return decodeTP
	}
	return readers
}

// LeaseTimes are the lease's derived durations as vLLM computes them in
// whole seconds: the heartbeat interval lease // 6 and the extension a
// heartbeat grants, lease * 2 // 3. A lease under 6 s gets a sub-second
// interval (vLLM's would be 0: a heartbeat every scheduler step).
func LeaseTimes(lease time.Duration) (interval, extension time.Duration) {
	s := int64(lease / time.Second)
	interval = time.Duration(s/6) * time.Second
	if interval <= 0 {
		interval = max(lease/6, time.Millisecond)
	}
	extension = time.Duration(s*2/3) * time.Second
	if extension <= 0 {
		extension = lease * 2 / 3
	}
	return interval, extension
}
