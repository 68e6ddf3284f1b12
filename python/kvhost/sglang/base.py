"""SGLang's connector base types, or stand-ins for them.

When SGLang is importable, every name here is SGLang's own (from
python/sglang/srt/disaggregation/base/conn.py, common/conn.py and
utils.py), so kvhost's classes subclass SGLang's bases and inherit their
defaults. A name an older SGLang lacks (StateType, KVTransferMetric) falls
back to the stand-in.

Without SGLang (CI, ``import kvhost.sglang`` anywhere), the stand-ins have
the members of SGLang's at the commits named on each class, with the same
signatures and defaults; they are this project's own code, written from
those files.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import Any, List, Optional

# The upstream files the stand-ins follow (github.com/sgl-project/sglang).
BASE_CONN = "python/sglang/srt/disaggregation/base/conn.py@0094505da74125a31ceb354f37ae7a1b6a97d3f5"
COMMON_CONN = "python/sglang/srt/disaggregation/common/conn.py@0094505da74125a31ceb354f37ae7a1b6a97d3f5"
UTILS = "python/sglang/srt/disaggregation/utils.py@000eaffacf048e51b64d4d72985ef8f0b7054b39"


class _StandinStateType(str, enum.Enum):
    """Stand-in for SGLang's StateType (base/conn.py@0094505d): the state
    component kinds of hybrid models, as their wire strings."""

    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"
    MINIMAX_INDEX_K = "minimax_index_k"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"


@dataclasses.dataclass
class _StandinKVTransferMetric:
    """Stand-in for SGLang's KVTransferMetric (base/conn.py@0094505d): what
    a sender reports after Success; None where a backend cannot tell."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class _StandinKVPoll:
    """Stand-in for SGLang's KVPoll (base/conn.py@0094505d)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class _StandinKVArgs:
    """Stand-in for SGLang's KVArgs (base/conn.py@0094505d): the fields the
    schedulers set and the connectors read. State is one entry per state
    type: ``state_types[i]`` with ``state_data_ptrs[i]`` (a list), etc.
    Keyword arguments set fields (a convenience of the stand-in: SGLang's
    schedulers make an empty KVArgs and assign fields)."""

    engine_rank: int = 0
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[Any]
    state_data_ptrs: List[List[int]]
    state_data_lens: List[List[int]]
    state_item_lens: List[List[int]]
    state_dim_per_tensor: List[List[int]]
    ib_device: str = ""
    ib_traffic_class: str = ""
    gpu_id: int = 0
    kv_head_num: int = 0
    total_kv_head_num: int = 0
    page_size: int = 1
    swa_page_size: Optional[int] = None
    system_dp_rank: int = 0
    pp_rank: int = 0
    prefill_start_layer: int = 0
    prefill_end_layer: Optional[int] = None
    dcp_size: int = 1
    dcp_rank: int = 0

    def __init__(self, **kw: Any):
        for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "aux_data_ptrs", "aux_data_lens",
                     "aux_item_lens", "state_types", "state_data_ptrs", "state_data_lens", "state_item_lens",
                     "state_dim_per_tensor"):
            setattr(self, name, [])
        for k, v in kw.items():
            setattr(self, k, v)


class _StandinBaseKVManager(ABC):
    """Stand-in for SGLang's BaseKVManager (base/conn.py@0094505d)."""

    @abstractmethod
    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False): ...

    @abstractmethod
    def register_to_bootstrap(self):
        """Registers the prefill rank with the bootstrap server."""


class _StandinBaseKVSender(ABC):
    """Stand-in for SGLang's BaseKVSender (base/conn.py@0094505d), with its
    two defaults: no decode prefix, and a chunk is sent when it has pages."""

    @abstractmethod
    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: List[int],
                 pp_rank: int, req_has_disagg_prefill_dp_rank: bool = False): ...

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None): ...

    @abstractmethod
    def send(self, kv_indices: Any, state_indices: Optional[List] = None, token_position_offset: int = 0): ...

    def pop_decode_prefix_len(self) -> int:
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    @abstractmethod
    def get_transfer_metric(self) -> Any: ...

    @abstractmethod
    def poll(self) -> Any: ...

    @abstractmethod
    def failure_exception(self): ...

    def clear(self):
        pass

    def abort(self):
        pass


class _StandinBaseKVReceiver(ABC):
    """Stand-in for SGLang's BaseKVReceiver (base/conn.py@0094505d)."""

    @abstractmethod
    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: Optional[int] = None): ...

    @abstractmethod
    def init(self, prefill_dp_rank: int): ...

    @abstractmethod
    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None): ...

    @abstractmethod
    def poll(self) -> Any: ...

    @abstractmethod
    def failure_exception(self): ...

    def clear(self):
        pass

    def abort(self):
        pass


class _StandinBaseKVBootstrapServer(ABC):
    """Stand-in for SGLang's BaseKVBootstrapServer (base/conn.py@0094505d)."""

    @abstractmethod
    def __init__(self, host: str, port: int): ...


class _StandinKVTransferError(Exception):
    """Stand-in for SGLang's KVTransferError (common/conn.py@0094505d): the
    exception failure_exception raises; the scheduler reads
    ``is_from_another_rank`` to mute propagated failures."""

    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self) -> str:
        return "KVTransferError(bootstrap_room=%s): %s" % (self.bootstrap_room, self.failure_reason)


class _StandinDisaggregationMode(enum.Enum):
    """Stand-in for SGLang's DisaggregationMode (utils.py@000eaffa)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def _sglang(module: str):
    """SGLang's module, or None when SGLang is not installed or fails to
    import here (it needs torch and, for some modules, a GPU)."""
    try:  # pragma: no cover: SGLang is not installed in CI
        import importlib

        return importlib.import_module(module)
    except Exception:
        return None


_base = _sglang("sglang.srt.disaggregation.base.conn")
HAVE_SGLANG = _base is not None
_common = _sglang("sglang.srt.disaggregation.common.conn") if HAVE_SGLANG else None
_utils = _sglang("sglang.srt.disaggregation.utils") if HAVE_SGLANG else None

StateType = getattr(_base, "StateType", _StandinStateType)
KVTransferMetric = getattr(_base, "KVTransferMetric", _StandinKVTransferMetric)
KVPoll = getattr(_base, "KVPoll", _StandinKVPoll)
KVArgs = getattr(_base, "KVArgs", _StandinKVArgs)
BaseKVManager = getattr(_base, "BaseKVManager", _StandinBaseKVManager)
BaseKVSender = getattr(_base, "BaseKVSender", _StandinBaseKVSender)
BaseKVReceiver = getattr(_base, "BaseKVReceiver", _StandinBaseKVReceiver)
BaseKVBootstrapServer = getattr(_base, "BaseKVBootstrapServer", _StandinBaseKVBootstrapServer)
KVTransferError = getattr(_common, "KVTransferError", _StandinKVTransferError)
DisaggregationMode = getattr(_utils, "DisaggregationMode", _StandinDisaggregationMode)
