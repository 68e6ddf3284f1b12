"""vLLM KV connector that hands transfers to a ``kvhost serve`` sidecar.

``KvhostConnector`` has the interface of vLLM's KV connector v1 as vLLM's
NIXL connector implements it (vLLM 0.13's
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, current
vLLM's v1/nixl/ package): the scheduler side (kvhost.vllm.scheduler)
decides which requests load or send KV and builds the per-step metadata;
the worker side (kvhost.vllm.worker) registers the KV caches, starts the
reads and reports what finished. Where the NIXL connector drives NIXL
itself (agents, handshakes, notifications, the abort timeout), this one
asks the sidecar (docs/engine-api.md, the ``vllm`` ops), which speaks the
NIXL connector's wire to its peers: a kvhost-backed vLLM engine pairs with
a NIXL-connector vLLM engine as well as with another kvhost one. The
peers' wire generation and compatibility-hash factors are the engine's
own (kvhost.vllm.generations).

Select it in vLLM (``kv_connector_module_path`` loads it; python/README.md
has the full command lines)::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KvhostConnector",
        "kv_connector_module_path": "kvhost.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvhost_control": "ipc:///run/kvhost/engine.sock"}}'

``kv_role``: ``kv_producer`` (prefill), ``kv_consumer`` (decode) or
``kv_both`` (either, per request, as vLLM's NIXL connector).
``kv_connector_extra_config`` keys (all optional): ``kvhost_control`` (the
sidecar's control endpoint; else ``$KVHOST_CONTROL``, else the client's
default), ``kvhost_role`` (``prefill``, ``decode`` or ``both``; else from
``kv_role``), ``kvhost_tp_rank`` (when vLLM's parallel state is not
initialised), ``kvhost_attn_backend`` and ``kvhost_kv_cache_layout`` (when
vLLM cannot be asked), ``kvhost_vllm_version`` and
``kvhost_nixl_connector_version`` (the compatibility-hash generation, when
vLLM cannot be asked), ``kvhost_blocks_first`` (FlashInfer-style caches,
``(num_blocks, 2, ...)`` per layer), ``kvhost_side_channel_host`` and
``kvhost_side_channel_port`` (else vLLM's
``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` plus the DP index, as the NIXL
connector does), ``kvhost_abort_timeout`` (seconds; else vLLM's
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` when vLLM is present, else the
sidecar's default), ``kv_lease_duration`` (vLLM's own key: seconds of the
prefill's lease at generations with leases, 6 on; else 30).
``num_threads``, vLLM's own NIXL knob (UCX worker threads), is passed to
the ranks' agents (``open_rank``'s ``agent_params``); unset, the
sidecar's default applies: worker threads on the decode rank, which
reads, none on the prefill.

kvhost moves one KV cache group: a hybrid model (sliding-window or Mamba
layers beside full attention) is refused at start with a message; run
such a model with ``--disable-hybrid-kv-cache-manager`` on both engines.

The prefill engine's abort timeout is kept by the sidecar: it releases
held blocks that no decode read in time and reports them like a read's
release, so the workers' ``get_finished`` returns them as
``finished_sending`` either way. From generation 6 it holds for a lease
the decode renews: the sidecar heartbeats reads in flight, and a decode
request waiting in the engine's queue is renewed from its arrival as
vLLM's NIXL scheduler does (on_new_request; the workers send ``watch``
with the step's metadata, ``unwatch`` when it ends before its read).

vLLM itself is imported lazily: when it is absent (tests, the engine
demo) stand-ins take the place of vLLM's base classes (kvhost.vllm.base).

What is proven without vLLM: python/tests/test_vllm_replay.py replays
vLLM's own scheduler and model-runner call order (0.13 and current vLLM,
each step named by upstream file and commit) against live ``kvhost
serve`` sidecars on the fake plugin, every byte checked;
python/tests/test_vllm_connector.py covers failures (bad
kv_transfer_params, sidecars gone and restarted, abort timeout);
python/tests/test_vllm_generations.py the compatibility factors per
generation. What needs a real vLLM: vLLM's own processes calling these
methods, CUDA tensors (the vram path uses torch's CUDA IPC handles),
layouts other than split K/V HND, the compatibility hash against a
NIXL-connector vLLM peer.
"""

from __future__ import annotations

from kvhost.vllm import settings
from kvhost.vllm.base import (
    HAVE_VLLM,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    connector_bases,
)
from kvhost.vllm.memory import dram_regions
from kvhost.vllm.scheduler import KvhostConnectorMetadata, KvhostConnectorScheduler, ReqMeta
from kvhost.vllm.worker import KvhostConnectorWorker

__all__ = [
    "HAVE_VLLM",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KvhostConnector",
    "KvhostConnectorMetadata",
    "KvhostConnectorScheduler",
    "KvhostConnectorWorker",
    "ReqMeta",
    "SupportsHMA",
    "dram_regions",
]


def _check_kv_cache_config(kv_cache_config):
    """kvhost moves one group of attention KV (per layer K and V, or MLA's
    one latent); refuse what it cannot move before vLLM serves anything."""
    groups = settings.get(kv_cache_config, "kv_cache_groups")
    if groups is None:
        return
    if len(groups) != 1:
        raise ValueError(
            f"KvhostConnector: this model's KV cache has {len(groups)} groups (hybrid attention: sliding-window or "
            "Mamba layers beside full attention); kvhost moves one group. Run vLLM with "
            "--disable-hybrid-kv-cache-manager on both the prefill and the decode engine"
        )
    spec = type(settings.get(groups[0], "kv_cache_spec")).__name__
    if "Mamba" in spec:
        raise ValueError(f"KvhostConnector: {spec}: kvhost moves attention KV, not Mamba state")


class KvhostConnector(*connector_bases()):
    """vLLM KV connector (v1) backed by ``kvhost serve``; see the module doc."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc is None or ktc.engine_id is None:
            raise ValueError("KvhostConnector: kv_transfer_config.engine_id must be set")
        _check_kv_cache_config(kv_cache_config)
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
        model_config = settings.get(vllm_config, "model_config")
        if model_config is None or settings.get(model_config, "use_mla", False):
            return None
        return "HND"

    # ---- scheduler side --------------------------------------------------

    def on_new_request(self, request):
        """Current vLLM's Scheduler.add_request calls this as a request
        arrives: a decode request's lease is renewed from here."""
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def update_connector_output(self, connector_output):
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

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
        """vLLM's scheduler calls this for a connector that is not a
        SupportsHMA (vLLM 0.13), with the one group's block ids."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA: current vLLM's scheduler calls this instead of
        request_finished, with one block id list per KV cache group
        (scheduler.py _connector_finished)."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, tuple(block_ids))

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

    def get_transfer_results(self, finished_req_ids):
        """Current vLLM's model runner asks this instead of get_finished
        (kv_connector_model_runner_mixin.py @ 00f4240e): vLLM's
        KVConnectorTransferResults with the reads that failed also in
        failed_recving (they are in finished_recving too)."""
        from dataclasses import fields

        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
            KVConnectorTransferResults,
        )

        assert self.connector_worker is not None
        sending, recving, failed = self.connector_worker.get_finished_and_failed()
        have = {f.name for f in fields(KVConnectorTransferResults)}
        out = {"finished_sending": sending, "finished_recving": recving, "failed_recving": failed}
        return KVConnectorTransferResults(**{k: v for k, v in out.items() if k in have})

    def get_block_ids_with_load_errors(self):
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
