"""Reference re-expression of SGLang's NIXL and MORI KV transfer math.

Test helper for planner/planjson/sglang_ref_test.go: reads a JSON list of
cases on stdin and prints, for each, the (src_addr, dst_addr, len)
descriptors SGLang's connectors (python/sglang/srt/disaggregation/nixl/conn.py,
.../mori/conn.py, and the common layer's pointer slicing,
CommonKVManager.get_mha_kv_ptrs_with_pp in .../common/conn.py) would hand
their backend, or the error they would raise. The formulas follow SGLang's
code line by line with numpy, so the Go planner is checked against SGLang's
own arithmetic rather than against a second Go implementation.

Run with /usr/bin/python3 (numpy from python3-numpy).
"""

import json
import sys

import numpy as np


class RefError(Exception):
    pass


def group_concurrent_contiguous(src, dst):
    if src.size == 0 or dst.size == 0:
        return [], []
    if src.size != dst.size:
        raise RefError("group_concurrent_contiguous requires equal-length src/dst index arrays")
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return [g.tolist() for g in np.split(src, brk)], [g.tolist() for g in np.split(dst, brk)]


def get_mha_kv_ptrs_with_pp(src_kv_ptrs, dst_kv_ptrs, start_layer):
    num_kv_layers = len(src_kv_ptrs) // 2
    end_layer = start_layer + num_kv_layers
    dst_num_total_layers = len(dst_kv_ptrs) // 2
    src_k_ptrs = src_kv_ptrs[:num_kv_layers]
    src_v_ptrs = src_kv_ptrs[num_kv_layers:]
    if num_kv_layers == dst_num_total_layers:
        dst_k_ptrs = dst_kv_ptrs[:dst_num_total_layers]
        dst_v_ptrs = dst_kv_ptrs[dst_num_total_layers:]
    elif num_kv_layers < dst_num_total_layers and dst_num_total_layers % num_kv_layers != 0:
        multiplier_ratio = dst_num_total_layers // num_kv_layers
        dst_k_ptrs = dst_kv_ptrs[start_layer:end_layer]
        v_ptr_offset = num_kv_layers * multiplier_ratio
        dst_v_ptrs = dst_kv_ptrs[v_ptr_offset + start_layer : v_ptr_offset + end_layer]
    else:
        dst_k_ptrs = dst_kv_ptrs[start_layer:end_layer]
        dst_v_ptrs = dst_kv_ptrs[dst_num_total_layers + start_layer : dst_num_total_layers + end_layer]
    layers = len(src_k_ptrs)
    if len(dst_k_ptrs) < layers or len(dst_v_ptrs) < layers:
        raise RefError("IndexError: decode pointer list shorter than the prefill stage")
    return src_k_ptrs, src_v_ptrs, dst_k_ptrs, dst_v_ptrs, layers


def get_mla_kv_ptrs_with_pp(src_kv_ptrs, dst_kv_ptrs, start_layer):
    if len(src_kv_ptrs) == len(dst_kv_ptrs):
        return src_kv_ptrs, dst_kv_ptrs, len(src_kv_ptrs)
    end_layer = start_layer + len(src_kv_ptrs)
    sliced = dst_kv_ptrs[start_layer:end_layer]
    if len(sliced) < len(src_kv_ptrs):
        raise RefError("IndexError: decode pointer list shorter than the prefill stage")
    return src_kv_ptrs, sliced, len(src_kv_ptrs)


def homogeneous(kinds, context):
    if len(set(kinds)) != 1:
        raise RefError(f"NotImplementedError: NIXL {context} mixed KV memory kinds")
    return kinds[0]


def mem_segments(src_kinds, dst_kinds):
    if len(src_kinds) != len(dst_kinds):
        raise RefError("KV source/destination memory kind length mismatch")
    segs = []
    start = 0
    cur = (src_kinds[0], dst_kinds[0])
    for i, pair in enumerate(zip(src_kinds, dst_kinds)):
        if pair == cur:
            continue
        segs.append((start, i))
        start = i
        cur = pair
    segs.append((start, len(src_kinds)))
    return segs


def prep_equal_tp_dlist(kv_ptrs, kv_item_lens, kv_data_lens, num_slots=None, kv_xfer_lens=None):
    if kv_xfer_lens is None:
        kv_xfer_lens = kv_item_lens
    arrays = []
    for base_ptr, item_len, data_len, xfer_len in zip(
        np.array(kv_ptrs, dtype=np.uint64), kv_item_lens, kv_data_lens, kv_xfer_lens
    ):
        if xfer_len > item_len:
            raise RefError("ValueError: NIXL prepared dlist transfer length exceeds item stride")
        n = num_slots if num_slots is not None else (data_len // item_len)
        addrs = np.arange(n, dtype=np.uint64) * np.uint64(item_len) + base_ptr
        arrays.append(np.column_stack([addrs, np.full(n, xfer_len, dtype=np.uint64)]))
    return np.vstack(arrays)


def repeat_indices_over_layers(indices, num_layers, layer_length):
    offsets = np.arange(num_layers, dtype=np.int32) * layer_length
    return (offsets[:, None] + indices[None, :]).ravel().astype(np.int32)


def expand_page_indices_for_slice(page_indices, num_ptr_pairs, num_slots, page_size, num_groups=1, head_group_idx=0):
    token_offsets = np.arange(page_size, dtype=np.int32)
    pair_stride = num_slots * page_size * num_groups
    within_pair = (
        page_indices[:, None] * (page_size * num_groups) + token_offsets[None, :] * num_groups + head_group_idx
    ).ravel()
    pair_offsets = np.arange(num_ptr_pairs, dtype=np.int64) * pair_stride
    return (pair_offsets[:, None] + within_pair[None, :]).ravel().astype(np.int32)


PREPPED = []  # per case: the dlists and index arrays of every prepped part


def make_prepped_xfer(src_list, src_idx, dst_list, dst_idx):
    """NIXL makeXferReq: pairs entries by index; lengths must match."""
    PREPPED.append({
        "src_list": src_list.tolist(), "dst_list": dst_list.tolist(),
        "src_idx": src_idx.tolist(), "dst_idx": dst_idx.tolist(),
    })
    if len(src_idx) != len(dst_idx):
        raise RefError("NIXL_ERR_INVALID_PARAM: index count mismatch")
    out = []
    for si, di in zip(src_idx.tolist(), dst_idx.tolist()):
        if si < 0 or si >= len(src_list) or di < 0 or di >= len(dst_list):
            raise RefError("NIXL_ERR_INVALID_PARAM: index outside dlist")
        s, d = src_list[si], dst_list[di]
        if int(s[1]) != int(d[1]):
            raise RefError("NIXL_ERR_MISMATCH: descriptor lengths differ")
        out.append([int(s[0]), int(d[0]), int(s[1])])
    return out


def nixl(c):
    p, d = c["prefill"], c["decode"]
    mla = c["attention"] == "mla"
    src_ptrs, src_items, src_pages = p["kv_ptrs"], p["kv_item_lens"], p["num_pages"]
    dst_ptrs, dst_items, dst_pages = d["kv_ptrs"], d["kv_item_lens"], d["num_pages"]
    src_kinds = p.get("mem_kinds") or ["VRAM"] * len(src_ptrs)
    dst_kinds = d.get("mem_kinds") or ["VRAM"] * len(dst_ptrs)
    src_data_lens = [i * src_pages for i in src_items]
    num_slots_src = src_data_lens[0] // src_items[0]
    start_layer = p.get("start_layer", 0)
    homogeneous(src_kinds, "source")
    n_src, n_dst = len(src_items), len(dst_items)
    if n_dst < n_src:
        raise RefError("ValueError: decode registered fewer KV regions")
    spec = n_dst > n_src

    # transfer_worker chunk rules
    src_idx = np.array(c["prefill_pages"], dtype=np.int32)
    dst_idx = np.array(c["decode_pages"], dtype=np.int32)
    if len(dst_idx) < len(src_idx):
        src_idx = src_idx[: len(dst_idx)]
    if len(src_idx) == 0:
        return {"parts": []}

    if not c.get("prepped", True):
        # _send_kvcache_generic, non-prepped branch
        item_lens = src_items
        sb, db = group_concurrent_contiguous(src_idx, dst_idx)
        if mla:
            s_ptrs, d_ptrs, layers = get_mla_kv_ptrs_with_pp(src_ptrs, dst_ptrs, start_layer)
            params = [(s_ptrs[i], d_ptrs[i], item_lens[i]) for i in range(layers)]
        else:
            sk, sv, dk, dv, layers = get_mha_kv_ptrs_with_pp(src_ptrs, dst_ptrs, start_layer)
            params = [(sk[i], dk[i], item_lens[i]) for i in range(layers)] + [
                (sv[i], dv[i], item_lens[i]) for i in range(layers)
            ]
        out = []
        for sp, dp, il in params:
            for s, t in zip(sb, db):
                out.append([sp + s[0] * il, dp + t[0] * il, il * len(s)])
        return {"parts": [out]}

    if mla or p["tp_size"] == d["tp_size"]:
        try:
            dst_kind = homogeneous(dst_kinds, "destination")
        except RefError:
            if spec:
                raise RefError("NotImplementedError: HiSparse with decode-only speculative decoding")
            parts = []
            for start, end in mem_segments(src_kinds, dst_kinds):
                src_list = prep_equal_tp_dlist(src_ptrs[start:end], src_items[start:end], src_data_lens[start:end])
                dst_num_slots = dst_pages
                ditems = dst_items[start:end]
                dst_list = prep_equal_tp_dlist(
                    dst_ptrs[start:end], ditems, [i * dst_num_slots for i in ditems],
                    num_slots=dst_pages, kv_xfer_lens=src_items[start:end],
                )
                layers = end - start
                parts.append(make_prepped_xfer(
                    src_list, repeat_indices_over_layers(src_idx, layers, num_slots_src),
                    dst_list, repeat_indices_over_layers(dst_idx, layers, dst_num_slots),
                ))
            return {"parts": parts}
        if spec and dst_kind != "VRAM":
            raise RefError("NotImplementedError: HiSparse with decode-only speculative decoding")
        src_list = prep_equal_tp_dlist(src_ptrs, src_items, src_data_lens)
        ditems = dst_items[:n_src]
        dst_list = prep_equal_tp_dlist(
            dst_ptrs[:n_src], ditems, [i * dst_pages for i in ditems], num_slots=dst_pages, kv_xfer_lens=src_items
        )
        num_layers = len(src_items)
        return {"parts": [make_prepped_xfer(
            src_list, repeat_indices_over_layers(src_idx, num_layers, num_slots_src),
            dst_list, repeat_indices_over_layers(dst_idx, num_layers, dst_pages),
        )]}

    # heterogeneous TP: _init_hetero_tp_prep_handle + send_kvcache_slice
    dst_kind = homogeneous(dst_kinds, "destination")
    if dst_kind != "VRAM":
        raise RefError("NotImplementedError: heterogeneous-TP direct-to-host")
    decode_tp_size = d["tp_size"]
    dst_kv_item_len = dst_items[0]
    prefill_tp_size = p["tp_size"]
    page_size = c["page_size"]
    total_kv_heads = c.get("total_kv_heads", 0)
    if total_kv_heads <= 0:
        total_kv_heads = p["kv_head_num"] * prefill_tp_size
    src_heads_per_rank = max(1, total_kv_heads // prefill_tp_size)
    dst_heads_per_rank = max(1, total_kv_heads // decode_tp_size)
    bytes_per_head_slice = dst_kv_item_len // page_size // dst_heads_per_rank
    if prefill_tp_size > decode_tp_size:
        src_replication = max(1, prefill_tp_size // total_kv_heads)
        local_tp_rank_in_group = p["tp_rank"] % prefill_tp_size
        num_groups = 1
        num_heads_to_send = src_heads_per_rank
        head_group_idx = 0
        unique_head_idx = local_tp_rank_in_group // src_replication
        dst_head_start = (unique_head_idx * src_heads_per_rank) % dst_heads_per_rank
        dst_head_offset = dst_head_start * bytes_per_head_slice
    else:
        dst_tp_rank_in_group = d["tp_rank"] % decode_tp_size
        num_groups = decode_tp_size // prefill_tp_size
        num_heads_to_send = dst_heads_per_rank
        src_head_start = (dst_tp_rank_in_group * dst_heads_per_rank) % src_heads_per_rank
        head_group_idx = src_head_start // dst_heads_per_rank
        dst_head_offset = 0
    src_kv_item_len = src_items[0]
    bytes_per_token_to_send = num_heads_to_send * bytes_per_head_slice
    bytes_per_token_src = src_kv_item_len // page_size
    bytes_per_token_dst = dst_kv_item_len // page_size
    sk, sv, dk, dv, layers = get_mha_kv_ptrs_with_pp(src_ptrs, dst_ptrs, start_layer)
    s_ptrs = list(sk[:layers]) + list(sv[:layers])
    d_ptrs = list(dk[:layers]) + list(dv[:layers])
    num_ptr_pairs = len(s_ptrs)
    num_slots = src_data_lens[0] // src_kv_item_len
    slots = np.arange(num_slots, dtype=np.uint64)
    tokens = np.arange(page_size, dtype=np.uint64)
    groups = np.arange(num_groups, dtype=np.uint64)
    addrs = (
        np.array(s_ptrs, dtype=np.uint64)[:, None, None, None]
        + slots[None, :, None, None] * np.uint64(src_kv_item_len)
        + tokens[None, None, :, None] * np.uint64(bytes_per_token_src)
        + groups[None, None, None, :] * np.uint64(bytes_per_token_to_send)
    ).ravel()
    src_list = np.column_stack([addrs, np.full(len(addrs), bytes_per_token_to_send, dtype=np.uint64)])
    dst_slots = np.arange(dst_pages, dtype=np.uint64)
    addrs = (
        np.array(d_ptrs, dtype=np.uint64)[:, None, None]
        + dst_slots[None, :, None] * np.uint64(dst_kv_item_len)
        + tokens[None, None, :] * np.uint64(bytes_per_token_dst)
        + np.uint64(dst_head_offset)
    ).ravel()
    dst_list = np.column_stack([addrs, np.full(len(addrs), bytes_per_token_to_send, dtype=np.uint64)])
    si = expand_page_indices_for_slice(src_idx, num_ptr_pairs, num_slots, page_size, num_groups, head_group_idx)
    di = expand_page_indices_for_slice(dst_idx, num_ptr_pairs, dst_pages, page_size)
    return {"parts": [make_prepped_xfer(src_list, si, dst_list, di)]}


def mori(c):
    p, d = c["prefill"], c["decode"]
    mla = c["attention"] == "mla"
    src_ptrs, src_items = p["kv_ptrs"], p["kv_item_lens"]
    dst_ptrs = d["kv_ptrs"]
    start_layer = p.get("start_layer", 0)
    prefill_kv_indices = np.array(c["prefill_pages"], dtype=np.int32)
    dst_kv_indices = np.array(c["decode_pages"], dtype=np.int32)
    out = []

    def submit(sp, dp, local_offsets, remote_offsets, sizes):
        for lo, ro, sz in zip(local_offsets, remote_offsets, sizes):
            out.append([sp + lo, dp + ro, sz])

    def grouped():
        sg, dg = group_concurrent_contiguous(prefill_kv_indices, dst_kv_indices)
        return [g[0] for g in sg], [g[0] for g in dg], [len(g) for g in sg]

    if mla:
        src_s, dst_s, counts = grouped()
        num_local_layers = len(src_ptrs)
        end_layer = start_layer + num_local_layers
        if end_layer > len(dst_ptrs):
            raise RefError("ValueError: Destination MLA KV descriptors do not match prefill pp configuration")
        dst_slice = dst_ptrs[start_layer:end_layer]
        for layer_id in range(num_local_layers):
            il = src_items[layer_id]
            submit(src_ptrs[layer_id], dst_slice[layer_id], [s * il for s in src_s], [s * il for s in dst_s],
                   [n * il for n in counts])
        return {"parts": [out]}

    num_local_layers = len(src_ptrs) // 2
    src_k, src_v = src_ptrs[:num_local_layers], src_ptrs[num_local_layers:]
    end_layer = start_layer + num_local_layers
    dst_total_layers = len(dst_ptrs) // 2
    if len(dst_ptrs) < 2 or end_layer > dst_total_layers:
        raise RefError("ValueError: Destination KV descriptors do not match prefill pp configuration")
    dst_k = dst_ptrs[start_layer:end_layer]
    dst_v = dst_ptrs[dst_total_layers + start_layer : dst_total_layers + end_layer]

    if d["tp_size"] != p["tp_size"]:
        page_size = c["page_size"]
        src_item_len = src_items[0]
        dst_item_len = d["kv_item_lens"][0]
        bytes_per_token_src = src_item_len // page_size
        bytes_per_token_dst = dst_item_len // page_size
        prefill_tp_size, decode_tp_size = p["tp_size"], d["tp_size"]
        total_kv_heads = c.get("total_kv_heads", 0)
        if total_kv_heads <= 0:
            total_kv_heads = p["kv_head_num"] * prefill_tp_size
        src_heads_per_rank = max(1, total_kv_heads // prefill_tp_size)
        dst_heads_per_rank = max(1, total_kv_heads // decode_tp_size)
        bytes_per_head_slice = bytes_per_token_dst // dst_heads_per_rank
        if bytes_per_head_slice == 0:
            raise RefError("ValueError: Head slice size evaluates to zero")
        src_replication = max(1, prefill_tp_size // total_kv_heads)
        local_tp_rank = p["tp_rank"] % prefill_tp_size
        dst_tp_rank = d["tp_rank"] % decode_tp_size
        if prefill_tp_size > decode_tp_size:
            src_head_start = 0
            num_heads_to_send = src_heads_per_rank
            unique_head_idx = local_tp_rank // src_replication
            dst_head_start = (unique_head_idx * src_heads_per_rank) % dst_heads_per_rank
        else:
            src_head_start = (dst_tp_rank * dst_heads_per_rank) % src_heads_per_rank
            num_heads_to_send = dst_heads_per_rank
            dst_head_start = 0
        src_off = src_head_start * bytes_per_head_slice
        dst_off = dst_head_start * bytes_per_head_slice
        heads_bytes = num_heads_to_send * bytes_per_head_slice
        if heads_bytes > bytes_per_token_dst:
            raise RefError("ValueError: Slice size exceeds destination token capacity")
        if prefill_kv_indices.size == 0 or dst_kv_indices.size == 0:
            return {"parts": [out]}
        limit = min(prefill_kv_indices.size, dst_kv_indices.size)
        src_pages = prefill_kv_indices[:limit].astype(np.int64)
        dst_pages = dst_kv_indices[:limit].astype(np.int64)
        token_slots = np.arange(page_size, dtype=np.int64)
        lo = (src_pages * src_item_len)[:, None] + token_slots * bytes_per_token_src + src_off
        ro = (dst_pages * dst_item_len)[:, None] + token_slots * bytes_per_token_dst + dst_off
        lo, ro = lo.flatten().tolist(), ro.flatten().tolist()
        sizes = [heads_bytes] * (limit * page_size)
        for layer_id in range(num_local_layers):
            submit(src_k[layer_id], dst_k[layer_id], lo, ro, sizes)
            submit(src_v[layer_id], dst_v[layer_id], lo, ro, sizes)
        return {"parts": [out]}

    src_s, dst_s, counts = grouped()
    il = src_items[0]
    lo, ro, sz = [s * il for s in src_s], [s * il for s in dst_s], [n * il for n in counts]
    for layer_id in range(num_local_layers):
        submit(src_k[layer_id], dst_k[layer_id], lo, ro, sz)
        submit(src_v[layer_id], dst_v[layer_id], lo, ro, sz)
    return {"parts": [out]}


def main():
    cases = json.load(sys.stdin)
    results = []
    for c in cases:
        PREPPED.clear()
        try:
            r = nixl(c) if c["style"] == "sglang-nixl" else mori(c)
            if c.get("want_prepped"):
                r["prepped"] = list(PREPPED)
        except RefError as e:
            r = {"error": str(e)}
        results.append(r)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
