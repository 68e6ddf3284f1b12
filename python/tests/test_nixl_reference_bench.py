"""What scripts/nixl_reference_bench.py computes without NIXL: the page
allocation, SGLang's contiguous-run merging, both connectors' descriptor
lists and indices, and the comparison table of scripts/nixl_compare.sh.

The descriptors are checked against the byte ranges a request must move,
worked out here page by page, so a wrong merge, offset or order fails."""

from __future__ import annotations

import importlib.util
import io
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("nixl_reference_bench", os.path.join(REPO, "scripts", "nixl_reference_bench.py"))
rb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rb  # dataclasses look their module up
_spec.loader.exec_module(rb)


def byte_ranges(descs):
    """(addr, len) pairs of an N x 3 descriptor array, split into pages of
    4 bytes so that merged and unmerged lists compare equal."""
    out = []
    for addr, length, _ in descs.tolist():
        out.extend((addr + o, 4) for o in range(0, length, 4))
    return out


def test_shape_matches_the_demo_request_sizes():
    s = rb.Shape()  # the demo's --layers 32 --kv-heads 8 --head-dim 128 --page-size 16, bf16
    assert s.page_bytes == 32 * 1024
    assert s.regions == 64
    assert s.request_bytes(64) == 8 * 2**20
    assert s.request_bytes(1024) == 128 * 2**20
    assert s.pages_for(17) == 2
    assert rb.pool_pages(64) == 128 and rb.pool_pages(4) == 64


def test_alloc_pages_are_distinct_and_in_the_pool():
    rng = np.random.default_rng(3)
    p = rb.alloc_pages(rng, 128, 64)
    assert len(set(p.tolist())) == 64 and p.min() >= 0 and p.max() < 128
    assert sorted(rb.alloc_pages(rng, 8, 8).tolist()) == list(range(8))
    with pytest.raises(ValueError):
        rb.alloc_pages(rng, 4, 5)


def test_contiguous_runs_split_where_either_side_jumps():
    assert rb.contiguous_runs([], []) == []
    assert rb.contiguous_runs([3, 4, 5], [7, 8, 9]) == [(3, 7, 3)]
    # the source advances by one but the destination does not: two runs
    assert rb.contiguous_runs([3, 4, 5], [7, 8, 1]) == [(3, 7, 2), (5, 1, 1)]
    assert rb.contiguous_runs([5, 4], [1, 2]) == [(5, 1, 1), (4, 2, 1)]
    with pytest.raises(ValueError):
        rb.contiguous_runs([1], [1, 2])


@pytest.mark.parametrize("seed", range(5))
def test_merged_descs_move_exactly_the_pages(seed):
    rng = np.random.default_rng(seed)
    pb = 16
    src_ptrs, dst_ptrs = [1000, 5000, 9000], [20000, 30000, 40000]
    sp, dp = rb.alloc_pages(rng, 12, 9), rb.alloc_pages(rng, 12, 9)
    if seed == 0:  # make sure runs do get merged in one case
        sp, dp = np.array([2, 3, 4, 9, 0]), np.array([5, 6, 7, 1, 2])
    src, dst = rb.merged_descs(src_ptrs, dst_ptrs, pb, sp, dp, dev=0)
    want_src = [(p + pg * pb + o, 4) for p in src_ptrs for pg in sp.tolist() for o in range(0, pb, 4)]
    want_dst = [(p + pg * pb + o, 4) for p in dst_ptrs for pg in dp.tolist() for o in range(0, pb, 4)]
    assert byte_ranges(src) == want_src
    assert byte_ranges(dst) == want_dst
    assert len(src) == len(rb.contiguous_runs(sp, dp)) * len(src_ptrs)
    if seed == 0:
        assert len(src) == 3 * 3
    assert (src[:, 1] == dst[:, 1]).all()


def test_prepped_list_and_indices_address_the_same_pages():
    pb, pool = 8, 6
    ptrs = [100, 1000, 2000, 3000]
    dl = rb.prepped_dlist(ptrs, pb, pool, dev=0)
    assert dl.shape == (len(ptrs) * pool, 3)
    pages = [4, 0, 5]
    idx = rb.region_indices(pages, len(ptrs), pool)
    assert idx.dtype == np.int32
    got = [tuple(dl[i].tolist()) for i in idx]
    assert got == [(p + pg * pb, pb, 0) for p in ptrs for pg in pages]


def test_summarize_counts_bytes_over_summed_time():
    s = rb.summarize(1_000_000, [0.001, 0.003, 0.002], [0.0005, 0.001, 0.0015])
    assert s["requests"] == 3
    assert s["path_gb_per_s"] == pytest.approx(3e6 / 0.006 / 1e9)
    assert s["xfer_gb_per_s"] == pytest.approx(3e6 / 0.003 / 1e9)
    assert s["path_p50_us"] == pytest.approx(2000)
    with pytest.raises(ValueError):
        rb.summarize(1, [], [])


def row(rnd, variant, rate, memcpy=None, error=False, style="sglang", procs=1):
    run = {"error": True} if error else (
        {"path_gb_per_s": rate, "xfer_gb_per_s": -1} if variant.startswith("reference") else {"xfer_gb_per_s": rate, "memcpy_gb_per_s": memcpy}
    )
    return {"round": rnd, "style": style, "tokens": 1024, "procs": procs, "variant": variant, "run": run}


def test_compare_table_pairs_ratios_within_rounds():
    rows = [
        row(1, "kvhost", 6.0, 20.0), row(1, "reference", 2.0),
        row(2, "kvhost", 3.0, 10.0), row(2, "reference", 3.0),
        row(3, "kvhost", 8.0, 16.0), row(3, "reference", 2.0),
        row(3, "before", 0, error=True),
    ]
    lines = {l["variant"]: l for l in rb.compare_table(rows)}
    k = lines["kvhost"]
    assert k["gb_per_s"] == 6.0 and k["runs"] == 3
    # per-round ratios 3, 1 and 4: their median, 3
    assert k["vs_reference"] == pytest.approx(3.0)
    assert k["vs_memcpy"] == pytest.approx(0.3)  # 0.3, 0.3, 0.5
    r = lines["reference"]
    assert r["gb_per_s"] == 2.0
    assert r["vs_memcpy"] == pytest.approx(2.0 / 16.0)  # 0.1, 0.3, 0.125
    assert lines["before"]["errors"] == 1 and lines["before"]["gb_per_s"] is None
    out = io.StringIO()
    rb.print_table(rb.compare_table(rows), out)
    assert "| sglang | 1024 | 1 | kvhost | 6.00 | 3 | 0.30x | 3.00x |" in out.getvalue()
    assert "| before | failed | 0 (1 failed) |" in out.getvalue()


def test_compare_table_pairs_pulls_with_sglangs_reference():
    rows = [
        row(1, "reference", 2.0), row(1, "kvhost", 5.0, 20.0, style="vllm"), row(1, "reference", 4.0, style="vllm"),
        row(2, "reference", 1.0), row(2, "kvhost", 4.0, 20.0, style="vllm"), row(2, "reference", 2.0, style="vllm"),
        row(3, "reference", 5.0), row(3, "kvhost", 5.0, 20.0, style="vllm"),
        # another process layout: never paired with procs 1
        row(1, "reference", 100.0, procs=2),
    ]
    lines = {(l["style"], l["procs"], l["variant"]): l for l in rb.compare_table(rows)}
    k = lines[("vllm", 1, "kvhost")]
    # the same round's SGLang reference: 2.5, 4 and 1; vLLM's own: 1.25, 2
    assert k["vs_sglang_reference"] == pytest.approx(2.5)
    assert k["vs_reference"] == pytest.approx(1.625)
    assert lines[("vllm", 1, "reference")]["vs_sglang_reference"] == pytest.approx(2.0)  # 2, 2
    # sglang's own lines get no such column
    assert "vs_sglang_reference" not in lines[("sglang", 1, "reference")]
