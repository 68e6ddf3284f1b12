"""kvhost.cuda against host/serve/engmem's stand-in libcudart (CUDA's IPC
entry points over POSIX shared memory; no GPU here): the handles it takes
are the allocation's, with the range's offset; what it cannot tell is not
device memory."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from kvhost import cuda
from kvhost import sglang as ks


@pytest.fixture
def standin(monkeypatch, standin_cudart):
    monkeypatch.setenv("KVHOST_CUDART", standin_cudart)
    cuda.reset()
    yield
    cuda.reset()


def test_region_of_allocation(standin):
    base = cuda.malloc(1 << 16, device=2)
    try:
        r = cuda.region_of(base + 4096, 8192)
        assert r["kind"] == "vram" and r["addr"] == base + 4096 and r["length"] == 8192
        assert r["offset"] == 4096 and r["device"] == 2
        h = r["cuda_ipc"]
        assert len(h) == 64 and h[:4] == b"KVSI"
        assert struct.unpack("<i", h[4:8])[0] == 2
        assert struct.unpack("<Q", h[56:64])[0] == 1 << 16
        # Past the allocation's end: not a range of it (and the stand-in has
        # no cudaPointerGetAttributes to say more).
        assert cuda.region_of(base + (1 << 16) - 8, 16) is None
    finally:
        cuda.free(base)


def test_host_memory_is_not_device_memory(standin):
    buf = np.zeros(64, dtype=np.uint8)
    assert cuda.region_of(buf.ctypes.data, 64) is None
    with pytest.raises(ValueError) as e:
        ks.regions_for_pointers([(buf.ctypes.data, 64)])
    assert "neither" in str(e.value)


def test_one_region_per_allocation(standin):
    base = cuda.malloc(4096)
    try:
        regs = ks.regions_for_pointers([(base, 1024), (base + 2048, 1024), (base + 1024, 512)])
        assert len(regs) == 1
        r = regs[0]
        assert r["addr"] == base and r["length"] == 3072 and r["offset"] == 0
    finally:
        cuda.free(base)


def test_no_cudart(monkeypatch):
    monkeypatch.setenv("KVHOST_CUDART", "/nonexistent/libcudart.so")
    monkeypatch.setattr(cuda, "_candidates", lambda: iter(["/nonexistent/libcudart.so"]))
    cuda.reset()
    try:
        assert cuda.available() is False
        assert cuda.region_of(ctypes.addressof(ctypes.c_int()), 4) is None
        with pytest.raises(RuntimeError) as e:
            cuda.malloc(16)
        assert "libcudart" in str(e.value)
    finally:
        cuda.reset()
