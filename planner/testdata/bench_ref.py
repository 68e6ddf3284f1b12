"""Per-request planning of the reference connectors, timed, for the planner
benchmarks (planner/kvplan_bench_test.go). The reference connectors are the
upstream ones: SGLang's python/sglang/srt/disaggregation/nixl/conn.py and
mori/conn.py, and vLLM's
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py.

A line-oriented server: the benchmark starts it once and sends one JSON
object per line, and it answers one JSON line each.

  {"op": "load", "id": ID, "case": CASE}  -> {"descriptors": N}
  {"op": "time", "id": ID, "reps": R}     -> {"ns": [R per-request times]}

CASE names the reference code path ("kind") and its inputs. Each path is
the per-request code of the reference connector, transcribed line for line
(the per-peer set-up the reference does at registration is done at "load",
as the reference does it once): what runs between the request's page
indices arriving and the backend call (make_prepped_xfer, batch_write,
initialize_xfer) receiving its lists. Backend calls are stubs.
"slice_only": true on the MORI TP-slice path leaves out the
group_concurrent_contiguous call send_kvcache makes before it (unused on
that path, but paid). "expand": true on MORI paths stands for
batch_write's own walk over its (offset, offset, size) lists, with the
per-descriptor loop of planner/testdata/ref_sglang.py (the baseline issue
17 first measured).

Run with /usr/bin/python3 (numpy from python3-numpy).
"""

import json
import sys
import time

import numpy as np


# --- SGLang, python/sglang/srt/disaggregation/common/utils.py ---------------

def group_concurrent_contiguous(src_indices, dst_indices):
    if src_indices.size == 0:
        return [], []
    brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    src_groups = np.split(src_indices, brk)
    dst_groups = np.split(dst_indices, brk)
    src_groups = [g.tolist() for g in src_groups]
    dst_groups = [g.tolist() for g in dst_groups]
    return src_groups, dst_groups


# --- SGLang, python/sglang/srt/disaggregation/nixl/conn.py ------------------

def expand_page_indices_for_slice(page_indices, num_ptr_pairs, num_slots, page_size, num_groups=1, head_group_idx=0):
    token_offsets = np.arange(page_size, dtype=np.int32)
    pair_stride = num_slots * page_size * num_groups
    within_pair = (
        page_indices[:, None] * (page_size * num_groups) + token_offsets[None, :] * num_groups + head_group_idx
    ).ravel()
    pair_offsets = np.arange(num_ptr_pairs, dtype=np.int64) * pair_stride
    return (pair_offsets[:, None] + within_pair[None, :]).ravel().astype(np.int32)


def repeat_indices_over_layers(indices, num_layers, layer_length):
    offsets = np.arange(num_layers, dtype=np.int32) * layer_length
    return (offsets[:, None] + indices[None, :]).ravel().astype(np.int32)


def nixl_prepped(c):
    """send_kvcache (prepped branch of _send_kvcache_generic) and
    send_kvcache_mixed: one pair of index arrays per part."""
    segments = c["segments"]  # layers of each part
    slots_src, slots_dst = c["slots_src"], c["slots_dst"]

    def run(src, dst):
        out = []
        for num_layers in segments:
            si = repeat_indices_over_layers(src, num_layers, slots_src)
            di = repeat_indices_over_layers(dst, num_layers, slots_dst)
            out.append((si, di))
        return out
    return run


def nixl_slice(c):
    """send_kvcache_slice."""
    pairs, page = c["pairs"], c["page_size"]
    slots_src, slots_dst = c["slots_src"], c["slots_dst"]
    groups, gidx = c["groups"], c["group_idx"]

    def run(src, dst):
        si = expand_page_indices_for_slice(np.asarray(src, dtype=np.int32), pairs, slots_src, page,
                                           num_groups=groups, head_group_idx=gidx)
        di = expand_page_indices_for_slice(np.asarray(dst, dtype=np.int32), pairs, slots_dst, page)
        return si, di
    return run


def nixl_generic(c):
    """_send_kvcache_generic, non-prepped branch (state transfers: SWA and
    DSA through maybe_send_extra), MLA-style flat layout."""
    src_ptrs, dst_ptrs, item_lens = c["src_ptrs"], c["dst_ptrs"], c["item_lens"]

    def run(prefill_data_indices, dst_data_indices):
        src_data_ptrs = np.array(src_ptrs, dtype=np.uint64)
        dst_data_ptrs = np.array(dst_ptrs, dtype=np.uint64)
        item_lens_np = np.array(item_lens, dtype=np.uint64)
        prefill_kv_blocks, dst_kv_blocks = group_concurrent_contiguous(prefill_data_indices, dst_data_indices)
        layers_params = [(src_data_ptrs[layer_id], dst_data_ptrs[layer_id], item_lens_np[layer_id])
                         for layer_id in range(len(src_ptrs))]
        src_addrs, src_lens, dst_addrs, dst_lens = [], [], [], []
        prefill_starts = np.fromiter((block[0] for block in prefill_kv_blocks), dtype=np.uint64)
        dst_starts = np.fromiter((block[0] for block in dst_kv_blocks), dtype=np.uint64)
        block_lens = np.fromiter((len(block) for block in prefill_kv_blocks), dtype=np.uint64)
        for src_ptr, dst_ptr, item_len in layers_params:
            lengths = item_len * block_lens
            src_addrs.append(src_ptr + prefill_starts * item_len)
            src_lens.append(lengths)
            dst_addrs.append(dst_ptr + dst_starts * item_len)
            dst_lens.append(lengths)

        def make_req_array(addr_chunks, len_chunks, gpu):
            if not addr_chunks:
                return np.empty((0, 3), dtype=np.uint64)
            flat_addrs = np.concatenate(addr_chunks).astype(np.uint64, copy=False)
            flat_lens = np.concatenate(len_chunks).astype(np.uint64, copy=False)
            return np.column_stack((flat_addrs, flat_lens, np.full_like(flat_addrs, gpu, dtype=np.uint64)))
        src_reqs = make_req_array(src_addrs, src_lens, 0)
        dst_reqs = make_req_array(dst_addrs, dst_lens, 0)
        return (src_reqs, dst_reqs)
    return run


def nixl_aux(c):
    """send_aux: one (addr, len, 0) tuple per aux buffer; get_xfer_descs
    and initialize_xfer are the backend."""
    src_ptrs, src_lens, dst_ptrs = c["src_ptrs"], c["src_lens"], c["dst_ptrs"]

    def run(src, dst):
        prefill_aux_index, dst_aux_index = int(src[0]), int(dst[0])
        src_addrs, dst_addrs = [], []
        for i, _ in enumerate(dst_ptrs):
            length = src_lens[i]
            src_addr = src_ptrs[i] + length * prefill_aux_index
            dst_addr = dst_ptrs[i] + length * dst_aux_index
            src_addrs.append((src_addr, length, 0))
            dst_addrs.append((dst_addr, length, 0))
        return src_addrs, dst_addrs
    return run


# --- SGLang, python/sglang/srt/disaggregation/mori/conn.py ------------------

class GroupedIndexPlan:
    __slots__ = ("src_starts", "dst_starts", "counts")

    def __init__(self, src_starts, dst_starts, counts):
        self.src_starts, self.dst_starts, self.counts = src_starts, dst_starts, counts

    @classmethod
    def from_groups(cls, src_groups, dst_groups):
        if len(src_groups) != len(dst_groups):
            raise ValueError("Source and destination groups must have the same length")
        return cls(
            src_starts=[int(group[0]) for group in src_groups],
            dst_starts=[int(group[0]) for group in dst_groups],
            counts=[len(group) for group in src_groups],
        )

    def materialize(self, item_len):
        return BatchTransferPlan(
            local_offsets=[start * item_len for start in self.src_starts],
            remote_offsets=[start * item_len for start in self.dst_starts],
            sizes=[count * item_len for count in self.counts],
        )


class BatchTransferPlan:
    __slots__ = ("local_offsets", "remote_offsets", "sizes")

    def __init__(self, local_offsets, remote_offsets, sizes):
        self.local_offsets, self.remote_offsets, self.sizes = local_offsets, remote_offsets, sizes

    def empty(self):
        return not self.sizes


class Engine:
    """MORI's IOEngine, stubbed: batch_write either returns at once or,
    with expand, walks its lists per descriptor (see the module doc)."""

    def __init__(self, expand):
        self.uid, self.expand, self.out = 0, expand, []

    def allocate_transfer_uid(self):
        self.uid += 1
        return self.uid

    def batch_write(self, src_descs, local_offsets, dst_descs, remote_offsets, sizes, uids):
        if self.expand:
            sp, dp = src_descs[0], dst_descs[0]
            out = self.out
            for lo, ro, sz in zip(local_offsets[0], remote_offsets[0], sizes[0]):
                out.append([sp + lo, dp + ro, sz])
        return []


def mori_kv(c):
    """MoriKVManager.send_kvcache with _submit_batch_transfer_plan and
    _build_tp_slice_transfer_plan."""
    eng = Engine(c.get("expand", False))
    mla, layers = c["mla"], c["layers"]
    item_lens = c["item_lens"]
    src_k = list(range(1 << 40, (1 << 40) + layers * (1 << 34), 1 << 34))
    dst_k = list(range(2 << 40, (2 << 40) + layers * (1 << 34), 1 << 34))
    src_v = [p + (1 << 33) for p in src_k]
    dst_v = [p + (1 << 33) for p in dst_k]
    tp = c.get("tp_slice")

    def submit(src_desc, dst_desc, plan):
        if plan.empty():
            return []
        transfer_uid = eng.allocate_transfer_uid()
        return eng.batch_write([src_desc], [plan.local_offsets], [dst_desc], [plan.remote_offsets],
                               [plan.sizes], [transfer_uid])

    def build_tp_slice_config():
        """_build_tp_slice_config, which send_kvcache calls per request."""
        g = c["tp_inputs"]
        page_size = g["page_size"]
        src_item_len = g["src_item_len"]
        dst_item_len = g["dst_item_len"]
        bytes_per_token_src = src_item_len // page_size
        bytes_per_token_dst = dst_item_len // page_size
        prefill_tp_size = g["prefill_tp_size"]
        decode_tp_size = g["decode_tp_size"]
        total_kv_heads = g["total_kv_heads"]
        if total_kv_heads <= 0:
            total_kv_heads = g["kv_head_num"] * prefill_tp_size
        src_heads_per_rank = max(1, total_kv_heads // prefill_tp_size)
        dst_heads_per_rank = max(1, total_kv_heads // decode_tp_size)
        bytes_per_head_slice = bytes_per_token_dst // dst_heads_per_rank
        if bytes_per_head_slice == 0:
            raise ValueError("Head slice size evaluates to zero")
        src_replication = max(1, prefill_tp_size // total_kv_heads)
        local_tp_rank = g["engine_rank"] % prefill_tp_size
        dst_tp_rank = g["decode_tp_rank"] % decode_tp_size
        if prefill_tp_size > decode_tp_size:
            src_head_start = 0
            num_heads_to_send = src_heads_per_rank
            unique_head_idx = local_tp_rank // src_replication
            dst_head_start = (unique_head_idx * src_heads_per_rank) % dst_heads_per_rank
        else:
            src_head_start = (dst_tp_rank * dst_heads_per_rank) % src_heads_per_rank
            num_heads_to_send = dst_heads_per_rank
            dst_head_start = 0
        heads_bytes_per_token = num_heads_to_send * bytes_per_head_slice
        if heads_bytes_per_token > bytes_per_token_dst:
            raise ValueError("Slice size exceeds destination token capacity for TP slice transfer")
        return dict(page_size=page_size, src_item_len=src_item_len, dst_item_len=dst_item_len,
                    bytes_per_token_src=bytes_per_token_src, bytes_per_token_dst=bytes_per_token_dst,
                    src_off=src_head_start * bytes_per_head_slice, dst_off=dst_head_start * bytes_per_head_slice,
                    heads_bytes=heads_bytes_per_token)

    def tp_slice_plan(kv_indices, dst_indices):
        if kv_indices.size == 0 or dst_indices.size == 0:
            return BatchTransferPlan([], [], [])
        limit = min(kv_indices.size, dst_indices.size)
        src_pages = kv_indices[:limit].astype(np.int64)
        dst_pages = dst_indices[:limit].astype(np.int64)
        token_slots = np.arange(tp["page_size"], dtype=np.int64)
        src_page_bases = src_pages * tp["src_item_len"]
        dst_page_bases = dst_pages * tp["dst_item_len"]
        src_token_offsets = token_slots * tp["bytes_per_token_src"]
        dst_token_offsets = token_slots * tp["bytes_per_token_dst"]
        local_offsets = (src_page_bases[:, np.newaxis] + src_token_offsets + tp["src_off"]).flatten().tolist()
        remote_offsets = (dst_page_bases[:, np.newaxis] + dst_token_offsets + tp["dst_off"]).flatten().tolist()
        num_transfers = limit * tp["page_size"]
        sizes = [tp["heads_bytes"]] * num_transfers
        if not local_offsets:
            return BatchTransferPlan([], [], [])
        return BatchTransferPlan(local_offsets, remote_offsets, sizes)

    slice_only = c.get("slice_only", False)

    def run(src, dst):
        eng.out = []
        if slice_only:
            # Issue 17's first measure of this path: the slice plan and its
            # submissions, without the grouping send_kvcache does first.
            slice_plan = tp_slice_plan(src, dst)
            for layer_id in range(layers):
                submit(src_k[layer_id], dst_k[layer_id], slice_plan)
                submit(src_v[layer_id], dst_v[layer_id], slice_plan)
            return []
        grouped_plan = GroupedIndexPlan.from_groups(*group_concurrent_contiguous(src, dst))
        statuses = []
        if mla:
            for layer_id in range(layers):
                layer_plan = grouped_plan.materialize(item_lens[layer_id])
                statuses.extend(submit(src_k[layer_id], dst_k[layer_id], layer_plan))
            return statuses
        if tp is not None:
            if build_tp_slice_config() != tp:
                raise ValueError("tp_slice_config differs from the planner's TPSlice")
            slice_plan = tp_slice_plan(src, dst)
            for layer_id in range(layers):
                statuses.extend(submit(src_k[layer_id], dst_k[layer_id], slice_plan))
                statuses.extend(submit(src_v[layer_id], dst_v[layer_id], slice_plan))
            return statuses
        layer_plan = grouped_plan.materialize(item_lens[0])
        for layer_id in range(layers):
            statuses.extend(submit(src_k[layer_id], dst_k[layer_id], layer_plan))
            statuses.extend(submit(src_v[layer_id], dst_v[layer_id], layer_plan))
        return statuses
    return run


# --- vLLM, vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py ----

def vllm_read(c):
    """_read_blocks up to make_prepped_xfer: get_mapped_blocks (block-size
    ratio) and _get_block_descs_ids of both sides."""
    ratio = c["block_size_ratio"]
    local_regions, local_blocks = c["local_regions"], c["local_blocks"]
    remote_regions, remote_blocks = c["remote_regions"], c["remote_blocks"]

    def get_mapped_blocks(block_ids, block_size_ratio):
        if block_ids.size == 0:
            return np.array([], dtype=np.int64)
        start_ids = block_ids * block_size_ratio
        offsets = np.arange(block_size_ratio)
        mapped_2d = start_ids[:, None] + offsets[None, :]
        return mapped_2d.flatten().astype(np.int64)

    def get_block_descs_ids(num_regions, num_blocks, block_ids, block_size_ratio=None):
        region_ids = np.arange(num_regions)
        if block_size_ratio is not None:
            num_blocks = int(num_blocks * block_size_ratio)
        region_ids = region_ids[:, None]
        block_ids = np.array(block_ids)[None, :]
        descs_ids = region_ids * num_blocks + block_ids
        return descs_ids.flatten()

    def run(local_block_ids, remote_block_ids):
        # The reference receives Python lists.
        local_block_ids, remote_block_ids = local_block_ids.tolist(), remote_block_ids.tolist()
        t0 = time.perf_counter_ns()
        block_size_ratio = ratio
        if block_size_ratio > 1:
            local_block_ids = get_mapped_blocks(np.asarray(local_block_ids), block_size_ratio)
            if len(local_block_ids) > len(remote_block_ids):
                local_block_ids = local_block_ids[: len(remote_block_ids)]
        num_local_blocks = len(local_block_ids)
        num_remote_blocks = len(remote_block_ids)
        if num_local_blocks < num_remote_blocks:
            remote_block_ids = remote_block_ids[-num_local_blocks:]
        remote_ids = get_block_descs_ids(remote_regions, remote_blocks, remote_block_ids)
        local_ids = get_block_descs_ids(local_regions, local_blocks, local_block_ids,
                                        block_size_ratio=block_size_ratio)
        return time.perf_counter_ns() - t0, (local_ids, remote_ids)
    run.self_timed = True
    return run


KINDS = {"nixl-prepped": nixl_prepped, "nixl-slice": nixl_slice, "nixl-generic": nixl_generic, "nixl-aux": nixl_aux,
         "mori-kv": mori_kv, "vllm-read": vllm_read}


def count(result):
    """Descriptors (or index pairs) one request hands the backend."""
    if isinstance(result, list) and result and isinstance(result[0], tuple) and hasattr(result[0][0], "size"):
        return int(sum(si.size for si, _ in result))
    if isinstance(result, tuple) and hasattr(result[0], "size"):
        return int(result[0].shape[0]) if result[0].ndim == 2 else int(result[0].size)
    if isinstance(result, tuple):
        return len(result[0])
    return 0


def main():
    cases = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "load":
            c = msg["case"]
            run = KINDS[c["kind"]](c)
            src = np.array(c["src"], dtype=np.int32)
            dst = np.array(c["dst"], dtype=np.int32)
            cases[msg["id"]] = (run, src, dst)
            r = run(src, dst)
            if getattr(run, "self_timed", False):
                r = r[1]
            ans = {"descriptors": count(r)}
        else:
            run, src, dst = cases[msg["id"]]
            ns = []
            self_timed = getattr(run, "self_timed", False)
            for _ in range(msg["reps"]):
                if self_timed:
                    ns.append(run(src, dst)[0])
                    continue
                t0 = time.perf_counter_ns()
                run(src, dst)
                ns.append(time.perf_counter_ns() - t0)
            ans = {"ns": ns}
        sys.stdout.write(json.dumps(ans) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
