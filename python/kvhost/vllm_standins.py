"""Stand-ins for the vLLM types a KV connector is handed, for driving
:class:`kvhost.vllm.KvhostConnector` where vLLM is not installed (the
tests and the engine demo). Nothing here stands in for kvhost.

Each is a transcription of vLLM's own type (vllm-project/vllm, file and
commit named on each), member for member for what vLLM's scheduler and
NIXL connector read or set of it; members for features a P/D connector
never sees (multimodal inputs, LoRA, structured output, pooling, events)
are left out, and say so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestStatus(enum.IntEnum):
    """vllm/v1/request.py @ dba83d52c06471eabafba4310718ac7a100cbfa4,
    every member (vLLM 0.13 lacks WAITING_FOR_STREAMING_REQ; a connector
    compares members, not values)."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Note: anything after PREEMPTED will be considered
    # as a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    """vllm/v1/request.py @ dba83d52: the members the scheduler's connector
    paths and the NIXL connector read (request_id, prompt_token_ids,
    num_prompt_tokens, kv_transfer_params, status, num_computed_tokens,
    num_preemptions, num_tokens, is_finished). vLLM takes
    kv_transfer_params from sampling_params.extra_args; sampling, output
    tokens, multimodal, LoRA and events are left out."""

    def __init__(self, request_id: str, prompt_token_ids: list, kv_transfer_params: Optional[dict] = None,
                 status: RequestStatus = RequestStatus.WAITING):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.kv_transfer_params = kv_transfer_params
        self.status = status
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


@dataclass
class KVCacheBlock:
    """vllm/v1/core/kv_cache_utils.py @
    bbf906a88ba1a39104884c88c9811a4f968e4659 (the free-list pointers are
    the block pool's, never read by a connector)."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: Optional[Any] = None
    prev_free_block: Optional["KVCacheBlock"] = None
    next_free_block: Optional["KVCacheBlock"] = None
    is_null: bool = False

    @property
    def block_hash(self):
        return self._block_hash


@dataclass
class KVCacheBlocks:
    """vllm/v1/core/kv_cache_manager.py @
    003df2961dd8830c317a61f9745ccd557da9fa06, every method a connector or
    the scheduler's connector paths call. ``blocks[i][j]``: group i, block j."""

    blocks: tuple

    def get_block_ids(self, allow_none: bool = False):
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list:
        # Skip padding blocks.
        return [
            [block.block_id for block in group if block.block_hash is None and not block.is_null]
            for group in self.blocks
        ]

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))


class KVCacheBlocks013:
    """vLLM 0.13's KVCacheBlocks as its NIXL connector uses it
    (nixl_connector.py of the vllm 0.13.0 wheel calls get_block_ids and
    get_unhashed_block_ids only): a KVCacheBlocks without the all-groups
    accessor, so a replay of 0.13 proves the adapter does not need it."""

    def __init__(self, blocks: tuple):
        self._b = KVCacheBlocks(blocks)
        self.blocks = blocks

    def get_block_ids(self, allow_none: bool = False):
        return self._b.get_block_ids(allow_none)

    def get_unhashed_block_ids(self) -> list:
        return self._b.get_unhashed_block_ids()


def kv_cache_blocks(block_ids, hashed: int = 0, profile: str = "newest"):
    """One KV cache group's blocks as the scheduler's KVCacheManager hands
    them to update_state_after_alloc; the first ``hashed`` are a local
    prefix-cache hit (they have a block hash)."""
    group = [KVCacheBlock(b, ref_cnt=1, _block_hash=("hash", b) if i < hashed else None)
             for i, b in enumerate(block_ids)]
    return (KVCacheBlocks013 if profile == "0.13" else KVCacheBlocks)((group,))


@dataclass
class SchedulerOutput:
    """vllm/v1/core/sched/output.py, the fields scheduler.py @
    00024d314514900f361ad072af6931e403b7f589 (Scheduler.schedule) sets
    that a connector or the model runner's connector calls read
    (finished_req_ids goes to get_finished; kv_connector_metadata to
    bind_connector_metadata). Per-request token and encoder data are left
    out."""

    num_scheduled_tokens: dict = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set = field(default_factory=set)
    preempted_req_ids: set = field(default_factory=set)
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False


@dataclass
class KVConnectorOutput:
    """vllm/v1/outputs.py: what the model runner's connector context
    (kv_connector_model_runner_mixin.py) hands back per step."""

    finished_sending: Optional[set] = None
    finished_recving: Optional[set] = None
    invalid_block_ids: set = field(default_factory=set)


@dataclass
class KVConnectorTransferResults:
    """vllm/distributed/kv_transfer/kv_connector/v1/base.py @
    7ba3df63cbe2e3e7aca19074bed2958311f46400 (lines 87-96): what current
    vLLM's model runner asks a worker connector for each step. A failed
    load is in finished_recving and in failed_recving."""

    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


@dataclass
class KVTransferConfig:
    """vllm/config/kv_transfer.py: the fields a connector reads."""

    engine_id: str
    kv_role: str
    kv_connector: str = "KvhostConnector"
    kv_connector_module_path: str = "kvhost.vllm"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key, default) -> Any:
        return self.kv_connector_extra_config.get(key, default)


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
    """vllm/config/parallel.py: data_parallel_rank (0.13's NIXL side channel
    offset) and data_parallel_index (current vLLM's)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_index: int = 0


@dataclass
class SchedulerConfig:
    disable_hybrid_kv_cache_manager: bool = False


@dataclass
class KVCacheGroupSpec:
    """vllm/v1/kv_cache_interface.py."""

    layer_names: list
    kv_cache_spec: Any = None


@dataclass
class KVCacheConfig:
    """vllm/v1/kv_cache_interface.py: what the connector factory passes."""

    num_blocks: int
    kv_cache_groups: list


@dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: Any = None


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
    vllm_version: str = "0.13.0",
) -> VllmConfig:
    """A config as ``vllm serve --kv-transfer-config`` would make it for a
    kvhost-backed engine (one per worker: ``tp_rank`` stands for vLLM's
    parallel state, which a worker process has initialised)."""
    ex = {
        "kvhost_control": control,
        "kvhost_attn_backend": "FLASH_ATTN",
        "kvhost_vllm_version": vllm_version,
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


def kv_cache_config(num_blocks: int, layers: int, groups: int = 1) -> KVCacheConfig:
    """A KVCacheConfig with ``groups`` KV cache groups over ``layers`` layers."""
    names = ["model.layers.%d.self_attn" % i for i in range(layers)]
    return KVCacheConfig(num_blocks=num_blocks,
                         kv_cache_groups=[KVCacheGroupSpec(names[g::groups]) for g in range(groups)])
