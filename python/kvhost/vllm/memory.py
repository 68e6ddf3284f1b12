"""Where a worker's KV cache tensors live, as docs/engine-api.md's
``register_memory`` regions: host memory by shared-memory mapping
(kvhost.shm pools, or any /dev/shm or /dev/hugepages mapping), CUDA
tensors by CUDA IPC handle."""

from __future__ import annotations

import re

_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ \d+\s+(.*)$")


def _shm_mappings():
    """This process's shared-memory file mappings: (start, end, path, file
    offset), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            m = _MAPS_LINE.match(line.rstrip("\n"))
            if not m:
                continue
            path = m.group(4).strip()
            if path.endswith(" (deleted)"):
                continue
            if not (path.startswith("/dev/shm/") or path.startswith("/dev/hugepages/")):
                continue
            out.append((int(m.group(1), 16), int(m.group(2), 16), path, int(m.group(3), 16)))
    return out


def dram_regions_for(ranges):
    """kvhost.shm's regions for ranges in its pools, else the shared-memory
    mappings holding them (memory another allocator put in /dev/shm)."""
    from kvhost import shm

    try:
        return shm.regions_for(ranges)
    except ValueError:
        return dram_regions(ranges)


def dram_regions(ranges):
    """The ``dram`` regions (docs/engine-api.md, register_memory) that hold
    the given (addr, length) ranges: one per shared-memory mapping of this
    process that holds any of them, the whole mapping. A range that is not
    in one shared-memory mapping is an error naming it."""
    maps = _shm_mappings()
    used = {}
    for addr, length in ranges:
        for start, end, path, off in maps:
            if start <= addr and addr + length <= end:
                used[(start, end)] = {
                    "kind": "dram",
                    "addr": start,
                    "length": end - start,
                    "shm": path,
                    "offset": off,
                }
                break
        else:
            raise ValueError(
                f"kvhost: KV cache at 0x{addr:x} (+{length} bytes) is not in shared memory: "
                "allocate host-memory KV caches with kvhost.shm so the sidecar can map them"
            )
    return [used[k] for k in sorted(used)]


def is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def ptr_len(t):
    """(data pointer, bytes) of a numpy array or torch tensor."""
    if is_torch(t):
        return t.data_ptr(), t.numel() * t.element_size()
    return t.__array_interface__["data"][0], t.nbytes


def vram_region(t):
    """A ``vram`` region for a CUDA torch tensor: its storage's CUDA IPC
    handle (torch's own sharing of CUDA storages between processes)."""
    storage = t.untyped_storage()
    shared = storage._share_cuda_()
    device, handle, size, offset = shared[0], shared[1], shared[2], shared[3]
    if len(handle) != 64:
        raise ValueError(f"kvhost: CUDA IPC handle of {len(handle)} bytes, want 64")
    return {
        "kind": "vram",
        "addr": storage.data_ptr(),
        "length": int(size),
        "cuda_ipc": bytes(handle),
        "offset": int(offset),
        "device": int(device),
    }



def unpack_i32(b: bytes) -> list:
    import struct

    n = len(b) // 4
    return list(struct.unpack(f"<{n}i", b[: n * 4]))
