"""kvhost: the Python side of ``kvhost serve``, the KV-transfer sidecar.

- :mod:`kvhost.client`: the engine control API (docs/engine-api.md).
- :mod:`kvhost.shm`: engine KV pools in POSIX shared memory.
- :mod:`kvhost.sglang`: SGLang's KV connector classes backed by the sidecar,
  and ``python -m kvhost.sglang.launch`` to start SGLang with them.
- :mod:`kvhost.vllm`: vLLM's KV connector backed by the sidecar.

Runtime dependencies: pyzmq and msgpack (numpy optional; torch, SGLang and
vLLM are imported only when used).
"""

from kvhost.client import (  # noqa: F401
    Client,
    ConnectionLost,
    KVHostError,
    default_endpoint,
    pack_pages,
)

__version__ = "0.1.0"
