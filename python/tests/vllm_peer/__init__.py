"""A vLLM peer that is not kvhost: vLLM's NIXL connector workers, written
from vLLM's connector of each generation the sidecar speaks (wire.py),
moving real KV bytes through ``nixl._api`` (peer.py).

``nixl_api(backend)`` is the ``nixl._api`` a test runs the peer on: NIXL's
own for ``KVHOST_TEST_BACKEND=nixl`` (NIXL's Python bindings on
PYTHONPATH: . /work/nixl-env.sh), else the stand-in over kvhost's fake
plugin (fake_nixl.py), which CI runs.
"""

from __future__ import annotations


def nixl_api(backend: str):
    if backend == "nixl":
        # NIXL's own; an ImportError here fails the test (no skipping).
        import nixl._api as api

        return api
    if backend != "fake":
        raise ValueError(f"the vLLM peer runs on NIXL or the fake plugin, not {backend!r}")
    from . import fake_nixl

    return fake_nixl
