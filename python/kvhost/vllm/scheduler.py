"""Scheduler side of KvhostConnector: vLLM's NIXL connector scheduler
(0.13: NixlConnectorScheduler in v1/nixl_connector.py; current vLLM:
NixlPullConnectorScheduler in v1/nixl/pull_scheduler.py @ 0050936b),
with request_finished asking the sidecar to hold the blocks (``hold``)
and returning the kv_transfer_params the sidecar made.

``hold`` stays a round trip on vLLM's scheduler thread (issue 24 asked):
the params could be made here (they are the engine's side channel, id
and TP size, learnt from an earlier reply, plus the request's blocks and
id), but the reply is what proves the sidecar holds the request before
the params leave the engine. A decode that reads and notifies before the
sidecar processed a pipelined hold finds the request unknown (the
sidecar logs "unrecognized request") and the hold then waits for a
notification that already came, until ``abort_timeout``: measured in
``kvhost.bench_engine``, where the decode reads at once. vLLM's NIXL
worker avoids this by knowing the request from the step it was scheduled
in (reqs_in_batch) and counting early notifications; the sidecar would
need the same (remember notifications of requests it does not hold yet)
before holds can be pipelined.
"""

from __future__ import annotations

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
        return meta

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
        try:
            self._next_reconnect = settings.reconnect(self._client, self._next_reconnect, "scheduler")[1]
            kv_params = self._client.hold(
                self.engine_id, request.request_id, block_ids,
                num_tokens=int(getattr(request, "num_computed_tokens", 0) or 0),
            )
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
