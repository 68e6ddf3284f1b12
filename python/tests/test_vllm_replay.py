"""KvhostConnector driven exactly as vLLM drives a KV connector
(tests/vllm_engine.py replays vLLM's engine core, scheduler, executor and
model runner, each step named by upstream file, function and commit),
for vLLM 0.13 (the reference) and current vLLM, against live ``kvhost
serve`` sidecars on the fake plugin. Every byte is checked on every decode
worker when the scheduler promotes the request out of
WAITING_FOR_REMOTE_KVS; the replayed scheduler keeps vLLM's asserts, so a
connector that reports a request vLLM already freed fails the test as it
would kill vLLM's engine core.

Wire generations: the sidecar speaks NIXL connector generation 2 (vLLM
0.13) today; the generation-6 and -12 runs are strict xfails that fail
(XPASS) once the sidecar's later codecs (worktree wt-vgo) merge, telling
whoever merges to drop the marker.
"""

from __future__ import annotations

import pytest

from kvhost import demo_pattern as pat
from kvhost.vllm import generations
from vllm_engine import PROFILES, EngineCoreDied, Engine, ReplayRequest

SHAPE = pat.Shape(layers=2, kv_heads=4, head_bytes=32, page_size=4)
NUM_BLOCKS = 32

# What the sidecar speaks now. Later generations: see the module doc.
SIDECAR_GENERATIONS = (2,)


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
            h0, h1 = SHAPE.heads_of(r, e.tp)
            why = pat.check(e.pools[r][1], block_ids, request.seed, SHAPE, h0, h1)
            assert why is None, "rank %d, request %s: %s" % (r, request.request_id, why)
        if loaded is not None:
            loaded.append(request.request_id)

    return check


@pytest.fixture
def engines(sidecar_factory, monkeypatch):
    import sys
    import types

    from kvhost import vllm_standins as vs

    # Current vLLM's KVConnectorTransferResults, where KvhostConnector's
    # get_transfer_results imports it from.
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorTransferResults = vs.KVConnectorTransferResults
    monkeypatch.setitem(sys.modules, base.__name__, base)
    made = []

    def make(profile, prefill_tp=1, decode_tp=2, prefill_role="kv_producer", decode_role="kv_consumer",
             gen=2, loaded=None, extra=None):
        prof = PROFILES[profile]
        sp, sd = sidecar_factory("prefill"), sidecar_factory("decode")
        extra = dict(extra or {}, kvhost_nixl_connector_version=gen)
        p = Engine("engine-p", prefill_role, sp.endpoint, prefill_tp, SHAPE, NUM_BLOCKS, prof, extra)
        made.append(p)
        d = Engine("engine-d", decode_role, sd.endpoint, decode_tp, SHAPE, NUM_BLOCKS, prof, extra)
        for e in (p, d):
            e.scheduler.on_loaded = _checker(e, loaded)
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


@pytest.mark.parametrize("gen", SIDECAR_GENERATIONS + tuple(
    pytest.param(g, marks=pytest.mark.xfail(strict=True, raises=WrongGeneration,
                                            reason="the sidecar speaks generation 2 until wt-vgo merges"))
    for g in sorted(generations.GENERATIONS) if g not in SIDECAR_GENERATIONS))
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replay_every_byte(engines, profile, gen):
    """Prefill TP 1 -> decode TP 2: three requests, one a partial local
    prefix hit on the decode, one ended by EOS (FINISHED_STOPPED) at the
    prefill, which current vLLM's NIXL connector hands off too."""
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
