"""vLLM's KV connector base types, or stand-ins when vLLM is absent.

With vLLM installed these are vLLM's own (v1/base.py): KvhostConnector
then is a KVConnectorBase_V1 and, where vLLM has it, a SupportsHMA. Without
vLLM (the tests, the engine demo) the stand-ins below take their place:
transcriptions of vllm-project/vllm
vllm/distributed/kv_transfer/kv_connector/v1/base.py @
003df2961dd8830c317a61f9745ccd557da9fa06, member for member for what a
connector inherits and the engine calls on the base (the abstract methods
KvhostConnector implements, and the defaults for features it does not use:
stats, events, handshake metadata, cross-layer blocks, host buffers, are
left out).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

try:  # vLLM's own
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # type: ignore
    except ImportError:  # a vLLM before the hybrid allocator's interface
        SupportsHMA = None
except ImportError:
    HAVE_VLLM = False

    class SupportsHMA(ABC):
        """base.py: a connector that supports the hybrid memory allocator
        gets request_finished_all_groups instead of request_finished."""

        @abstractmethod
        def request_finished_all_groups(self, request, block_ids):
            raise NotImplementedError

    class KVConnectorRole(enum.Enum):
        # Connector running in the scheduler process
        SCHEDULER = 0
        # Connector running in the worker process
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024 (empty, as vLLM's)
        """Scheduler KVConnector -> Worker KVConnector."""

    class KVConnectorBase_V1(ABC):
        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if vllm_config.kv_transfer_config is not None:
                self._kv_transfer_config = vllm_config.kv_transfer_config
            else:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def prefer_cross_layer_blocks(self) -> bool:
            return False

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches):
            return

        def handle_preemptions(self, kv_connector_metadata):
            return

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs) -> None:
            pass

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            pass

        @abstractmethod
        def wait_for_save(self):
            pass

        def get_finished(self, finished_req_ids):
            return None, None

        def get_block_ids_with_load_errors(self):
            return set()

        def shutdown(self):
            return None

        # Scheduler side.

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            pass

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            pass

        def update_connector_output(self, connector_output):
            return

        def request_finished(self, request, block_ids):
            return False, None

        def take_events(self):
            return ()

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return None


def connector_bases() -> tuple:
    """KvhostConnector's bases: KVConnectorBase_V1, and SupportsHMA where
    this vLLM has it (current vLLM's scheduler hands a SupportsHMA connector
    every KV cache group's blocks in request_finished_all_groups, and vLLM
    need not turn its hybrid allocator off for it: the compatibility-hash
    factor is_hma_enabled then matches a NIXL peer's by default)."""
    if SupportsHMA is None:
        return (KVConnectorBase_V1,)
    return (KVConnectorBase_V1, SupportsHMA)
