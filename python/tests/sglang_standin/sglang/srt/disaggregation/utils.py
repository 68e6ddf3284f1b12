"""Stand-in for SGLang's disaggregation/utils.py: the closed backend enum
and get_kv_class, with SGLang's names and values."""
from enum import Enum


class TransferBackend(Enum):
    MOONCAKE = "mooncake"
    MORI = "mori"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"


class KVClassType(Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


class FakeKVManager:
    pass


def get_kv_class(transfer_backend, class_type):
    if transfer_backend == TransferBackend.FAKE:
        return {KVClassType.MANAGER: FakeKVManager}.get(class_type)
    raise ValueError(f"Unsupported transfer backend: {transfer_backend}")
