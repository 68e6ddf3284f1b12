"""Scheduler side of KvhostConnector: vLLM's NIXL connector scheduler
(0.13: NixlConnectorScheduler in v1/nixl_connector.py; current vLLM:
NixlPullConnectorScheduler in v1/nixl/pull_scheduler.py @ 0050936b),
with request_finished asking the sidecar to hold the blocks (``hold``)
and returning the kv_transfer_params the sidecar made.

request_finished runs on vLLM's scheduler thread, so after the first
hold it does not wait for the sidecar (issue 24): the params are the
engine's part of the last reply the sidecar gave (``remote_engine_id``,
the side channel's ``remote_host`` and ``remote_port``, ``tp_size``, and
whatever else of its generation's keys is not the request's own;
docs/engine-api.md says which keys and in which order) with the
request's own ``remote_block_ids``, ``remote_request_id`` and (version 6)
``remote_num_tokens``, and the hold is sent without waiting. They cannot
come from anywhere else: this connection opens no rank, so only a hold's
reply tells it the side channel's address; a reply with a key this
module does not know keeps hold a round trip. A decode handed these
params may read and notify before the sidecar processed the hold: the
sidecar keeps such notifications and applies them when the hold comes
(as vLLM's NIXL worker counts notifications of requests it does not
know yet). Two things can then go differently than request_finished
said:

- the sidecar refuses the hold (the engine's ranks closed, a block id out
  of range, the held-request limit): vLLM was told to keep the blocks and
  nothing holds them, so the refusal (seen on the client's I/O thread)
  goes to the workers in the next metadata (``reqs_hold_refused``) and
  they report the request finished_sending with the sidecar's reason:
  vLLM frees the blocks, the decode's read fails and it recomputes, as
  after a hold that expired;
- the sidecar's params differ (the side channel reopened on another
  port): the next requests use the new ones; the decode of this one
  fails its read (the sidecar checks the engine id at the handshake) and
  recomputes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kvhost.vllm import settings
from kvhost.vllm.settings import logger

# The keys vLLM's NIXL scheduler requires in a decode request's
# kv_transfer_params besides remote_block_ids (update_state_after_alloc,
# the same in 0.13 and pull_scheduler.py @ 0050936b).
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

# The request statuses after which a prefill request's blocks are held
# for its decode: vLLM 0.13's NIXL scheduler held only
# FINISHED_LENGTH_CAPPED (max_tokens=1); current vLLM's
# (pull_scheduler.py @ 0050936b) also FINISHED_STOPPED, so a prefill
# whose one token is EOS still hands its KV off instead of leaving the
# decode to recompute the prompt. kvhost holds on both with any vLLM: the
# decode, NIXL or kvhost, reads whatever kv_transfer_params it is given.
HOLD_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class ReqMeta:
    """One request's transfer, as vLLM's NIXL ReqMeta (current vLLM's
    nixl/metadata.py @ 02cfb534) without the fields the sidecar derives
    itself (remote ranks, physical block ids). ``local_block_ids`` is one
    list (one KV cache group, as kvhost moves). ``awaiting_kvs``: the
    scheduler parked the request in WAITING_FOR_REMOTE_KVS and expects it
    in finished_recving; a notify-only read (full prefix hit, request
    finished before it was scheduled) must never be reported, since vLLM's
    scheduler asserts every finished_recving id is a request it still
    has (scheduler.py _update_from_kv_xfer_finished)."""

    local_block_ids: list
    kv_transfer_params: dict
    tp_size: int = 1
    awaiting_kvs: bool = True


def _metadata_base():
    from kvhost.vllm import base

    return base.KVConnectorMetadata


class KvhostConnectorMetadata(_metadata_base()):
    """The scheduler's per-step message to the workers: vLLM's
    NixlConnectorMetadata's fields (reqs_to_save is always empty: the
    sidecar reads the KV caches in place)."""

    def __init__(self):
        self.reqs_to_recv: dict[str, ReqMeta] = {}
        self.reqs_to_save: dict[str, ReqMeta] = {}
        self.reqs_to_send: dict[str, float] = {}
        self.reqs_in_batch: set[str] = set()
        self.reqs_not_processed: set[str] = set()
        # Leases (generations 6 on): decode requests that arrived, whose
        # prefill lease the decode ranks renew until their read ends
        # (``watch``), and those that ended before it (``unwatch``). The
        # scheduler opens no rank, so its workers send them, as vLLM's
        # scheduler hands NIXL's workers heartbeat_by_engine.
        self.reqs_to_watch: dict[str, dict] = {}
        self.reqs_to_unwatch: set[str] = set()
        # Requests request_finished answered with params made here whose
        # hold the sidecar then refused (see KvhostConnectorScheduler):
        # request id -> reason. Nothing holds their blocks, so the workers
        # report them finished_sending (vLLM frees them).
        self.reqs_hold_refused: dict[str, str] = {}


# The keys of a hold's kv_transfer_params that are the engine's, the same
# for every request (docs/engine-api.md, "vLLM pull requests"; vLLM's
# NixlConnectorScheduler.request_finished dict, generations 2, 6 and 10:
# 10 adds the engine's dcp_size, pp_size and transfer_mode), and those that
# are the request's own. A reply with any other key keeps hold a round
# trip: its value could not be made here.
_ENGINE_KEYS = frozenset(("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host",
                          "remote_port", "tp_size", "remote_blocks_expiry_time",
                          "dcp_size", "pp_size", "transfer_mode"))
_PER_REQUEST = frozenset(("remote_block_ids", "remote_request_id", "remote_num_tokens"))


@dataclass(frozen=True)
class _Template:
    """The engine's part of a hold's kv_transfer_params: the keys in the
    sidecar's order, the engine's values, and whether remote_block_ids is
    one list per KV cache group (versions 6 and 10) or flat (version 2)."""

    keys: tuple
    engine: dict
    grouped: bool


def _template_of(params):
    """The template of a hold's kv_transfer_params, or None when they are
    not of a shape this module can reproduce."""
    keys = tuple(params)
    if not set(keys) <= _ENGINE_KEYS | _PER_REQUEST:
        return None
    if not set(REMOTE_KEYS + ("remote_block_ids", "tp_size")) <= set(keys):
        return None
    if params.get("do_remote_prefill") is not True or params.get("do_remote_decode", False) is not False:
        return None
    if params.get("remote_blocks_expiry_time") is not None:
        return None
    blocks = params["remote_block_ids"]
    if not isinstance(blocks, list):
        return None
    grouped = len(blocks) == 1 and isinstance(blocks[0], list)
    if not grouped and not all(isinstance(b, int) for b in blocks):
        return None
    return _Template(keys, {k: v for k, v in params.items() if k in _ENGINE_KEYS}, grouped)


def _status_name(status) -> str:
    return getattr(status, "name", str(status))


def single_group(block_ids, what):
    """The one KV cache group's list of a per-group block id tuple (vLLM's
    KVCacheBlocks.get_block_ids / request_finished_all_groups), or a flat
    list as it is. kvhost moves one group: KvhostConnector refuses
    hybrid KV cache configs at construction, so more is a bug."""
    if isinstance(block_ids, tuple):
        if len(block_ids) != 1:
            raise ValueError(f"KvhostConnector: {what}: {len(block_ids)} KV cache groups, kvhost moves one")
        return list(block_ids[0])
    return list(block_ids)


class KvhostConnectorScheduler:
    def __init__(self, vllm_config, engine_id, client=None):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self._client = client if client is not None else settings.connect(vllm_config)
        self._next_reconnect = 0.0
        # Request id -> (its kv_transfer_params as the proxy sent them,
        # local block ids, awaiting_kvs). A copy of the params: vLLM's
        # scheduler clears do_remote_prefill in the request's own dict once
        # the load is scheduled, and the sidecar reads them as the prefill
        # made them.
        self._reqs_need_recv: dict[str, tuple] = {}
        self._reqs_need_send: dict[str, float] = {}
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()
        # Decode requests heartbeated from their arrival (vLLM's
        # _heartbeat_req_engine, nixl/base_scheduler.py @ 0050936b), and
        # those to tell the workers of at the next step.
        self._watched: set[str] = set()
        self._reqs_to_watch: dict[str, dict] = {}
        self._reqs_to_unwatch: set[str] = set()
        # Pipelined holds (issue 24): the template of the last
        # kv_transfer_params the sidecar answered, with the connection
        # generation it came on. While it is known, request_finished makes
        # the params itself and does not wait for the hold's reply; the
        # reply is compared and refreshes the template, a refusal lands in
        # _hold_refused (filled on the client's I/O thread).
        self._template = None
        self._template_gen = 0
        self._hold_refused = collections.deque()
        self.holds_waited = 0
        self.holds_pipelined = 0
        self.template_mismatches = 0

    def shutdown(self):
        if self._client is not None:
            self._client.close()
            self._client = None

    def on_new_request(self, request):
        """Current vLLM's scheduler calls this as a request arrives
        (Scheduler.add_request); vLLM's NIXL scheduler starts heartbeating
        a decode request here (on_new_request, nixl/base_scheduler.py @
        0050936b), so its prefill's lease outlives the wait in this
        engine's queue. The workers send ``watch`` (the worker ignores it
        on a generation without leases)."""
        params = request.kv_transfer_params
        if params is None or not params.get("do_remote_prefill"):
            return
        if any(params.get(k) is None for k in REMOTE_KEYS + ("tp_size",)):
            return  # as vLLM: only requests naming their prefill in full
        self._watched.add(request.request_id)
        self._reqs_to_watch[request.request_id] = dict(params)

    def update_connector_output(self, connector_output):
        """The loads that ended: the sidecar stopped watching them with
        their reads (vLLM's update_connector_output stops the heartbeats)."""
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._watched.discard(req_id)

    def _stop_watch(self, req_id):
        """vLLM's _stop_heartbeat, from request_finished: a request that
        ends before its read is not renewed any more."""
        if req_id not in self._watched:
            return
        self._watched.discard(req_id)
        if self._reqs_to_watch.pop(req_id, None) is None:
            self._reqs_to_unwatch.add(req_id)  # the workers watch it already

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            # Remote prefill: load every prompt token not computed locally,
            # asynchronously (vLLM's NIXL connector does the same).
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._reqs_in_batch.add(request.request_id)
        elif params.get("do_remote_prefill"):
            if params.get("remote_block_ids"):
                if all(k in params for k in REMOTE_KEYS):
                    # num_external_tokens == 0 is a full prefix hit: read
                    # nothing, but tell the prefill so it frees its blocks;
                    # vLLM keeps such a request RUNNING, so it is not
                    # awaited.
                    local = []
                    if num_external_tokens > 0:
                        if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
                            local = single_group(tuple(blocks.get_unhashed_block_ids_all_groups()), "blocks")
                        else:  # vLLM 0.13's KVCacheBlocks
                            local = list(blocks.get_unhashed_block_ids())
                    self._reqs_need_recv[request.request_id] = (dict(params), local, num_external_tokens > 0)
                else:
                    logger.warning(
                        "kvhost: invalid kv_transfer_params %s: request %s will not load KV",
                        params,
                        request.request_id,
                    )
            else:
                assert num_external_tokens == 0
            # One transfer per request.
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output):
        meta = KvhostConnectorMetadata()
        for req_id, (params, block_ids, awaiting) in self._reqs_need_recv.items():
            meta.reqs_to_recv[req_id] = ReqMeta(
                local_block_ids=list(block_ids),
                kv_transfer_params=params,
                tp_size=params.get("tp_size", 1),
                awaiting_kvs=awaiting,
            )
        meta.reqs_to_send = self._reqs_need_send
        meta.reqs_in_batch = self._reqs_in_batch
        meta.reqs_not_processed = self._reqs_not_processed
        meta.reqs_to_watch = self._reqs_to_watch
        meta.reqs_to_unwatch = self._reqs_to_unwatch
        self._reqs_to_watch = {}
        self._reqs_to_unwatch = set()
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        self._reqs_in_batch = set()
        self._reqs_not_processed = set()
        while self._hold_refused:
            req_id, reason = self._hold_refused.popleft()
            meta.reqs_hold_refused[req_id] = reason
        return meta

    def _params_for(self, request_id, block_ids, num_tokens):
        """kv_transfer_params made from the template: the dict the sidecar's
        hold answers (the same keys in the same order), the request's block
        ids, id and token count filled in."""
        t = self._template
        out = {}
        for k in t.keys:
            if k == "remote_block_ids":
                blocks = [int(b) for b in block_ids]
                out[k] = [blocks] if t.grouped else blocks
            elif k == "remote_request_id":
                out[k] = request_id
            elif k == "remote_num_tokens":
                out[k] = num_tokens
            else:
                out[k] = t.engine[k]
        return out

    def _learn(self, params, gen):
        t = _template_of(params)
        if t is not None:
            self._template, self._template_gen = t, gen

    def _hold_pipelined(self, request, block_ids, num_tokens):
        """request_finished's hold without waiting for the reply, or None
        when there is no template to make the params from."""
        c = self._client
        gen = c.generation
        if self._template is None or self._template_gen != gen:
            return None
        req_id = request.request_id
        params = self._params_for(req_id, block_ids, num_tokens)

        def refused(e):
            # On the client's I/O thread. vLLM was told to keep the blocks
            # (request_finished returned True) and nothing holds them: the
            # workers report the request finished_sending so vLLM frees
            # them; the decode's read fails and it recomputes.
            logger.error("kvhost: hold of request %s refused: %s", req_id, e)
            self._hold_refused.append((req_id, "hold refused: %s" % e))

        def answered(real):
            # On the client's I/O thread: the sidecar's own params. They
            # differ from the template's only when the engine's side
            # channel moved (a rank reopened); the next requests use them.
            if real != params:
                self.template_mismatches += 1
                logger.warning("kvhost: request %s: kv_transfer_params %s, the sidecar's are %s",
                               req_id, params, real)
                self._learn(real, gen)

        c.hold_nowait(self.engine_id, req_id, block_ids, num_tokens, on_error=refused, on_reply=answered)
        self.holds_pipelined += 1
        return params

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        if not params:
            return False, None
        self._stop_watch(request.request_id)
        if params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: read nothing but
            # notify the prefill so its blocks are freed now, not at the
            # timeout. vLLM frees this request now (it is not waiting for
            # KV), so it is not awaited: reporting it in finished_recving
            # would kill vLLM's engine core (scheduler.py asserts
            # req_id in self.requests).
            self._reqs_need_recv[request.request_id] = (dict(params), [], False)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if _status_name(request.status) not in HOLD_STATUSES:
            # Aborted: the blocks are freed now, nothing held.
            self._reqs_not_processed.add(request.request_id)
            return False, None
        block_ids = single_group(block_ids, "request_finished")
        if len(block_ids) == 0:
            # Nothing to hold (vLLM's NIXL connector returns params with no
            # blocks, which the decode then loads nothing from).
            self._reqs_not_processed.add(request.request_id)
            return False, None
        num_tokens = int(getattr(request, "num_computed_tokens", 0) or 0)
        try:
            self._next_reconnect = settings.reconnect(self._client, self._next_reconnect, "scheduler")[1]
            kv_params = self._hold_pipelined(request, block_ids, num_tokens)
            if kv_params is None:
                gen = self._client.generation
                kv_params = self._client.hold(self.engine_id, request.request_id, block_ids, num_tokens=num_tokens)
                self.holds_waited += 1
                self._learn(kv_params, gen)
        except settings.client_error_types() as e:
            # Not held (the sidecar refused, or is gone): the blocks are
            # freed now and the response carries no params, so no decode
            # waits for them; vLLM's scheduler goes on.
            logger.error("kvhost: hold of request %s refused: %s", request.request_id, e)
            self._reqs_not_processed.add(request.request_id)
            return False, None
        # The worker learns of it from the metadata; expiry is the sidecar's.
        self._reqs_need_send[request.request_id] = 0.0
        return True, dict(kv_params)
