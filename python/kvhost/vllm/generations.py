"""vLLM's NIXL connector wire generations, as data.

vLLM numbers every incompatible change of its NIXL connector's wire
(handshake metadata, kv_transfer_params, notifications) with
``NIXL_CONNECTOR_VERSION`` and hashes it, with other factors, into the
compatibility hash both engines of a pair must agree on
(``compute_nixl_compatibility_hash``: vLLM 0.13's
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, later
vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py). The sidecar
speaks the peers' wire, so it must learn the engine's generation and the
exact factors: ``open_rank``'s ``compat`` map (docs/engine-api.md) is the
factor dict vLLM hashes, names and JSON types as vLLM has them.

Where they come from, best first:

1. vLLM itself, when it is importable (a real engine): the generation is
   its ``NIXL_CONNECTOR_VERSION`` and the factors are the dict its own
   ``compute_nixl_compatibility_hash`` hashes, caught on the way to
   ``hash_factors`` (:func:`factors_from_vllm`), so a factor vLLM adds
   later is sent without a change here.
2. Else this table: ``kv_connector_extra_config.kvhost_nixl_connector_version``,
   else the generation of the vLLM version (``kvhost_vllm_version``, else
   the installed vllm package's metadata) in :data:`RELEASES`, else
   generation 2 (vLLM 0.13, the reference). A generation or version this
   table does not know is refused with a message saying what to set: a
   guessed factor set would fail every handshake later, far from its cause.

Adding a generation is an entry in :data:`GENERATIONS` (and, when its
release is known, in :data:`RELEASES`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

# The factors every generation hashes (vLLM 0.13.0, nixl_connector.py,
# compute_nixl_compatibility_hash): name -> how it is read from vLLM's
# config. str() where vLLM hashes str(), ints as vLLM's getters return them.
BASE_FACTORS = (
    "vllm_version",
    "nixl_connector_version",
    "model",
    "dtype",
    "num_kv_heads",
    "head_size",
    "num_hidden_layers",
    "attn_backend_name",
    "cache_dtype",
)


@dataclass(frozen=True)
class Generation:
    """One NIXL connector wire generation: the factors its compatibility
    hash covers (in addition to BASE_FACTORS), whether its
    kv_transfer_params carry ``remote_block_ids`` per KV cache group
    (``[[...]]``) rather than one flat list, and where it was read."""

    version: int
    extra_factors: tuple
    block_ids_per_group: bool
    source: str
    # The prefill holds for a lease the decode renews by heartbeats, from
    # the request's arrival (the scheduler's on_new_request): the adapter
    # sends ``watch`` / ``unwatch`` and kv_lease_duration.
    leases: bool = False

    @property
    def factors(self) -> tuple:
        return BASE_FACTORS + self.extra_factors


GENERATIONS = {
    g.version: g
    for g in (
        Generation(
            2, (), False,
            "vLLM 0.13.0 (wheel), vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
        ),
        Generation(
            6, ("cross_layers_blocks", "is_hma_enabled", "speculative_config"), True,
            "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py at "
            "NIXL_CONNECTOR_VERSION = 6 (vllm-project/vllm#49230, 2026-07-20)",
            leases=True,
        ),
        Generation(
            # 7 put transfer_mode in the hash and took cross_layers_blocks
            # out; 8-10 changed NixlAgentMetadata and kv_transfer_params,
            # not the factors.
            10, ("is_hma_enabled", "speculative_config", "transfer_mode"), True,
            "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py "
            "@ 0316d25ab5286b130d7663b57959cc8a740b3864",
            leases=True,
        ),
        Generation(
            # 11 added per-region geometry and memory types to
            # NixlAgentMetadata, 12 region members: the sidecar's business
            # (host/wire/vllm); the factors are 10's.
            11, ("is_hma_enabled", "speculative_config", "transfer_mode"), True,
            "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py "
            "@ 02cfb534df5674737558730b10f23d1b7aef9b7c (version history: 11)",
            leases=True,
        ),
        Generation(
            12, ("is_hma_enabled", "speculative_config", "transfer_mode"), True,
            "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py "
            "@ 02cfb534df5674737558730b10f23d1b7aef9b7c",
            leases=True,
        ),
    )
}

# The reference: vLLM 0.13.
DEFAULT_GENERATION = 2

# vLLM release (major, minor) -> its NIXL_CONNECTOR_VERSION, where read
# from that release's own code. Only what was read: a release missing here
# is refused unless vLLM can be asked or the generation is configured.
RELEASES = {
    (0, 13): 2,  # the vllm 0.13.0 wheel's nixl_connector.py
}


class UnknownGeneration(ValueError):
    """The engine's NIXL connector generation cannot be told for sure."""


def generation_for_version(vllm_version: Optional[str]) -> int:
    """NIXL_CONNECTOR_VERSION of a vLLM release by its version string
    (``0.13.0``, ``0.13.1.dev3+g1234``); DEFAULT_GENERATION for None."""
    if vllm_version is None:
        return DEFAULT_GENERATION
    m = re.match(r"^v?(\d+)\.(\d+)", str(vllm_version))
    if m is None or (int(m.group(1)), int(m.group(2))) not in RELEASES:
        known = ", ".join("%d.%d" % k for k in sorted(RELEASES))
        raise UnknownGeneration(
            f"KvhostConnector: vLLM {vllm_version!r}: its NIXL connector generation is not in kvhost's "
            f"table (known releases: {known}); run inside vLLM (the generation is read from it) or set "
            "kv_connector_extra_config.kvhost_nixl_connector_version"
        )
    return RELEASES[(int(m.group(1)), int(m.group(2)))]


def generation(version: int) -> Generation:
    g = GENERATIONS.get(int(version))
    if g is None:
        raise UnknownGeneration(
            f"KvhostConnector: NIXL connector generation {version} is not in kvhost's table "
            f"(known: {sorted(GENERATIONS)}); run inside vLLM, whose own factors are then used"
        )
    return g


def _speculative_factors(vllm_config) -> Optional[dict]:
    """vLLM's _get_speculative_compatibility_factors (nixl/metadata.py,
    generation 6 on): None unless an EAGLE-style draft model shares the KV."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.use_eagle():
        return None
    draft = spec.draft_model_config
    aux = getattr(draft.hf_config, "eagle_aux_hidden_state_layer_ids", None)
    return {
        "method": spec.method,
        "model": draft.model,
        "revision": draft.revision,
        "code_revision": draft.code_revision,
        "parallel_drafting": spec.parallel_drafting,
        "kv_cache_dtype": str(spec.kv_cache_dtype or vllm_config.cache_config.cache_dtype),
        # A tuple in vLLM; JSON (what vLLM hashes) and msgpack make it a list.
        "auxiliary_layer_ids": list(aux) if aux is not None else None,
    }


def _is_hma_enabled(vllm_config) -> bool:
    sc = getattr(vllm_config, "scheduler_config", None)
    return not bool(getattr(sc, "disable_hybrid_kv_cache_manager", False))


# Generation-specific factors: name -> value from (vllm_config, context).
# context: cross_layers_blocks (kvhost registers per-layer caches: False)
# and transfer_mode (kvhost pulls: "pull").
_EXTRA = {
    "cross_layers_blocks": lambda cfg, ctx: bool(ctx.get("cross_layers_blocks", False)),
    "is_hma_enabled": lambda cfg, ctx: _is_hma_enabled(cfg),
    "speculative_config": lambda cfg, ctx: _speculative_factors(cfg),
    "transfer_mode": lambda cfg, ctx: str(ctx.get("transfer_mode", "pull")),
}


def table_factors(vllm_config, attn_backend_name: str, vllm_version: str, gen: int, **context) -> dict:
    """The factors generation ``gen`` hashes, from the config, as vLLM's
    compute_nixl_compatibility_hash of that generation computes them."""
    g = generation(gen)
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    out = {
        "vllm_version": str(vllm_version),
        "nixl_connector_version": int(g.version),
        "model": str(mc.model),
        "dtype": str(mc.dtype),
        "num_kv_heads": int(mc.get_total_num_kv_heads()),
        "head_size": int(mc.get_head_size()),
        "num_hidden_layers": int(mc.get_total_num_hidden_layers()),
        "attn_backend_name": str(attn_backend_name),
        "cache_dtype": str(cc.cache_dtype),
    }
    for name in g.extra_factors:
        out[name] = _EXTRA[name](vllm_config, context)
    return out


def compatibility_hash(factors: dict) -> str:
    """vLLM's hash_factors (vllm/config/utils.py): sha256 of
    json.dumps(factors, sort_keys=True). For logs and tests: the sidecar
    computes its own from the same map."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def _jsonable(v):
    """The value as vLLM's json.dumps sees it (tuples are arrays)."""
    return json.loads(json.dumps(v))


@contextlib.contextmanager
def _catching_hash_factors(config_utils, caught: list):
    """Has vllm.config.utils.hash_factors also record what it hashes, for
    the duration (compute_nixl_compatibility_hash imports it from there at
    each call)."""
    real = config_utils.hash_factors

    def recording(items):
        caught.append(dict(items))
        return real(items)

    config_utils.hash_factors = recording
    try:
        yield
    finally:
        config_utils.hash_factors = real


def factors_from_vllm(
    vllm_config,
    attn_backend_name: str,
    importer: Callable[[str], Any] = None,
    cross_layers_blocks: bool = False,
    transfer_mode: str = "pull",
) -> Optional[dict]:
    """The factor dict vLLM's own compute_nixl_compatibility_hash hashes
    for this config, or None when vLLM (or its NIXL connector) is absent.

    Its signature varies by release: (vllm_config, attn_backend_name) in
    0.13; cross_layers_blocks added later; transfer_mode (default "pull")
    later still. Each is passed when the function takes it. ``importer``
    is importlib.import_module (tests pass their own)."""
    if importer is None:
        import importlib

        importer = importlib.import_module
    compute = None
    for mod_name in (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector",
    ):
        try:
            compute = getattr(importer(mod_name), "compute_nixl_compatibility_hash", None)
        except ImportError:
            continue
        if compute is not None:
            break
    if compute is None:
        return None
    try:
        config_utils = importer("vllm.config.utils")
    except ImportError:
        return None
    params = inspect.signature(compute).parameters
    kwargs = {}
    if "cross_layers_blocks" in params:
        kwargs["cross_layers_blocks"] = cross_layers_blocks
    if "transfer_mode" in params:
        kwargs["transfer_mode"] = transfer_mode
    caught: list = []
    with _catching_hash_factors(config_utils, caught):
        digest = compute(vllm_config, attn_backend_name, **kwargs)
    if len(caught) != 1:
        raise RuntimeError(
            f"KvhostConnector: vLLM's compute_nixl_compatibility_hash hashed {len(caught)} factor dicts, "
            "want 1: kvhost cannot tell which the peers compare"
        )
    factors = _jsonable(caught[0])
    if compatibility_hash(factors) != digest:
        raise RuntimeError("KvhostConnector: vLLM's compatibility hash is not sha256(json(factors)) any more")
    return factors
