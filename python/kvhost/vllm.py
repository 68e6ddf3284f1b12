"""vLLM KV connector that hands transfers to a ``kvhost serve`` sidecar.

``KvhostConnector`` has the interface of vLLM's KV connector v1 as vLLM's
NIXL connector implements it (vLLM's
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): the
scheduler side decides which requests load or send KV and builds the
per-step metadata; the worker side registers the KV caches, starts the
reads and reports what finished. Where the NIXL connector drives NIXL
itself (agents, handshakes, notifications, the abort timeout), this one
asks the sidecar (docs/engine-api.md, the ``vllm`` ops), which speaks
the NIXL connector's wire to its peers: a kvhost-backed vLLM engine pairs
with a NIXL-connector vLLM engine as well as with another kvhost one.

Select it in vLLM (``kv_connector_module_path`` loads it)::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KvhostConnector",
        "kv_connector_module_path": "kvhost.vllm",
        "kv_role": "kv_producer",            # kv_consumer on the decode engine
        "kv_connector_extra_config": {"kvhost_control": "ipc:///run/kvhost/engine.sock"}}'

``kv_connector_extra_config`` keys (all optional): ``kvhost_control``
(the sidecar's control endpoint; else ``$KVHOST_CONTROL``, else the
client's default), ``kvhost_role`` (``prefill`` or ``decode``; else from
``kv_role``), ``kvhost_tp_rank`` (when vLLM's parallel state is not
initialised), ``kvhost_attn_backend`` and ``kvhost_kv_cache_layout``
(when vLLM cannot be asked), ``kvhost_blocks_first`` (FlashInfer-style
caches, ``(num_blocks, 2, ...)`` per layer), ``kvhost_side_channel_host``
and ``kvhost_side_channel_port`` (else vLLM's
``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` plus the DP rank, as the NIXL
connector does), ``kvhost_abort_timeout`` (seconds; else vLLM's
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` when vLLM is present, else the
sidecar's default). ``num_threads``, vLLM's own NIXL knob (UCX worker
threads), is passed to the rank's agent (``open_rank``'s
``agent_params``); unset, the sidecar's default applies: 4 on the decode
rank, which reads, none on the prefill (vLLM's connector gives both 4).

The prefill engine's abort timeout is kept by the sidecar: it releases
held blocks that no decode read in time and reports them like a read's
release, so the workers' ``get_finished`` returns them as
``finished_sending`` either way.

vLLM itself is imported lazily: when it is absent (tests, the engine
demo) small stand-ins take the place of vLLM's base classes
(``KVConnectorBase_V1``, ``KVConnectorMetadata``, ``KVConnectorRole``).

What is proven without vLLM (python/tests/test_vllm_connector.py and
``make demo-engine``, against live ``kvhost serve`` sidecars on the fake
plugin, engines' KV in shared-memory numpy pools): the scheduler and worker
calls in vLLM's order (kvhost.vllm_standins stands in for vLLM's config,
request, block and scheduler-output types) move every byte, TP 1 -> 2 and
2 -> 4, HND; releases (notified, abort timeout) reach every prefill
worker's finished_sending; a full prefix hit and a request aborted before
it was scheduled free the prefill's blocks; bad kv_transfer_params, a
prefill sidecar gone and the decode's own sidecar gone end the load as
finished_recving with its blocks in get_block_ids_with_load_errors; a
prefill sidecar gone reports its held requests finished_sending; a
restarted sidecar is reconnected to and registered with again.
What needs a real vLLM: vLLM's own scheduler, KVOutputAggregator and
model runner calling these methods (including async scheduling), CUDA
tensors (the vram path uses torch's CUDA IPC handles and is not run here),
layouts other than split K/V HND (NHD, blocks-first, MLA: passed to the
sidecar as vLLM describes them, not exercised), the compatibility hash
against a NIXL-connector vLLM peer (factors as vLLM computes them; vLLM's
version and attention backend name come from vLLM when present).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import re
import time
from dataclasses import dataclass

logger = logging.getLogger("kvhost.vllm")

# vLLM's NIXL_CONNECTOR_VERSION (vllm/distributed/kv_transfer/kv_connector/
# v1/nixl_connector.py): part of the compatibility hash, so a kvhost engine
# and a NIXL-connector engine of the same vLLM agree on it.
NIXL_CONNECTOR_VERSION = 2

# The keys vLLM's NixlConnectorScheduler.update_state_after_alloc requires
# in a decode request's kv_transfer_params besides remote_block_ids.
_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def _vllm_base():
    """vLLM's connector base classes, or stand-ins when vLLM is absent."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
            KVConnectorBase_V1,
            KVConnectorMetadata,
            KVConnectorRole,
        )

        return KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, True
    except ImportError:
        pass

    class KVConnectorRole(enum.Enum):  # vLLM's v1/base.py values
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # vLLM's is an empty abstract base too
        pass

    class KVConnectorBase_V1:
        """What vLLM's KVConnectorBase_V1 gives a connector: the config, the
        role and the bound per-step metadata."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

    return KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, False


KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, HAVE_VLLM = _vllm_base()


@dataclass
class ReqMeta:
    """One request's transfer, as vLLM's NIXL ReqMeta without the fields
    the sidecar derives itself (remote ranks, physical block ids)."""

    local_block_ids: list
    kv_transfer_params: dict
    tp_size: int = 1


class KvhostConnectorMetadata(KVConnectorMetadata):
    """The scheduler's per-step message to the workers: vLLM's
    NixlConnectorMetadata with the same fields (reqs_to_save is always
    empty: the sidecar reads the KV caches in place)."""

    def __init__(self):
        self.reqs_to_recv: dict[str, ReqMeta] = {}
        self.reqs_to_save: dict[str, ReqMeta] = {}
        self.reqs_to_send: dict[str, float] = {}
        self.reqs_in_batch: set[str] = set()
        self.reqs_not_processed: set[str] = set()


def _get(obj, name, default=None):
    return getattr(obj, name, default) if obj is not None else default


def _extra(vllm_config, key, default=None):
    ktc = _get(vllm_config, "kv_transfer_config")
    extra = _get(ktc, "kv_connector_extra_config") or {}
    return extra.get(key, default)


def _connect(vllm_config):
    """A kvhost client connected to the sidecar named by the config."""
    from kvhost import client as kvclient

    # None: the client's default (KVHOST_CONTROL, then the default socket).
    addr = _extra(vllm_config, "kvhost_control")
    # Events arrive through a listener (never dropped), not the client's
    # bounded queue.
    return kvclient.Client(addr, client_name="kvhost.vllm", queue_events=False)


# After the sidecar connection is lost: how often to try again, and how
# long each try waits for the sidecar's hello (it blocks the engine's step).
RECONNECT_INTERVAL = 2.0
RECONNECT_TIMEOUT = 1.0


def _reconnect(client, next_try, who):
    """(connected, next try time): reconnects a lost client when it is
    time (waiting at most RECONNECT_TIMEOUT for the sidecar's hello)."""
    if client.lost is None:
        return True, next_try
    now = time.monotonic()
    if now < next_try:
        return False, next_try
    next_try = now + RECONNECT_INTERVAL
    saved = client.connect_timeout
    client.connect_timeout = min(saved, RECONNECT_TIMEOUT)
    try:
        restarted = client.reconnect()
    except Exception as e:  # still gone; try again later
        logger.warning("kvhost: %s: sidecar still unreachable: %s", who, e)
        return False, next_try
    finally:
        client.connect_timeout = saved
    logger.warning("kvhost: %s: reconnected to %s sidecar", who, "a restarted" if restarted else "the")
    return True, next_try


def _client_error_types():
    from kvhost import client as kvclient

    return (kvclient.KVHostError,)


class KvhostConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1) backed by ``kvhost serve``; see the module doc."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc is None or ktc.engine_id is None:
            raise ValueError("KvhostConnector: kv_transfer_config.engine_id must be set")
        self.engine_id: str = ktc.engine_id
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvhostConnectorScheduler(vllm_config, self.engine_id)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvhostConnectorWorker(vllm_config, self.engine_id)
        else:
            raise ValueError(f"KvhostConnector: unknown role {role!r}")

    # ---- class methods vLLM asks before building the KV caches ----------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        """HND for MHA (the heads of a block are contiguous, so heterogeneous
        TP reads whole ranges), as vLLM's NIXL connector asks."""
        model_config = _get(vllm_config, "model_config")
        if model_config is None or _get(model_config, "use_mla", False):
            return None
        return "HND"

    # ---- scheduler side --------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ---- worker side -----------------------------------------------------

    def register_kv_caches(self, kv_caches):
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        assert self.connector_worker is not None
        assert isinstance(self._connector_metadata, KvhostConnectorMetadata)
        self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name):
        """Not layerwise, as vLLM's NIXL connector."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing to save: the prefill's blocks are read in place."""

    def wait_for_save(self):
        """Nothing to wait for (vLLM's NIXL connector copies to its host
        buffer here; the sidecar reads the registered memory directly)."""

    def get_finished(self, finished_req_ids):
        assert self.connector_worker is not None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self):
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()


class KvhostConnectorScheduler:
    """Scheduler side: vLLM's NixlConnectorScheduler, with request_finished
    asking the sidecar to hold the blocks (``hold``) and returning the
    kv_transfer_params the sidecar made."""

    def __init__(self, vllm_config, engine_id, client=None):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self._client = client if client is not None else _connect(vllm_config)
        self._next_reconnect = 0.0
        # Request id -> (its kv_transfer_params as the proxy sent them,
        # local block ids). A copy: vLLM's scheduler clears
        # do_remote_prefill in the request's own dict once the load is
        # scheduled, and the sidecar reads the params as the prefill made
        # them.
        self._reqs_need_recv: dict[str, tuple[dict, list]] = {}
        self._reqs_need_send: dict[str, float] = {}
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()

    def shutdown(self):
        if self._client is not None:
            self._client.close()
            self._client = None

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
                if all(k in params for k in _REMOTE_KEYS):
                    # num_external_tokens == 0 is a full prefix hit: read
                    # nothing, but tell the prefill so it frees its blocks.
                    local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
                    self._reqs_need_recv[request.request_id] = (dict(params), local)
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
        for req_id, (params, block_ids) in self._reqs_need_recv.items():
            meta.reqs_to_recv[req_id] = ReqMeta(
                local_block_ids=list(block_ids),
                kv_transfer_params=params,
                tp_size=params.get("tp_size", 1),
            )
        meta.reqs_to_send = self._reqs_need_send
        meta.reqs_in_batch = self._reqs_in_batch
        meta.reqs_not_processed = self._reqs_not_processed
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        self._reqs_in_batch = set()
        self._reqs_not_processed = set()
        return meta

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: read nothing but
            # notify the prefill so its blocks are freed now, not at timeout.
            self._reqs_need_recv[request.request_id] = (dict(params), [])
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not _finished_length_capped(request):
            # Aborted or stopped early: the blocks are freed now, nothing held.
            self._reqs_not_processed.add(request.request_id)
            return False, None
        if len(block_ids) == 0:
            # Nothing to hold (vLLM's NIXL connector returns params with no
            # blocks, which the decode then loads nothing from).
            self._reqs_not_processed.add(request.request_id)
            return False, None
        try:
            self._next_reconnect = _reconnect(self._client, self._next_reconnect, "scheduler")[1]
            kv_params = self._client.hold(self.engine_id, request.request_id, list(block_ids))
        except _client_error_types() as e:
            # Not held (the sidecar refused, or is gone): the blocks are
            # freed now and the response carries no params, so no decode
            # waits for them; vLLM's scheduler goes on.
            logger.error("kvhost: hold of request %s refused: %s", request.request_id, e)
            self._reqs_not_processed.add(request.request_id)
            return False, None
        # The worker learns of it from the metadata; expiry is the sidecar's.
        self._reqs_need_send[request.request_id] = 0.0
        return True, dict(kv_params)


def _finished_length_capped(request) -> bool:
    """request.status is vLLM's RequestStatus.FINISHED_LENGTH_CAPPED (a
    prefill request stopped by max_tokens=1, the one to send)."""
    status = request.status
    try:
        from vllm.v1.request import RequestStatus  # type: ignore

        return status == RequestStatus.FINISHED_LENGTH_CAPPED
    except ImportError:
        return getattr(status, "name", status) == "FINISHED_LENGTH_CAPPED"


# ---- worker side -----------------------------------------------------------

_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ \d+\s+(.*)$")


def _shm_mappings():
    """This process's shared-memory file mappings: (start, end, path, file
    offset), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            m = _MAPS_LINE.match(line.rstrip("\n"))
            if not m:
                continue
            path = m.group(4).strip()
            if path.endswith(" (deleted)"):
                continue
            if not (path.startswith("/dev/shm/") or path.startswith("/dev/hugepages/")):
                continue
            out.append((int(m.group(1), 16), int(m.group(2), 16), path, int(m.group(3), 16)))
    return out


def _dram_regions(ranges):
    """kvhost.shm's regions for ranges in its pools, else the shared-memory
    mappings holding them (memory another allocator put in /dev/shm)."""
    from kvhost import shm

    try:
        return shm.regions_for(ranges)
    except ValueError:
        return dram_regions(ranges)


def dram_regions(ranges):
    """The ``dram`` regions (docs/engine-api.md, register_memory) that hold
    the given (addr, length) ranges: one per shared-memory mapping of this
    process that holds any of them, the whole mapping. A range that is not
    in one shared-memory mapping is an error naming it."""
    maps = _shm_mappings()
    used = {}
    for addr, length in ranges:
        for start, end, path, off in maps:
            if start <= addr and addr + length <= end:
                used[(start, end)] = {
                    "kind": "dram",
                    "addr": start,
                    "length": end - start,
                    "shm": path,
                    "offset": off,
                }
                break
        else:
            raise ValueError(
                f"kvhost: KV cache at 0x{addr:x} (+{length} bytes) is not in shared memory: "
                "allocate host-memory KV caches with kvhost.shm so the sidecar can map them"
            )
    return [used[k] for k in sorted(used)]


def _is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def _ptr_len(t):
    """(data pointer, bytes) of a numpy array or torch tensor."""
    if _is_torch(t):
        return t.data_ptr(), t.numel() * t.element_size()
    return t.__array_interface__["data"][0], t.nbytes


def _vram_region(t):
    """A ``vram`` region for a CUDA torch tensor: its storage's CUDA IPC
    handle (torch's own sharing of CUDA storages between processes)."""
    storage = t.untyped_storage()
    shared = storage._share_cuda_()
    device, handle, size, offset = shared[0], shared[1], shared[2], shared[3]
    if len(handle) != 64:
        raise ValueError(f"kvhost: CUDA IPC handle of {len(handle)} bytes, want 64")
    return {
        "kind": "vram",
        "addr": storage.data_ptr(),
        "length": int(size),
        "cuda_ipc": bytes(handle),
        "offset": int(offset),
        "device": int(device),
    }


def _tp_rank_size(vllm_config):
    try:
        from vllm.distributed.parallel_state import (  # type: ignore
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        pass
    rank = _extra(vllm_config, "kvhost_tp_rank")
    if rank is None:
        raise ValueError("KvhostConnector: vLLM's TP rank is unknown: set kv_connector_extra_config.kvhost_tp_rank")
    return int(rank), int(vllm_config.parallel_config.tensor_parallel_size)


def _compat_factors(vllm_config, attn_backend_name):
    """vLLM's compute_nixl_compatibility_hash factors (the sidecar hashes
    them as vLLM's hash_factors does)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm import __version__ as vllm_version  # type: ignore
    except ImportError:
        vllm_version = _extra(vllm_config, "kvhost_vllm_version", "unknown")
    return {
        "vllm_version": str(vllm_version),
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": str(mc.model),
        "dtype": str(mc.dtype),
        "num_kv_heads": int(mc.get_total_num_kv_heads()),
        "head_size": int(mc.get_head_size()),
        "num_hidden_layers": int(mc.get_total_num_hidden_layers()),
        "attn_backend_name": str(attn_backend_name),
        "cache_dtype": str(cc.cache_dtype),
    }


def _attn_backend_name(vllm_config):
    name = _extra(vllm_config, "kvhost_attn_backend")
    if name:
        return name
    try:
        from vllm.attention.selector import get_attn_backend  # type: ignore

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        return get_attn_backend(
            mc.get_head_size(), mc.dtype, cc.cache_dtype, cc.block_size, use_mla=mc.use_mla
        ).get_name()
    except ImportError:
        raise ValueError(
            "KvhostConnector: vLLM is absent: set kv_connector_extra_config.kvhost_attn_backend"
        ) from None


def _kv_cache_layout(vllm_config):
    layout = _extra(vllm_config, "kvhost_kv_cache_layout")
    if layout:
        return layout
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # type: ignore

        return get_kv_cache_layout()
    except ImportError:
        return "HND"


def _side_channel(vllm_config):
    host = _extra(vllm_config, "kvhost_side_channel_host")
    port = _extra(vllm_config, "kvhost_side_channel_port")
    if host is None or port is None:
        try:
            from vllm import envs  # type: ignore

            env_host, env_port = envs.VLLM_NIXL_SIDE_CHANNEL_HOST, envs.VLLM_NIXL_SIDE_CHANNEL_PORT
        except ImportError:
            env_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
            env_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        dp_rank = int(_get(_get(vllm_config, "parallel_config"), "data_parallel_rank", 0) or 0)
        host = env_host if host is None else host
        port = env_port + dp_rank if port is None else port
    return str(host), int(port)


def _abort_timeout(vllm_config):
    """Seconds the prefill holds blocks no decode read (vLLM's
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT); None: the sidecar's default."""
    t = _extra(vllm_config, "kvhost_abort_timeout")
    if t is not None:
        return float(t)
    try:
        from vllm import envs  # type: ignore

        return float(envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    except ImportError:
        return None


def _role(vllm_config):
    role = _extra(vllm_config, "kvhost_role")
    if role:
        if role not in ("prefill", "decode"):
            raise ValueError(f"KvhostConnector: kvhost_role {role!r}: want prefill or decode")
        return role
    kv_role = vllm_config.kv_transfer_config.kv_role
    if kv_role == "kv_producer":
        return "prefill"
    if kv_role == "kv_consumer":
        return "decode"
    raise ValueError(
        f"KvhostConnector: kv_role {kv_role!r}: a kvhost rank is a prefill (kv_producer) or a decode "
        "(kv_consumer) rank; set kv_connector_extra_config.kvhost_role for kv_both"
    )


class KvhostConnectorWorker:
    """Worker side: vLLM's NixlConnectorWorker, with the sidecar's rank in
    place of the NIXL agent: register_kv_caches opens the rank,
    start_load_kv sends one ``read`` per request, get_finished reports the
    sidecar's ``read`` and ``released`` events."""

    def __init__(self, vllm_config, engine_id, client=None):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.use_mla = bool(_get(vllm_config.model_config, "use_mla", False))
        self.role = _role(vllm_config)
        self.tp_rank, self.tp_size = _tp_rank_size(vllm_config)
        self._client = client if client is not None else _connect(vllm_config)
        # Events, appended by the client's I/O thread, handled by the
        # worker's thread in get_finished.
        self._events = collections.deque()
        self._client.add_listener(self._on_event)
        self.rank = None  # the sidecar's rank id once register_kv_caches ran
        self.agent_params = {}  # the agent's parameters as the sidecar reports them
        self._rank_open = False
        self._next_reconnect = 0.0
        self.region_ids: list = []
        self.kv_caches = None
        self.num_blocks = 0
        # The requests start_load_kv asked to read, by request id.
        self._recving: dict[str, ReqMeta] = {}
        # Finished reads not yet reported, and reads that failed before the
        # sidecar took them (reported as finished, as NIXL's
        # _failed_recv_reqs).
        self._done_recving: set[str] = set()
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
        blocks_first = bool(_extra(self.vllm_config, "kvhost_blocks_first", False))
        split = not self.use_mla and not blocks_first
        tensors = []
        seen = set()
        for _name, cache in kv_caches.items():
            for t in ([cache[0], cache[1]] if split else [cache]):
                ptr, _ = _ptr_len(t)
                if ptr in seen:  # layers sharing one tensor (hybrid allocator)
                    continue
                seen.add(ptr)
                tensors.append(t)
        if not tensors:
            raise ValueError("KvhostConnector: no KV caches to register")
        sizes = {_ptr_len(t)[1] for t in tensors}
        if len(sizes) != 1:
            raise ValueError(f"KvhostConnector: KV cache tensors of different sizes {sorted(sizes)}")
        region_len = sizes.pop()
        num_blocks = int(tensors[0].shape[0])
        if any(int(t.shape[0]) != num_blocks for t in tensors):
            raise ValueError("KvhostConnector: KV cache tensors with different block counts")

        cuda = [t for t in tensors if _is_torch(t) and t.is_cuda]
        if cuda and len(cuda) != len(tensors):
            raise ValueError("KvhostConnector: KV caches partly on GPU, partly in host memory")
        if cuda:
            regions, seen_alloc = [], set()
            for t in tensors:
                r = _vram_region(t)
                if r["addr"] not in seen_alloc:
                    seen_alloc.add(r["addr"])
                    regions.append(r)
        else:
            regions = _dram_regions([_ptr_len(t) for t in tensors])
        self._regions = regions

        mc = self.vllm_config.model_config
        fields = dict(
            engine_id=self.engine_id,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            kv_caches_base_addr=[_ptr_len(t)[0] for t in tensors],
            region_len=region_len,
            num_blocks=num_blocks,
            block_size=self.block_size,
            kv_cache_layout=_kv_cache_layout(self.vllm_config),
            blocks_first=blocks_first,
            is_mla=self.use_mla,
            total_kv_heads=int(mc.get_total_num_kv_heads()),
            compat=_compat_factors(self.vllm_config, _attn_backend_name(self.vllm_config)),
        )
        threads = _extra(self.vllm_config, "num_threads")
        if threads is not None:
            fields["agent_params"] = {"num_threads": str(int(threads))}
        if self.role == "prefill":
            host, port = _side_channel(self.vllm_config)
            fields.update(side_channel_host=host, side_channel_port=port)
            abort = _abort_timeout(self.vllm_config)
            if abort is not None:
                fields["abort_timeout"] = abort
        self._fields = fields
        self._open()
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks

    def _open(self):
        """Registers the KV caches' memory and opens the rank (again, after
        a reconnect: the sidecar forgot everything of the old connection)."""
        self._rank_open = False
        self.region_ids = list(self._client.register_memory(self._regions))
        reply = self._client.open_rank(style="vllm", role=self.role, **self._fields)
        self.rank = reply["rank"]
        self.endpoint = reply.get("endpoint", "")
        # What the sidecar created the rank's agent with (its defaults
        # included), for logs and tests.
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
        ok, self._next_reconnect = _reconnect(self._client, self._next_reconnect, "worker")
        if not ok:
            return False
        if lost is not None:
            # What the old connection had ended with it, whether or not its
            # connection_lost event was handled yet.
            self._lost_all(lost)
        try:
            self._open()
        except _client_error_types() as e:
            logger.warning("kvhost: worker: registering again: %s", e)
            self._next_reconnect = time.monotonic() + RECONNECT_INTERVAL
            return False
        return True

    # -- per step --

    def start_load_kv(self, metadata):
        errors = _client_error_types()
        if self.rank is not None:
            self._connected()  # reads fail at once while it is gone
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving[req_id] = meta
            try:
                self._client.read(self.rank, req_id, meta.kv_transfer_params, list(meta.local_block_ids))
            except errors as e:
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
        if self._client.lost is not None:
            self._release_all_held()

    def _release_all_held(self):
        """The sidecar is gone, and with it every hold: nothing will read
        these blocks, so they are reported finished (vLLM frees them), as
        NIXL's worker does when their abort timeout expires."""
        for req_id in self._reqs_to_send:
            self._reqs_to_process.discard(req_id)
            self._done_sending.add(req_id)
            self.release_reasons[req_id] = "sidecar connection lost"
        self._reqs_to_send.clear()

    def _fail_recv(self, req_id, invalid, reason):
        meta = self._recving.get(req_id)
        if invalid:
            self._invalid_block_ids.update(invalid)
        elif meta is not None:
            self._invalid_block_ids.update(meta.local_block_ids)
        self.read_results[req_id] = {"ok": False, "reason": reason}
        self._done_recving.add(req_id)

    def _on_event(self, ev):
        # On the client's I/O thread: only queue it, with the connection it
        # came on (an old connection's late events must not touch the new
        # one's reads).
        self._events.append((self._client.generation, ev))

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
                if ev.get("rank") != self.rank:
                    continue
                req_id = ev.get("request_id")
                if req_id not in self._recving:
                    logger.warning("kvhost: read event for unknown request %s", req_id)
                    continue
                if ev.get("ok"):
                    self.read_results[req_id] = {
                        "ok": True,
                        "bytes": ev.get("bytes", 0),
                        "seconds": ev.get("seconds", 0.0),
                    }
                    self._done_recving.add(req_id)
                else:
                    invalid = _unpack_i32(ev.get("invalid_blocks") or b"")
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
        self._handle_events()
        done_sending, self._done_sending = self._done_sending, set()
        done_recving, self._done_recving = self._done_recving, set()
        for req_id in done_recving:
            self._recving.pop(req_id, None)
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self):
        self._handle_events()
        result, self._invalid_block_ids = self._invalid_block_ids, set()
        return result

    def shutdown(self):
        """Close the rank and the connection (the sidecar fails its reads
        and releases its mappings)."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            if self.rank is not None:
                client.close_rank(self.rank)
        except Exception as e:  # closing anyway
            logger.debug("kvhost: close_rank: %s", e)
        finally:
            self.rank = None
            client.close()


def _unpack_i32(b: bytes) -> list:
    import struct

    n = len(b) // 4
    return list(struct.unpack(f"<{n}i", b[: n * 4]))
