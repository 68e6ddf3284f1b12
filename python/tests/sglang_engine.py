"""A stand-in for SGLang's scheduler that drives kvhost.sglang's connector
classes in the order SGLang's own scheduler drives its connectors
(SGLang's python/sglang/srt/disaggregation/prefill.py and decode.py), over
numpy KV pools in shared memory, and checks every byte that arrives.

Only SGLang's scheduler loop is stood in for; the connector classes under
test are kvhost.sglang's, talking to real ``kvhost serve`` sidecars.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np

from kvhost import shm
from kvhost import sglang as ks
from kvhost.sglang import KVPoll


class Geometry:
    """An MHA (K and V per layer, heads split over TP) or MLA (one latent
    per layer, replicated) model, SGLang's page layout: a page is
    page_size tokens x heads x head bytes, token-major."""

    def __init__(self, layers=2, heads=4, head_bytes=16, page_size=4, mla=False, aux_bytes=32):
        self.layers, self.heads, self.head_bytes = layers, heads, head_bytes
        self.page_size, self.mla, self.aux_bytes = page_size, mla, aux_bytes

    def heads_per_rank(self, tp):
        return self.heads if self.mla else self.heads // tp

    def item_len(self, tp):
        return self.page_size * self.heads_per_rank(tp) * self.head_bytes


class VramPool:
    """KVPool's fields over "GPU memory": one kvhost.cuda.malloc for the KV
    buffers (with the stand-in libcudart, host-visible, so numpy can fill
    and check it; the sidecar opens it by CUDA IPC handle) and aux in a
    kvhost.shm pool (SGLang's aux buffers are host memory)."""

    def __init__(self, layers, pages, item_len, mla, aux_bytes, aux_slots, device=0):
        import ctypes

        from kvhost import cuda

        nbuf = layers * (1 if mla else 2)
        buf_len = pages * item_len
        self.base = cuda.malloc(nbuf * buf_len, device)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (nbuf * buf_len)).from_address(self.base))
        self.kv_data_ptrs = [self.base + i * buf_len for i in range(nbuf)]
        self.kv_data_lens = [buf_len] * nbuf
        self.kv_item_lens = [item_len] * nbuf
        self.kv = [raw[i * buf_len:(i + 1) * buf_len].reshape(pages, item_len) for i in range(nbuf)]
        self.auxpool = shm.KVPool(0, 0, 0, aux_item_lens=[aux_bytes], aux_slots=aux_slots)
        self.aux_data_ptrs = self.auxpool.aux_data_ptrs
        self.aux_data_lens = self.auxpool.aux_data_lens
        self.aux_item_lens = self.auxpool.aux_item_lens
        self.aux = self.auxpool.aux

    def close(self):
        from kvhost import cuda

        self.kv = []
        cuda.free(self.base)
        self.auxpool.close()


class Rank:
    def __init__(self, geo: Geometry, tp: int, tp_rank: int, role: str, pages: int, aux_slots: int,
                 server_args, seed: int, vram: bool = False, backing: str = "shm"):
        self.geo, self.tp, self.tp_rank, self.role = geo, tp, tp_rank, role
        if vram:
            self.pool = VramPool(geo.layers, pages, geo.item_len(tp), geo.mla, geo.aux_bytes, aux_slots)
        else:
            self.pool = shm.KVPool(geo.layers, pages, geo.item_len(tp), mla=geo.mla,
                                   aux_item_lens=[geo.aux_bytes], aux_slots=aux_slots, backing=backing)
        self.rng = np.random.default_rng(seed)
        for buf in self.pool.kv:
            buf[:] = self.rng.integers(0, 256, buf.shape, dtype=np.uint8)
        # Aux (SGLang's metadata: output ids and the like) is the same on
        # every TP rank of an engine: with decode TP < prefill TP several
        # prefill ranks write one decode slot.
        aux_rng = np.random.default_rng(4242 if role == "prefill" else seed)
        for buf in self.pool.aux:
            buf[:] = aux_rng.integers(0, 256, buf.shape, dtype=np.uint8)
        args = ks.KVArgs()
        args.engine_rank = tp_rank
        args.kv_data_ptrs = self.pool.kv_data_ptrs
        args.kv_data_lens = self.pool.kv_data_lens
        args.kv_item_lens = self.pool.kv_item_lens
        args.aux_data_ptrs = self.pool.aux_data_ptrs
        args.aux_data_lens = self.pool.aux_data_lens
        args.aux_item_lens = self.pool.aux_item_lens
        args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
        args.kv_head_num = geo.heads_per_rank(tp)
        args.total_kv_head_num = geo.heads
        args.page_size = geo.page_size
        args.gpu_id = 0
        args.prefill_start_layer = 0
        args.pp_rank = 0
        args.system_dp_rank = 0
        mode = ks.DisaggregationMode.PREFILL if role == "prefill" else ks.DisaggregationMode.DECODE
        self.mgr = ks.KVManager(args, mode, server_args, is_mla_backend=geo.mla)
        self.free = list(self.rng.permutation(pages))

    def alloc(self, n):
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "test pool too small"
        return np.array(out, dtype=np.int32)

    def close(self):
        self.mgr.close()
        self.pool.close()


def server_args(tp, port, endpoint, page_size, variant="nixl"):
    """The ServerArgs fields the connectors read, plus the launcher's
    kvhost_* settings."""
    return SimpleNamespace(tp_size=tp, dp_size=1, enable_dp_attention=False, pp_size=1, page_size=page_size,
                           disaggregation_bootstrap_port=port, host="127.0.0.1", kv_cache_dtype="auto",
                           kvhost_control=endpoint, kvhost_host="127.0.0.1", kvhost_variant=variant)


class Request:
    def __init__(self, room, tokens, chunk_pages):
        self.room, self.tokens, self.chunk_pages = room, tokens, chunk_pages
        self.senders: List = []
        self.receivers: List = []
        self.src_pages: List[np.ndarray] = []
        self.dst_pages: List[np.ndarray] = []
        self.aux_src = 0
        self.aux_dst = 0
        self.prefill_state = "bootstrap"
        self.decode_state = "prealloc"
        self.sent = 0
        self.prefill_result: Optional[int] = None
        self.decode_result: Optional[int] = None
        self.failure: Optional[str] = None


def all_reduce(polls):
    """SGLang's poll_and_all_reduce: MIN over the TP ranks."""
    return min(int(p) for p in polls)


def decode_polls(receivers):
    """SGLang's poll_and_all_reduce_with_staging (disaggregation/utils.py)
    reads require_staging on every receiver before polling it."""
    assert all(rc.require_staging is False for rc in receivers)
    return all_reduce(rc.poll() for rc in receivers)


def run(geo: Geometry, prefill: List[Rank], decode: List[Rank], reqs: List[Request], bootstrap_addr: str,
        timeout: float = 120.0):
    """Drives every request through both schedulers until each side
    concluded, one scheduler step at a time, as SGLang's event loops do."""
    pages_of = lambda r: -(-r.tokens // geo.page_size)  # noqa: E731
    for i, r in enumerate(reqs):
        # prefill.py PrefillBootstrapQueue.add: one KVSender per rank.
        r.senders = [ks.KVSender(rk.mgr, bootstrap_addr, r.room, [rk.tp_rank], 0) for rk in prefill]
        # decode.py DecodePreallocQueue.add: one KVReceiver per rank, then init(prefill_dp_rank).
        r.receivers = [ks.KVReceiver(rk.mgr, bootstrap_addr, r.room) for rk in decode]
        for rc in r.receivers:
            rc.init(0)
        r.aux_src = i % 4
        r.aux_dst = (i + 1) % 4
    deadline = time.monotonic() + timeout
    while any(r.prefill_result is None or r.decode_result is None for r in reqs):
        if time.monotonic() > deadline:
            raise AssertionError("timed out: %s" % [
                (r.room, r.prefill_state, r.prefill_result, [s._reason for s in r.senders], r.decode_state,
                 [rc._reason for rc in r.receivers])
                for r in reqs if r.prefill_result is None or r.decode_result is None])
        progressed = False
        for r in reqs:
            n = pages_of(r)
            # ---- decode scheduler
            if r.decode_state == "prealloc":
                p = decode_polls(r.receivers)
                if p == KVPoll.WaitingForInput:
                    r.dst_pages = [rk.alloc(n) for rk in decode]
                    for rk, rc, pages in zip(decode, r.receivers, r.dst_pages):
                        rc.send_metadata(pages, r.aux_dst, None, 0)
                    r.decode_state = "transfer"
                    progressed = True
                elif p == KVPoll.Failed:
                    r.decode_state, r.decode_result = "done", KVPoll.Failed
            elif r.decode_state == "transfer":
                p = decode_polls(r.receivers)
                if p in (KVPoll.Success, KVPoll.Failed):
                    r.decode_state, r.decode_result = "done", p
                    if p == KVPoll.Failed:
                        for rc in r.receivers:
                            if rc.poll() == KVPoll.Failed:
                                try:
                                    rc.failure_exception()
                                except ks.KVTransferError as e:
                                    r.failure = str(e)
                    for rc in r.receivers:
                        rc.clear()
                    progressed = True
            # ---- prefill scheduler
            if r.prefill_state == "bootstrap":
                p = all_reduce(s.poll() for s in r.senders)
                if p == KVPoll.WaitingForInput:
                    for s in r.senders:
                        s.init(n, r.aux_src)
                    r.src_pages = [rk.alloc(n) for rk in prefill]
                    r.prefill_state = "forward"
                    progressed = True
                elif p == KVPoll.Failed:
                    r.prefill_state, r.prefill_result = "done", KVPoll.Failed
            elif r.prefill_state == "forward":
                # Chunked prefill: send_kv_chunk per chunk, the last with state.
                end = min(n, r.sent + r.chunk_pages)
                for s, pages in zip(r.senders, r.src_pages):
                    s.send(pages[r.sent:end])
                r.sent = end
                if r.sent == n:
                    r.prefill_state = "inflight"
                progressed = True
            elif r.prefill_state == "inflight":
                p = all_reduce(s.poll() for s in r.senders)
                if p in (KVPoll.Success, KVPoll.Failed):
                    r.prefill_state, r.prefill_result = "done", p
                    for s in r.senders:
                        s.clear()
                    progressed = True
        if not progressed:
            time.sleep(0.002)


def verify(geo: Geometry, prefill: List[Rank], decode: List[Rank], r: Request) -> int:
    """Checks every byte of the request's pages and aux slot on every
    decode rank against the prefill rank(s) that own its heads. Returns the
    bytes checked."""
    p_tp, d_tp = len(prefill), len(decode)
    checked = 0
    for di, drk in enumerate(decode):
        dpages = r.dst_pages[di]
        for b in range(len(drk.pool.kv)):
            dst = drk.pool.kv[b][dpages].reshape(len(dpages), geo.page_size, geo.heads_per_rank(d_tp), geo.head_bytes)
            if geo.mla:
                src_rank = di * p_tp // d_tp if d_tp >= p_tp else di * (p_tp // d_tp)
                src = prefill[src_rank].pool.kv[b][r.src_pages[src_rank]].reshape(dst.shape)
                np.testing.assert_array_equal(dst, src, "room %d decode rank %d buffer %d" % (r.room, di, b))
            else:
                # Global heads of this decode rank, each found on the prefill
                # rank that holds it.
                hd = geo.heads_per_rank(d_tp)
                hp = geo.heads_per_rank(p_tp)
                for j in range(hd):
                    g = di * hd + j
                    pr, pj = g // hp, g % hp
                    src = prefill[pr].pool.kv[b][r.src_pages[pr]].reshape(
                        len(dpages), geo.page_size, hp, geo.head_bytes)[:, :, pj, :]
                    np.testing.assert_array_equal(dst[:, :, j, :], src,
                                                  "room %d decode rank %d buffer %d head %d" % (r.room, di, b, j))
            checked += dst.size
        # aux: written by the prefill rank(s) this decode rank maps to.
        src_rank = di * p_tp // d_tp if d_tp >= p_tp else di * (p_tp // d_tp)
        np.testing.assert_array_equal(drk.pool.aux[0][r.aux_dst], prefill[src_rank].pool.aux[0][r.aux_src],
                                      "room %d decode rank %d aux" % (r.room, di))
        checked += geo.aux_bytes
    return checked


# --------------------------------------------------------------------------
# The byte formula of kvhost's demo workers (kvhost's
# host/demo/kvpool/kvpool.go: seedKey.seed, mix, word), so a Python engine
# fills and checks KV exactly as `kvhost prefill` / `kvhost decode` do.

_M64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15


def _mix(z):
    """SplitMix64's finalizer on numpy uint64 arrays (wrapping)."""
    z = z + np.uint64(_GOLD)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def kvpool_seeds(room: int, layer: int, kv: int, tokens, heads):
    """seedKey{room, layer, kv, token, head}.seed() for every (token, head):
    a (len(tokens), len(heads)) uint64 array. layer -1 is aux."""
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(room ^ 0x6B76686F7374))
        h = _mix(h ^ np.uint64(((layer << 1) & _M64)) ^ np.uint64(kv))
        t = np.asarray(tokens, dtype=np.uint64)[:, None]
        h = _mix(h ^ t)
        return _mix(h ^ np.asarray(heads, dtype=np.uint64)[None, :])


def kvpool_bytes(seeds, head_bytes: int):
    """The content of each head: little-endian words seed + i*golden,
    truncated to head_bytes. Shape seeds.shape + (head_bytes,)."""
    nwords = -(-head_bytes // 8)
    with np.errstate(over="ignore"):
        words = seeds[..., None] + np.arange(nwords, dtype=np.uint64) * np.uint64(_GOLD)
    b = words.astype("<u8").view(np.uint8).reshape(seeds.shape + (nwords * 8,))
    return b[..., :head_bytes]


def fill_like_kvhost(rank: Rank, room: int, pages, tokens: int, aux_slot: int):
    """Writes the tokens of ``room`` into ``pages`` and its aux into
    ``aux_slot`` the way kvhost's demo prefill does (SGLang K-then-V
    layout, token-major pages)."""
    geo = rank.geo
    hl = geo.heads_per_rank(rank.tp)
    heads = [0] if geo.mla else [rank.tp_rank * hl + h for h in range(hl)]
    kvs = 1 if geo.mla else 2
    npages = len(pages)
    toks = np.arange(npages * geo.page_size)
    for kv in range(kvs):
        for layer in range(geo.layers):
            buf = rank.pool.kv[kv * geo.layers + layer]
            content = kvpool_bytes(kvpool_seeds(room, layer, kv, toks, heads), geo.head_bytes)
            content[tokens:] = 0  # beyond the prompt: not part of the request
            buf[np.asarray(pages)] = content.reshape(npages, geo.item_len(rank.tp))
    aux = kvpool_bytes(kvpool_seeds(room, -1, 0, [0], [0]), geo.aux_bytes).reshape(-1)
    rank.pool.aux[0][aux_slot] = aux


def check_like_kvhost(rank: Rank, room: int, pages, tokens: int, aux_slot: int):
    """Checks the tokens of ``room`` in ``pages`` (and its aux slot) against
    kvhost's formula; AssertionError names the first difference."""
    geo = rank.geo
    hl = geo.heads_per_rank(rank.tp)
    heads = [0] if geo.mla else [rank.tp_rank * hl + h for h in range(hl)]
    kvs = 1 if geo.mla else 2
    npages = len(pages)
    toks = np.arange(npages * geo.page_size)
    for kv in range(kvs):
        for layer in range(geo.layers):
            buf = rank.pool.kv[kv * geo.layers + layer]
            want = kvpool_bytes(kvpool_seeds(room, layer, kv, toks, heads), geo.head_bytes)[:tokens]
            got = buf[np.asarray(pages)].reshape(npages * geo.page_size, hl, geo.head_bytes)[:tokens]
            np.testing.assert_array_equal(got, want, "room %d layer %d kv %d" % (room, layer, kv))
    aux = kvpool_bytes(kvpool_seeds(room, -1, 0, [0], [0]), geo.aux_bytes).reshape(-1)
    np.testing.assert_array_equal(rank.pool.aux[0][aux_slot], aux, "room %d aux" % room)
