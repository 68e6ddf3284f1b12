"""Worker side of KvhostConnector: vLLM's NIXL connector worker (0.13:
NixlConnectorWorker in v1/nixl_connector.py; current vLLM: v1/nixl/
pull_worker.py), with the sidecar's ranks in place of the NIXL agent:
register_kv_caches opens the ranks (a prefill rank serving the side
channel, a decode rank reading, or both for kv_both), start_load_kv sends
one ``read`` per request, get_finished reports the sidecar's ``read`` and
``released`` events.
"""

from __future__ import annotations

import collections
import time

from kvhost.vllm import generations, memory, settings
from kvhost.vllm.settings import logger


class KvhostConnectorWorker:
    def __init__(self, vllm_config, engine_id, client=None):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.use_mla = bool(settings.get(vllm_config.model_config, "use_mla", False))
        self.roles = settings.rank_roles(vllm_config)
        self.tp_rank, self.tp_size = settings.tp_rank_size(vllm_config)
        self._client = client if client is not None else settings.connect(vllm_config)
        # Events, appended by the client's I/O thread, handled by the
        # worker's thread in get_finished.
        self._events = collections.deque()
        self._client.add_listener(self._listener(self._client))
        # The sidecar's rank ids once register_kv_caches ran: rank reads
        # (decode role), prefill_rank serves the side channel.
        self.rank = None
        self.prefill_rank = None
        self.endpoint = ""
        # What the sidecar created the rank's agent with, its defaults
        # included (the decode rank's of a kv_both worker), for logs and
        # tests.
        self.agent_params: dict = {}
        self._rank_open = False
        self._next_reconnect = 0.0
        # The generation has leases (register_kv_caches learns it): the
        # decode rank is told of queued requests (watch / unwatch).
        self.leases = False
        self.region_ids: list = []
        self.kv_caches = None
        self.num_blocks = 0
        # The requests start_load_kv asked to read, by request id (their
        # ReqMeta: awaiting_kvs says whether vLLM waits for them).
        self._recving: dict = {}
        # Finished awaited reads not yet reported, and reads that failed
        # before the sidecar took them (reported as finished, as NIXL's
        # _failed_recv_reqs).
        self._done_recving: set[str] = set()
        # Those of them that failed (vLLM's failed_recving).
        self._failed_recving: set[str] = set()
        # The prefill requests this engine scheduled to send (vLLM's NIXL
        # _reqs_to_process), those of them held by the sidecar (request_
        # finished ran: NIXL's _reqs_to_send), and those released but not
        # yet reported.
        self._reqs_to_process: set[str] = set()
        self._reqs_to_send: set[str] = set()
        self._done_sending: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        # The last release/read reasons, for logs and tests.
        self.release_reasons: dict[str, str] = {}
        self.read_results: dict[str, dict] = {}

    # -- registration --

    def register_kv_caches(self, kv_caches):
        """Share the KV caches with the sidecar and open this rank.

        ``kv_caches`` is vLLM's {layer name: tensor}: per layer one tensor
        of shape (2, num_blocks, ...) (K and V), or (num_blocks, ...) for
        MLA and for blocks-first (FlashInfer) caches. Host-memory caches
        (numpy arrays or CPU tensors) must lie in shared memory (kvhost.shm);
        CUDA tensors are shared by CUDA IPC handle."""
        blocks_first = bool(settings.extra(self.vllm_config, "kvhost_blocks_first", False))
        split = not self.use_mla and not blocks_first
        tensors, names = [], []
        seen = set()
        for name, cache in kv_caches.items():
            for t in ([cache[0], cache[1]] if split else [cache]):
                ptr, _ = memory.ptr_len(t)
                if ptr in seen:  # layers sharing one tensor (hybrid allocator)
                    continue
                seen.add(ptr)
                tensors.append(t)
                names.append(str(name))
        if not tensors:
            raise ValueError("KvhostConnector: no KV caches to register")
        sizes = {memory.ptr_len(t)[1] for t in tensors}
        if len(sizes) != 1:
            raise ValueError(f"KvhostConnector: KV cache tensors of different sizes {sorted(sizes)}")
        region_len = sizes.pop()
        num_blocks = int(tensors[0].shape[0])
        if any(int(t.shape[0]) != num_blocks for t in tensors):
            raise ValueError("KvhostConnector: KV cache tensors with different block counts")

        cuda = [t for t in tensors if memory.is_torch(t) and t.is_cuda]
        if cuda and len(cuda) != len(tensors):
            raise ValueError("KvhostConnector: KV caches partly on GPU, partly in host memory")
        if cuda:
            regions, seen_alloc = [], set()
            for t in tensors:
                r = memory.vram_region(t)
                if r["addr"] not in seen_alloc:
                    seen_alloc.add(r["addr"])
                    regions.append(r)
        else:
            regions = memory.dram_regions_for([memory.ptr_len(t) for t in tensors])
        self._regions = regions

        mc = self.vllm_config.model_config
        self._fields = dict(
            engine_id=self.engine_id,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            kv_caches_base_addr=[memory.ptr_len(t)[0] for t in tensors],
            # The layer of each region: NIXL connector versions 11 and later
            # advertise them (region_names).
            region_names=names,
            region_len=region_len,
            num_blocks=num_blocks,
            block_size=self.block_size,
            kv_cache_layout=settings.kv_cache_layout(self.vllm_config),
            blocks_first=blocks_first,
            is_mla=self.use_mla,
            total_kv_heads=int(mc.get_total_num_kv_heads()),
            compat=settings.compat_factors(self.vllm_config, settings.attn_backend_name(self.vllm_config)),
        )
        gen = generations.GENERATIONS.get(int(self._fields["compat"].get("nixl_connector_version", 0)))
        # An unknown generation has the sidecar refuse open_rank below.
        self.leases = gen is not None and gen.leases
        lease = settings.kv_lease_duration(self.vllm_config)
        if self.leases and lease is not None:
            self._fields["kv_lease_duration"] = lease
        # vLLM's own NIXL knob (UCX worker threads) goes to the ranks'
        # agents; unset, the sidecar's default applies: worker threads on
        # the decode rank, which reads, none on the prefill.
        threads = settings.extra(self.vllm_config, "num_threads")
        if threads is not None:
            self._fields["agent_params"] = {"num_threads": str(int(threads))}
        self._prefill_fields = {}
        if "prefill" in self.roles:
            host, port = settings.side_channel(self.vllm_config)
            self._prefill_fields.update(side_channel_host=host, side_channel_port=port)
            abort = settings.abort_timeout(self.vllm_config)
            if abort is not None:
                self._prefill_fields["abort_timeout"] = abort
        try:
            self._open()
        except settings.client_error_types() as e:
            # At start-up, where it is clear: a generation the sidecar does
            # not speak (its message names it and the versions it speaks),
            # a geometry it refuses. vLLM fails to start, as it should.
            raise RuntimeError(
                f"KvhostConnector: the sidecar refused this engine's rank (NIXL connector version "
                f"{self._fields['compat'].get('nixl_connector_version')}): {e}"
            ) from e
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks

    @property
    def compat(self) -> dict:
        """The compatibility factors this worker sent (open_rank's compat)."""
        return dict(self._fields["compat"])

    def _open(self):
        """Registers the KV caches' memory and opens the ranks (again, after
        a reconnect: the sidecar forgot everything of the old connection)."""
        self._rank_open = False
        self.rank = self.prefill_rank = None
        self.region_ids = list(self._client.register_memory(self._regions))
        if "prefill" in self.roles:
            reply = self._client.open_rank(style="vllm", role="prefill", **self._fields, **self._prefill_fields)
            self.prefill_rank = reply["rank"]
            self.endpoint = reply.get("endpoint", "")
            self.agent_params = dict(reply.get("agent_params") or {})
        if "decode" in self.roles:
            reply = self._client.open_rank(style="vllm", role="decode", **self._fields)
            self.rank = reply["rank"]
            self.agent_params = dict(reply.get("agent_params") or {})
        self._rank_open = True

    def _connected(self):
        """False while the sidecar is gone. After the connection was lost,
        tries (at most every RECONNECT_INTERVAL seconds) to connect again
        and register the rank again, so a restarted sidecar serves this
        worker without restarting vLLM."""
        if self._client.lost is None:
            if self._rank_open:
                return True
            if time.monotonic() < self._next_reconnect:
                return False  # registering again failed a moment ago
        lost = self._client.lost
        ok, self._next_reconnect = settings.reconnect(self._client, self._next_reconnect, "worker")
        if not ok:
            return False
        if lost is not None:
            # What the old connection had ended with it, whether or not its
            # connection_lost event was handled yet.
            self._lost_all(lost)
        try:
            self._open()
        except settings.client_error_types() as e:
            logger.warning("kvhost: worker: registering again: %s", e)
            self._next_reconnect = time.monotonic() + settings.RECONNECT_INTERVAL
            return False
        return True

    # -- per step --

    def start_load_kv(self, metadata):
        errors = settings.client_error_types()
        if self.kv_caches is not None:
            self._connected()  # reads fail at once while it is gone
        self._send_watches(metadata, errors)
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving[req_id] = meta
            try:
                if self.rank is None:
                    raise _NotDecode(f"request {req_id}: this worker has no decode rank (kv_role kv_producer)")
                # Not waited for (vLLM calls start_load_kv in the forward
                # pass; NIXL's worker only starts the handshake or transfer
                # there): a refusal comes back as a failed read.
                self._client.read_nowait(self.rank, req_id, meta.kv_transfer_params, list(meta.local_block_ids),
                                         self._on_read_refused(self._client, req_id))
            except (errors + (_NotDecode,)) as e:
                # Refused before any byte moved (bad kv_transfer_params, an
                # unknown engine): the blocks hold nothing valid, as after
                # NIXL's failed handshake.
                logger.error("kvhost: read of request %s refused: %s", req_id, e)
                self._fail_recv(req_id, None, str(e))
        # As vLLM's NIXL worker: a prefill request is tracked from the step
        # it is scheduled in (reqs_in_batch) until its release is reported;
        # reqs_to_send (the step after request_finished) adds nothing, as
        # the release may already have been reported by then.
        for req_id in metadata.reqs_in_batch:
            self._reqs_to_process.add(req_id)
        for req_id in metadata.reqs_not_processed:
            self._reqs_to_process.discard(req_id)
        for req_id in metadata.reqs_to_send:
            if req_id in self._reqs_to_process:
                self._reqs_to_send.add(req_id)
        for req_id, reason in getattr(metadata, "reqs_hold_refused", {}).items():
            # The scheduler answered request_finished with params it made
            # and the sidecar then refused the hold: nothing holds the
            # blocks, so the request is finished sending now.
            if req_id in self._reqs_to_process:
                self._reqs_to_process.discard(req_id)
                self._reqs_to_send.discard(req_id)
                self._done_sending.add(req_id)
                self.release_reasons[req_id] = reason
        if self._client.lost is not None:
            self._release_all_held()

    def _send_watches(self, metadata, errors):
        """The scheduler's lease renewals (on_new_request) and their ends
        (request_finished before a read), pipelined so the step does not
        wait on them; a refusal is only logged (the read goes on, and
        fails if the lease lapsed). A request read in this same step
        needs no watch: its read heartbeats it."""
        if not self.leases or self.rank is None or self._client.lost is not None:
            return
        try:
            for req_id in getattr(metadata, "reqs_to_unwatch", ()):
                self._client.unwatch_nowait(self.rank, req_id)
            for req_id, params in getattr(metadata, "reqs_to_watch", {}).items():
                if req_id not in metadata.reqs_to_recv:
                    self._client.watch_nowait(self.rank, req_id, params)
        except errors as e:
            logger.warning("kvhost: watch: %s", e)

    def _release_all_held(self):
        """The sidecar is gone, and with it every hold: nothing will read
        these blocks, so they are reported finished (vLLM frees them), as
        NIXL's worker does when their abort timeout expires."""
        for req_id in self._reqs_to_send:
            self._reqs_to_process.discard(req_id)
            self._done_sending.add(req_id)
            self.release_reasons[req_id] = "sidecar connection lost"
        self._reqs_to_send.clear()

    def _finish_recv(self, req_id, result):
        """A read ended (ok or not). An awaited one is reported in the next
        finished_recving; a notify-only one (awaiting_kvs False) is
        forgotten: vLLM's scheduler does not wait for it and may have freed
        the request already."""
        self.read_results[req_id] = result
        meta = self._recving.get(req_id)
        if meta is not None and not meta.awaiting_kvs:
            del self._recving[req_id]
            if not result.get("ok"):
                logger.warning("kvhost: notification of request %s to its prefill failed: %s",
                               req_id, result.get("reason", ""))
            return
        self._done_recving.add(req_id)

    def _fail_recv(self, req_id, invalid, reason):
        meta = self._recving.get(req_id)
        if meta is not None and meta.awaiting_kvs:
            self._failed_recving.add(req_id)
            if invalid:
                self._invalid_block_ids.update(invalid)
            else:
                self._invalid_block_ids.update(meta.local_block_ids)
        self._finish_recv(req_id, {"ok": False, "reason": reason})

    def _on_read_refused(self, client, req_id):
        rank = self.rank

        def refused(e):
            logger.error("kvhost: read of request %s refused: %s", req_id, e)
            # On the client's I/O thread: queued like the read event the
            # sidecar sends for a read that failed after it started.
            self._events.append((client.generation, {
                "event": "read", "rank": rank, "request_id": req_id, "ok": False,
                "invalid_blocks": b"", "reason": "read refused: %s" % e,
            }))

        return refused

    def _listener(self, client):
        def on_event(ev):
            # On the client's I/O thread (and still after shutdown): only
            # queue it, with the connection it came on (an old connection's
            # late events must not touch the new one's reads).
            self._events.append((client.generation, ev))

        return on_event

    def _lost_all(self, reason):
        """Every read in flight is lost with the connection: its blocks are
        invalid (vLLM recomputes them). Every hold too."""
        for req_id in list(self._recving):
            if req_id not in self._done_recving:
                self._fail_recv(req_id, None, reason)
        self._release_all_held()

    def _handle_events(self):
        while self._events:
            gen, ev = self._events.popleft()
            if gen != self._client.generation:
                continue  # the old connection's: _connected ended its work
            kind = ev.get("event")
            if kind == "read":
                if self.rank is None or ev.get("rank") != self.rank:
                    continue
                req_id = ev.get("request_id")
                if req_id not in self._recving or req_id in self._done_recving:
                    logger.warning("kvhost: read event for unknown request %s", req_id)
                    continue
                if ev.get("ok"):
                    self._finish_recv(req_id, {
                        "ok": True,
                        "bytes": ev.get("bytes", 0),
                        "seconds": ev.get("seconds", 0.0),
                    })
                else:
                    invalid = memory.unpack_i32(ev.get("invalid_blocks") or b"")
                    self._fail_recv(req_id, invalid, ev.get("reason", ""))
            elif kind == "released":
                if ev.get("engine_id") != self.engine_id:
                    continue
                req_id = ev.get("request_id")
                self.release_reasons[req_id] = ev.get("reason", "")
                if req_id in self._reqs_to_process:
                    self._reqs_to_process.discard(req_id)
                    self._reqs_to_send.discard(req_id)
                    self._done_sending.add(req_id)
                else:
                    # As vLLM's NIXL connector: a release of a request this
                    # engine is not sending (expired, or already aborted).
                    logger.warning("kvhost: release of unrecognized request %s", req_id)
            elif kind == "connection_lost":
                self._lost_all(ev.get("reason", "sidecar connection lost"))

    def get_finished(self):
        """(finished_sending, finished_recving) since the last call."""
        return self.get_finished_and_failed()[:2]

    def get_finished_and_failed(self):
        """(finished_sending, finished_recving, the failed of those
        recving) since the last call."""
        self._handle_events()
        done_sending, self._done_sending = self._done_sending, set()
        done_recving, self._done_recving = self._done_recving, set()
        failed, self._failed_recving = self._failed_recving & done_recving, self._failed_recving - done_recving
        for req_id in done_recving:
            self._recving.pop(req_id, None)
        return done_sending, done_recving, failed

    def get_block_ids_with_load_errors(self):
        self._handle_events()
        result, self._invalid_block_ids = self._invalid_block_ids, set()
        return result

    def shutdown(self):
        """Close the ranks and the connection (the sidecar fails their reads
        and releases their mappings)."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            for rank in (self.rank, self.prefill_rank):
                if rank is not None:
                    client.close_rank(rank)
        except Exception as e:  # closing anyway
            logger.debug("kvhost: close_rank: %s", e)
        finally:
            self.rank = self.prefill_rank = None
            client.close()


class _NotDecode(Exception):
    """A read on a worker that opened no decode rank."""
