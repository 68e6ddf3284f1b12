"""A replay of vLLM's engine around a KV connector: the connector calls of
vLLM's engine core, scheduler, executor and model runner, in their order,
with their checks, for two version profiles.

Each step names the upstream file, function and commit it replays
(vllm-project/vllm):

- engine: vllm/v1/engine/core.py EngineCore.step @ 01efc7ef781391e744ed08c3292817a773d654e6
  (schedule, execute_model, update_from_output) and
  EngineCore.abort_requests (scheduler.finish_requests(ids, FINISHED_ABORTED),
  between steps, from _process_input_queue).
- scheduler: vllm/v1/core/sched/scheduler.py @ 00024d314514900f361ad072af6931e403b7f589
  (schedule, update_from_output, finish_requests, _free_request,
  _free_blocks, _connector_finished, _update_waiting_for_remote_kv,
  _update_from_kv_xfer_finished, _handle_invalid_blocks). The 0.13 profile
  replays the same paths: the connector-facing ones predate 0.13 (the
  SupportsHMA dispatch in _connector_finished came with
  vllm-project/vllm#25712, 2025-10; the finished_recving assert is older),
  though vLLM 0.13's own scheduler.py was not at hand to compare line by
  line (its NIXL connector, shared/reference, was).
- executor: KVOutputAggregator (vllm/distributed/kv_transfer/kv_connector/utils.py):
  a request is finished_sending/finished_recving for the scheduler once
  every worker reported it.
- model runner: vllm/v1/worker/kv_connector_model_runner_mixin.py
  _get_kv_connector_output. Profile "0.13" (the 0.11-0.13 text):
  bind_connector_metadata, start_load_kv, the forward (wait_for_layer_load
  and save_kv_layer per attention layer), wait_for_save,
  get_finished(finished_req_ids), get_block_ids_with_load_errors,
  clear_connector_metadata. Profile "newest" (@ 00f4240ee6458263d76cf51ca7901ce1350bb4d1):
  start_load_kv after the forward when the step has no synchronous
  loads, then the same but get_transfer_results(finished_req_ids) for
  get_finished (vLLM's KVConnectorTransferResults: a stand-in
  transcription, vllm_standins.py, in vLLM's module name).

What is left out is what a P/D connector never sees: sampling (a token
is an int; EOS ends a request FINISHED_STOPPED, max_tokens
FINISHED_LENGTH_CAPPED), chunked prefill (budgets are large), preemption,
encoders, LoRA, spec decode, async scheduling. The KV contents are
kvhost.demo_pattern's, written by the prefill's "forward" into its
workers' shared-memory pools and checked byte for byte on every decode
worker when the scheduler promotes the request out of
WAITING_FOR_REMOTE_KVS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvhost import demo_pattern as pat
from kvhost import demo_vllm as dv
from kvhost import vllm as kvllm
from kvhost import vllm_standins as vs

RS = vs.RequestStatus


@dataclass
class Profile:
    name: str
    vllm_version: str
    # The model runner starts loads after the forward (newest) or before.
    start_load_after_forward: bool
    # What KVCacheBlocks update_state_after_alloc gets.
    blocks: str
    # The model runner asks get_transfer_results (newest) or get_finished.
    transfer_results: bool
    # Scheduler.add_request calls connector.on_new_request (newest: where
    # vLLM's NIXL scheduler starts heartbeating a decode request).
    on_new_request: bool


PROFILES = {
    "0.13": Profile("0.13", "0.13.0", False, "0.13", False, False),
    "newest": Profile("newest", "0.21.0", True, "newest", True, True),
}


class EngineCoreDied(AssertionError):
    """One of vLLM's scheduler asserts failed: the engine core would die."""


def _check(cond, what):
    if not cond:
        raise EngineCoreDied(what)


class BlockPool:
    """vLLM's BlockPool reduced to a free list with reference counts; a
    freed block is handed out again first (LIFO), so a block freed while
    its KV is still to be read is overwritten by the next prefill."""

    def __init__(self, n):
        self.n = n
        self.free = list(range(n - 1, -1, -1))
        self.ref = [0] * n

    def take(self, k):
        if k > len(self.free):
            return None
        out = [self.free.pop() for _ in range(k)]
        for b in out:
            self.ref[b] += 1
        return out

    def give(self, ids):
        for b in reversed(ids):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, "block %d freed twice" % b
            if self.ref[b] == 0:
                self.free.append(b)


class ReplayRequest(vs.Request):
    def __init__(self, request_id, ntok, params, seed, max_tokens=1, eos_at=None, cached_blocks=()):
        super().__init__(request_id, list(range(ntok)), params)
        self.seed = seed
        self.max_tokens = max_tokens
        self.eos_at = eos_at  # output token index that is EOS
        self.output = []
        self.cached_blocks = list(cached_blocks)  # a local prefix-cache hit, hashed
        self.num_external_computed_tokens = 0


class Scheduler:
    """scheduler.py @ 00024d31: the paths a KV connector is on."""

    def __init__(self, connector, num_blocks, block_size, profile, on_loaded=None):
        self.connector = connector
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.profile = profile
        self.requests = {}
        self.waiting = []
        self.running = []
        self.finished_req_ids = set()
        self.finished_recving_kv_req_ids = set()
        self.failed_recving_kv_req_ids = set()
        self.blocks = {}  # request id -> block ids (KVCacheManager's)
        self.hashed = {}  # request id -> how many leading blocks are hashed
        self.kv_transfer_params = {}  # request id -> what the engine returned
        self.on_loaded = on_loaded

    # -- KVCacheManager (vllm/v1/core/kv_cache_manager.py) --

    def _get_blocks(self, req_id):
        ids = self.blocks.get(req_id, [])
        return vs.kv_cache_blocks(ids, self.hashed.get(req_id, 0), self.profile.blocks)

    def _get_block_ids(self, req_id):
        return (list(self.blocks.get(req_id, [])),)

    def _free_kv(self, req_id):
        self.pool.give(self.blocks.pop(req_id, []))
        self.hashed.pop(req_id, None)

    # -- requests in and out --

    def add_request(self, req):
        """add_request: queued, then (newest) connector.on_new_request."""
        self.waiting.append(req)
        self.requests[req.request_id] = req
        if self.profile.on_new_request:
            self.connector.on_new_request(req)

    def finish_requests(self, request_ids, finished_status):
        """finish_requests: a request waiting for remote KV keeps its blocks
        until its load is reported (delay_free_blocks)."""
        assert RS.is_finished(finished_status)
        valid = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid.append(request)
            if request.status == RS.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        for request in valid:
            delay_free_blocks = False
            if request.status == RS.WAITING_FOR_REMOTE_KVS:
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free_blocks)

    def _free_request(self, request, delay_free_blocks=False):
        assert request.is_finished()
        connector_delay, kv_xfer_params = self._connector_finished(request)
        self.finished_req_ids.add(request.request_id)
        if not (delay_free_blocks or connector_delay):
            self._free_blocks(request)
        self.kv_transfer_params[request.request_id] = kv_xfer_params
        return kv_xfer_params

    def _free_blocks(self, request):
        assert request.is_finished()
        self._free_kv(request.request_id)
        del self.requests[request.request_id]

    def _connector_finished(self, request):
        """_connector_finished: a SupportsHMA connector gets every group's
        block ids; another one the one group's."""
        block_ids = self._get_block_ids(request.request_id)
        if not isinstance(self.connector, kvllm.SupportsHMA):
            return self.connector.request_finished(request, block_ids[0])
        return self.connector.request_finished_all_groups(request, block_ids)

    # -- one step --

    def _update_waiting_for_remote_kv(self, request):
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        if request.request_id in self.failed_recving_kv_req_ids:
            if request.num_computed_tokens == 0:
                self._free_kv(request.request_id)
            self.failed_recving_kv_req_ids.remove(request.request_id)
        else:
            (block_ids,) = self._get_block_ids(request.request_id)
            num_computed_tokens = min(len(block_ids) * self.block_size, request.num_tokens)
            if num_computed_tokens == request.num_tokens:
                num_computed_tokens -= 1
            request.num_computed_tokens = num_computed_tokens
            if self.on_loaded is not None:
                self.on_loaded(request, list(block_ids))
        self.finished_recving_kv_req_ids.remove(request.request_id)
        return True

    def schedule(self):
        num_scheduled_tokens = {}
        for request in self.running:  # decode: one token each
            num_scheduled_tokens[request.request_id] = 1
        skipped = []
        while self.waiting:
            request = self.waiting.pop(0)
            if request.status == RS.WAITING_FOR_REMOTE_KVS:
                if not self._update_waiting_for_remote_kv(request):
                    skipped.append(request)
                    continue
                request.status = RS.WAITING
            load_kv_async = False
            num_external = 0
            new_local = 0
            if request.num_computed_tokens == 0:
                # get_computed_blocks: the local prefix-cache hit.
                new_local = len(request.cached_blocks) * self.block_size
                ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(request, new_local)
                request.num_external_computed_tokens = num_external = ext_tokens
                num_computed = new_local + num_external
            else:
                num_computed = request.num_computed_tokens
            num_new_tokens = 0 if load_kv_async else request.num_tokens - num_computed
            if request.request_id not in self.blocks:
                # allocate_slots: the cached blocks, then new ones for
                # every token not cached.
                # The cached blocks are touched (out of the free queue)
                # before new ones are taken.
                need = -(-request.num_tokens // self.block_size) - len(request.cached_blocks)
                if need > len(self.pool.free) - sum(b in self.pool.free for b in request.cached_blocks):
                    skipped.append(request)
                    break
                for b in request.cached_blocks:
                    self.pool.ref[b] += 1
                    if b in self.pool.free:
                        self.pool.free.remove(b)
                new = self.pool.take(need)
                self.blocks[request.request_id] = list(request.cached_blocks) + new
                self.hashed[request.request_id] = len(request.cached_blocks)
            # update_state_after_alloc, with KVCacheManager.get_blocks.
            self.connector.update_state_after_alloc(request, self._get_blocks(request.request_id), num_external)
            if load_kv_async:
                request.status = RS.WAITING_FOR_REMOTE_KVS
                skipped.append(request)
                continue
            self.running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            request.status = RS.RUNNING
            request.num_computed_tokens = num_computed
        self.waiting = skipped + self.waiting
        out = vs.SchedulerOutput(
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
        )
        # build_connector_meta, after the output is built.
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        # _update_after_schedule
        for req_id, n in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        self.finished_req_ids = set()
        return out

    def update_from_output(self, scheduler_output, kv_output):
        if kv_output.invalid_block_ids:
            self._handle_invalid_blocks(kv_output.invalid_block_ids)
        stopped = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # partial prefill: no token
            request.output.append(len(request.output))
            request._all_token_ids.append(request.output[-1])
            # check_stop (vllm/v1/core/sched/utils.py)
            if request.eos_at is not None and len(request.output) - 1 == request.eos_at:
                request.status = RS.FINISHED_STOPPED
            elif len(request.output) >= request.max_tokens:
                request.status = RS.FINISHED_LENGTH_CAPPED
            else:
                continue
            self._free_request(request)
            stopped.append(request)
        for r in stopped:
            self.running.remove(r)
        self._update_from_kv_xfer_finished(kv_output)

    def _handle_invalid_blocks(self, invalid_block_ids):
        """Async loads with a failed block restart from the first one
        (recompute policy)."""
        for request in self.waiting:
            if request.status != RS.WAITING_FOR_REMOTE_KVS:
                continue
            (ids,) = self._get_block_ids(request.request_id)
            for idx, b in enumerate(ids):
                if b in invalid_block_ids:
                    request.num_computed_tokens = idx * self.block_size
                    self.failed_recving_kv_req_ids.add(request.request_id)
                    break

    def _update_from_kv_xfer_finished(self, kv_output):
        self.connector.update_connector_output(kv_output)
        for req_id in kv_output.finished_recving or ():
            _check(req_id in self.requests, "finished_recving names %r, which the scheduler freed" % req_id)
            req = self.requests[req_id]
            if req.status == RS.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                _check(RS.is_finished(req.status), "finished_recving names %r, which is %s" % (req_id, req.status))
                self._free_blocks(req)
        for req_id in kv_output.finished_sending or ():
            _check(req_id in self.requests, "finished_sending names %r, which the scheduler freed" % req_id)
            self._free_blocks(self.requests[req_id])


class Executor:
    """The TP workers (one KvhostConnector each, WORKER role) and
    KVOutputAggregator."""

    def __init__(self, workers, pools, profile):
        self.workers = workers
        self.pools = pools
        self.profile = profile
        self._pending = {"s": {}, "r": {}}

    def _run_worker(self, w, out, forward):
        """_get_kv_connector_output around one forward."""
        w.bind_connector_metadata(out.kv_connector_metadata)
        if not self.profile.start_load_after_forward:
            w.start_load_kv(None)
        if forward is not None:
            forward()
        if self.profile.start_load_after_forward:
            w.start_load_kv(None)
        w.wait_for_save()
        if self.profile.transfer_results:
            results = w.get_transfer_results(out.finished_req_ids)
            sending, recving = results.finished_sending, results.finished_recving
        else:
            sending, recving = w.get_finished(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        return sending or set(), recving or set(), invalid

    def execute_model(self, out, forward_for_rank):
        finished = {"s": set(), "r": set()}
        invalid = set()
        for rank, w in enumerate(self.workers):
            s, r, inv = self._run_worker(w, out, lambda: forward_for_rank(rank))
            invalid |= inv
            for kind, ids in (("s", s), ("r", r)):
                for x in ids:
                    n = self._pending[kind].get(x, 0) + 1
                    if n == len(self.workers):
                        self._pending[kind].pop(x, None)
                        finished[kind].add(x)
                    else:
                        self._pending[kind][x] = n
        return vs.KVConnectorOutput(finished_sending=finished["s"], finished_recving=finished["r"],
                                    invalid_block_ids=invalid)


def stub_transfer_results(monkeypatch):
    """Current vLLM's KVConnectorTransferResults where KvhostConnector's
    get_transfer_results imports it from (the "newest" profile), for the
    test's duration."""
    import sys
    import types

    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorTransferResults = vs.KVConnectorTransferResults
    monkeypatch.setitem(sys.modules, base.__name__, base)


def check_pool(pool, block_ids, seed, shape, h0, h1, mla):
    """None when a rank's pool (layers, 2, blocks, heads, page_size,
    head_bytes) holds exactly the request's KV for heads [h0, h1) at
    block_ids (MLA: the latent, plane 0, the one registered), else a
    sentence naming what differs."""
    if not mla:
        return pat.check(pool, block_ids, seed, shape, h0, h1)
    got = pool[:, 0][:, list(block_ids)]
    want = pat.expected(seed, shape, len(block_ids), h0, h1)[:, 0]
    if got.shape == want.shape and (got == want).all():
        return None
    bad = [tuple(int(i) for i in ix) for ix in zip(*(got != want).nonzero())][:1] if got.shape == want.shape else []
    return "MLA latent differs (layer, page, head, token, byte) %s, shapes %s/%s" % (bad, got.shape, want.shape)


class Engine:
    """One vLLM engine beside its sidecar: scheduler connector, TP workers
    with shared-memory KV pools in vLLM's HND layout.

    ``mla``: an MLA model (vLLM's use_mla): one latent "head"
    (shape.kv_heads must be 1), the same on every TP rank, one tensor
    (num_blocks, ...) per layer rather than K and V. Its pools keep the
    pattern's (layers, 2, ...) order and register plane 0 of each layer,
    so only plane 0 (the latent) is moved and checked."""

    def __init__(self, engine_id, kv_role, control, tp, shape, num_blocks, profile, extra=None, check=None,
                 mla=False):
        self.shape, self.tp, self.profile, self.mla = shape, tp, profile, mla
        ex = dict(extra or {})
        if mla:
            assert shape.kv_heads == 1, "an MLA latent is one head"
            self.pools = []
            for _ in range(tp):
                sp, arr, _caches = dv._pools(shape, 1, num_blocks)[0]
                self.pools.append((sp, arr, {"model.layers.%d.self_attn" % i: arr[i, 0] for i in range(shape.layers)}))
        else:
            self.pools = dv._pools(shape, tp, num_blocks)

        def cfg(rank=None):
            c = vs.make_config(engine_id, kv_role, control, tp_size=tp, tp_rank=rank, layers=shape.layers,
                               kv_heads=shape.kv_heads, head_size=shape.head_bytes // 2,
                               block_size=shape.page_size, extra=ex, vllm_version=profile.vllm_version)
            c.model_config.use_mla = mla
            return c

        kcc = vs.kv_cache_config(num_blocks, shape.layers)
        # KVConnectorFactory.create_connector(config, role, kv_cache_config)
        self.connector = kvllm.KvhostConnector(cfg(), kvllm.KVConnectorRole.SCHEDULER, kcc)
        self.workers = []
        for r in range(tp):
            w = kvllm.KvhostConnector(cfg(r), kvllm.KVConnectorRole.WORKER, kcc)
            # register_kv_caches, once the model runner allocated them.
            w.register_kv_caches(self.pools[r][2])
            self.workers.append(w)
        self.scheduler = Scheduler(self.connector, num_blocks, shape.page_size, profile, on_loaded=check)
        self.executor = Executor(self.workers, self.pools, profile)

    def heads_of(self, rank):
        """The global heads [h0, h1) rank holds (MLA: the latent, on all)."""
        return (0, 1) if self.mla else self.shape.heads_of(rank, self.tp)

    def check_bytes(self, rank, block_ids, seed):
        """None when rank's blocks hold exactly the request's KV (MLA: its
        latent, plane 0), else a sentence naming what differs."""
        h0, h1 = self.heads_of(rank)
        return check_pool(self.pools[rank][1], block_ids, seed, self.shape, h0, h1, self.mla)

    def _forward(self, out):
        def run(rank):
            h0, h1 = self.heads_of(rank)
            for req_id, n in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[req_id]
                if req.num_computed_tokens == n and n == req.num_tokens:  # a whole prefill this step
                    pat.fill(self.pools[rank][1], self.scheduler.blocks[req_id], req.seed, self.shape, h0, h1)

        return run

    def step(self):
        """EngineCore.step."""
        out = self.scheduler.schedule()
        kv_out = self.executor.execute_model(out, self._forward(out))
        self.scheduler.update_from_output(out, kv_out)
        return out, kv_out

    def abort(self, req_ids):
        """EngineCore.abort_requests, between steps."""
        self.scheduler.finish_requests(req_ids, RS.FINISHED_ABORTED)

    def run_until(self, cond, what, others=(), timeout=30.0):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for " + what)
            self.step()
            for o in others:
                o.step()
            time.sleep(0.002)

    def idle(self):
        return not self.scheduler.requests

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()
