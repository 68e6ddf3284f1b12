"""The wire of each vLLM NIXL connector generation the peer speaks, as a
table: adding a generation is one entry in WIRES (and the tests, which
take their generations from WIRES, then run it both ways):
``Wire(version, True, True, <its metadata fields>, <its params>, <what
its notification counts>)``, the fields built as _MD10 and _P10 are.

What kvhost's own tables already hold is read from them, not restated:
kvhost.vllm.generations.GENERATIONS gives the hash factors (through
kvhost.vllm.settings.compat_factors), whether remote_block_ids is one
list per KV cache group, and whether the prefill holds for a lease. What
only a peer needs is here, read from vLLM's connector (the sources are
those host/wire/vllm/generation.go names, and
host/pull/testdata/vllm_nixl_peer.py speaks the same handshake):

  - 2: vLLM 0.13's vllm/distributed/kv_transfer/kv_connector/v1/
    nixl_connector.py (/work/shared/reference/vllm_nixl_connector.py.txt):
    NixlAgentMetadata and NixlHandshakePayload, _nixl_handshake_listener
    (request (GET_META_MSG, tp_rank), reply one frame), _nixl_handshake,
    request_finished's kv_transfer_params, _read_blocks' notification
    "{remote_request_id}:{tp_ratio}" and _get_new_notifs, which frees after
    tp_ratio of them;
  - 6: vllm-project/vllm's kv_connector/v1/nixl/ package with
    NIXL_CONNECTOR_VERSION = 6: metadata.py (ssm_sizes, attn_backend_name,
    physical_blocks_per_logical_kv_block appended), base_scheduler.py
    (request (GET_META_MSG, pp_rank, tp_rank), reply [payload,
    msgpack(perf_counter())]), pull_scheduler.py's request_finished
    (remote_num_tokens, remote_blocks_expiry_time), pull_worker.py (READ
    notification "{remote_request_id}:{world_size}", the prefill rank
    freeing after decode_tp // prefill_tp of them, 1 when decode TP <=
    prefill TP), base_worker.py (_send_heartbeats "HB:" + ",".join(ids)
    every lease // 6 s, _handle_heartbeat extending to now + lease*2//3);
  - 10: the same package @ 0316d25ab5286b130d7663b57959cc8a740b3864:
    metadata.py (block_strides after block_lens, dcp_size and pcp_size
    last), pull_worker.py _read_blocks ("{remote_request_id}:
    {expected_consumers}", the decode ranks reading that prefill rank),
    kv_transfer_params with dcp_size, pp_size and transfer_mode
    (pull_scheduler.py request_finished @ 0050936b22adda2ef0197fa3bb2551fe6c5437dc);
  - 11 and 12: metadata.py @ 02cfb534df5674737558730b10f23d1b7aef9b7c
    (NIXL_CONNECTOR_VERSION = 12): 11 adds region_num_blocks,
    region_group_ids, region_names and region_mem_types (default None)
    before dcp_size, 12 region_members (default []) last; the handshake,
    kv_transfer_params and notification are 10's (host/wire/vllm's
    generation.go names the files read for them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhost.vllm import generations

GET_META_MSG = b"get_meta_msg"
HEARTBEAT_PREFIX = "HB:"

# NixlAgentMetadata's fields in declaration order.
_MD2 = ("engine_id", "agent_metadata", "kv_caches_base_addr", "device_id", "num_blocks", "block_lens",
        "kv_cache_layout", "block_size")
_MD6 = _MD2 + ("ssm_sizes", "attn_backend_name", "physical_blocks_per_logical_kv_block")
_MD10 = _MD6[: _MD6.index("block_lens") + 1] + ("block_strides",) + _MD6[_MD6.index("block_lens") + 1:] + (
    "dcp_size", "pcp_size")
_REGIONS = ("region_num_blocks", "region_group_ids", "region_names", "region_mem_types")
_MD11 = _MD10[: _MD10.index("dcp_size")] + _REGIONS + ("dcp_size", "pcp_size")
_MD12 = _MD11 + ("region_members",)
# The fields with a default, which msgspec's decoder does not require.
DEFAULTED = frozenset(_REGIONS + ("dcp_size", "pcp_size", "region_members"))

# request_finished's kv_transfer_params, in its order.
_P2 = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
       "remote_host", "remote_port", "tp_size")
_P6 = _P2 + ("remote_num_tokens", "remote_blocks_expiry_time")
_P10 = _P2 + ("dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode")

# What the number after a READ notification's last ':' counts.
READERS = "readers"  # the decode ranks reading this prefill rank (the TP ratio)
DECODE_TP = "decode_tp"  # the decode's world size


@dataclass(frozen=True)
class Wire:
    version: int
    request_pp_rank: bool  # handshake request (GET_META_MSG, pp_rank, tp_rank)
    reply_clock: bool  # reply [payload, msgpack(perf_counter())]
    metadata_fields: tuple
    params_fields: tuple
    notif_counts: str

    @property
    def generation(self) -> generations.Generation:
        """kvhost's entry for this generation (factors, grouping, leases)."""
        return generations.generation(self.version)

    @property
    def grouped_block_ids(self) -> bool:
        return self.generation.block_ids_per_group

    @property
    def leases(self) -> bool:
        return self.generation.leases

    def notif_number(self, decode_tp: int, prefill_tp: int) -> int:
        """The number a decode rank puts after the ':' of its READ
        notification."""
        if self.notif_counts == DECODE_TP:
            return decode_tp
        return max(decode_tp // prefill_tp, 1)

    def consumers(self, n: int, prefill_tp: int) -> int:
        """How many notifications carrying n a prefill rank waits for."""
        if self.notif_counts == DECODE_TP:
            return n // prefill_tp if n > prefill_tp else 1
        return n


WIRES = {
    w.version: w
    for w in (
        Wire(2, False, False, _MD2, _P2, READERS),
        Wire(6, True, True, _MD6, _P6, DECODE_TP),
        Wire(10, True, True, _MD10, _P10, READERS),
        Wire(11, True, True, _MD11, _P10, READERS),
        Wire(12, True, True, _MD12, _P10, READERS),
    )
}


def wire(version: int) -> Wire:
    w = WIRES.get(int(version))
    if w is None:
        raise ValueError(f"the vLLM peer speaks NIXL connector versions {sorted(WIRES)}, not {version}")
    return w
