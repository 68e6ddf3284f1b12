#!/usr/bin/python3
"""The reference connectors' NIXL path, timed: the baseline kvhost's
transfers are compared with (plugins/nixl/README.md, "Against the
reference path").

A measurement tool, not part of kvhost: it needs NIXL's Python module
(``nixl._api``) and numpy, which CI does not have; what it computes
without NIXL (page allocation, run merging, descriptor lists and indices,
the summary) is tested in python/tests/test_nixl_reference_bench.py.

It moves one synthetic MHA request at a time between a prefill and a
decode agent, registered and addressed the way the engines' NIXL
connectors do it (written from the connectors' code in
/work/shared/reference, nothing copied):

``--style sglang`` (push; SGLang's NIXL connector, sglang_nixl_conn.py):
  the prefill agent writes. Agents are made with ``nixl_agent_config(
  backends=[], num_threads=N, sync_mode=STRICT)`` and the UCX backend is
  created explicitly with ``num_threads`` in its parameters: 8 on the
  prefill, none on the decode. Each of 2 x layers regions (K of every
  layer, then V) is registered on its own. ``--sglang-path merged`` (the
  default) builds a request's descriptors afresh: per region, one
  descriptor per run of pages contiguous on both sides
  (group_concurrent_contiguous), then ``get_xfer_descs`` and
  ``initialize_xfer("WRITE", ..., notif)``; ``prepped`` is its equal-TP
  path: one prepared list per side of every page of every region, built
  once, and ``make_prepped_xfer("WRITE", ...)`` with the page indices
  repeated over the regions. Then ``transfer`` and ``check_xfer_state``
  polled with ``time.sleep(0)`` until DONE.

``--style vllm`` (pull; vLLM's NIXL connector, nixl_connector.py): the
  decode agent reads. Agents are ``nixl_agent_config(num_threads=4,
  capture_telemetry=True)`` (every agent, prefill and decode: the
  connector's default ``num_threads``). Regions are K0, V0, K1, V1, ...;
  each side prepares its list of every block of every region once
  (descriptor id = region x blocks + block); per request
  ``make_prepped_xfer("READ", ..., notif)``, ``transfer``, then
  ``check_xfer_state`` polled until DONE.

Pages (blocks) are drawn at random from a pool of max(64, 2 x pages per
request) on each side, as ``kvhost demo`` allocates them. ``--procs 2``
puts the target agent in a child process; metadata go over a pipe.
The last request's destination pages are compared with the source.

For each request it times the path (descriptor building and the make
call through DONE) and the transfer alone (``transfer`` through DONE,
what NIXL's telemetry and kvhost demo's ``transfer_gb_per_s`` count);
``--json`` prints medians and GB/s of both.

  . /work/nixl-env.sh
  /usr/bin/python3 scripts/nixl_reference_bench.py --style sglang \\
      --tokens 1024 --requests 12 --procs 1 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class Shape:
    """One rank's MHA KV cache: layers x (K, V) regions of pool pages."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_size: int = 16

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one region (one layer's K or V)."""
        return self.page_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def regions(self) -> int:
        return 2 * self.layers

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def request_bytes(self, tokens: int) -> int:
        return self.pages_for(tokens) * self.page_bytes * self.regions


def pool_pages(pages_per_request: int, concurrency: int = 1) -> int:
    """Pages of each side's pool, as kvhost demo sizes it
    (pullworker.DefaultNumBlocks): max(64, 2 x concurrency x pages)."""
    return max(64, 2 * concurrency * pages_per_request)


def alloc_pages(rng: np.random.Generator, pool: int, n: int) -> np.ndarray:
    """n distinct pages of 0..pool-1 in random order (a scattered
    allocation, as an engine's allocator leaves it)."""
    if n > pool:
        raise ValueError(f"{n} pages needed, the pool has {pool}")
    return rng.choice(pool, size=n, replace=False).astype(np.int64)


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(src start, dst start, pages) of each run in which both page lists
    advance by exactly one: SGLang's group_concurrent_contiguous."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages, {len(dst)} destination pages")
    runs: List[Tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        s, d = int(s), int(d)
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def merged_descs(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    page_bytes: int,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    dev: int = 0,
) -> Tuple[np.ndarray, np.ndarray]:
    """SGLang's per-request (non-prepped) descriptors: for each region
    pair in order, one (addr, len, dev) per contiguous run. Returns the
    source and destination N x 3 uint64 arrays."""
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} source regions, {len(dst_ptrs)} destination regions")
    runs = contiguous_runs(src_pages, dst_pages)
    if not runs:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    rs = np.array([r[0] for r in runs], dtype=np.uint64)
    rd = np.array([r[1] for r in runs], dtype=np.uint64)
    lens = np.array([r[2] for r in runs], dtype=np.uint64) * np.uint64(page_bytes)
    pb = np.uint64(page_bytes)
    src = [np.column_stack((np.uint64(p) + rs * pb, lens, np.full_like(lens, dev))) for p in src_ptrs]
    dst = [np.column_stack((np.uint64(p) + rd * pb, lens, np.full_like(lens, dev))) for p in dst_ptrs]
    return np.vstack(src), np.vstack(dst)


def prepped_dlist(ptrs: Sequence[int], page_bytes: int, pages: int, dev: int = 0) -> np.ndarray:
    """Every page of every region, region by region: the list both
    connectors prepare once per side (descriptor id = region x pages +
    page)."""
    off = np.arange(pages, dtype=np.uint64) * np.uint64(page_bytes)
    return np.vstack(
        [
            np.column_stack((np.uint64(p) + off, np.full(pages, page_bytes, dtype=np.uint64), np.full(pages, dev, dtype=np.uint64)))
            for p in ptrs
        ]
    )


def region_indices(pages: Sequence[int], regions: int, pool: int) -> np.ndarray:
    """Descriptor ids of pages in every region of a prepped list:
    SGLang's repeat_indices_over_layers, vLLM's _get_block_descs_ids."""
    p = np.asarray(pages, dtype=np.int64)
    return ((np.arange(regions, dtype=np.int64) * pool)[:, None] + p[None, :]).ravel().astype(np.int32)


def summarize(bytes_per_request: int, path_s: Sequence[float], xfer_s: Sequence[float]) -> dict:
    """Medians (µs) and rates (GB/s: bytes over the summed seconds, as
    kvhost demo computes its transfer rate) of the timed requests."""
    if not path_s or len(path_s) != len(xfer_s):
        raise ValueError("no timed requests")
    n = len(path_s)
    return {
        "requests": n,
        "bytes_per_request": bytes_per_request,
        "path_p50_us": statistics.median(path_s) * 1e6,
        "xfer_p50_us": statistics.median(xfer_s) * 1e6,
        "path_gb_per_s": bytes_per_request * n / sum(path_s) / 1e9,
        "xfer_gb_per_s": bytes_per_request * n / sum(xfer_s) / 1e9,
    }


def run_rate(variant: str, run: dict) -> float:
    """The rate a nixl_compare.sh run stands for: kvhost demo's transfer
    rate (post to completion per transfer), the reference's path rate
    (descriptors built and the request made, posted and polled to DONE)."""
    return run["path_gb_per_s"] if variant.startswith("reference") else run["xfer_gb_per_s"]


def compare_table(rows: Sequence[dict]) -> List[dict]:
    """nixl_compare.sh's runs reduced to one line per (style, tokens,
    procs, variant): the median rate over rounds, the median memcpy rate
    of the kvhost runs, and the medians over rounds of the paired ratios
    (same round and row) against each reference variant and memcpy. Lines
    of a style other than sglang are also paired with SGLang's reference
    path of the same round, tokens and processes ("vs_sglang_reference"):
    issue 26's bar is the reference configured as SGLang configures it,
    for pulls too. A run that failed makes the line's "errors" count and
    is left out."""
    groups: dict = {}
    for r in rows:
        k = (r["style"], r["tokens"], r["procs"])
        groups.setdefault(k, {}).setdefault(r["round"], {})[r["variant"]] = r["run"]
    out = []
    for k in sorted(groups):
        rounds = groups[k]
        variants = sorted({v for rd in rounds.values() for v in rd})
        for v in variants:
            rates, errors = [], 0
            ratios: dict = {}
            for rnd, rd in rounds.items():
                run = rd.get(v)
                if run is None:
                    continue
                if run.get("error"):
                    errors += 1
                    continue
                rate = run_rate(v, run)
                rates.append(rate)
                for w, other in rd.items():
                    if w != v and w.startswith("reference") and not other.get("error"):
                        ratios.setdefault(w, []).append(rate / run_rate(w, other))
                sg = groups.get(("sglang", k[1], k[2]), {}).get(rnd, {}).get("reference")
                if k[0] != "sglang" and sg is not None and not sg.get("error"):
                    ratios.setdefault("sglang_reference", []).append(rate / run_rate("reference", sg))
                mem = [o["memcpy_gb_per_s"] for o in rd.values() if not o.get("error") and "memcpy_gb_per_s" in o]
                if mem:
                    ratios.setdefault("memcpy", []).append(rate / statistics.median(mem))
            line = {"style": k[0], "tokens": k[1], "procs": k[2], "variant": v, "runs": len(rates), "errors": errors,
                    "gb_per_s": statistics.median(rates) if rates else None,
                    "per_round": rates}
            line.update({"vs_" + w: statistics.median(x) for w, x in sorted(ratios.items())})
            out.append(line)
    return out


def print_table(lines: Sequence[dict], f=sys.stdout) -> None:
    cols = sorted({c for l in lines for c in l if c.startswith("vs_")})
    print("| style | tokens | procs | variant | GB/s (median) | runs | " + " | ".join(c.replace("_", " ") for c in cols) + " | per round |", file=f)
    print("|" + " --- |" * (6 + len(cols) + 1), file=f)
    for l in lines:
        gb = "failed" if l["gb_per_s"] is None else f"{l['gb_per_s']:.2f}"
        rs = " | ".join(f"{l[c]:.2f}x" if c in l else "" for c in cols)
        runs = f"{l['runs']}" + (f" ({l['errors']} failed)" if l["errors"] else "")
        print(f"| {l['style']} | {l['tokens']} | {l['procs']} | {l['variant']} | {gb} | {runs} | {rs} | "
              + " ".join(f"{x:.2f}" for x in l["per_round"]) + " |", file=f)


# --- everything below needs NIXL ---------------------------------------


class Side:
    """One agent with its registered pool: regions of pool pages each."""

    def __init__(self, name: str, style: str, initiator: bool, shape: Shape, pool: int, seed: int):
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.shape, self.pool = shape, pool
        if style == "sglang":
            threads = 8 if initiator else 0  # the prefill writes
            cfg = nixl_agent_config(backends=[], num_threads=threads, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self.agent = nixl_agent(name, cfg)
            params = {"num_threads": str(threads)} if threads > 0 else {}
            self.agent.create_backend("UCX", params)
        else:
            self.agent = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))
        rng = np.random.default_rng(seed)
        self.bufs = [rng.integers(0, 256, pool * shape.page_bytes, dtype=np.uint8) for _ in range(shape.regions)]
        # SGLang: K of every layer, then V; vLLM: K0, V0, K1, V1, ... The
        # buffers are alike, so only their order differs.
        if style == "vllm":
            L = shape.layers
            self.bufs = [self.bufs[(i % 2) * L + i // 2] for i in range(shape.regions)]
        self.ptrs = [b.ctypes.data for b in self.bufs]
        self.reg = self.agent.register_memory([(p, pool * shape.page_bytes, 0, "") for p in self.ptrs], "DRAM")

    def metadata(self) -> dict:
        return {"md": self.agent.get_agent_metadata(), "ptrs": self.ptrs}

    def pages(self, pages: Sequence[int]) -> bytes:
        """The bytes of pages in every region, region by region."""
        pb = self.shape.page_bytes
        return b"".join(b[p * pb : (p + 1) * pb].tobytes() for b in self.bufs for p in pages)


def target_main(conn, style: str, shape: Shape, pool: int, seed: int) -> None:
    """The passive side in its own process: registers, hands over its
    metadata, drains notifications, and on request returns pages' bytes."""
    side = Side("target", style, False, shape, pool, seed)
    conn.send(side.metadata())
    peer = conn.recv()
    side.agent.add_remote_agent(peer["md"])
    notifs = 0
    while True:
        if conn.poll(0.001):
            msg = conn.recv()
            if msg[0] == "pages":
                conn.send(side.pages(msg[1]))
            elif msg[0] == "stop":
                for v in side.agent.get_new_notifs().values():
                    notifs += len(v)
                conn.send(notifs)
                return
        for v in side.agent.get_new_notifs().values():
            notifs += len(v)


def run(style: str, path: str, tokens: int, requests: int, procs: int, shape: Shape, seed: int, warmup: int) -> dict:
    n = shape.pages_for(tokens)
    pool = pool_pages(n)
    rng = np.random.default_rng(seed)
    init = Side("initiator", style, True, shape, pool, seed + 1)
    child = None
    if procs == 1:
        target = Side("target", style, False, shape, pool, seed + 2)
        tmd = target.metadata()
    else:
        ctx = mp.get_context("spawn")
        parent, cconn = ctx.Pipe()
        child = ctx.Process(target=target_main, args=(cconn, style, shape, pool, seed + 2), daemon=True)
        child.start()
        tmd = parent.recv()
        parent.send(init.metadata())
    peer = init.agent.add_remote_agent(tmd["md"])
    if procs == 1:
        target.agent.add_remote_agent(init.agent.get_agent_metadata())
    op = "WRITE" if style == "sglang" else "READ"
    local_prep = remote_prep = None
    if style == "vllm" or path == "prepped":
        local_prep = init.agent.prep_xfer_dlist("NIXL_INIT_AGENT", prepped_dlist(init.ptrs, shape.page_bytes, pool), "DRAM")
        remote_prep = init.agent.prep_xfer_dlist(peer, prepped_dlist(tmd["ptrs"], shape.page_bytes, pool), "DRAM")
    path_s: List[float] = []
    xfer_s: List[float] = []
    notifs = 0
    last = None
    for i in range(warmup + requests):
        lp, rp = alloc_pages(rng, pool, n), alloc_pages(rng, pool, n)
        notif = f"req{i}".encode()
        t0 = time.perf_counter()
        if local_prep is None:
            src, dst = merged_descs(init.ptrs, tmd["ptrs"], shape.page_bytes, lp, rp)
            h = init.agent.initialize_xfer(
                op, init.agent.get_xfer_descs(src, "DRAM"), init.agent.get_xfer_descs(dst, "DRAM"), peer, notif
            )
        else:
            h = init.agent.make_prepped_xfer(
                op, local_prep, region_indices(lp, shape.regions, pool), remote_prep, region_indices(rp, shape.regions, pool), notif
            )
        t1 = time.perf_counter()
        state = init.agent.transfer(h)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError(f"request {i}: transfer failed")
            time.sleep(0)
            state = init.agent.check_xfer_state(h)
        t2 = time.perf_counter()
        init.agent.release_xfer_handle(h)
        if i >= warmup:
            path_s.append(t2 - t0)
            xfer_s.append(t2 - t1)
        if procs == 1:
            for v in target.agent.get_new_notifs().values():
                notifs += len(v)
        last = (lp, rp)
    # The last request's bytes must have arrived.
    lp, rp = last
    if procs == 1:
        tb = target.pages(rp)
    else:
        parent.send(("pages", rp))
        tb = parent.recv()
    ib = init.pages(lp)
    if tb != ib:
        raise RuntimeError("the last request's destination pages differ from its source")
    if procs == 1:
        deadline = time.monotonic() + 5
        while notifs < warmup + requests and time.monotonic() < deadline:
            for v in target.agent.get_new_notifs().values():
                notifs += len(v)
    else:
        parent.send(("stop",))
        notifs = parent.recv()
        child.join(10)
    out = summarize(shape.request_bytes(tokens), path_s, xfer_s)
    out.update(
        style=style, path=path if style == "sglang" else "prepped", tokens=tokens, procs=procs,
        descriptors_per_request=n * shape.regions if local_prep is not None else len(contiguous_runs(lp, rp)) * shape.regions,
        notifications=notifs,
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--style", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--sglang-path", choices=["merged", "prepped"], default="merged")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--procs", type=int, choices=[1, 2], default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", metavar="RUNS.jsonl", help="print the medians and ratios of scripts/nixl_compare.sh's runs and exit")
    a = ap.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print_table(compare_table([json.loads(l) for l in f if l.strip()]))
        return 0
    shape = Shape(a.layers, a.kv_heads, a.head_dim, a.dtype_bytes, a.page_size)
    out = run(a.style, a.sglang_path, a.tokens, a.requests, a.procs, shape, a.seed, a.warmup)
    if a.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['style']} {out['path']} {out['tokens']} tokens ({out['bytes_per_request'] / 2**20:.2f} MiB) "
            f"{out['procs']} proc: path {out['path_gb_per_s']:.2f} GB/s, transfer {out['xfer_gb_per_s']:.2f} GB/s "
            f"(p50 {out['path_p50_us']:.0f} / {out['xfer_p50_us']:.0f} us, {out['descriptors_per_request']} descs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
