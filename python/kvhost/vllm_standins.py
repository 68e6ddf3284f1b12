"""Stand-ins for the vLLM types a KV connector is handed, for driving
:class:`kvhost.vllm.KvhostConnector` where vLLM is not installed (the
tests and the engine demo). Each has only what vLLM's NIXL connector
(vLLM's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py)
reads of the real one: VllmConfig and its sub-configs
(vllm/config/), Request and RequestStatus (vllm/v1/request.py),
KVCacheBlocks (vllm/v1/core/kv_cache_manager.py) and SchedulerOutput
(vllm/v1/core/sched/output.py). Nothing here stands in for kvhost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestStatus(enum.IntEnum):
    """vLLM's RequestStatus values a connector compares against."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list
    kv_transfer_params: Optional[dict] = None
    status: RequestStatus = RequestStatus.WAITING


class KVCacheBlocks:
    """One KV cache group's blocks (vLLM's get_block_ids() returns one list
    per group); ``hashed`` leading blocks are a local prefix-cache hit."""

    def __init__(self, block_ids, hashed: int = 0):
        self._ids = list(block_ids)
        self._hashed = hashed

    def get_block_ids(self):
        return (list(self._ids),)

    def get_unhashed_block_ids(self):
        return list(self._ids[self._hashed:])


@dataclass
class SchedulerOutput:
    """The connector reads nothing of it."""


@dataclass
class KVTransferConfig:
    engine_id: str
    kv_role: str
    kv_connector: str = "KvhostConnector"
    kv_connector_module_path: str = "kvhost.vllm"
    kv_connector_extra_config: dict = field(default_factory=dict)


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"


@dataclass
class ModelConfig:
    model: str = "kvhost/demo-llama"
    dtype: str = "torch.bfloat16"
    use_mla: bool = False
    num_kv_heads: int = 8
    head_size: int = 128
    num_hidden_layers: int = 16

    def get_total_num_kv_heads(self) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size

    def get_total_num_hidden_layers(self) -> int:
        return self.num_hidden_layers


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_rank: int = 0


@dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


def make_config(
    engine_id: str,
    kv_role: str,
    control: str,
    tp_size: int = 1,
    tp_rank: Optional[int] = None,
    layers: int = 16,
    kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    extra: Optional[dict[str, Any]] = None,
) -> VllmConfig:
    """A config as ``vllm serve --kv-transfer-config`` would make it for a
    kvhost-backed engine (one per worker: ``tp_rank`` stands for vLLM's
    parallel state, which a worker process has initialised)."""
    ex = {
        "kvhost_control": control,
        "kvhost_attn_backend": "FLASH_ATTN",
        "kvhost_vllm_version": "0.13.0",
        "kvhost_side_channel_host": "127.0.0.1",
        "kvhost_side_channel_port": 0,
    }
    if tp_rank is not None:
        ex["kvhost_tp_rank"] = tp_rank
    ex.update(extra or {})
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(engine_id=engine_id, kv_role=kv_role, kv_connector_extra_config=ex),
        model_config=ModelConfig(num_kv_heads=kv_heads, head_size=head_size, num_hidden_layers=layers),
        cache_config=CacheConfig(block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
    )
