"""CUDA IPC handles for ``register_memory``'s vram regions, through libcudart.

Loaded only when called (kvhost imports no CUDA library on its own):
libcudart is found as ``$KVHOST_CUDART``, ``libcudart.so``,
``libcudart.so.13``, ``libcudart.so.12`` or the copy inside torch's
package, and libcuda (the driver, for an allocation's base address) as
``libcuda.so.1``. ``region_of`` returns None when the pointer is not CUDA
device memory or CUDA is not there, so callers fall back to other memory
kinds; :func:`region_of_tensor` takes a torch tensor.

Allocations made with :func:`malloc` are recorded, so their regions need
only cudaIpcGetMemHandle (no cudaPointerGetAttributes or driver call):
that is the path the tests run with the stand-in libcudart of
host/serve/engmem/testdata (CUDA's entry points over POSIX shared memory),
since CI has no GPU. Memory from elsewhere (torch's caching allocator) is
found with cudaPointerGetAttributes and cuMemGetAddressRange, which only a
real GPU exercises.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any, Optional

_lock = threading.Lock()
_libs: Any = None
_allocs: dict = {}  # base pointer -> (size, device) of malloc's allocations

CUDA_MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice
IPC_HANDLE_SIZE = 64


class _PointerAttributes(ctypes.Structure):
    # cudaPointerAttributes since CUDA 10: type, device, devicePointer, hostPointer.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


def _candidates():
    env = os.environ.get("KVHOST_CUDART")
    if env:
        yield env
    yield from ("libcudart.so", "libcudart.so.13", "libcudart.so.12")
    try:
        import torch  # noqa: F401  (its bundled runtime, when it has one)

        yield from sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*")))
    except Exception:
        pass


def _load():
    global _libs
    with _lock:
        if _libs is not None:
            return _libs or None
        rt = None
        for name in _candidates():
            try:
                rt = ctypes.CDLL(name)
                break
            except OSError:
                continue
        drv = None
        try:
            drv = ctypes.CDLL("libcuda.so.1")
        except OSError:
            pass
        _libs = (rt, drv) if rt is not None else False
        return _libs or None


def available() -> bool:
    """True when libcudart could be loaded."""
    return _load() is not None


def reset() -> None:
    """Forgets the loaded library (tests switch $KVHOST_CUDART)."""
    global _libs
    with _lock:
        _libs = None
        _allocs.clear()


def _rt():
    libs = _load()
    if libs is None:
        raise RuntimeError("libcudart not found (tried $KVHOST_CUDART, libcudart.so, .so.13, .so.12)")
    return libs[0]


def malloc(size: int, device: int = 0) -> int:
    """cudaMalloc of ``size`` bytes on ``device``; returns the pointer."""
    rt = _rt()
    if rt.cudaSetDevice(int(device)) != 0:
        raise RuntimeError("cudaSetDevice(%d) failed" % device)
    p = ctypes.c_void_p()
    err = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(int(size)))
    if err != 0 or not p.value:
        raise MemoryError("cudaMalloc(%d) failed: error %d" % (size, err))
    with _lock:
        _allocs[p.value] = (int(size), int(device))
    return p.value


def free(ptr: int) -> None:
    """cudaFree of a pointer :func:`malloc` returned."""
    with _lock:
        _allocs.pop(int(ptr), None)
    _rt().cudaFree(ctypes.c_void_p(int(ptr)))


def _known(ptr: int, length: int):
    with _lock:
        for base, (size, dev) in _allocs.items():
            if base <= ptr and ptr + length <= base + size:
                return base, dev
    return None


def region_of(ptr: int, length: int) -> Optional[dict]:
    """The vram region of ``length`` bytes at device pointer ``ptr``: the
    IPC handle of the allocation holding it, the offset in it and the
    device; None when ``ptr`` is not device memory or CUDA is absent."""
    libs = _load()
    if libs is None:
        return None
    rt, drv = libs
    known = _known(ptr, length)
    if known is not None:
        return _handle_region(rt, ptr, length, known[0], known[1])
    attrs = _PointerAttributes()
    get_attrs = getattr(rt, "cudaPointerGetAttributes", None)
    if get_attrs is None:  # a libcudart without it cannot tell device memory
        return None
    if get_attrs(ctypes.byref(attrs), ctypes.c_void_p(ptr)) != 0:
        rt.cudaGetLastError()  # clear the sticky-free error of a host pointer
        return None
    if attrs.type != CUDA_MEMORY_TYPE_DEVICE:
        return None
    base = ctypes.c_uint64(ptr)
    if drv is not None:
        size = ctypes.c_size_t()
        if drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            raise RuntimeError("cuMemGetAddressRange failed for %#x" % ptr)
        if ptr + length > base.value + size.value:
            raise ValueError("[%#x, +%d) runs past its CUDA allocation" % (ptr, length))
    return _handle_region(rt, ptr, length, base.value, attrs.device)


def _handle_region(rt, ptr: int, length: int, base: int, device: int) -> dict:
    prev = ctypes.c_int()
    rt.cudaGetDevice(ctypes.byref(prev))
    rt.cudaSetDevice(int(device))
    try:
        handle = (ctypes.c_char * IPC_HANDLE_SIZE)()
        err = rt.cudaIpcGetMemHandle(handle, ctypes.c_void_p(base))
        if err != 0:
            raise RuntimeError("cudaIpcGetMemHandle failed for %#x: error %d" % (base, err))
    finally:
        rt.cudaSetDevice(prev.value)
    return {"kind": "vram", "addr": int(ptr), "length": int(length), "cuda_ipc": bytes(handle),
            "offset": int(ptr - base), "device": int(device)}


def region_of_tensor(t: Any) -> dict:
    """The vram region of a CUDA torch tensor's storage range."""
    n = t.numel() * t.element_size()
    r = region_of(int(t.data_ptr()), n)
    if r is None:
        raise ValueError("tensor is not in CUDA device memory (or libcudart was not found)")
    return r
