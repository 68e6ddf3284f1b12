"""KvhostConnector driven exactly as vLLM drives a KV connector
(tests/vllm_engine.py replays vLLM's engine core, scheduler, executor and
model runner, each step named by upstream file, function and commit),
for vLLM 0.13 (the reference) and current vLLM, against live ``kvhost
serve`` sidecars on the fake plugin. Every byte is checked on every decode
worker when the scheduler promotes the request out of
WAITING_FOR_REMOTE_KVS; the replayed scheduler keeps vLLM's asserts, so a
connector that reports a request vLLM already freed fails the test as it
would kill vLLM's engine core.

Wire generations: the sidecar speaks NIXL connector generations 2 (vLLM
0.13), 6, 10, 11 and 12 (host/wire/vllm/generation.go; 12 is
nixl/metadata.py @ 02cfb534, the newest); each replays end to end. A
generation the sidecar does not speak is refused when the worker opens its
rank, at start-up, with a message naming the version and the versions it
speaks. Generations 6 on have leases: the decode renews the prefill's
lease from the request's arrival (``watch``), so a request waiting in the
decode's queue longer than the lease is still read.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from kvhost import demo_pattern as pat
from kvhost.vllm import generations
from conftest import BACKEND
from vllm_engine import PROFILES, EngineCoreDied, Engine, ReplayRequest, stub_transfer_results

SHAPE = pat.Shape(layers=2, kv_heads=4, head_bytes=32, page_size=4)
# An MLA model's latent: one head, replicated on every TP rank.
MLA_SHAPE = pat.Shape(layers=2, kv_heads=1, head_bytes=64, page_size=4)
NUM_BLOCKS = 32

# What the sidecar speaks (host/wire/vllm/generation.go).
SIDECAR_GENERATIONS = (2, 6, 10, 11, 12)
# The leased generations the lease tests run: the first and the newest.
LEASED_GENERATIONS = (6, 12)


class WrongGeneration(AssertionError):
    """kv_transfer_params not in the shape of the engine's generation."""


def _check_params_shape(params, gen):
    ids = params["remote_block_ids"]
    per_group = isinstance(ids, (list, tuple)) and len(ids) > 0 and isinstance(ids[0], (list, tuple))
    if per_group != generations.generation(gen).block_ids_per_group:
        raise WrongGeneration("generation %d: remote_block_ids %r" % (gen, ids))


def _checker(e, loaded):
    """Every byte of a loaded request on every worker of engine e, when
    the scheduler promotes it out of WAITING_FOR_REMOTE_KVS."""

    def check(request, block_ids):
        for r in range(e.tp):
            why = e.check_bytes(r, block_ids, request.seed)
            assert why is None, "rank %d, request %s: %s" % (r, request.request_id, why)
        if loaded is not None:
            loaded.append(request.request_id)

    return check


@pytest.fixture
def engines(sidecar_factory, monkeypatch):
    stub_transfer_results(monkeypatch)
    made = []

    def make(profile, prefill_tp=1, decode_tp=2, prefill_role="kv_producer", decode_role="kv_consumer",
             gen=2, loaded=None, extra=None, mla=False):
        prof = PROFILES[profile]
        shape = MLA_SHAPE if mla else SHAPE
        sp, sd = sidecar_factory("prefill"), sidecar_factory("decode")
        extra = dict(extra or {}, kvhost_nixl_connector_version=gen)
        p = Engine("engine-p", prefill_role, sp.endpoint, prefill_tp, shape, NUM_BLOCKS, prof, extra, mla=mla)
        made.append(p)
        d = Engine("engine-d", decode_role, sd.endpoint, decode_tp, shape, NUM_BLOCKS, prof, extra, mla=mla)
        for e in (p, d):
            e.scheduler.on_loaded = _checker(e, loaded)
            # The plugin moving the bytes is the one asked for (conftest).
            assert e.workers[0].connector_worker._client.hello.backend == BACKEND
        made.append(d)
        return p, d

    yield make
    for e in made:
        e.close()


def _prefill(p, d, rid, ntok, seed, gen=2, eos=False):
    """The proxy's first leg: the prefill engine runs the request with
    max_tokens=1 and answers with kv_transfer_params."""
    p.scheduler.add_request(ReplayRequest(rid, ntok, {"do_remote_decode": True}, seed, max_tokens=1,
                                          eos_at=0 if eos else None))
    p.run_until(lambda: rid in p.scheduler.kv_transfer_params, "prefill of " + rid, others=(d,))
    params = p.scheduler.kv_transfer_params[rid]
    assert params is not None and params["do_remote_prefill"] is True, params
    _check_params_shape(params, gen)
    return params


def _cached(d, rid, ntok, seed, k):
    """k blocks of the decode's local prefix cache holding the request's
    first k pages, as an earlier request with the same prefix left them."""
    ids = d.scheduler.pool.take(k)
    n = SHAPE.pages(ntok)
    for r in range(d.tp):
        h0, h1 = SHAPE.heads_of(r, d.tp)
        d.pools[r][1][:, :, ids] = pat.expected(seed, SHAPE, n, h0, h1)[:, :, :k]
    d.scheduler.pool.give(ids)
    return ids


def _drain(p, d):
    p.run_until(lambda: p.idle() and d.idle(), "both engines idle", others=(d,))
    # Every block back: nothing leaked or held.
    assert len(p.scheduler.pool.free) == NUM_BLOCKS and len(d.scheduler.pool.free) == NUM_BLOCKS


@pytest.mark.parametrize("gen", SIDECAR_GENERATIONS)
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_every_byte(engines, profile, gen):
    """Prefill TP 1 -> decode TP 2: three requests, one a partial local
    prefix hit on the decode, one ended by EOS (FINISHED_STOPPED) at the
    prefill, which current vLLM's NIXL connector hands off too. Holds after
    the first are pipelined."""
    loaded = []
    p, d = engines(profile, gen=gen, loaded=loaded)
    reqs = [("a", 9, 11, False, 0), ("b", 16, 22, True, 0), ("c", 13, 33, False, 2)]
    for rid, ntok, seed, eos, hit in reqs:
        params = _prefill(p, d, rid, ntok, seed, gen, eos)
        cached = _cached(d, "d-" + rid, ntok, seed, hit) if hit else ()
        d.scheduler.add_request(ReplayRequest("d-" + rid, ntok, dict(params), seed, max_tokens=2,
                                              cached_blocks=cached))
    _drain(p, d)
    assert sorted(loaded) == ["d-a", "d-b", "d-c"]
    for w in p.workers:
        assert {k: w.connector_worker.release_reasons[k] for k in "abc"} == dict.fromkeys("abc", "notified")
    # The first hold waited for the sidecar's params, the next two were
    # made here and sent without waiting (issue 24), in this generation's
    # shape: every reply matched them.
    sched = p.scheduler.connector.connector_scheduler
    assert (sched.holds_waited, sched.holds_pipelined, sched.template_mismatches) == (1, 2, 0)


def test_every_table_generation_is_spoken_by_the_sidecar():
    """kvhost's Python table and the sidecar speak the same generations:
    one the table knows and the sidecar does not would only fail at start-up."""
    assert tuple(sorted(generations.GENERATIONS)) == SIDECAR_GENERATIONS


def test_replay_refused_generation_at_startup(engines, monkeypatch):
    """A generation the sidecar does not speak (13, put in the Python
    table with 12's factors, as a later vLLM's would be) fails the engine's
    start (the worker's register_kv_caches), naming the version and the
    ones the sidecar speaks; no request ever runs."""
    monkeypatch.setitem(generations.GENERATIONS, 13, dataclasses.replace(generations.GENERATIONS[12], version=13))
    with pytest.raises(RuntimeError) as ei:
        engines("newest", gen=13)
    msg = str(ei.value)
    assert "NIXL connector version 13" in msg, msg
    assert "unsupported" in msg and "kvhost speaks versions 2, 6, 10, 11, 12" in msg, msg


@pytest.mark.parametrize("gen,extra", [
    (6, ("cross_layers_blocks", "is_hma_enabled", "speculative_config")),
    (10, ("is_hma_enabled", "speculative_config", "transfer_mode")),
    (11, ("is_hma_enabled", "speculative_config", "transfer_mode")),
    (12, ("is_hma_enabled", "speculative_config", "transfer_mode")),
])
def test_leased_generation_factors_are_what_the_sidecar_requires(engines, gen, extra):
    """open_rank at generation 6, 10, 11 or 12 against a live sidecar
    succeeds (the sidecar refuses a factor set missing one it requires), and
    the set sent is exactly the generation's: vLLM's nine base factors plus
    those its compute_nixl_compatibility_hash adds (metadata.py at version
    6; at 0316d25, version 10; at 02cfb534, version 12, whose factors are
    10's)."""
    p, d = engines("newest", gen=gen)
    want = sorted(generations.BASE_FACTORS + extra)
    for w in p.workers + d.workers:
        cw = w.connector_worker
        assert cw.rank is not None or cw.prefill_rank is not None
        assert sorted(cw.compat) == want
        assert cw.compat["nixl_connector_version"] == gen and cw.leases


def test_gen6_factor_missing_is_refused_at_startup(engines, monkeypatch):
    """The check above can fail: a generation-6 table entry without one of
    the factors the sidecar requires is refused when the rank opens."""
    g = generations.GENERATIONS[6]
    monkeypatch.setitem(generations.GENERATIONS, 6, dataclasses.replace(
        g, extra_factors=tuple(f for f in g.extra_factors if f != "speculative_config")))
    with pytest.raises(RuntimeError, match="compat.speculative_config: missing"):
        engines("newest", gen=6)


LEASE = 2.0  # seconds: kv_connector_extra_config.kv_lease_duration (short; 2 s leaves a loaded machine room for the first handshake)


def _hog(d):
    """Every free block of the decode taken, so a request waits in its
    queue (vLLM's scheduler skips it until blocks free up)."""
    return d.scheduler.pool.take(len(d.scheduler.pool.free))


def _wait_queued(p, d, rid, seconds):
    """Steps both engines for at least ``seconds`` while ``rid`` waits in
    the decode's queue (a lower bound only: a slow machine waits longer)."""
    t0 = time.monotonic()
    p.run_until(lambda: time.monotonic() - t0 >= seconds, "the lease to pass", others=(d,),
                timeout=seconds + 60)
    assert d.scheduler.requests[rid].status.name == "WAITING", d.scheduler.requests[rid].status


@pytest.mark.parametrize("gen", LEASED_GENERATIONS)
def test_replay_lease_renewed_while_queued(engines, gen):
    """Generations 6 and 12, lease LEASE s: a decode request waits in the decode's
    queue for 4 leases (no free blocks) before it is scheduled; the
    decode renews the prefill's lease from its arrival (watch), so its
    read still gets every byte and the prefill releases it as read."""
    loaded = []
    p, d = engines("newest", gen=gen, loaded=loaded, extra={"kv_lease_duration": LEASE})
    params = _prefill(p, d, "q", 12, 8, gen=gen)
    hog = _hog(d)
    d.scheduler.add_request(ReplayRequest("d-q", 12, dict(params), 8, max_tokens=2))
    _wait_queued(p, d, "d-q", 4 * LEASE)
    assert "q" not in p.workers[0].connector_worker.release_reasons  # still held
    d.scheduler.pool.give(hog)
    _drain(p, d)
    assert loaded == ["d-q"]
    assert p.workers[0].connector_worker.release_reasons["q"] == "notified"


def test_replay_lease_lapses_without_watch(engines, monkeypatch):
    """The mutation check of the test above: a decode that does not renew
    a queued request's lease (no watch) lets it lapse on the prefill
    (released ``timeout``): its blocks are free for the prefill's next
    request to overwrite before the late read (which, as NIXL's, is not
    refused: the prefill's memory is still registered)."""
    from kvhost.vllm import scheduler as ksched

    monkeypatch.setattr(ksched.KvhostConnectorScheduler, "on_new_request", lambda self, request: None)
    loaded = []
    p, d = engines("newest", gen=6, loaded=loaded, extra={"kv_lease_duration": LEASE})
    params = _prefill(p, d, "n", 12, 8, gen=6)
    hog = _hog(d)
    d.scheduler.add_request(ReplayRequest("d-n", 12, dict(params), 8, max_tokens=2))
    p.run_until(lambda: "n" in p.workers[0].connector_worker.release_reasons, "the lease to lapse", others=(d,))
    assert p.workers[0].connector_worker.release_reasons["n"] == "timeout"
    p.run_until(lambda: p.idle(), "the prefill's blocks freed", others=(d,))
    d.scheduler.pool.give(hog)
    _drain(p, d)


@pytest.mark.parametrize("gen", LEASED_GENERATIONS)
def test_replay_lease_lapses_when_heartbeats_stop(engines, gen):
    """Generations 6 and 12: a queued decode request is renewed until its decode
    stops heartbeating (its engine goes away without a word: the workers'
    ranks close); then the prefill's lease lapses, released ``timeout``."""
    p, d = engines("newest", gen=gen, extra={"kv_lease_duration": LEASE})
    params = _prefill(p, d, "h", 12, 8, gen=gen)
    _hog(d)
    d.scheduler.add_request(ReplayRequest("d-h", 12, dict(params), 8, max_tokens=2))
    _wait_queued(p, d, "d-h", 3 * LEASE)
    assert "h" not in p.workers[0].connector_worker.release_reasons  # renewed so far
    for w in d.workers:
        w.shutdown()
    p.run_until(lambda: "h" in p.workers[0].connector_worker.release_reasons, "the lease to lapse")
    assert p.workers[0].connector_worker.release_reasons["h"] == "timeout"
    p.run_until(lambda: p.idle(), "the prefill's blocks freed")


@pytest.mark.parametrize("tps", [(1, 1), (2, 2), (2, 4)], ids=lambda t: "tp%d-%d" % t)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("gen", SIDECAR_GENERATIONS)
def test_replay_tp_pairs(engines, gen, mla, tps):
    """Each generation, MHA and MLA, prefill TP -> decode TP 1->1, 2->2
    and 2->4 (a decode rank reads part of a prefill rank's heads; MLA's
    latent is whole on every rank): every byte on every decode rank, each
    hold released as read. The profile is the vLLM of the generation."""
    loaded = []
    profile = "0.13" if gen == 2 else "newest"
    p, d = engines(profile, prefill_tp=tps[0], decode_tp=tps[1], gen=gen, loaded=loaded, mla=mla)
    reqs = [("a", 9, 41), ("b", 16, 42), ("c", 21, 43)]
    for rid, ntok, seed in reqs:
        params = _prefill(p, d, rid, ntok, seed, gen)
        d.scheduler.add_request(ReplayRequest("d-" + rid, ntok, dict(params), seed, max_tokens=2))
    _drain(p, d)
    assert sorted(loaded) == ["d-a", "d-b", "d-c"]
    for w in p.workers:
        assert {k: w.connector_worker.release_reasons[k] for k in "abc"} == dict.fromkeys("abc", "notified")
    # What each decode rank read: its heads (MLA: the latent) of every page.
    shape = d.shape
    planes, heads = (1, 1) if mla else (2, shape.kv_heads // tps[1])
    total = seconds = 0
    for rid, ntok, _ in reqs:
        want = shape.layers * planes * shape.pages(ntok) * heads * shape.page_size * shape.head_bytes
        for w in d.workers:
            res = w.connector_worker.read_results["d-" + rid]
            assert res["ok"] and res["bytes"] == want, (rid, res, want)
            total += res["bytes"]
            seconds += res["seconds"]
    print("\n%s gen %d %s TP %d->%d: %d bytes read in %.6f s of reads" % (
        BACKEND, gen, "MLA" if mla else "MHA", tps[0], tps[1], total, seconds))


def test_replay_abort_while_queued_unwatches(engines, monkeypatch):
    """Generation 6: a watched decode request aborted in the queue is
    unwatched on every decode rank (vLLM's request_finished stops its
    heartbeats) and its prefill notified, so it frees its blocks as
    read, not at the lease's end."""
    from kvhost import client as kc

    sent = []
    real = kc.Client.unwatch_nowait

    def recording(self, rank, request_id):
        sent.append(request_id)
        return real(self, rank, request_id)

    monkeypatch.setattr(kc.Client, "unwatch_nowait", recording)
    p, d = engines("newest", gen=6, extra={"kv_lease_duration": LEASE})
    params = _prefill(p, d, "u", 12, 8, gen=6)
    hog = _hog(d)
    d.scheduler.add_request(ReplayRequest("d-u", 12, dict(params), 8, max_tokens=2))
    for _ in range(3):
        d.step()  # the watch goes out with the step's metadata
    d.abort(["d-u"])
    d.step()
    assert sent == ["d-u"] * d.tp
    p.run_until(lambda: p.idle(), "the prefill's blocks freed", others=(d,))
    assert p.workers[0].connector_worker.release_reasons["u"] == "notified"
    d.scheduler.pool.give(hog)
    _drain(p, d)


def test_watch_refusal_is_logged(engines, caplog):
    """A pipelined watch the sidecar refuses (here: on a generation-2
    rank, which has no leases; the worker never sends one there) is
    logged, not lost."""
    from kvhost import client as kc

    p, d = engines("newest", gen=2)
    cw = d.workers[0].connector_worker
    assert not cw.leases
    params = _prefill(p, d, "g", 8, 3)
    with caplog.at_level(logging.WARNING, logger="kvhost.client"):
        cw._client.watch_nowait(cw.rank, "d-g", dict(params))
        with pytest.raises(kc.KVHostError):  # replies come in order: the refusal is in by its end
            cw._client.release("engine-d", "nobody")
    assert any("watch refused: unsupported" in r.getMessage() for r in caplog.records), caplog.text
    d.scheduler.add_request(ReplayRequest("d-g", 8, dict(params), 3, max_tokens=2))  # still served
    _drain(p, d)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_abort_before_scheduled(engines, profile):
    """A decode request aborted before it is scheduled: vLLM frees it at
    once (request_finished says not to wait); the connector only tells the
    prefill, which frees its blocks, and finished_recving never names it
    (vLLM's scheduler would assert and its engine core die)."""
    p, d = engines(profile)
    params = _prefill(p, d, "x", 8, 5)
    d.scheduler.add_request(ReplayRequest("d-x", 8, dict(params), 5, max_tokens=2))
    d.abort(["d-x"])
    assert "d-x" not in d.scheduler.requests
    p.run_until(lambda: p.idle(), "the prefill's blocks freed", others=(d,))
    assert p.workers[0].connector_worker.release_reasons["x"] == "notified"
    for _ in range(5):  # later steps: still nothing reported
        d.step()
    _drain(p, d)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_abort_before_scheduled_old_behaviour_kills_the_engine(engines, profile, monkeypatch):
    """The mutation check of the test above: a connector that reports the
    notify-only read in finished_recving (kvhost before this fix) trips
    the replayed scheduler's assert, as it kills vLLM's engine core."""
    from kvhost.vllm import scheduler as ksched

    real = ksched.KvhostConnectorScheduler.request_finished

    def old(self, request, block_ids):
        out = real(self, request, block_ids)
        entry = self._reqs_need_recv.get(request.request_id)
        if entry is not None:
            self._reqs_need_recv[request.request_id] = entry[:2] + (True,)
        return out

    monkeypatch.setattr(ksched.KvhostConnectorScheduler, "request_finished", old)
    p, d = engines(profile)
    params = _prefill(p, d, "x", 8, 5)
    d.scheduler.add_request(ReplayRequest("d-x", 8, dict(params), 5, max_tokens=2))
    d.abort(["d-x"])
    with pytest.raises(EngineCoreDied, match="which the scheduler freed"):
        d.run_until(lambda: False, "the engine core to die", others=(p,), timeout=20)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_abort_while_waiting_for_remote_kv(engines, profile):
    """A decode request aborted while its KV is loading keeps its blocks
    until the load is reported (finish_requests' delay_free_blocks), then
    vLLM frees it: finished_recving must name it exactly once."""
    p, d = engines(profile)
    params = _prefill(p, d, "w", 12, 7)
    d.scheduler.add_request(ReplayRequest("d-w", 12, dict(params), 7, max_tokens=2))
    d.step()  # scheduled: WAITING_FOR_REMOTE_KVS, the read goes out
    req = d.scheduler.requests["d-w"]
    assert req.status.name == "WAITING_FOR_REMOTE_KVS"
    d.abort(["d-w"])
    assert "d-w" in d.scheduler.requests  # blocks held for the read in flight
    _drain(p, d)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_kv_both(engines, profile):
    """kv_both (what vLLM's NIXL examples use) on both engines: each
    worker opens a prefill and a decode rank; each request's
    kv_transfer_params choose the direction."""
    loaded = []
    p, d = engines(profile, prefill_tp=2, decode_tp=2, prefill_role="kv_both", decode_role="kv_both", loaded=loaded)
    for w in p.workers + d.workers:
        cw = w.connector_worker
        assert cw.rank is not None and cw.prefill_rank is not None
    params = _prefill(p, d, "k", 10, 9)
    d.scheduler.add_request(ReplayRequest("d-k", 10, dict(params), 9, max_tokens=2))
    _drain(p, d)
    assert loaded == ["d-k"]
    # And the other way round: the decode engine prefills for the prefill one.
    params = _prefill(d, p, "r", 7, 4)
    p.scheduler.add_request(ReplayRequest("p-r", 7, dict(params), 4, max_tokens=2))
    _drain(p, d)
    assert loaded == ["d-k", "p-r"]
    assert all(w.connector_worker.release_reasons.get("r") == "notified" for w in d.workers)


def test_replay_finished_stopped_is_handed_off_newest(engines):
    """Current vLLM: a prefill whose only token is EOS (FINISHED_STOPPED)
    is held and read, not recomputed by the decode."""
    loaded = []
    p, d = engines("newest", loaded=loaded)
    params = _prefill(p, d, "s", 11, 3, eos=True)
    assert p.scheduler.requests["s"].status.name == "FINISHED_STOPPED"  # held: not freed
    d.scheduler.add_request(ReplayRequest("d-s", 11, dict(params), 3, max_tokens=2))
    _drain(p, d)
    assert loaded == ["d-s"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_failed_load_is_recomputed(engines, profile):
    """A load that fails (kv_transfer_params naming an engine nobody
    serves) is reported finished_recving with its blocks invalid in the
    same step or before: vLLM's scheduler marks it failed, frees its
    blocks and computes the prompt itself; nothing dies, nothing leaks.
    The prefill, never notified, releases at its abort timeout."""
    loaded = []
    p, d = engines(profile, decode_tp=2, loaded=loaded, extra={"kvhost_abort_timeout": 1})
    params = _prefill(p, d, "f", 10, 6)
    d.scheduler.add_request(ReplayRequest("d-f", 10, dict(params, remote_engine_id="nobody"), 6, max_tokens=2))
    d.run_until(lambda: "d-f" in d.scheduler.kv_transfer_params, "the decode to finish d-f", others=(p,))
    assert loaded == []  # never promoted as loaded: recomputed
    for w in d.workers:
        res = w.connector_worker.read_results["d-f"]
        assert not res["ok"] and res["reason"], res
    _drain(p, d)
    assert all(w.connector_worker.release_reasons["f"] == "timeout" for w in p.workers)
