"""What the connector reads of vLLM's config and environment, and its
connection to the sidecar: shared by the scheduler side
(kvhost.vllm.scheduler) and the worker side (kvhost.vllm.worker).

Every value vLLM can give is taken from vLLM when it is importable;
``kv_connector_extra_config`` keys (``kvhost_*``, listed in
kvhost.vllm's module doc) stand in where it is not (tests, the engine
demo) or override it.
"""

from __future__ import annotations

import inspect
import logging
import os
import time

from kvhost.vllm import generations

logger = logging.getLogger("kvhost.vllm")

# After the sidecar connection is lost: how often to try again, and how
# long each try waits for the sidecar's hello (it blocks the engine's step).
RECONNECT_INTERVAL = 2.0
RECONNECT_TIMEOUT = 1.0


def get(obj, name, default=None):
    return getattr(obj, name, default) if obj is not None else default


def extra(vllm_config, key, default=None):
    ktc = get(vllm_config, "kv_transfer_config")
    ex = get(ktc, "kv_connector_extra_config") or {}
    return ex.get(key, default)


def connect(vllm_config):
    """A kvhost client connected to the sidecar named by the config."""
    from kvhost import client as kvclient

    # None: the client's default (KVHOST_CONTROL, then the default socket).
    addr = extra(vllm_config, "kvhost_control")
    # Events arrive through a listener (never dropped), not the client's
    # bounded queue.
    return kvclient.Client(addr, client_name="kvhost.vllm", queue_events=False)


def reconnect(client, next_try, who):
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


def client_error_types():
    from kvhost import client as kvclient

    return (kvclient.KVHostError,)


def data_parallel_index(vllm_config) -> int:
    """The DP index the NIXL side channel port is offset by: vLLM's
    ParallelConfig.data_parallel_index where it has one (the NIXL
    scheduler of current vLLM, nixl/base_scheduler.py @ 0050936b), else
    data_parallel_rank (vLLM 0.13's NixlConnectorScheduler)."""
    pc = get(vllm_config, "parallel_config")
    idx = get(pc, "data_parallel_index")
    if idx is None:
        idx = get(pc, "data_parallel_rank", 0)
    return int(idx or 0)


def side_channel(vllm_config):
    """(host, port) of the prefill engine's NIXL side channel: vLLM's
    VLLM_NIXL_SIDE_CHANNEL_HOST and VLLM_NIXL_SIDE_CHANNEL_PORT + the DP
    index, as vLLM's NIXL connector computes them; the extra config's
    kvhost_side_channel_host/_port override."""
    host = extra(vllm_config, "kvhost_side_channel_host")
    port = extra(vllm_config, "kvhost_side_channel_port")
    if host is None or port is None:
        try:
            from vllm import envs  # type: ignore

            env_host, env_port = envs.VLLM_NIXL_SIDE_CHANNEL_HOST, int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT)
        except ImportError:
            env_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
            env_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        host = env_host if host is None else host
        port = env_port + data_parallel_index(vllm_config) if port is None else port
    return str(host), int(port)


def abort_timeout(vllm_config):
    """Seconds the prefill holds blocks no decode read (vLLM's
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT); None: the sidecar's default."""
    t = extra(vllm_config, "kvhost_abort_timeout")
    if t is not None:
        return float(t)
    try:
        from vllm import envs  # type: ignore

        return float(envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    except ImportError:
        return None



def kv_lease_duration(vllm_config):
    """Seconds of a prefill's lease on held blocks, which the decode's
    heartbeats renew (generations with leases: 6 on), as vLLM's NIXL
    connector reads it: kv_connector_extra_config.kv_lease_duration
    (nixl/base_scheduler.py). None: the sidecar's default (vLLM's, 30 s).
    Both engines of a pair must agree, as NIXL's must."""
    t = extra(vllm_config, "kv_lease_duration")
    return None if t is None else float(t)

# kv_role -> the sidecar ranks a worker opens. kv_both (what most of
# vLLM's NIXL examples use) is both: each request's kv_transfer_params say
# whether it is sent (do_remote_decode) or loaded (do_remote_prefill), as
# in vLLM's NIXL connector, which never looks at kv_role.
_ROLES = {"kv_producer": ("prefill",), "kv_consumer": ("decode",), "kv_both": ("prefill", "decode")}
_KVHOST_ROLES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}


def rank_roles(vllm_config) -> tuple:
    """The sidecar rank roles a worker opens: ("prefill",), ("decode",)
    or both, from kvhost_role, else kv_role."""
    role = extra(vllm_config, "kvhost_role")
    if role:
        if role not in _KVHOST_ROLES:
            raise ValueError(f"KvhostConnector: kvhost_role {role!r}: want prefill, decode or both")
        return _KVHOST_ROLES[role]
    kv_role = vllm_config.kv_transfer_config.kv_role
    if kv_role not in _ROLES:
        raise ValueError(f"KvhostConnector: kv_role {kv_role!r}: want kv_producer, kv_consumer or kv_both")
    return _ROLES[kv_role]


def tp_rank_size(vllm_config):
    try:
        from vllm.distributed.parallel_state import (  # type: ignore
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        pass
    rank = extra(vllm_config, "kvhost_tp_rank")
    if rank is None:
        raise ValueError("KvhostConnector: vLLM's TP rank is unknown: set kv_connector_extra_config.kvhost_tp_rank")
    return int(rank), int(vllm_config.parallel_config.tensor_parallel_size)


def _selector():
    """vLLM's get_attn_backend: vllm.v1.attention.selector in current vLLM
    (v0.20 on), vllm.attention.selector before (0.13)."""
    for name in ("vllm.v1.attention.selector", "vllm.attention.selector"):
        try:
            mod = __import__(name, fromlist=["get_attn_backend"])
        except ImportError:
            continue
        fn = getattr(mod, "get_attn_backend", None)
        if fn is not None:
            return fn
    return None


def attn_backend_name(vllm_config, selector=None):
    """The attention backend's name, as vLLM's NIXL worker hashes it:
    kvhost_attn_backend, else vLLM's get_attn_backend(...).get_name().
    The selector's parameters changed (0.13: head_size, dtype,
    kv_cache_dtype, block_size, use_mla; v0.20 on: no block_size): only
    those it takes are passed, by name."""
    name = extra(vllm_config, "kvhost_attn_backend")
    if name:
        return name
    fn = selector if selector is not None else _selector()
    if fn is None:
        raise ValueError("KvhostConnector: vLLM is absent: set kv_connector_extra_config.kvhost_attn_backend")
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    offered = {
        "head_size": mc.get_head_size(),
        "dtype": mc.dtype,
        "kv_cache_dtype": cc.cache_dtype,
        "block_size": cc.block_size,
        "use_mla": bool(get(mc, "use_mla", False)),
    }
    params = inspect.signature(fn).parameters
    missing = [p.name for p in params.values()
               if p.default is inspect.Parameter.empty and p.name not in offered
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ValueError(
            f"KvhostConnector: vLLM's get_attn_backend wants {missing}, which kvhost does not know: "
            "set kv_connector_extra_config.kvhost_attn_backend"
        )
    return fn(**{k: v for k, v in offered.items() if k in params}).get_name()


def kv_cache_layout(vllm_config):
    layout = extra(vllm_config, "kvhost_kv_cache_layout")
    if layout:
        return layout
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # type: ignore

        return get_kv_cache_layout()
    except ImportError:
        return "HND"


def _installed_vllm_version():
    try:
        from vllm import __version__  # type: ignore

        return str(__version__)
    except ImportError:
        pass
    try:
        from importlib import metadata

        return metadata.version("vllm")
    except Exception:  # not installed: no version to map
        return None


def compat_factors(vllm_config, backend_name: str) -> dict:
    """open_rank's ``compat``: the factor dict vLLM's NIXL connector of
    this engine hashes (kvhost.vllm.generations says where it comes from)."""
    configured = extra(vllm_config, "kvhost_nixl_connector_version")
    if configured is None:
        from_vllm = generations.factors_from_vllm(vllm_config, backend_name)
        if from_vllm is not None:
            return from_vllm
    version = extra(vllm_config, "kvhost_vllm_version") or _installed_vllm_version()
    gen = int(configured) if configured is not None else generations.generation_for_version(version)
    if version is None:
        raise ValueError(
            "KvhostConnector: vLLM's version is unknown (it is a hash factor): "
            "set kv_connector_extra_config.kvhost_vllm_version"
        )
    return generations.table_factors(vllm_config, backend_name, version, gen)
