"""The engine demo's vLLM-style pair: a prefill engine and a decode engine,
each a Python process that owns its KV pools (numpy arrays in shared
memory, vLLM's HND layout) and drives :class:`kvhost.vllm.KvhostConnector`
in vLLM's scheduler/worker call order, beside its own ``kvhost serve``.

Per engine step, as vLLM's engine core and its workers call a connector
(vLLM's vllm/v1/core/sched/scheduler.py and
vllm/v1/worker/kv_connector_model_runner_mixin.py):

- scheduler: get_num_new_matched_tokens, allocate, update_state_after_alloc
  for each new request, then build_connector_meta;
- every worker: bind_connector_metadata, start_load_kv, (the forward pass:
  the prefill writes the request's KV), wait_for_save, get_finished,
  get_block_ids_with_load_errors, clear_connector_metadata;
- scheduler: request_finished for requests that finished this step (the
  prefill's, which hold their blocks until every worker reports them in
  finished_sending; the decode's after the check);

and a request moves on only when every TP worker reported it (vLLM's
KVOutputAggregator). The decode checks every byte of every rank's pages
with kvhost.demo_pattern before freeing them; the prefill reuses freed
blocks at once, so a release before the decode's read completed shows as
wrong bytes.

The forward pass and the check are GPU work: each engine runs them on its
device thread (kvhost.demo_device). The prefill's step launches every
worker's forward pass and waits for the device before wait_for_save (vLLM's
step returns the sampled tokens, a GPU sync, before the scheduler finishes
the request); the decode's step launches the check of the requests it
finished loading as that step's forward pass and waits for the device
likewise before it finishes them and frees their blocks. (A decode loop
that kept stepping meanwhile measured worse here: it ran every worker's
per-step calls a thousand times a second against the device thread for
the GIL and the cores.)
"""

from __future__ import annotations

import queue
import signal
import sys
import time
import traceback

import numpy as np

from kvhost import demo_pattern as pat
from kvhost import vllm as kvllm
from kvhost.demo_device import Device
from kvhost import vllm_standins as vs


def exit_on_sigterm():
    """An engine the demo terminates (SIGTERM) exits through Python, so
    kvhost.shm unlinks its pools (at exit) instead of leaving them in
    /dev/shm."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


class Phases:
    """Where an engine loop's wall time goes: seconds per phase
    ("adapter" (the adapter calls a request makes once or once per chunk:
    creating, initialising, sending, finishing), "poll" (the calls the
    engine's loop makes every pass whatever it has to do: SGLang's poll(),
    vLLM's per-step connector calls), "wait_device" (blocked until the
    device thread (kvhost.demo_device) finishes a job, nothing else to
    do), "idle" (sleeping for lack of work), "fill"/"verify" where they
    run on the loop's thread (no device given), the rest "other"), how many calls or passes each
    counted phase took, and the intervals its requests' transfers were in
    flight as the engine saw them (from handing a request's KV to kvhost
    to seeing it done)."""

    # Phases whose thread CPU time is measured beside their wall time:
    # on a machine with more runnable threads than cores an engine's
    # thread waits for a core inside a call as anywhere else, and the
    # difference says how much of a call's wall time was that.
    CPU_TIMED = ("adapter", "poll")

    def __init__(self):
        self.t0 = time.monotonic()
        self.secs = {}
        self.cpu = {}
        self.counts = {}
        self.spans = []

    def timed(self, name, count=0):
        """A context timing a phase; count adds to the phase's count (the
        calls or passes it made)."""
        if count:
            self.counts[name] = self.counts.get(name, 0) + count
        return _Timed(self, name, name in self.CPU_TIMED)

    def add(self, name, dt, cpu=None):
        self.secs[name] = self.secs.get(name, 0.0) + dt
        if cpu is not None:
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu

    def report(self):
        wall = time.monotonic() - self.t0
        out = dict(self.secs)
        out["other"] = max(0.0, wall - sum(self.secs.values()))
        out["wall"] = wall
        return {"phases": out, "cpu": dict(self.cpu), "counts": dict(self.counts), "spans": self.spans}


class _Timed:
    __slots__ = ("ph", "name", "cpu", "t", "c")

    def __init__(self, ph, name, cpu):
        self.ph, self.name, self.cpu = ph, name, cpu

    def __enter__(self):
        self.t = time.monotonic()
        if self.cpu:
            self.c = time.thread_time()

    def __exit__(self, *_):
        # CPU clock read inside the wall interval at both ends, so the
        # CPU time of a call never exceeds its wall time by the cost of a
        # clock read (a system call for the thread CPU clock; thousands of
        # poll() calls add them up).
        c = time.thread_time() if self.cpu else 0.0
        t = time.monotonic()
        self.ph.add(self.name, t - self.t, c - self.c if self.cpu else None)


class BlockPool:
    """vLLM's free block queue, reduced: ids out, ids back."""

    def __init__(self, n):
        self.free = list(range(n - 1, -1, -1))

    def take(self, n):
        if n > len(self.free):
            return None
        out = self.free[-n:]
        del self.free[-n:]
        return out[::-1]

    def give(self, ids):
        self.free.extend(ids)


def _pools(shape, tp_size, num_blocks, backing="shm"):
    """One shared-memory pool per rank: (layers, 2, blocks, heads/TP,
    page_size, head_bytes) uint8, vLLM's HND per layer; and its
    kv_caches dict {layer name: (2, blocks, ...) view}. ``backing``:
    kvhost.shm's, "memfd" (sealed memfds, which the fake plugin may map)
    or "shm"."""
    from kvhost import shm

    heads = shape.kv_heads // tp_size
    dims = (shape.layers, 2, num_blocks, heads, shape.page_size, shape.head_bytes)
    size = int(np.prod(dims))
    out = []
    for _ in range(tp_size):
        sp = shm.SharedPool(size, backing=backing)
        sp.populate()  # allocated up front, as an engine's KV memory is
        arr = sp.ndarray("uint8", dims)
        caches = {"model.layers.%d.self_attn" % i: arr[i] for i in range(shape.layers)}
        out.append((sp, arr, caches))
    return out


def _workers(engine_id, kv_role, control, shape, tp_size, pools, extra=None):
    workers = []
    for r in range(tp_size):
        cfg = vs.make_config(
            engine_id, kv_role, control, tp_size=tp_size, tp_rank=r, layers=shape.layers,
            kv_heads=shape.kv_heads, head_size=shape.head_bytes // 2, block_size=shape.page_size, extra=extra,
        )
        w = kvllm.KvhostConnector(cfg, kvllm.KVConnectorRole.WORKER)
        w.register_kv_caches(pools[r][2])
        workers.append(w)
    return workers


def _step_workers(workers, meta, forward=None, ph=None, device=None):
    """One step of every worker; returns (sending counts, recving counts,
    load-error blocks) of this step. The connector calls count as "poll"
    in ph (a Phases). forward(rank), the forward pass, runs between every
    worker's start_load_kv and its wait_for_save: on ``device`` (a
    kvhost.demo_device.Device, the step waiting for it as vLLM's step
    waits for its sampled tokens) or, without one, on this thread
    ("fill"). The workers are separate processes in vLLM, so their calls
    interleave here as they may there."""
    ph = ph or Phases()
    sending, recving, errors = {}, {}, set()
    for w in workers:
        with ph.timed("poll"):
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
    if forward is not None:
        if device is not None:
            device.wait([device.submit("fill", forward, r) for r in range(len(workers))], ph)
        else:
            for r in range(len(workers)):
                with ph.timed("fill"):
                    forward(r)
    for w in workers:
        with ph.timed("poll"):
            w.wait_for_save()
            s, v = w.get_finished(set())
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        for x in s:
            sending[x] = sending.get(x, 0) + 1
        for x in v:
            recving[x] = recving.get(x, 0) + 1
    return sending, recving, errors


def prefill_engine(args, control, requests, to_decode, results):
    """The prefill engine: prefills each request (writes its KV into every
    rank's pages), finishes it with max_tokens=1 and hands the
    kv_transfer_params of request_finished to the decode (the proxy's
    part)."""
    exit_on_sigterm()
    dev = None
    try:
        shape = pat.Shape(args["layers"], args["kv_heads"], args["head_bytes"], args["page_size"])
        tp = args["prefill_tp"]
        num_blocks = args["num_blocks"]
        pools = _pools(shape, tp, num_blocks, args.get("pool", "shm"))
        sched = kvllm.KvhostConnector(
            vs.make_config("prefill-engine", "kv_producer", control, tp_size=tp, layers=shape.layers,
                           kv_heads=shape.kv_heads, head_size=shape.head_bytes // 2, block_size=shape.page_size),
            kvllm.KVConnectorRole.SCHEDULER,
        )
        workers = _workers("prefill-engine", "kv_producer", control, shape, tp, pools)
        blocks = BlockPool(num_blocks)
        ph = Phases()
        dev = Device(args.get("device_priority", "idle"), delay=args.get("device_delay", 0.0))
        todo = list(requests)  # (request id, tokens, seed)
        held = {}  # request id -> (block ids, workers reported)
        deadline = time.monotonic() + args["timeout"]
        while todo or held:
            if time.monotonic() > deadline:
                raise TimeoutError("prefill: %d requests not prefilled, %d still held" % (len(todo), len(held)))
            new = []
            while todo and len(held) + len(new) < args["prefill_inflight"]:
                rid, ntok, seed = todo[0]
                req = vs.Request(rid, list(range(ntok)), {"do_remote_decode": True})
                with ph.timed("adapter"):
                    n, is_async = sched.get_num_new_matched_tokens(req, 0)
                assert (n, is_async) == (0, False)
                ids = blocks.take(shape.pages(ntok))
                if ids is None:
                    break
                todo.pop(0)
                with ph.timed("adapter"):
                    sched.update_state_after_alloc(req, vs.kv_cache_blocks(ids), 0)
                new.append((req, ids, seed))
            with ph.timed("poll", 1):
                meta = sched.build_connector_meta(vs.SchedulerOutput())

            def forward(rank):
                h0, h1 = shape.heads_of(rank, tp)
                for req, ids, seed in new:
                    pat.fill(pools[rank][1], ids, seed, shape, h0, h1)

            sending, _, _ = _step_workers(workers, meta, forward if new else None, ph, dev)
            for rid, k in sending.items():
                ids, seen = held[rid]
                seen += k
                if seen == tp:
                    del held[rid]
                    blocks.give(ids)
                else:
                    held[rid] = (ids, seen)
            for req, ids, seed in new:
                req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
                with ph.timed("adapter"):
                    delay, params = sched.request_finished(req, ids)
                assert delay and params is not None, (delay, params)
                held[req.request_id] = (ids, 0)
                to_decode.put((req.request_id, len(req.prompt_token_ids), seed, params))
            if not new and not sending:
                dev.idle(ph)
        rep = ph.report()
        rep["device"] = dev.report()
        rep["shm"] = [p[0].shm for p in pools]
        results.put(("prefill_done", rep))
        for w in workers:
            w.shutdown()
        sched.shutdown()
    except Exception as e:  # reported to the demo, which fails the run
        results.put(("error", "prefill engine: %s\n%s" % (e, traceback.format_exc())))
    finally:
        if dev is not None:
            dev.close()


def decode_engine(args, control, nreq, from_prefill, results):
    """The decode engine: takes each request with the prefill's
    kv_transfer_params, loads its KV through the connector, checks every
    byte on every rank, frees the blocks."""
    exit_on_sigterm()
    dev = None
    try:
        shape = pat.Shape(args["layers"], args["kv_heads"], args["head_bytes"], args["page_size"])
        tp = args["decode_tp"]
        num_blocks = args["num_blocks"]
        pools = _pools(shape, tp, num_blocks, args.get("pool", "shm"))
        sched = kvllm.KvhostConnector(
            vs.make_config("decode-engine", "kv_consumer", control, tp_size=tp, layers=shape.layers,
                           kv_heads=shape.kv_heads, head_size=shape.head_bytes // 2, block_size=shape.page_size),
            kvllm.KVConnectorRole.SCHEDULER,
        )
        workers = _workers("decode-engine", "kv_consumer", control, shape, tp, pools)
        blocks = BlockPool(num_blocks)
        ph = Phases()
        dev = Device(args.get("device_priority", "idle"), delay=args.get("device_delay", 0.0))

        def check(ids, seed):
            """Every byte of every rank's blocks: None, or what is wrong."""
            for r in range(tp):
                h0, h1 = shape.heads_of(r, tp)
                why = pat.check(pools[r][1], ids, seed, shape, h0, h1)
                if why:
                    return "decode rank %d: %s" % (r, why)
            return None

        waiting = []
        loading = {}  # decode request id -> [req, ids, seed, workers done, t0]
        done = 0
        corrupt = args.get("corrupt")
        deadline = time.monotonic() + args["timeout"]
        t_first = None
        while done < nreq:
            if time.monotonic() > deadline:
                raise TimeoutError("decode: %d of %d requests done" % (done, nreq))
            while True:
                try:
                    waiting.append(from_prefill.get_nowait())
                except queue.Empty:
                    break
            admitted = 0
            while waiting and len(loading) < args["concurrency"]:
                prid, ntok, seed, params = waiting[0]
                req = vs.Request("d-" + prid, list(range(ntok)), dict(params))
                with ph.timed("adapter"):
                    n, is_async = sched.get_num_new_matched_tokens(req, 0)
                assert is_async and n == ntok, (n, is_async)
                ids = blocks.take(shape.pages(ntok))
                if ids is None:
                    break
                waiting.pop(0)
                with ph.timed("adapter"):
                    sched.update_state_after_alloc(req, vs.kv_cache_blocks(ids), n)
                # [req, ids, seed, workers done, t0, read issued]
                loading[req.request_id] = [req, ids, seed, 0, time.monotonic(), None]
                admitted += 1
                if t_first is None:
                    t_first = time.monotonic()
            with ph.timed("poll", 1):
                meta = sched.build_connector_meta(vs.SchedulerOutput())
            # The reads of this step's new requests are issued by the
            # workers' start_load_kv: their transfers are in flight from
            # here until every worker reported them in finished_recving.
            t_issue = time.monotonic()
            for ent in loading.values():
                if ent[5] is None:
                    ent[5] = t_issue
            _, recving, errors = _step_workers(workers, meta, ph=ph)
            t_step = time.monotonic()
            loaded = []  # (req, ids, bytes read, latency, device job or what failed)
            for rid, k in recving.items():
                ent = loading[rid]
                ent[3] += k
                if ent[3] < tp:
                    continue
                req, ids, seed, _, t0, t_read = loading.pop(rid)
                ph.spans.append((t_read, t_step))
                lat = time.monotonic() - t0
                err = None
                bad = errors & set(ids)
                if bad:
                    reasons = {w.connector_worker.read_results.get(rid, {}).get("reason", "") for w in workers}
                    err = "load errors in blocks %s: %s" % (sorted(bad)[:8], "; ".join(sorted(r for r in reasons if r)))
                nbytes = 0
                for r in range(tp):
                    res = workers[r].connector_worker.read_results.pop(rid, {})
                    nbytes += int(res.get("bytes", 0) or 0)
                    if err is None and not res.get("ok", False):
                        err = "rank %d: read failed: %s" % (r, res.get("reason", ""))
                if err is None:
                    if corrupt is not None and corrupt == req.request_id[2:]:
                        # The mutation check: one byte wrong in the decode's
                        # memory after the transfer must fail the run.
                        pools[0][1][0, 0, ids[0], 0, 0, 0] ^= 0xFF
                    # The check, launched as this step's forward pass.
                    err = dev.submit("verify", check, ids, seed)
                loaded.append((req, ids, nbytes, lat, err))
            # vLLM's step waits for its forward pass (the sampled tokens)
            # before the scheduler finishes a request and frees its blocks.
            dev.wait([e for *_, e in loaded if not isinstance(e, str)], ph)
            for req, ids, nbytes, lat, err in loaded:
                if not isinstance(err, str):
                    err = err.value()
                verified = 0 if err else shape.layers * 2 * shape.kv_heads * len(ids) * shape.page_size * shape.head_bytes
                results.put(("request", {
                    "request_id": req.request_id[2:], "ok": err is None, "error": err or "",
                    "bytes": nbytes, "verified": verified, "latency": lat, "pages": len(ids),
                }))
                req.status = vs.RequestStatus.FINISHED_LENGTH_CAPPED
                with ph.timed("adapter"):
                    delay, params = sched.request_finished(req, ids)
                assert not delay and params is None
                blocks.give(ids)
                done += 1
            if not admitted and not recving:
                dev.idle(ph)
        rep = ph.report()
        rep["device"] = dev.report()
        rep["shm"] = [p[0].shm for p in pools]
        rep["seconds"] = time.monotonic() - (t_first or time.monotonic())
        results.put(("decode_done", rep))
        for w in workers:
            w.shutdown()
        sched.shutdown()
    except Exception as e:
        results.put(("error", "decode engine: %s\n%s" % (e, traceback.format_exc())))
    finally:
        if dev is not None:
            dev.close()
