#!/usr/bin/python3
"""Independent restatement of vLLM 0.13.0's NIXL pull descriptor math.

Used by planner/vllm_ref_test.go. Reads a JSON list of cases on stdin and
writes a JSON list of results on stdout. Each case is one decode rank's
handshake with one prefill rank plus one request; the result is what
vllm_nixl_connector.py.txt would hand NIXL: the local (decode) and remote
(prefill) descriptor lists and the two descriptor id arrays of the READ, or
the error it raises.

The functions below follow vLLM's kv_connector/v1/nixl_connector.py's structure and arithmetic (numpy
where it uses numpy) statement by statement:
  register_kv_caches / register_local_xfer_handler, _nixl_handshake,
  add_remote_agent, _validate_remote_agent_handshake, TpKVTopology,
  _read_blocks, get_mapped_blocks, _get_block_descs_ids,
  _logical_to_kernel_block_ids.
The windowed (local-attention) path is kept literally, including the
reference's swapped engine ids; the Go test only generates windowed cases
where that swap is harmless (decode blocks x block-size ratio == prefill
blocks). Index checks that NIXL itself performs in make_prepped_xfer are
emulated so an out-of-range id is an error, as it would be at run time.

Case fields: local/remote {base_addrs, block_lens, num_blocks, block_size,
layout, device_id}, tp_rank, tp_size, remote_tp_size, mla, blocks_first,
total_kv_heads, windows (null or list of null/int), permute, kernel_factor,
local_block_ids, remote_block_ids, remote_request_id.
"""

import json
import sys

import numpy as np

LOCAL = "decode-engine"
REMOTE = "prefill-engine"


class RefError(Exception):
    pass


class Topo:
    """TpKVTopology (vLLM 0.13.0) without the attention backend probe."""

    def __init__(self, tp_rank, remote_tp_size, is_mla, total_num_kv_heads,
                 remote_block_size, blocks_first):
        self.tp_rank = tp_rank
        self.remote_tp_size = remote_tp_size
        self.is_mla = is_mla
        self.total_num_kv_heads = total_num_kv_heads
        self.engine_id = LOCAL
        self.remote_block_size = remote_block_size
        self.is_kv_layout_blocks_first = blocks_first

    @property
    def split_k_and_v(self):
        return not (self.is_mla or self.is_kv_layout_blocks_first)

    @property
    def tp_size(self):
        return self.remote_tp_size[self.engine_id]

    @property
    def block_size(self):
        return self.remote_block_size[self.engine_id]

    def tp_ratio(self, remote_tp_size):
        assert self.tp_size % remote_tp_size == 0, "tp not divisible"
        return self.tp_size // remote_tp_size

    def block_size_ratio(self, remote_block_size):
        assert self.block_size % remote_block_size == 0, "block size not divisible"
        return self.block_size // remote_block_size

    def tp_ratio_from_engine_id(self, eid):
        return self.tp_ratio(self.remote_tp_size[eid])

    def block_size_ratio_from_engine_id(self, eid):
        return self.block_size_ratio(self.remote_block_size[eid])

    def is_kv_replicated(self, eid):
        return self.remote_tp_size[eid] // self.total_num_kv_heads >= 1

    def replicates_kv_cache(self, eid):
        return self.is_mla or self.is_kv_replicated(eid)

    def get_target_remote_rank(self, remote_tp_size):
        return self.tp_rank // self.tp_ratio(remote_tp_size)


class Worker:
    def __init__(self, c):
        loc = c["local"]
        self.use_mla = c["mla"]
        self.block_size = loc["block_size"]
        self.tp_rank = c["tp_rank"]
        self.device_id = loc["device_id"]
        self.kv_cache_layout = loc["layout"]
        self.enable_permute = c["permute"]
        self._tp_size = {LOCAL: c["tp_size"]}
        self._block_size = {LOCAL: self.block_size}
        self.kv_topo = Topo(self.tp_rank, self._tp_size, self.use_mla,
                            c["total_kv_heads"], self._block_size, c["blocks_first"])
        self.kv_caches_base_addr = {}
        self.dst_num_blocks = {}
        self.src_xfer_side_handles = {}
        self.dst_xfer_side_handles = {}
        self._physical_blocks_per_logical_kv_block = c["kernel_factor"]
        windows = c["windows"]
        self.block_window_per_layer = [] if windows is None else list(windows)
        self.register_kv_caches(loc, windows)

    # register_kv_caches, with block_len_per_layer given instead of tensors.
    def register_kv_caches(self, loc, windows):
        self.num_blocks = loc["num_blocks"]
        self.block_len_per_layer = list(loc["block_lens"])
        self.slot_size_per_layer = [bl // self.block_size for bl in self.block_len_per_layer]
        seen = list(loc["base_addrs"])
        if not self.use_mla:
            for bl in self.block_len_per_layer:
                assert bl == self.block_len_per_layer[0], "All kv cache tensors must have the same size"
        assert self.num_blocks != 0
        self.kv_caches_base_addr[LOCAL] = seen
        self.num_regions = len(seen)
        if windows is not None:
            self.num_layers = len(windows)
        elif self.kv_topo.split_k_and_v:
            self.num_layers = len(seen) // 2
        else:
            self.num_layers = len(seen)
        self.dst_num_blocks[LOCAL] = self.num_blocks
        if self.kv_topo.is_kv_layout_blocks_first:
            for i in range(len(self.slot_size_per_layer)):
                assert self.slot_size_per_layer[i] % 2 == 0
                self.slot_size_per_layer[i] //= 2
            self.num_regions *= 2
        self.seen_base_addresses = seen
        self.src_xfer_side_handle = self.register_local_xfer_handler(self.block_size)
        self.src_xfer_side_handles[self.block_size] = self.src_xfer_side_handle

    def get_backend_aware_kv_block_len(self, layer_idx):
        if self.kv_topo.is_kv_layout_blocks_first:
            return self.block_len_per_layer[layer_idx] // 2
        return self.block_len_per_layer[layer_idx]

    def register_local_xfer_handler(self, block_size):
        block_size_ratio = self.block_size // block_size
        blocks_data = []
        for i, base_addr in enumerate(self.seen_base_addresses):
            kv_block_len = self.get_backend_aware_kv_block_len(layer_idx=i) // block_size_ratio
            block_len_per_layer = self.block_len_per_layer[i] // block_size_ratio
            num_blocks = self.num_blocks * block_size_ratio
            for block_id in range(num_blocks):
                block_offset = block_id * block_len_per_layer
                addr = base_addr + block_offset
                blocks_data.append((addr, kv_block_len, self.device_id))
            if self.kv_topo.is_kv_layout_blocks_first:
                for block_id in range(num_blocks):
                    block_offset = block_id * block_len_per_layer
                    addr = base_addr + block_offset
                    v_addr = addr + kv_block_len
                    blocks_data.append((v_addr, kv_block_len, self.device_id))
        return blocks_data

    # _nixl_handshake after decoding the metadata.
    def handshake(self, meta, remote_tp_size):
        assert meta["block_size"] <= self.block_size, "nP > nD is not supported yet."
        self.add_remote_agent(meta, remote_tp_size)

    def add_remote_agent(self, meta, remote_tp_size):
        engine_id = REMOTE
        self._tp_size[engine_id] = remote_tp_size
        self._block_size[engine_id] = meta["block_size"]
        replicates_kv_cache = self.kv_topo.replicates_kv_cache(engine_id)
        block_size_ratio = self.kv_topo.block_size_ratio_from_engine_id(engine_id)
        self.dst_num_blocks[engine_id] = meta["num_blocks"]
        self.kv_caches_base_addr[engine_id] = meta["base_addrs"]
        self._validate_remote_agent_handshake(meta, remote_tp_size)
        tp_ratio = self.kv_topo.tp_ratio_from_engine_id(engine_id)
        blocks_data = []
        for i, base_addr in enumerate(meta["base_addrs"]):
            kv_block_len = self.get_backend_aware_kv_block_len(layer_idx=i)
            remote_kv_block_len = kv_block_len // block_size_ratio
            if block_size_ratio > 1:
                kv_block_len = remote_kv_block_len
            rank_offset = (
                self.tp_rank % tp_ratio * remote_kv_block_len
                if not replicates_kv_cache
                else 0
            )
            for block_id in range(meta["num_blocks"]):
                block_offset = block_id * meta["block_lens"][i]
                addr = base_addr + block_offset + rank_offset
                blocks_data.append((addr, kv_block_len, meta["device_id"]))
            if self.kv_topo.is_kv_layout_blocks_first:
                for block_id in range(meta["num_blocks"]):
                    block_offset = block_id * meta["block_lens"][i]
                    addr = base_addr + block_offset + rank_offset
                    v_addr = addr + meta["block_lens"][i] // 2
                    blocks_data.append((v_addr, kv_block_len, meta["device_id"]))
        self.dst_xfer_side_handles[engine_id] = blocks_data
        if block_size_ratio > 1:
            self.src_xfer_side_handles[meta["block_size"]] = (
                self.register_local_xfer_handler(meta["block_size"])
            )

    def _validate_remote_agent_handshake(self, meta, remote_tp_size):
        eid = REMOTE
        assert self._tp_size[eid] == remote_tp_size
        tp_ratio = self.kv_topo.tp_ratio_from_engine_id(eid)
        block_size_ratio = self.kv_topo.block_size_ratio_from_engine_id(eid)
        assert tp_ratio > 0, "Decode TP cannot be smaller than prefill TP"
        if not self.use_mla and meta["layout"] != self.kv_cache_layout:
            if self.enable_permute and meta["layout"] == "HND":
                pass
            else:
                raise RuntimeError("Heterogeneous TP expects same kv_cache_layout.")
        remote_block_len = meta["block_lens"][0]
        if self.use_mla or self.kv_topo.is_kv_replicated(eid):
            for i in range(len(self.block_len_per_layer)):
                assert (
                    self.block_len_per_layer[i] // block_size_ratio
                    == meta["block_lens"][i]
                ), "KV cache sizes must match between P and D when replicated"
        else:
            for block_len in meta["block_lens"]:
                assert block_len == remote_block_len, "All remote layers must have the same block size"
            assert (
                remote_block_len
                == (self.block_len_per_layer[0] * tp_ratio) // block_size_ratio
            ), "Remote P worker KV layer cache shape"
        assert self.dst_num_blocks[eid] == meta["num_blocks"]
        assert len(meta["base_addrs"]) == len(self.block_len_per_layer)

    def get_mapped_blocks(self, block_ids, block_size_ratio):
        if block_ids.size == 0:
            return np.array([], dtype=np.int64)
        start_ids = block_ids * block_size_ratio
        offsets = np.arange(block_size_ratio)
        mapped_2d = start_ids[:, None] + offsets[None, :]
        return mapped_2d.flatten().astype(np.int64)

    def _get_block_descs_ids(self, engine_id, block_ids, layer_idx=None, block_size_ratio=None):
        if layer_idx is None:
            region_ids = np.arange(self.num_regions)
        else:
            assert layer_idx < self.num_layers
            if self.num_layers < self.num_regions:
                assert 2 * self.num_layers == self.num_regions
                region_ids = np.arange(2 * layer_idx, 2 * layer_idx + 2)
            else:
                assert self.num_layers == self.num_regions
                region_ids = np.arange(layer_idx, layer_idx + 1)
        num_blocks = self.dst_num_blocks[engine_id]
        if block_size_ratio is not None:
            num_blocks = int(num_blocks * block_size_ratio)
        region_ids = region_ids[:, None]
        block_ids = np.array(block_ids, dtype=np.int64)[None, :]
        descs_ids = region_ids * num_blocks + block_ids
        return descs_ids.flatten()

    def _logical_to_kernel_block_ids(self, block_ids):
        k = self._physical_blocks_per_logical_kv_block
        if k == 1:
            return block_ids
        block_ids_np = np.array(block_ids, dtype=np.int64)
        block_arange = np.arange(0, k).reshape(1, -1)
        # BlockTable.map_to_kernel_blocks: every logical block becomes k
        # consecutive kernel blocks.
        return (block_ids_np.reshape(-1, 1) * k + block_arange).reshape(-1).tolist()

    def read_blocks(self, local_block_ids, remote_block_ids, remote_request_id):
        dst_engine_id = REMOTE
        local_block_ids = self._logical_to_kernel_block_ids(local_block_ids)
        remote_block_ids = self._logical_to_kernel_block_ids(remote_block_ids)
        block_size_ratio = self.kv_topo.block_size_ratio_from_engine_id(dst_engine_id)
        if block_size_ratio > 1:
            local_block_ids = self.get_mapped_blocks(np.asarray(local_block_ids, dtype=np.int64), block_size_ratio)
            if len(local_block_ids) > len(remote_block_ids):
                local_block_ids = local_block_ids[: len(remote_block_ids)]
        tp_ratio = self.kv_topo.tp_ratio_from_engine_id(dst_engine_id)
        notif_id = f"{remote_request_id}:{tp_ratio}"
        out = {"tp_ratio": tp_ratio, "notif": notif_id,
               "remote_rank": self.kv_topo.get_target_remote_rank(self._tp_size[dst_engine_id])}
        num_local_blocks = len(local_block_ids)
        if num_local_blocks == 0:
            out["notify_only"] = True
            return out
        num_remote_blocks = len(remote_block_ids)
        assert num_local_blocks <= num_remote_blocks
        if num_local_blocks < num_remote_blocks:
            remote_block_ids = remote_block_ids[-num_local_blocks:]
        remote_block_size = self.kv_topo.remote_block_size[dst_engine_id]
        local_list = self.src_xfer_side_handles.get(remote_block_size, self.src_xfer_side_handle)
        remote_list = self.dst_xfer_side_handles[dst_engine_id]
        if not self.block_window_per_layer:
            remote_ids = self._get_block_descs_ids(dst_engine_id, remote_block_ids)
            local_ids = self._get_block_descs_ids(LOCAL, local_block_ids, block_size_ratio=block_size_ratio)
        else:
            local_descs_list = []
            remote_descs_list = []
            for layer_idx, block_window in enumerate(self.block_window_per_layer):
                if block_window is None:
                    layer_local = local_block_ids
                    layer_remote = remote_block_ids
                else:
                    layer_local = local_block_ids[-block_window:]
                    layer_remote = remote_block_ids[-block_window:]
                # Literal reference: engine ids swapped (see module doc).
                local_descs_list.append(self._get_block_descs_ids(dst_engine_id, layer_local, layer_idx))
                remote_descs_list.append(self._get_block_descs_ids(
                    LOCAL, layer_remote, layer_idx, block_size_ratio=block_size_ratio))
            local_ids = np.concatenate(local_descs_list)
            remote_ids = np.concatenate(remote_descs_list)
        assert len(local_ids) == len(remote_ids)
        # make_prepped_xfer: NIXL refuses indices outside the prepped lists.
        for ids, lst in ((local_ids, local_list), (remote_ids, remote_list)):
            if len(ids) and (ids.min() < 0 or ids.max() >= len(lst)):
                raise RefError("NIXL: descriptor index out of range")
        out["notify_only"] = False
        out["local_descs"] = [list(d) for d in local_list]
        out["remote_descs"] = [list(d) for d in remote_list]
        out["local_ids"] = [int(x) for x in local_ids]
        out["remote_ids"] = [int(x) for x in remote_ids]
        return out


def run(c):
    try:
        w = Worker(c)
        w.handshake(c["remote"], c["remote_tp_size"])
        return w.read_blocks(c["local_block_ids"], c["remote_block_ids"], c["remote_request_id"])
    except (AssertionError, RuntimeError, RefError, ZeroDivisionError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    cases = json.load(sys.stdin)
    json.dump([run(c) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
