"""kvhost.vllm.KvhostConnector against live ``kvhost serve`` sidecars.

Each test starts its sidecars from bin/kvhost (built by ``make``; the
tests fail, not skip, without it) and drives the connector in vLLM's call
order (vLLM's vllm/v1/core/sched/scheduler.py for the scheduler side,
vllm/v1/worker/kv_connector_model_runner_mixin.py for the workers), with
kvhost.vllm_standins in place of vLLM's own config, request and block
types. Bytes are checked in the engines' own shared memory with
kvhost.demo_pattern.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import time

import pytest

from kvhost import demo_pattern as pat
from kvhost import demo_vllm as dv
from kvhost import vllm as kvllm
from kvhost import vllm_standins as vs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KVHOST = os.environ.get("KVHOST_BIN", os.path.join(ROOT, "bin", "kvhost"))

SHAPE = pat.Shape(layers=2, kv_heads=4, head_bytes=32, page_size=4)
NUM_BLOCKS = 16
WAIT = 30.0  # generous: the machine is shared


class Sidecar:
    def __init__(self, tmpdir, name, env=None):
        if not os.access(KVHOST, os.X_OK):
            pytest.fail("%s is missing: run make (these tests need the kvhost binary)" % KVHOST)
        self.sock = os.path.join(tmpdir, name + ".sock")
        self.control = "ipc://" + self.sock
        self.log = open(os.path.join(tmpdir, name + ".log"), "wb")
        self.proc = subprocess.Popen(
            [KVHOST, "--backend", "fake", "serve", "--control", self.control],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, **(env or {})),
        )
        deadline = time.monotonic() + WAIT
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("kvhost serve did not start:\n" + open(self.log.name, errors="replace").read()[-3000:])
            time.sleep(0.02)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def sidecars(tmpdir_short):
    # tmpdir_short (conftest.py): ipc:// paths are limited to ~107 bytes.
    made = []

    def make(name, env=None):
        s = Sidecar(tmpdir_short, name, env)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


class Engine:
    """One vLLM engine (scheduler + TP workers) beside a sidecar."""

    def __init__(self, engine_id, kv_role, control, tp, extra=None):
        self.tp = tp
        self.pools = dv._pools(SHAPE, tp, NUM_BLOCKS)
        self.sched = kvllm.KvhostConnector(
            vs.make_config(engine_id, kv_role, control, tp_size=tp, layers=SHAPE.layers, kv_heads=SHAPE.kv_heads,
                           head_size=SHAPE.head_bytes // 2, block_size=SHAPE.page_size, extra=extra),
            kvllm.KVConnectorRole.SCHEDULER,
        )
        self.workers = dv._workers(engine_id, kv_role, control, SHAPE, tp, self.pools, extra)
        self.sending, self.recving, self.errors = {}, {}, set()

    def step(self, forward=None):
        meta = self.sched.build_connector_meta(vs.SchedulerOutput())
        s, r, e = dv._step_workers(self.workers, meta, forward)
        for k, v in s.items():
            self.sending[k] = self.sending.get(k, 0) + v
        for k, v in r.items():
            self.recving[k] = self.recving.get(k, 0) + v
        self.errors |= e
        return meta

    def until(self, cond, what):
        deadline = time.monotonic() + WAIT
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail("timed out waiting for " + what)
            self.step()
            time.sleep(0.005)

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


def prefill(engine, rid, ntok, seed, ids):
    """Prefill a request (max_tokens=1) and finish it: its kv_transfer_params."""
    req = vs.Request(rid, list(range(ntok)), {"do_remote_decode": True})
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    engine.sched.update_state_after_alloc(req, vs.kv_cache_blocks(ids), 0)

    def forward(rank):
        h0, h1 = SHAPE.heads_of(rank, engine.tp)
        pat.fill(engine.pools[rank][1], ids, seed, SHAPE, h0, h1)

    engine.step(forward)
    req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = engine.sched.request_finished(req, ids)
    assert delay is True and params is not None
    return params


def load(engine, rid, ntok, params, ids, hashed=0):
    """Decode side: schedule a request with the prefill's params."""
    req = vs.Request(rid, list(range(ntok)), dict(params))
    n, is_async = engine.sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (ntok, True)
    engine.sched.update_state_after_alloc(req, vs.kv_cache_blocks(ids, hashed), n)
    return req


def check_all(engine, ids, seed):
    for r in range(engine.tp):
        h0, h1 = SHAPE.heads_of(r, engine.tp)
        why = pat.check(engine.pools[r][1], ids, seed, SHAPE, h0, h1)
        assert why is None, "rank %d: %s" % (r, why)


@pytest.fixture
def pair(sidecars):
    made = []

    def make(prefill_tp=1, decode_tp=2, prefill_extra=None, decode_extra=None):
        sp, sd = sidecars("prefill"), sidecars("decode")
        p = Engine("engine-p", "kv_producer", sp.control, prefill_tp, prefill_extra)
        d = Engine("engine-d", "kv_consumer", sd.control, decode_tp, decode_extra)
        made.extend([p, d])
        return p, d, sp, sd

    yield make
    for e in made:
        e.close()


def test_import_by_module_path_without_vllm():
    # vLLM's KVConnectorFactory loads kv_connector_module_path, then the
    # class named kv_connector.
    mod = importlib.import_module("kvhost.vllm")
    cls = getattr(mod, "KvhostConnector")
    assert issubclass(cls, mod.KVConnectorBase_V1)
    assert not mod.HAVE_VLLM
    cfg = vs.make_config("e", "kv_producer", "ipc:///nonexistent")
    assert cls.get_required_kvcache_layout(cfg) == "HND"


def test_pull_tp1_to_tp2_every_byte_and_release(pair):
    p, d, _, _ = pair(prefill_tp=1, decode_tp=2)
    seeds = {"r1": 11, "r2": 22}
    ntok = {"r1": 9, "r2": 16}
    pids = {"r1": [3, 1, 7], "r2": [0, 2, 4, 5]}
    dids = {"r1": [10, 4, 6], "r2": [1, 2, 3, 15]}
    params = {rid: prefill(p, rid, ntok[rid], seeds[rid], pids[rid]) for rid in seeds}
    for rid, pr in params.items():
        assert pr["do_remote_prefill"] is True and pr["remote_engine_id"] == "engine-p"
        assert pr["remote_request_id"] == rid and list(pr["remote_block_ids"]) == pids[rid]
        load(d, "d-" + rid, ntok[rid], pr, dids[rid])
    d.until(lambda: all(d.recving.get("d-" + r) == d.tp for r in seeds), "decode finished_recving")
    assert not d.errors, [w.connector_worker.read_results for w in d.workers]
    for rid in seeds:
        check_all(d, dids[rid], seeds[rid])
        for w in d.workers:
            assert w.connector_worker.read_results["d-" + rid]["ok"]
    # The prefill's workers report the release once every decode rank read.
    p.until(lambda: all(p.sending.get(r) == p.tp for r in seeds), "prefill finished_sending")
    for w in p.workers:
        assert w.connector_worker.release_reasons == {"r1": "notified", "r2": "notified"}


def test_pull_tp2_to_tp4_every_byte(pair):
    p, d, _, _ = pair(prefill_tp=2, decode_tp=4)
    params = prefill(p, "x", 13, 5, [8, 9, 10, 11])
    load(d, "d-x", 13, params, [3, 0, 12, 6])
    d.until(lambda: d.recving.get("d-x") == 4, "decode finished_recving")
    assert not d.errors, [w.connector_worker.read_results for w in d.workers]
    check_all(d, [3, 0, 12, 6], 5)
    p.until(lambda: p.sending.get("x") == 2, "prefill finished_sending")


def test_mutation_one_wrong_byte_fails_the_check(pair):
    """The mutation check: after a verified transfer, one byte flipped in
    the decode's memory makes the check fail, naming page and byte."""
    p, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    params = prefill(p, "m", 8, 3, [2, 5])
    load(d, "d-m", 8, params, [7, 1])
    d.until(lambda: d.recving.get("d-m") == 1, "decode finished_recving")
    check_all(d, [7, 1], 3)
    d.pools[0][1][1, 1, 1, 2, 3, 17] ^= 0x01  # layer 1, V, block 1 (page 1), head 2, token 3, byte 17
    why = pat.check(d.pools[0][1], [7, 1], 3, SHAPE, 0, SHAPE.kv_heads)
    assert why is not None
    assert "page 1 (block 1) layer 1 V head 2 token 7 byte 17" in why and "1 wrong bytes" in why


def test_full_prefix_hit_reads_nothing_and_frees_prefill(pair):
    p, d, _, _ = pair(prefill_tp=1, decode_tp=2)
    params = prefill(p, "h", 8, 4, [0, 1])
    req = vs.Request("d-h", list(range(8)), dict(params))
    # Every token already computed locally: nothing to load.
    assert d.sched.get_num_new_matched_tokens(req, 8) == (0, False)
    d.sched.update_state_after_alloc(req, vs.kv_cache_blocks([4, 5], hashed=2), 0)
    meta = d.step()
    assert meta.reqs_to_recv["d-h"].local_block_ids == []
    assert meta.reqs_to_recv["d-h"].awaiting_kvs is False
    p.until(lambda: p.sending.get("h") == 1, "prefill finished_sending")
    d.step()
    # vLLM keeps a full-hit request RUNNING: finished_recving must not name
    # it (vLLM's scheduler asserts a reported request is finished or
    # waiting for KV).
    assert "d-h" not in d.recving


def test_abort_before_scheduled_frees_prefill(pair):
    """A decode request finished (aborted) before it was scheduled still
    tells the prefill, which frees its blocks before the timeout."""
    p, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    params = prefill(p, "a", 8, 4, [0, 1])
    req = vs.Request("d-a", list(range(8)), dict(params), status=vs.RequestStatus.FINISHED_ABORTED)
    assert d.sched.request_finished(req, []) == (False, None)
    meta = d.step()  # the notify-only read goes out
    assert meta.reqs_to_recv["d-a"].awaiting_kvs is False
    p.until(lambda: p.sending.get("a") == 1, "prefill finished_sending")
    assert p.workers[0].connector_worker.release_reasons["a"] == "notified"
    d.step()
    # vLLM freed it at request_finished: reporting it would kill vLLM's
    # engine core (test_vllm_replay.py replays that order).
    assert "d-a" not in d.recving


def test_prefill_aborted_request_is_not_held(pair):
    p, _, _, _ = pair(prefill_tp=1, decode_tp=1)
    req = vs.Request("s", list(range(8)), {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req, vs.kv_cache_blocks([0, 1]), 0)
    p.step()
    req.status = vs.RequestStatus.FINISHED_ABORTED
    assert p.sched.request_finished(req, [0, 1]) == (False, None)
    meta = p.step()
    assert meta.reqs_not_processed == {"s"}


def test_abort_timeout_releases_unread_blocks(sidecars):
    sp = sidecars("prefill")
    p = Engine("engine-p", "kv_producer", sp.control, 2, {"kvhost_abort_timeout": 1})
    try:
        t0 = time.monotonic()
        prefill(p, "t", 8, 4, [0, 1])
        p.until(lambda: p.sending.get("t") == 2, "release at the abort timeout")
        assert time.monotonic() - t0 >= 0.9
        for w in p.workers:
            assert w.connector_worker.release_reasons["t"] == "timeout"
    finally:
        p.close()


def _expect_failed_load(d, rid, ids):
    d.until(lambda: d.recving.get(rid) == d.tp, "failed load reported as finished_recving")
    assert set(ids) <= d.errors, (ids, d.errors)
    for w in d.workers:
        res = w.connector_worker.read_results[rid]
        assert not res["ok"] and res["reason"], res


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda pr: pr.update(remote_engine_id="no-such-engine"), id="unknown-engine"),
    pytest.param(lambda pr: pr.update(remote_port="5600"), id="port-not-int"),
    pytest.param(lambda pr: pr.update(remote_block_ids=[0]), id="fewer-remote-blocks"),
    pytest.param(lambda pr: pr.update(tp_size=3), id="tp-size-not-dividing"),
    pytest.param(lambda pr: pr.update(remote_host="127.0.0.1", remote_port=1), id="nothing-at-remote-port"),
    pytest.param(lambda pr: pr.update(remote_block_ids=[0, 1 << 30]), id="remote-block-out-of-range"),
])
def test_bad_kv_transfer_params_fail_the_load(pair, mutate):
    p, d, _, _ = pair(prefill_tp=1, decode_tp=2)
    params = prefill(p, "b", 8, 4, [0, 1])
    bad = dict(params)
    mutate(bad)
    load(d, "d-b", 8, bad, [2, 3])
    _expect_failed_load(d, "d-b", [2, 3])


def test_kv_transfer_params_missing_keys_load_nothing(pair):
    """As vLLM's NIXL connector: params without remote_host & co. are
    refused by the scheduler (a warning), no read is started."""
    _, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    req = vs.Request("d-z", list(range(8)), {"do_remote_prefill": True, "remote_block_ids": [0, 1]})
    d.sched.update_state_after_alloc(req, vs.kv_cache_blocks([0, 1]), 8)
    meta = d.step()
    assert meta.reqs_to_recv == {} and req.kv_transfer_params["do_remote_prefill"] is False


def test_prefill_engine_gone_fails_the_load(pair):
    p, d, sp, _ = pair(prefill_tp=1, decode_tp=2)
    params = prefill(p, "g", 8, 4, [0, 1])
    sp.kill()
    load(d, "d-g", 8, params, [5, 6])
    _expect_failed_load(d, "d-g", [5, 6])


def test_sidecar_gone_fails_reads_in_flight(pair):
    """The decode's own sidecar dies: a read in flight is reported finished
    with its blocks invalid (vLLM recomputes them), not left hanging."""
    p, d, _, sd = pair(prefill_tp=1, decode_tp=1)
    params = prefill(p, "k", 8, 4, [0, 1])
    load(d, "d-k", 8, params, [5, 6])
    # The read is sent in this step; the sidecar dies before or after it
    # completes: either way the request must end (ok or failed), never hang.
    sd.kill()
    d.until(lambda: d.recving.get("d-k") == 1, "finished_recving after the sidecar died")
    res = d.workers[0].connector_worker.read_results["d-k"]
    if not res["ok"]:
        assert {5, 6} <= d.errors


def test_release_before_reqs_to_send_leaves_nothing_tracked(pair):
    """The decode can read and the prefill's sidecar release before the
    prefill scheduler's next build_connector_meta names the request in
    reqs_to_send (async scheduling): the worker reports it once and keeps
    tracking nothing (as vLLM's NIXL worker, which only arms requests still
    in _reqs_to_process)."""
    p, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    params = prefill(p, "e", 8, 4, [0, 1])
    load(d, "d-e", 8, params, [2, 3])
    d.until(lambda: d.recving.get("d-e") == 1, "decode finished_recving")
    w = p.workers[0]
    deadline = time.monotonic() + WAIT
    sent = set()
    while "e" not in sent:  # the workers' get_finished, no scheduler step
        assert time.monotonic() < deadline, "no release"
        sent |= w.get_finished(set())[0]
        time.sleep(0.005)
    meta = p.step()  # now the scheduler's metadata names it in reqs_to_send
    assert "e" in meta.reqs_to_send
    assert "e" not in p.sending
    assert w.connector_worker._reqs_to_process == set()


def test_prefill_sidecar_gone_frees_held_blocks(pair):
    """The prefill's own sidecar dies with requests held: nothing can read
    them any more, so every worker reports them finished_sending (vLLM
    frees the blocks) instead of holding them forever; a request finishing
    afterwards is not held (request_finished returns (False, None), it does
    not raise into vLLM's scheduler)."""
    p, _, sp, _ = pair(prefill_tp=2, decode_tp=2)
    prefill(p, "q1", 8, 4, [0, 1])
    p.step()  # the metadata naming q1 in reqs_to_send reaches the workers
    prefill(p, "q2", 8, 5, [2, 3])  # held; its reqs_to_send comes after the loss
    sp.kill()
    p.until(lambda: p.sending.get("q1") == 2 and p.sending.get("q2") == 2, "held requests reported after the loss")
    req = vs.Request("q3", list(range(8)), {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req, vs.kv_cache_blocks([4, 5]), 0)
    p.step()
    req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.sched.request_finished(req, [4, 5]) == (False, None)
    meta = p.step()
    assert "q3" in meta.reqs_not_processed
    for w in p.workers:
        assert w.connector_worker._reqs_to_process == set()


@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_sidecar_restarted_serves_again(pair, sidecars, which):
    """A sidecar dies and another starts on the same socket: the engine's
    connectors connect again and register again on their own (no vLLM
    restart), and the next request moves every byte."""
    p, d, sp, sd = pair(prefill_tp=1, decode_tp=2)
    eng, side = (d, sd) if which == "decode" else (p, sp)
    side.kill()
    os.unlink(side.sock)  # the killed sidecar's socket file
    deadline = time.monotonic() + WAIT
    while any(w.connector_worker._client.lost is None for w in eng.workers):
        assert time.monotonic() < deadline, "the loss was not noticed"
        time.sleep(0.01)
    new = sidecars(which + "2")
    os.rename(new.sock, side.sock)  # the new sidecar at the old address
    params = None
    deadline = time.monotonic() + WAIT
    while params is None:  # the prefill scheduler's hold reconnects too
        assert time.monotonic() < deadline, "hold never succeeded again"
        p.step()
        req = vs.Request("n%d" % int(time.monotonic() * 1000), list(range(8)), {"do_remote_decode": True})
        p.sched.update_state_after_alloc(req, vs.kv_cache_blocks([0, 1]), 0)
        for r in range(p.tp):
            pat.fill(p.pools[r][1], [0, 1], 9, SHAPE, *SHAPE.heads_of(r, p.tp))
        p.step()
        req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p.sched.request_finished(req, [0, 1])
        time.sleep(0.05)
    load(d, "d-n", 8, params, [4, 5])
    d.until(lambda: d.recving.get("d-n") == 2, "decode finished_recving")
    assert not d.errors, [w.connector_worker.read_results for w in d.workers]
    check_all(d, [4, 5], 9)


def test_get_transfer_results_for_current_vllm(pair, monkeypatch):
    """Current vLLM's model runner (kv_connector_model_runner_mixin.py @
    00f4240e) asks get_transfer_results: vLLM's KVConnectorTransferResults
    (a stand-in module here) with a failed read in finished_recving and in
    failed_recving, a good one only in finished_recving."""
    import sys
    import types
    from dataclasses import dataclass, field

    @dataclass
    class KVConnectorTransferResults:
        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)
        prefix_replay_checkpoints: dict = field(default_factory=dict)

    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorTransferResults = KVConnectorTransferResults
    monkeypatch.setitem(sys.modules, base.__name__, base)
    p, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    good = prefill(p, "t1", 8, 4, [0, 1])
    bad = dict(prefill(p, "t2", 8, 5, [2, 3]), remote_engine_id="no-such-engine")
    load(d, "d-t1", 8, good, [4, 5])
    load(d, "d-t2", 8, bad, [6, 7])
    w = d.workers[0]
    w.bind_connector_metadata(d.sched.build_connector_meta(vs.SchedulerOutput()))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    got = KVConnectorTransferResults()
    deadline = time.monotonic() + WAIT
    while got.finished_recving != {"d-t1", "d-t2"}:
        assert time.monotonic() < deadline, got
        r = w.get_transfer_results(set())
        assert isinstance(r, KVConnectorTransferResults)
        got.finished_recving |= r.finished_recving
        got.failed_recving |= r.failed_recving
        time.sleep(0.005)
    assert got.failed_recving == {"d-t2"}
    check_all(d, [4, 5], 4)


def test_agent_params(sidecars):
    """The decode rank reads, so the sidecar gives its agent the host's
    num_threads default (the fake plugin documents the key, as nixl does);
    the prefill, whose memory the decode reads from its own process, the
    target's prefault=false; vLLM's own num_threads knob, when set, goes to
    every rank's agent."""
    s = sidecars("agent-params")
    engines = [Engine("engine-d", "kv_consumer", s.control, 1), Engine("engine-p", "kv_producer", s.control, 1),
               Engine("engine-d2", "kv_consumer", s.control, 1, {"num_threads": 2}),
               Engine("engine-p2", "kv_producer", s.control, 1, {"num_threads": 2})]
    try:
        got = [e.workers[0].connector_worker.agent_params for e in engines]
        assert got[0] == {"num_threads": "4"}, got
        assert got[1] == {"prefault": "false"}, got
        assert got[2]["num_threads"] == "2" and got[3]["num_threads"] == "2", got
    finally:
        for e in engines:
            e.close()


def test_refused_read_fails_the_load_without_waiting(pair):
    """start_load_kv does not wait for the sidecar (issue 24: vLLM calls it
    in the forward pass): a read the sidecar refuses (a local block id
    outside the decode rank's blocks) comes back on the I/O thread and is
    reported like a read that failed, its blocks invalid, with the
    sidecar's reason; the other request of the step loads."""
    p, d, _, _ = pair(prefill_tp=1, decode_tp=1)
    waited = []
    for w in d.workers:
        c = w.connector_worker._client
        real = c._request

        def request(msg, timeout=None, real=real):
            waited.append(msg["op"])
            return real(msg, timeout)

        c._request = request
    good = prefill(p, "ok", 8, 4, [0, 1])
    load(d, "d-ok", 8, good, [4, 5])
    # kv_transfer_params that are not a map: the sidecar refuses the read
    # (bad_request); vLLM's scheduler would not pass such params, but a
    # refusal of any kind takes this path.
    build = d.sched.build_connector_meta

    def with_bad_read(out):
        meta = build(out)
        meta.reqs_to_recv["d-bad"] = kvllm.ReqMeta(local_block_ids=[6, 7], kv_transfer_params=["not", "a", "map"])
        d.sched.build_connector_meta = build
        return meta

    d.sched.build_connector_meta = with_bad_read
    _expect_failed_load(d, "d-bad", [6, 7])
    res = d.workers[0].connector_worker.read_results["d-bad"]
    assert "read refused" in res["reason"] and "bad_request" in res["reason"], res
    d.until(lambda: d.recving.get("d-ok") == d.tp, "the good request loaded")
    assert d.workers[0].connector_worker.read_results["d-ok"]["ok"]
    check_all(d, [4, 5], 4)
    assert "read" not in waited, waited


def _scheduler_of(engine):
    return engine.sched.connector_scheduler


def test_holds_after_the_first_do_not_wait(pair):
    """request_finished waits for the first hold only (issue 24): later
    params are made from its reply and are exactly what the sidecar
    answers (every reply is compared), and the pulls move every byte."""
    p, d, _, _ = pair(prefill_tp=1, decode_tp=2)
    sched = _scheduler_of(p)
    seeds = {"h%d" % i: 30 + i for i in range(4)}
    pids = {"h0": [0, 1], "h1": [2, 3], "h2": [4, 5], "h3": [6, 7]}
    params = {rid: prefill(p, rid, 8, seeds[rid], pids[rid]) for rid in seeds}
    assert (sched.holds_waited, sched.holds_pipelined) == (1, 3)
    for i, (rid, pr) in enumerate(params.items()):
        assert list(pr["remote_block_ids"]) == pids[rid] and pr["remote_request_id"] == rid
        load(d, "d-" + rid, 8, pr, [8 + 2 * i, 9 + 2 * i])
    d.until(lambda: all(d.recving.get("d-" + r) == d.tp for r in seeds), "decode finished_recving")
    assert not d.errors, [w.connector_worker.read_results for w in d.workers]
    for i, rid in enumerate(seeds):
        check_all(d, [8 + 2 * i, 9 + 2 * i], seeds[rid])
    p.until(lambda: all(p.sending.get(r) == p.tp for r in seeds), "prefill finished_sending")
    assert sched.template_mismatches == 0


def test_refused_pipelined_hold_frees_the_blocks(pair):
    """A hold sent without waiting that the sidecar refuses (a block id
    outside the rank's blocks) reaches the workers through the next
    metadata, and they report the request finished_sending, so vLLM frees
    its blocks instead of keeping them for a hold that never was; the
    next request is held as usual."""
    p, d, _, _ = pair(prefill_tp=2, decode_tp=2)
    sched = _scheduler_of(p)
    prefill(p, "first", 8, 1, [0, 1])  # the round trip that gives the template
    req = vs.Request("bad", list(range(8)), {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req, vs.kv_cache_blocks([2, 3]), 0)
    p.step()
    req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.sched.request_finished(req, [2, NUM_BLOCKS + 5])
    assert delay is True and params["remote_request_id"] == "bad"
    assert sched.holds_pipelined == 1
    p.until(lambda: p.sending.get("bad") == p.tp, "refused hold reported finished_sending")
    for w in p.workers:
        reason = w.connector_worker.release_reasons["bad"]
        assert "hold refused" in reason and "bad_request" in reason, reason
    good = prefill(p, "after", 8, 2, [4, 5])
    load(d, "d-after", 8, good, [6, 7])
    d.until(lambda: d.recving.get("d-after") == d.tp, "decode finished_recving")
    assert not d.errors
    check_all(d, [6, 7], 2)


def test_region_names_are_the_layer_names(sidecars):
    """From NIXL connector version 11 a prefill advertises each region's
    layer (region_names): the worker hands the sidecar vLLM's kv_caches
    keys, K and V of a layer sharing one, and a version-12 decode (the
    handshake-only vLLM peer of host/pull's tests) reads them back."""
    s = sidecars("region-names")
    e = Engine("engine-p12", "kv_producer", s.control, 1,
               {"kvhost_nixl_connector_version": 12, "kvhost_vllm_version": "0.21.0"})
    try:
        w = e.workers[0].connector_worker
        assert w.endpoint
        peer = os.path.join(os.path.dirname(__file__), "..", "..", "host", "pull", "testdata", "vllm_nixl_peer.py")
        out = subprocess.run(["/usr/bin/python3", peer, "req", w.endpoint, "0", "12"], check=True,
                             capture_output=True, timeout=60).stdout
        md = json.loads(out)["metadata"]
        want = ["model.layers.%d.self_attn" % (i // 2) for i in range(2 * SHAPE.layers)]
        assert md["region_names"] == want, md
    finally:
        e.close()
