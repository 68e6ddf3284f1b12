"""kvhost engines paired with a vLLM engine that is NOT kvhost: vLLM's NIXL
connector of each generation the sidecar speaks (2, 6, 10), written from
vLLM's code (tests/vllm_peer), moving real bytes through ``nixl._api``.

The kvhost side is KvhostConnector driven by the replay of vLLM's engine
(tests/vllm_engine.py) against a live ``kvhost serve``; the peer is
vllm_peer.PeerEngine in this process, one NIXL agent per TP worker, KV in
its private memory. Both directions (peer prefill -> kvhost decode,
kvhost prefill -> peer decode), MHA and MLA, TP 1->1, 2->2, 2->4, no,
partial and full prefix hits, holds kept by heartbeats and lapsed. Every
byte a decode read is checked where it landed (the replay's checker on
the kvhost side, the peer's own after each read).

Backend: ``KVHOST_TEST_BACKEND`` (conftest). ``fake`` (CI): the sidecar
on the fake plugin and the peer on the stand-in nixl._api over the same
plugin (vllm_peer/fake_nixl.py), the bytes crossing processes with
process_vm_readv. ``nixl``: both on NIXL (UCX), the peer on NIXL's own
Python API; see python/README.md for the command.
"""

from __future__ import annotations

import time

import pytest

from kvhost import demo_pattern as pat
from conftest import BACKEND
from vllm_engine import PROFILES, Engine, ReplayRequest, stub_transfer_results
from vllm_peer import nixl_api
from vllm_peer.peer import HandshakeError, PeerEngine
from vllm_peer.wire import WIRES

SHAPE = pat.Shape(layers=2, kv_heads=4, head_bytes=32, page_size=4)
MLA_SHAPE = pat.Shape(layers=2, kv_heads=1, head_bytes=64, page_size=4)
NUM_BLOCKS = 32
# Every generation the peer speaks (a new one is a line in vllm_peer/wire.py).
GENERATIONS = tuple(sorted(WIRES))
LEASED = tuple(g for g in GENERATIONS if WIRES[g].leases)
LEASE = 2.0  # seconds (kv_lease_duration; short, with room for a loaded machine's first handshake)
# The lease of the kept-alive cases: heartbeats every 0.5 s, each
# extending by 2 s (vLLM's lease // 6 and lease * 2 // 3), so a stall of
# well over a second on a loaded machine does not lapse it.
KEEP_LEASE = 3.0
# (request, tokens, seed, decode prefix-cache hit in pages): none,
# partial, full (every page of the request already in the decode's cache).
REQUESTS = [("a", 9, 41, 0), ("b", 16, 42, 2), ("c", 8, 43, 2)]

TOTALS = {"bytes_read": 0, "bytes_verified": 0, "cases": 0}


def _profile(gen):
    return PROFILES["0.13" if gen == 2 else "newest"]


class Pair:
    """One kvhost engine beside its sidecar and one vLLM peer engine."""

    def __init__(self, sidecar_factory, direction, gen, tps, mla, extra=None, lease=30.0, abort_timeout=480.0,
                 peer_gen=None, shape=None):
        self.gen, self.mla, self.direction = gen, mla, direction
        self.shape = shape or (MLA_SHAPE if mla else SHAPE)
        peer_gen = gen if peer_gen is None else peer_gen
        prof = _profile(gen)
        ex = dict(extra or {}, kvhost_nixl_connector_version=gen)
        self.loaded = []
        self.verified = 0  # bytes the kvhost engine's checker compared
        self.api = nixl_api(BACKEND)
        sc = sidecar_factory("kvhost")
        if direction == "peer-to-kvhost":
            self.peer = PeerEngine(self.api, "peer-p", peer_gen, tps[0], self.shape, NUM_BLOCKS, prof.vllm_version,
                                   mla=mla, lease=lease, abort_timeout=abort_timeout)
            self.peer.listen()
            self.kv = Engine("engine-d", "kv_consumer", sc.endpoint, tps[1], self.shape, NUM_BLOCKS, prof, ex, mla=mla)
        else:
            self.kv = Engine("engine-p", "kv_producer", sc.endpoint, tps[0], self.shape, NUM_BLOCKS, prof, ex, mla=mla)
            self.peer = PeerEngine(self.api, "peer-d", peer_gen, tps[1], self.shape, NUM_BLOCKS, prof.vllm_version,
                                   mla=mla, lease=lease, abort_timeout=abort_timeout)
        # The plugin moving the sidecar's bytes is the one asked for, and
        # so is the peer's nixl._api.
        assert self.kv.workers[0].connector_worker._client.hello.backend == BACKEND
        # (NIXL's nixl._api is its nixl_cu12._api or nixl_cu13._api.)
        assert (self.api.__name__ == "vllm_peer.fake_nixl") == (BACKEND == "fake"), self.api.__name__
        self.kv.scheduler.on_loaded = self._check

    def _check(self, request, block_ids):
        for r in range(self.kv.tp):
            why = self.kv.check_bytes(r, block_ids, request.seed)
            assert why is None, "kvhost rank %d, request %s: %s" % (r, request.request_id, why)
            # What check_bytes compared: every registered plane of the blocks.
            pool = self.kv.pools[r][1]
            block = pool[:, :1, 0] if self.mla else pool[:, :, 0]
            self.verified += len(block_ids) * block.nbytes
        self.loaded.append(request.request_id)

    def cached(self, ntok, seed, k):
        """k blocks of the kvhost decode's prefix cache holding the
        request's first k pages (an earlier request's)."""
        ids = self.kv.scheduler.pool.take(k)
        n = self.shape.pages(ntok)
        for r in range(self.kv.tp):
            self.kv.pools[r][1][:, :, ids] = pat.expected(seed, self.shape, n, *self.kv.heads_of(r))[:, :, :k]
        self.kv.scheduler.pool.give(ids)
        return ids

    def kv_prefill(self, rid, ntok, seed):
        """The proxy's first leg on the kvhost prefill."""
        p = self.kv
        p.scheduler.add_request(ReplayRequest(rid, ntok, {"do_remote_decode": True}, seed, max_tokens=1))
        p.run_until(lambda: rid in p.scheduler.kv_transfer_params, "prefill of " + rid, others=(self.peer,))
        params = p.scheduler.kv_transfer_params[rid]
        assert params is not None and params["do_remote_prefill"] is True, params
        return params

    def run(self, cond, what, timeout=60.0):
        self.kv.run_until(cond, what, others=(self.peer,), timeout=timeout)

    def drain(self):
        self.run(lambda: self.kv.idle() and self.peer.idle(), "both engines idle")
        assert len(self.kv.scheduler.pool.free) == NUM_BLOCKS and len(self.peer.free) == NUM_BLOCKS

    def kv_release_reasons(self, rid):
        return [w.connector_worker.release_reasons.get(rid) for w in self.kv.workers]

    def close(self):
        self.kv.close()
        self.peer.close()


@pytest.fixture
def pair(sidecar_factory, monkeypatch):
    stub_transfer_results(monkeypatch)
    made = []

    def make(*args, **kw):
        p = Pair(sidecar_factory, *args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _hit_blocks(ntok, hit):
    return min(hit, SHAPE.pages(ntok))


def _report(pr, tps, read, verified):
    TOTALS["bytes_read"] += read
    TOTALS["bytes_verified"] += verified
    TOTALS["cases"] += 1
    print("\n%s %s gen %d %s TP %d->%d: %d bytes read, %d bytes verified (cumulative %d cases, %d read, %d verified)"
          % (BACKEND, pr.direction, pr.gen, "MLA" if pr.mla else "MHA", tps[0], tps[1], read, verified,
             TOTALS["cases"], TOTALS["bytes_read"], TOTALS["bytes_verified"]))


def _want_read(shape, mla, decode_tp, pages):
    """What one decode rank reads for ``pages`` pages: its heads of every
    layer, K and V (MLA: the latent)."""
    planes, heads = (1, 1) if mla else (2, shape.kv_heads // decode_tp)
    return shape.layers * planes * pages * heads * shape.page_size * shape.head_bytes


TP_PAIRS = [(1, 1), (2, 2), (2, 4)]


@pytest.mark.parametrize("tps", TP_PAIRS, ids=lambda t: "tp%d-%d" % t)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("gen", GENERATIONS)
def test_peer_prefill_to_kvhost_decode(pair, gen, mla, tps):
    """A vLLM NIXL prefill (the peer) hands three requests to a kvhost
    decode: no prefix hit, a partial one, a full one (only the
    notification). The kvhost decode reads over NIXL's wire of the
    generation; every byte is checked on every kvhost decode rank; the
    peer frees each hold as read ("notified"), counting notifications
    as its vLLM does."""
    pr = pair("peer-to-kvhost", gen, tps, mla)
    for rid, ntok, seed, hit in REQUESTS:
        params = pr.peer.prefill(rid, ntok, seed)
        k = _hit_blocks(ntok, hit)
        cached = pr.cached(ntok, seed, k) if k else ()
        pr.kv.scheduler.add_request(ReplayRequest("d-" + rid, ntok, dict(params), seed, max_tokens=2,
                                                  cached_blocks=cached))
        # Allocated before the next request's cached blocks are made (a
        # free block is handed out again first: it would overwrite them).
        pr.run(lambda: "d-" + rid not in pr.kv.scheduler.requests or "d-" + rid in pr.kv.scheduler.blocks,
               "d-%s allocated" % rid)
    pr.drain()
    # a and b waited for remote KV and were checked when promoted; c was
    # a full hit (nothing to read).
    assert sorted(pr.loaded) == ["d-a", "d-b"], pr.loaded
    assert pr.peer.release_reasons == dict.fromkeys("abc", "notified"), pr.peer.release_reasons
    assert not any(w.unrecognized for w in pr.peer.workers), [w.unrecognized for w in pr.peer.workers]
    assert not pr.peer.listener_errors, pr.peer.listener_errors
    read = 0
    for rid, ntok, _, hit in REQUESTS:
        pages = SHAPE.pages(ntok) - _hit_blocks(ntok, hit)
        want = _want_read(pr.shape, mla, tps[1], pages)
        for w in pr.kv.workers:
            res = w.connector_worker.read_results["d-" + rid]
            assert res["ok"] and res["bytes"] == want, (rid, res, want)
            read += res["bytes"]
    _report(pr, tps, read, pr.verified)


@pytest.mark.parametrize("tps", TP_PAIRS, ids=lambda t: "tp%d-%d" % t)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("gen", GENERATIONS)
def test_kvhost_prefill_to_peer_decode(pair, gen, mla, tps):
    """A kvhost prefill hands three requests to a vLLM NIXL decode (the
    peer): it handshakes with the sidecar's side channel, loads its agent,
    READs with make_prepped_xfer and notifies; a partial prefix hit reads
    the last blocks, a full one only notifies. Every byte is checked in
    the peer's memory; the kvhost prefill releases every hold as read."""
    pr = pair("kvhost-to-peer", gen, tps, mla)
    for rid, ntok, seed, hit in REQUESTS:
        params = pr.kv_prefill(rid, ntok, seed)
        pr.peer.load("d-" + rid, params, seed, hit=_hit_blocks(ntok, hit))
    pr.drain()
    assert pr.peer.loaded == dict.fromkeys(["d-a", "d-b", "d-c"], True), pr.peer.loaded
    for rid in "abc":
        assert pr.kv_release_reasons(rid) == ["notified"] * tps[0], (rid, pr.kv_release_reasons(rid))
    read = 0
    for rid, ntok, _, hit in REQUESTS:
        want = _want_read(pr.shape, mla, tps[1], SHAPE.pages(ntok) - _hit_blocks(ntok, hit))
        got = pr.peer.bytes_read("d-" + rid)
        assert got == [want] * tps[1], (rid, got, want)
        read += sum(got)
    _report(pr, tps, read, pr.peer.bytes_verified)


def _corrupt(pool, block):
    pool[0, 0, block].flat[0] ^= 0xFF


def test_peer_to_kvhost_detects_a_wrong_byte(pair):
    """The checks above can fail: one byte of the peer's KV changed after
    its prefill reaches the kvhost decode, whose check names it."""
    pr = pair("peer-to-kvhost", 2, (1, 1), False)
    params = pr.peer.prefill("x", 9, 5)
    _corrupt(pr.peer.workers[0].pool, params["remote_block_ids"][1])
    pr.kv.scheduler.add_request(ReplayRequest("d-x", 9, dict(params), 5, max_tokens=2))
    with pytest.raises(AssertionError, match="kvhost rank 0, request d-x: page 1"):
        pr.drain()


def test_kvhost_to_peer_detects_a_wrong_byte(pair):
    """... and the peer's: one byte of the kvhost prefill's KV changed
    after its prefill reaches the peer decode, whose check names it."""
    pr = pair("kvhost-to-peer", 2, (1, 1), False)
    params = pr.kv_prefill("y", 9, 6)
    _corrupt(pr.kv.pools[0][1], params["remote_block_ids"][2])
    pr.peer.load("d-y", params, 6)
    with pytest.raises(AssertionError, match="request d-y: page 2"):
        pr.drain()


def _hog(e):
    """Every free block of the kvhost decode taken: a request waits in
    its queue."""
    return e.scheduler.pool.take(len(e.scheduler.pool.free))


def _wait(pr, seconds, what):
    """Steps both engines for at least ``seconds`` (a lower bound only)."""
    t0 = time.monotonic()
    pr.run(lambda: time.monotonic() - t0 >= seconds, what, timeout=seconds + 60)


@pytest.mark.parametrize("gen", LEASED)
def test_peer_prefill_lease_kept_by_kvhost_heartbeats(pair, gen):
    """The peer prefill holds for a lease of KEEP_LEASE s; the kvhost
    decode's request waits in its queue for 2 leases; the kvhost decode's
    heartbeats ("HB:" notifications over NIXL) renew the peer's lease, so
    the late read still gets every byte and the peer frees as read."""
    pr = pair("peer-to-kvhost", gen, (1, 1), False, extra={"kv_lease_duration": KEEP_LEASE}, lease=KEEP_LEASE)
    params = pr.peer.prefill("q", 12, 8)
    hog = _hog(pr.kv)
    pr.kv.scheduler.add_request(ReplayRequest("d-q", 12, dict(params), 8, max_tokens=2))
    _wait(pr, 2 * KEEP_LEASE, "two leases")
    assert pr.kv.scheduler.requests["d-q"].status.name == "WAITING"
    assert "q" not in pr.peer.release_reasons, pr.peer.release_reasons  # still held
    assert pr.peer.heartbeats_seen > 0
    pr.kv.scheduler.pool.give(hog)
    pr.drain()
    assert pr.loaded == ["d-q"]
    assert pr.peer.release_reasons["q"] == "notified"


@pytest.mark.parametrize("gen", GENERATIONS)
def test_peer_prefill_hold_lapses(pair, gen, monkeypatch):
    """A kvhost decode that does not renew a queued request (no watch:
    generations 6 and 10; generation 2 has no heartbeats, only the abort
    timeout) lets the peer's hold lapse: the peer frees it as timed out."""
    from kvhost.vllm import scheduler as ksched

    monkeypatch.setattr(ksched.KvhostConnectorScheduler, "on_new_request", lambda self, request: None)
    pr = pair("peer-to-kvhost", gen, (1, 1), False, extra={"kv_lease_duration": LEASE}, lease=LEASE,
              abort_timeout=LEASE)
    params = pr.peer.prefill("n", 12, 8)
    hog = _hog(pr.kv)
    pr.kv.scheduler.add_request(ReplayRequest("d-n", 12, dict(params), 8, max_tokens=2))
    pr.run(lambda: "n" in pr.peer.release_reasons, "the peer's hold to lapse")
    assert pr.peer.release_reasons["n"] == "timeout"
    assert pr.peer.heartbeats_seen == 0
    pr.kv.abort(["d-n"])
    pr.kv.scheduler.pool.give(hog)
    pr.drain()


@pytest.mark.parametrize("gen", LEASED)
def test_kvhost_prefill_lease_kept_by_peer_heartbeats(pair, gen):
    """The kvhost prefill holds for a lease of KEEP_LEASE s; the peer
    decode's request waits 2 leases in its queue while the peer heartbeats the
    prefill's agents, as vLLM's worker does; then it reads every byte and
    the kvhost prefill releases as read."""
    pr = pair("kvhost-to-peer", gen, (2, 2), False, extra={"kv_lease_duration": KEEP_LEASE}, lease=KEEP_LEASE)
    params = pr.kv_prefill("q", 12, 8)
    pr.peer.queue("d-q", params)
    _wait(pr, 2 * KEEP_LEASE, "two leases")
    assert pr.kv_release_reasons("q") == [None, None]  # still held
    assert pr.peer.heartbeats_sent > 0
    pr.peer.load("d-q", params, 8)
    pr.drain()
    assert pr.peer.loaded == {"d-q": True}
    assert pr.kv_release_reasons("q") == ["notified", "notified"]


@pytest.mark.parametrize("gen", GENERATIONS)
def test_kvhost_prefill_hold_lapses(pair, gen):
    """A peer decode that handshook but never heartbeats (generation 2:
    the abort timeout) lets the kvhost prefill's hold lapse: released
    as timed out."""
    pr = pair("kvhost-to-peer", gen, (1, 1), False,
              extra={"kv_lease_duration": LEASE, "kvhost_abort_timeout": LEASE}, lease=LEASE)
    params = pr.kv_prefill("n", 12, 8)
    pr.peer.queue("d-n", params, heartbeat=False)
    pr.run(lambda: pr.kv_release_reasons("n") == ["timeout"], "the kvhost prefill's hold to lapse")
    assert pr.peer.heartbeats_sent == 0
    pr.peer.abort("d-n")
    pr.drain()


# A model large enough that a request is megabytes: 4 layers, 8 KV heads
# of 256 bytes, 16-token pages (256 KiB a page).
BIG = pat.Shape(layers=4, kv_heads=8, head_bytes=256, page_size=16)


@pytest.mark.parametrize("direction", ["peer-to-kvhost", "kvhost-to-peer"])
def test_large_requests(pair, direction):
    """Generation 10, MHA, TP 2 -> 4, two requests of 30 pages (7.5 MiB
    each over the decode ranks), the second a partial prefix hit: every
    byte checked where it landed."""
    gen, tps = GENERATIONS[-1], (2, 4)
    pr = pair(direction, gen, tps, False, shape=BIG)
    reqs = [("a", 30 * 16, 7, 0), ("b", 30 * 16 - 5, 8, 6)]
    for rid, ntok, seed, hit in reqs:
        if direction == "peer-to-kvhost":
            params = pr.peer.prefill(rid, ntok, seed)
            cached = pr.cached(ntok, seed, hit) if hit else ()
            pr.kv.scheduler.add_request(ReplayRequest("d-" + rid, ntok, dict(params), seed, max_tokens=2,
                                                      cached_blocks=cached))
        else:
            params = pr.kv_prefill(rid, ntok, seed)
            pr.peer.load("d-" + rid, params, seed, hit=hit)
        pr.drain()  # one at a time: each takes most of the 32 blocks
    read = 0
    for rid, ntok, _, hit in reqs:
        want = _want_read(BIG, False, tps[1], BIG.pages(ntok) - hit)
        if direction == "peer-to-kvhost":
            got = [w.connector_worker.read_results["d-" + rid]["bytes"] for w in pr.kv.workers]
        else:
            got = pr.peer.bytes_read("d-" + rid)
        assert got == [want] * tps[1], (rid, got, want)
        read += sum(got)
    if direction == "peer-to-kvhost":
        assert sorted(pr.loaded) == ["d-a", "d-b"]
        assert pr.peer.release_reasons == dict.fromkeys("ab", "notified")
        verified = pr.verified
    else:
        assert pr.peer.loaded == {"d-a": True, "d-b": True}
        verified = pr.peer.bytes_verified
    assert verified == sum(BIG.bytes_per_page() * BIG.pages(n) for _, n, _, _ in reqs)
    _report(pr, tps, read, verified)


def test_generation_mismatch_is_refused(pair):
    """A kvhost decode of generation 6 and a peer prefill of generation
    10 hash different factors: the sidecar refuses the handshake (the
    read fails, vLLM recomputes), and the peer's lease lapses."""
    pr = pair("peer-to-kvhost", 6, (1, 1), False, peer_gen=10, lease=LEASE)
    params = pr.peer.prefill("m", 9, 4)
    pr.kv.scheduler.add_request(ReplayRequest("d-m", 9, dict(params), 4, max_tokens=2))
    pr.drain()
    res = pr.kv.workers[0].connector_worker.read_results["d-m"]
    assert not res["ok"] and "hash" in res["reason"], res
    assert pr.loaded == [] and pr.peer.release_reasons == {"m": "timeout"}


def test_generation_mismatch_is_refused_by_the_peer(pair):
    """... and the other way: a peer decode of generation 6 refuses a
    kvhost prefill of generation 10 at the hash, as vLLM's
    _nixl_handshake does, before it decodes the metadata."""
    pr = pair("kvhost-to-peer", 10, (1, 1), False, peer_gen=6, extra={"kv_lease_duration": LEASE})
    params = pr.kv_prefill("m", 9, 4)
    with pytest.raises(HandshakeError, match="compatibility hash mismatch"):
        pr.peer.load("d-m", params, 4)
    pr.run(lambda: pr.kv_release_reasons("m") == ["timeout"], "the kvhost prefill's hold to lapse")
    pr.drain()
