#!/usr/bin/python3
"""Reference restatement for planner B's equivalence tests.

Re-states, in plain Python + numpy, the formulas of the SGLang reference
connectors that planner B reproduces in Go (aux buffers, hybrid state,
Mamba slicing, DSA tail remap, CP page filtering, layer-id pairing, rank
mapping, DSV4 state indices). It follows SGLang's disaggregation/{nixl,mori}/conn.py's semantics
exactly, including which list lookups fail (IndexError) and which length
mismatches truncate, so the Go test can compare errors as well as bytes.

Input (stdin): a JSON list of {"fn": name, "args": {...}}.
Output (stdout): a JSON list of {"ok": result} or {"err": message}, one per
case. Block lists are [src_addr, dst_addr, length] triples in the order the
reference builds them.
"""

import json
import sys
from collections import deque

import numpy as np

MAMBA = "mamba"
PAGED = ("swa", "dsa", "swa_ring", "c128_state")


# ---------------------------------------------------------------- common ---

def contiguous_groups(src, dst):
    """group_concurrent_contiguous."""
    s = np.asarray(src, dtype=np.int32)
    d = np.asarray(dst, dtype=np.int32)
    if s.size == 0 or d.size == 0:
        return [], []
    if s.size != d.size:
        raise ValueError("unequal index arrays")
    cuts = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    return ([g.tolist() for g in np.split(s, cuts)],
            [g.tolist() for g in np.split(d, cuts)])


def mha_pp(src, dst, start):
    """CommonKVManager.get_mha_kv_ptrs_with_pp."""
    n = len(src) // 2
    end = start + n
    total = len(dst) // 2
    sk, sv = src[:n], src[n:]
    if n == total:
        dk, dv = dst[:total], dst[total:]
    elif n < total and total % n != 0:
        off = n * (total // n)
        dk, dv = dst[start:end], dst[off + start:off + end]
    else:
        dk, dv = dst[start:end], dst[total + start:total + end]
    return sk, sv, dk, dv, len(sk)


def mla_pp(src, dst, pp, st):
    """CommonKVManager.get_mla_kv_ptrs_with_pp (with _mla_slice_ptrs_for_pp)."""
    if len(src) == len(dst):
        return src, dst, len(src)
    ratios = pp.get("ratios") or []
    start = pp.get("start", 0)
    if ratios:
        end = pp.get("end")
        if end is None:
            raise AssertionError("prefill_end_layer must be set")
        c4 = sum(1 for r in ratios if r == 4)
        c128 = sum(1 for r in ratios if r == 128)
        kv_len = 2 * c4 + c128
        c4s = sum(1 for r in ratios[:start] if r == 4)
        c4e = sum(1 for r in ratios[:end] if r == 4)
        c128s = sum(1 for r in ratios[:start] if r == 128)
        c128e = sum(1 for r in ratios[:end] if r == 128)
        if st == "c128_state":
            out = list(dst[c128s:c128e])
        elif st == "swa_ring":
            out = list(dst[min(start, len(dst)):min(end, len(dst))])
        elif st not in ("swa", "swa_ring", "c128_state") and len(dst) == kv_len:
            out = (list(dst[c4s:c4e]) + list(dst[c4 + c4s:c4 + c4e])
                   + list(dst[2 * c4 + c128s:2 * c4 + c128e]))
        else:
            swa = len(dst) - 2 * c4
            if swa < 0 or swa > len(ratios):
                raise ValueError("unexpected compressed-MLA dst length")
            out = (list(dst[min(start, swa):min(end, swa)])
                   + list(dst[swa + c4s:swa + c4e])
                   + list(dst[swa + c4 + c4s:swa + c4 + c4e]))
        return src, out, len(src)
    return src, dst[start:start + len(src)], len(src)


def entry_pairs(src_ids, dst_ids, n_src, n_dst, fallback=False):
    """build_transfer_entry_pairs."""
    if n_src == 0:
        return []
    if bool(src_ids) != bool(dst_ids):
        if not fallback:
            raise RuntimeError("layer metadata on one side only")
        src_ids, dst_ids = [], []
    if src_ids:
        if len(src_ids) != n_src or len(dst_ids) != n_dst:
            raise RuntimeError("layer metadata length")
        queues = {}
        for j, lid in enumerate(dst_ids):
            queues.setdefault(lid, deque()).append(j)
        out = []
        for i, lid in enumerate(src_ids):
            if not queues.get(lid):
                raise RuntimeError("missing layer %d" % lid)
            out.append((i, queues[lid].popleft()))
        return out
    if n_dst < n_src or (n_src != n_dst and not fallback):
        raise RuntimeError("PP-heterogeneous transfer requires layer ids")
    return [(i, i) for i in range(n_src)]


# ------------------------------------------------------------------- aux ---

def lists(d):
    """JSON null lists (Go nil slices) read as empty."""
    return {k: (v if v is not None else []) for k, v in d.items()}


def aux_nixl(a):
    a["src"], a["dst"] = lists(a["src"]), lists(a["dst"])
    sp, sl = a["src"]["ptrs"], a["src"]["item_lens"]
    out = []
    for i, dp in enumerate(a["dst"]["ptrs"]):
        n = sl[i]
        out.append((sp[i] + n * a["pi"], dp + n * a["di"], n))
    return {"path": "nixl-aux", "blocks": out}


def aux_mori(a):
    src, dst, pi, di = lists(a["src"]), lists(a["dst"]), a["pi"], a["di"]
    if di < 0:
        return {"path": "mori-aux-skip", "blocks": []}
    out = []
    if src["ptrs"] and len(src["ptrs"]) == len(dst["ptrs"]):
        for i in range(len(src["ptrs"])):
            n = src["item_lens"][i]
            out.append((src["ptrs"][i] + pi * n, dst["ptrs"][i] + di * n, n))
        return {"path": "mori-aux-rdma", "blocks": out}
    # TCP: prefill reads its slot, decode writes it at its own item length.
    dlens = dst.get("item_lens") or src["item_lens"]
    for i in range(len(src["ptrs"])):
        n = src["item_lens"][i]
        saddr = src["ptrs"][i] + n * pi
        daddr = dst["ptrs"][i] + dlens[i] * di
        out.append((saddr, daddr, n))
    return {"path": "mori-aux-tcp", "blocks": out}


# ----------------------------------------------------------------- mamba ---

def slice_blocks(src_dim, dst_dim, src_tp, dst_tp, dst_rank, local_rank, groups):
    """compute_mamba_state_slice_blocks."""
    sub = groups is not None and sum(groups) == src_dim * src_tp
    if src_tp > dst_tp:
        w = local_rank % (src_tp // dst_tp)
        if not sub:
            return [(0, w * src_dim, src_dim)]
        out, so, do = [], 0, 0
        for full in groups:
            s, d = full // src_tp, full // dst_tp
            out.append((so, do + w * s, s))
            so, do = so + s, do + d
        return out
    if not sub:
        return [((dst_rank * dst_dim) % src_dim, 0, dst_dim)]
    out, so, do = [], 0, 0
    for full in groups:
        s, d = full // src_tp, full // dst_tp
        out.append((so + (dst_rank * d) % s, do, d))
        so, do = so + s, do + d
    return out


def slice_byte_blocks(a):
    """compute_mamba_state_slice_byte_blocks."""
    sbpd = a["src_item"] // (a["src_dim"] * a["outer"])
    dbpd = a["dst_item"] // (a["dst_dim"] * a["outer"])
    logical = slice_blocks(a["src_dim"], a["dst_dim"], a["src_tp"], a["dst_tp"],
                           a["dst_rank"], a["local_rank"], a.get("groups"))
    out = []
    for row in range(a["outer"]):
        sr, dr = row * a["src_dim"] * sbpd, row * a["dst_dim"] * dbpd
        for s, d, n in logical:
            out.append((sr + s * sbpd, dr + d * dbpd, n * sbpd))
    return out


def comp(a, side, key, i):
    """Component i of a per-component list; missing reads as [] (None too:
    the Go side encodes empty lists as JSON null)."""
    lst = a[side].get(key) or []
    return (lst[i] or []) if i < len(lst) else []


def mamba_pairs(a, i, n_src, n_dst, over_dst):
    sids, dids = comp(a, "src", "layer_ids", i), comp(a, "dst", "layer_ids", i)
    if sids or dids:
        return entry_pairs(sids, dids, n_src, n_dst, a["topo"]["pp_size"] <= 1)
    n = n_dst if over_dst else n_src
    return [(k, k) for k in range(n)]


def nixl_mamba_whole(a, i, si, di):
    assert len(si) == 1, "Mamba should have single state index"
    assert len(di) == len(si), "state index count mismatch"
    sp, sl = comp(a, "src", "ptrs", i), comp(a, "src", "item_lens", i)
    dp = comp(a, "dst", "ptrs", i)
    out = []
    for s, d in mamba_pairs(a, i, len(sp), len(dp), True):
        n = sl[s]
        if n == 0 or sp[s] == 0 or dp[d] == 0:
            continue
        out.append((sp[s] + n * int(si[0]), dp[d] + n * int(di[0]), n))
    return "nixl-state-mamba", out


def mamba_slice_tensor(a, i, s, d, si, di):
    """One tensor of a TP-sliced Mamba copy (NIXL and MORI agree)."""
    t = a["topo"]
    sl, dl = comp(a, "src", "item_lens", i), comp(a, "dst", "item_lens", i)
    sd, dd = comp(a, "src", "dims", i), comp(a, "dst", "dims", i)
    sp, dp = comp(a, "src", "ptrs", i), comp(a, "dst", "ptrs", i)
    local = t["p_rank"] % t["p_tp"]
    dst_rank = t["d_rank"] % t["d_tp"]
    conv = comp(a, "src", "conv", i)
    outer = comp(a, "src", "outer", i)
    if conv or outer:
        # The newer per-sub-block slicing (mooncake's path).
        groups = conv[s] if conv and s < len(conv) else None
        oc = outer[s] if outer and s < len(outer) else 1
        blocks = slice_byte_blocks({
            "src_item": sl[s], "dst_item": dl[d], "src_dim": sd[s], "dst_dim": dd[d],
            "outer": oc, "src_tp": t["p_tp"], "dst_tp": t["d_tp"],
            "dst_rank": dst_rank, "local_rank": local, "groups": groups})
        return [(sp[s] + sl[s] * int(si[0]) + so, dp[d] + dl[d] * int(di[0]) + do, n)
                for so, do, n in blocks]
    # The NIXL/MORI connectors' own formula.
    src_item, dst_item = sl[s], dl[d]
    src_dim, dst_dim = sd[s], dd[d]
    sbpd = src_item // src_dim
    dbpd = dst_item // dst_dim
    if t["p_tp"] > t["d_tp"]:
        start, num = 0, src_dim
        dstart = (local % (t["p_tp"] // t["d_tp"])) * src_dim
    else:
        start, num, dstart = (dst_rank * dst_dim) % src_dim, dst_dim, 0
    return [(sp[s] + src_item * int(si[0]) + start * sbpd,
             dp[d] + dst_item * int(di[0]) + dstart * dbpd, num * sbpd)]


def nixl_mamba_slice(a, i, si, di):
    assert len(si) == 1, "Mamba should have single state index"
    if not comp(a, "src", "dims", i) or not comp(a, "dst", "dims", i):
        return nixl_mamba_whole(a, i, si, di)
    sp, sl = comp(a, "src", "ptrs", i), comp(a, "src", "item_lens", i)
    dp, dl = comp(a, "dst", "ptrs", i), comp(a, "dst", "item_lens", i)
    out = []
    for s, d in mamba_pairs(a, i, len(sp), len(dp), True):
        src_item, _ = sl[s], dl[d]
        if src_item == 0 or sp[s] == 0 or dp[d] == 0:
            continue
        out += mamba_slice_tensor(a, i, s, d, si, di)
    return "nixl-state-mamba-slice", out


def nixl_paged(a, i, si, di, mla_or_flat, st):
    sp, dp = comp(a, "src", "ptrs", i), comp(a, "dst", "ptrs", i)
    lens = comp(a, "src", "item_lens", i)
    pg, dg = contiguous_groups(si, di)
    sids, dids = comp(a, "src", "layer_ids", i), comp(a, "dst", "layer_ids", i)
    if sids or dids:
        pairs = entry_pairs(sids, dids, len(sp), len(dp), a["topo"]["pp_size"] <= 1)
        params = [(sp[s], dp[d], lens[s]) for s, d in pairs]
    elif mla_or_flat:
        s_, d_, n = mla_pp(sp, dp, a["topo"]["pp"], st)
        params = [(s_[l], d_[l], lens[l]) for l in range(n)]
    else:
        sk, sv, dk, dv, n = mha_pp(sp, dp, a["topo"]["pp"].get("start", 0))
        params = ([(sk[l], dk[l], lens[l]) for l in range(n)]
                  + [(sv[l], dv[l], lens[l]) for l in range(n)])
    out = []
    for s, d, n in params:
        for g, h in zip(pg, dg):
            out.append((s + g[0] * n, d + h[0] * n, n * len(g)))
    return "nixl-state-paged", out


def state_nixl(a):
    a["si"], a["di"] = a["si"] or [], a["di"] or []
    t = a["topo"]
    mism = t["p_tp"] != t["d_tp"]
    res = []
    for i, st in enumerate(a["types"]):
        si = a["si"][i] if i < len(a["si"]) else None
        if si is None or len(si) == 0:
            continue
        di = a["di"][i] if i < len(a["di"]) else []
        di = di or []
        if st == MAMBA:
            path, blocks = (nixl_mamba_slice if mism else nixl_mamba_whole)(a, i, si, di)
        elif st in PAGED:
            if not t["mla"] and mism:
                raise RuntimeError("different TP sizes for non-MLA " + st)
            if len(si) != len(di):
                raise RuntimeError("state index length mismatch")
            path, blocks = nixl_paged(a, i, si, di, t["mla"], st)
        elif st == "minimax_index_k":
            if t["pp_size"] > 1:
                raise RuntimeError("PP>1 not supported for MiniMax")
            if mism:
                raise RuntimeError("heterogeneous TP not supported for MiniMax")
            if len(si) != len(di):
                raise RuntimeError("state index length mismatch")
            path, blocks = nixl_paged(a, i, si, di, True, None)
        else:
            raise RuntimeError("unsupported state type " + st)
        res.append({"component": i, "path": path, "blocks": blocks})
    return res


def mori_mamba(a, i, si, di):
    if len(si) != 1 or len(di) != 1:
        raise RuntimeError("mamba requires single state index")
    t = a["topo"]
    sd, dd = comp(a, "src", "dims", i), comp(a, "dst", "dims", i)
    mism = t["p_tp"] != t["d_tp"] and bool(sd) and bool(dd)
    sp, sl = comp(a, "src", "ptrs", i), comp(a, "src", "item_lens", i)
    dp = comp(a, "dst", "ptrs", i)
    out = []
    for s, d in mamba_pairs(a, i, len(sp), len(dp), False):
        _ = dp[d]
        n = sl[s]
        if not mism:
            out.append((sp[s] + int(si[0]) * n, dp[d] + int(di[0]) * n, n))
        else:
            out += mamba_slice_tensor(a, i, s, d, si, di)
    return ("mori-state-mamba-slice" if mism else "mori-state-mamba"), out


def mori_paged(a, i, si, di, st):
    t = a["topo"]
    mism = t["p_tp"] != t["d_tp"]
    if st == "swa" and not t["mla"] and mism:
        raise RuntimeError("TP-mismatched non-MLA SWA")
    if st == "minimax_index_k":
        if t["pp_size"] > 1:
            raise RuntimeError("PP>1 MiniMax")
        if mism:
            raise RuntimeError("hetero TP MiniMax")
    common = min(len(si), len(di))
    if st == "c128_state" and common == 0 and len(si) == 0 and len(di) == 0:
        return "mori-state-paged", []
    if common == 0 and max(len(si), len(di)) > 0:
        raise RuntimeError("no overlapping state indices")
    if len(si) != len(di):
        if st in ("swa_ring", "c128_state"):
            raise RuntimeError("index length mismatch")
        si, di = si[:common], di[:common]
    pg, dg = contiguous_groups(si, di)
    sp, dp = comp(a, "src", "ptrs", i), comp(a, "dst", "ptrs", i)
    lens = comp(a, "src", "item_lens", i)
    sids, dids = comp(a, "src", "layer_ids", i), comp(a, "dst", "layer_ids", i)
    if sids or dids:
        pairs = entry_pairs(sids, dids, len(sp), len(dp), t["pp_size"] <= 1)
    else:
        pairs = [(k, k) for k in range(len(sp))]
    out = []
    for s, d in pairs:
        dptr = dp[d]
        n = lens[s]
        for g, h in zip(pg, dg):
            out.append((sp[s] + int(g[0]) * n, dptr + int(h[0]) * n, len(g) * n))
    return "mori-state-paged", out


def state_mori(a):
    a["si"], a["di"] = a["si"] or [], a["di"] or []
    if not a["src"].get("ptrs"):
        return []
    if not a["types"]:
        raise RuntimeError("state_types empty")
    if len(a["dst"].get("ptrs") or []) != len(a["src"]["ptrs"]):
        raise RuntimeError("component count mismatch")
    res = []
    for i, st in enumerate(a["types"]):
        si = a["si"][i] if i < len(a["si"]) else None
        di = a["di"][i] if i < len(a["di"]) else None
        if si is None or len(si) == 0 or di is None or len(di) == 0:
            continue
        _ = a["src"]["ptrs"][i]  # state_mem_descs[i]
        if st == MAMBA:
            path, blocks = mori_mamba(a, i, si, di)
        elif st in PAGED or st == "minimax_index_k":
            path, blocks = mori_paged(a, i, si, di, st)
        else:
            raise RuntimeError("unknown state_type " + st)
        res.append({"component": i, "path": path, "blocks": blocks})
    return res


# ------------------------------------------------------------------- DSA ---

def dsa_tail_indices(a):
    if not a["use_compress"]:
        return []
    pool = int(a["pool_size"])
    tail = pool + int(a["extra"])
    if pool <= 1 or tail < pool:
        raise ValueError("bad pool")
    n_valid = int(a["seq_len"]) % pool
    if n_valid == 0:
        return []
    start = (int(a["seq_len"]) - n_valid) % tail
    first = min(n_valid, tail - start)
    return [int(a["req"]), start, first, 0, n_valid - first, tail]


def dsa_tail_slice(a):
    src, dst = list(range(a["n_src"])), list(range(a["n_dst"]))
    start, end = a["start"], a.get("end")
    if len(src) == len(dst):
        return list(dst)
    if len(src) % 2 or len(dst) % 2:
        raise ValueError("halves")
    sl, dl = len(src) // 2, len(dst) // 2
    exp = start + sl
    if end is not None and end - start == sl:
        exp = end
    if start < 0 or exp > dl:
        raise ValueError("count mismatch")
    return list(dst[start:exp]) + list(dst[dl + start:dl + exp])


def dsa_tail_blocks(a):
    sp, sl, dp = a["src_ptrs"], a["src_item_lens"], a["dst_ptrs"]
    si, di = a["si"], a["di"]
    dl = a.get("dst_item_lens")
    if not si and not di:
        return []
    if not si or not di:
        raise ValueError("missing")
    if len(si) != 6 or len(di) != 6:
        raise ValueError("not 6-tuples")
    if dl is None:
        dl = sl
    if not (len(sp) == len(dp) == len(sl) == len(dl)):
        raise ValueError("metadata mismatch")
    st, dt = int(si[5]), int(di[5])
    if st <= 0 or dt <= 0:
        raise ValueError("ring sizes")

    def segs(idx, tail):
        out = []
        for k in (1, 2):
            off, n = int(idx[2 * k - 1]), int(idx[2 * k])
            if min(off, n) < 0:
                raise ValueError("negative")
            if off + n > tail:
                raise ValueError("exceeds ring")
            if n:
                out.append((off, n))
        return out

    ss, ds = segs(si, st), segs(di, dt)
    if sum(n for _, n in ss) != sum(n for _, n in ds):
        raise ValueError("count mismatch")
    sr, dr = int(si[0]), int(di[0])
    if sr < 0 or dr < 0:
        raise ValueError("rows")
    out = []
    for p, sb, q, db in zip(sp, sl, dp, dl):
        sb, db = int(sb), int(db)
        if sb == 0 and db == 0:
            continue
        if sb <= 0 or sb % st:
            raise ValueError("src row")
        if db <= 0 or db % dt:
            raise ValueError("dst row")
        slot = sb // st
        if db // dt != slot:
            raise ValueError("slot size")
        sbase, dbase = p + sb * sr, q + db * dr
        i = j = cs = cd = 0
        while i < len(ss):
            n = min(ss[i][1] - cs, ds[j][1] - cd)
            out.append((sbase + (ss[i][0] + cs) * slot, dbase + (ds[j][0] + cd) * slot, n * slot))
            cs += n
            cd += n
            if cs == ss[i][1]:
                i, cs = i + 1, 0
            if cd == ds[j][1]:
                j, cd = j + 1, 0
    return out


# -------------------------------------------------------- CP, layers, ranks ---

def cp_bounds(a):
    total, rank, size = a["total"], a["rank"], a["size"]
    base, rem = total // size, total % size
    start = rank * base + min(rank, rem)
    return [start, start + base + (1 if rank < rem else 0)]


def cp_filter(a):
    idx = np.asarray(a["indices"], dtype=np.int32)
    total = a.get("total")
    if total is None:
        total = len(idx)
    if a["size"] <= 1:
        return [idx.tolist(), a["start"], a["stop"]]
    rs, re_ = cp_bounds({"total": total, "rank": a["rank"], "size": a["size"]})
    cs, ce = a["start"], a["stop"]
    first, last = max(rs, cs) - cs, min(re_, ce) - cs
    if last <= first:
        return [[], cs, cs]
    return [idx[first:last].tolist(), cs + first, cs + last]


def kv_layer_ids(a):
    if not a["hybrid"]:
        return []
    ids = list(a["ids"] or [])
    draft = a.get("draft")
    if draft is None:
        return ids
    n = a["num_draft"]
    if draft["hybrid"]:
        dids = list(draft["ids"])
    else:
        if draft["layer_num"] <= 0 or n % draft["layer_num"] != 0:
            raise RuntimeError("whole groups")
        dids = list(range(draft["layer_num"])) * (n // draft["layer_num"])
    if len(dids) != n:
        raise RuntimeError("cover")
    band = {lid: k for k, lid in enumerate(dict.fromkeys(dids))}
    return ids + [a["hidden"] + band[lid] for lid in dids]


def rank_map(a):
    d, p, r = a["d_tp"], a["p_tp"], a["rank"] % a["d_tp"]
    if d == p:
        tr, trs, dst_num, resp = r, [r], 1, 1
    elif d > p:
        tr = r // (d // p)
        trs, dst_num, resp = [tr], d // p, 1
    else:
        trs = list(range(r * (p // d), (r + 1) * (p // d)))
        tr, dst_num = trs[0], 1
        resp = 1 if a["mla"] else p // d
    if a["p_cp"] == 1:
        cps = [0]
    else:
        cps = list(range(a["p_cp"]))
        if not (a["all_cp"] or a["split"]):
            cps = cps[:1]
        else:
            resp *= a["p_cp"]
    assert a["d_pp"] == a["p_pp"] or a["d_pp"] == 1
    if a["p_pp"] == a["d_pp"]:
        pps = [a["pp_rank"]]
    else:
        pps = list(range(a["p_pp"]))
        resp *= a["p_pp"] // a["d_pp"]
    targets = []
    for cp in cps:
        for tp in trs:
            for pp in reversed(pps):
                dummy = not (tp == tr) if a["mla"] else False
                targets.append([cp, tp, pp, dummy])
    return {"tr": tr, "trs": trs, "cps": cps, "pps": pps, "dst_num": dst_num,
            "resp": resp, "targets": targets}


def dsv4_c4(a):
    ring = a["ring"]
    if ring < 8 or ring % 4 != 0:
        raise ValueError("ring")
    seq = max(0, int(a["seq"]))
    n = seq % 4 + 4
    pos = np.arange(max(0, seq - n), seq, dtype=np.int64)
    rows = int(a["req"]) * int(ring) + pos % int(ring)
    return rows.astype(np.int32).tolist()


def dsv4_c128(a):
    seq = a["seq"]
    if seq == 0 or seq % 128 == 0:
        return []
    if a["online"]:
        return [int(a["req"])]
    assert a["ring"] % 128 == 0
    per = a["ring"] // 128
    return [int(a["req"]) * per + ((seq - 1) % a["ring"]) // 128]


FNS = {
    "aux_nixl": aux_nixl, "aux_mori": aux_mori,
    "state_nixl": state_nixl, "state_mori": state_mori,
    "mamba_byte_blocks": slice_byte_blocks,
    "mamba_blocks": lambda a: slice_blocks(a["src_dim"], a["dst_dim"], a["src_tp"], a["dst_tp"],
                                           a["dst_rank"], a["local_rank"], a.get("groups")),
    "dsa_tail_indices": dsa_tail_indices, "dsa_tail_slice": dsa_tail_slice,
    "dsa_tail_blocks": dsa_tail_blocks,
    "cp_bounds": cp_bounds, "cp_filter": cp_filter,
    "entry_pairs": lambda a: entry_pairs(a["src_ids"], a["dst_ids"], a["n_src"], a["n_dst"], a["fallback"]),
    "kv_layer_ids": kv_layer_ids, "rank_map": rank_map,
    "dsv4_c4": dsv4_c4, "dsv4_c128": dsv4_c128,
}


def main():
    out = []
    for case in json.load(sys.stdin):
        try:
            out.append({"ok": FNS[case["fn"]](case["args"])})
        except Exception as e:  # every reference failure is an expected error
            out.append({"err": "%s: %s" % (type(e).__name__, e)})
    json.dump(out, sys.stdout, default=lambda o: int(o))


if __name__ == "__main__":
    main()
