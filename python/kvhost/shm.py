"""Engine KV pools in shared memory, shared with ``kvhost serve``.

A host-memory (DRAM) pool that the sidecar must read or write is allocated
here, mapped MAP_SHARED into this process, with one of two backings
(``backing=``):

- ``"shm"`` (the default): a file under /dev/shm (the POSIX shared-memory
  object ``/NAME``), which the sidecar opens by name;
- ``"memfd"``: a memfd (``os.memfd_create``) sealed against shrinking,
  growing and further seals once sized, which the sidecar opens through
  this process's descriptor (``/proc/<pid>/fd/<n>``). The kernel refuses
  any truncate of it, so the sidecar and its plugin may map it without
  fearing the SIGBUS a shrunk shm object gives: the fake plugin copies
  into and out of such memory of a peer with memcpy instead of a system
  call per copy. Needs a sidecar whose ``hello`` offers ``dram_memfd``.

The engine works on numpy views (or, when torch is importable, torch
tensors) over the mapping; the sidecar maps the same object and writes the
very bytes the engine reads, without a copy. :meth:`SharedPool.region`
gives the region map ``register_memory`` takes (docs/engine-api.md,
"Memory"): ``addr`` is this process's pointer to the first byte, which is
what the engine later names in ``kv_data_ptrs``.

Every pool this process allocates is recorded (:func:`find_region`), so an
adapter handed only pointers (SGLang's KVArgs) finds the shared-memory
object behind each one.

Ownership: the pool that created a shm object unlinks it on :meth:`close`
(and at interpreter exit, for pools never closed); a memfd pool closes its
descriptor on :meth:`close` (the kernel frees the memory once nothing maps
or holds it: a sidecar that registered it holds its own descriptor until
the region is deregistered). The mapping stays valid while views of it
are alive (Python keeps the mmap open until the last view is gone), so
closing is safe at any time; a closed memfd pool cannot be registered
any more (its descriptor number may name another file by then), so
register before closing.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import itertools
import mmap
import os
import secrets
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

SHM_DIR = "/dev/shm"

_lock = threading.Lock()
_pools: "weakref.WeakValueDictionary[int, SharedPool]" = weakref.WeakValueDictionary()
_counter = itertools.count()


# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14; its value on every Linux
# architecture), which older Pythons' mmap modules do not name.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


# The seals of a memfd pool: its size is fixed once allocated (no shrink,
# which would fault the sidecar's mapping; no growth, which a pool never
# needs), and the seals cannot change (fcntl's names since Python 3.9).
_MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

BACKINGS = ("shm", "memfd")


def _check_register_as(kind: Optional[str]) -> Optional[str]:
    if kind is not None and kind not in ("dram", "vram"):
        raise ValueError("register_as %r is neither 'dram' nor 'vram'" % (kind,))
    return kind


def _shm_path(name: str) -> str:
    if name.startswith(SHM_DIR + "/") or name.startswith("/dev/hugepages/"):
        return name
    base = name.lstrip("/")
    if not base or "/" in base:
        raise ValueError("bad shared-memory name %r: want /NAME or a path under /dev/shm" % name)
    return os.path.join(SHM_DIR, base)


class SharedPool:
    """``size`` bytes of shared memory, mapped MAP_SHARED.

    ``backing``: ``"shm"`` (a POSIX shared-memory object) or ``"memfd"``
    (a memfd sealed against shrinking and growing; see the module's doc).
    ``name``: the shared-memory name (``/kvhost-<pid>-<n>-<random>`` when
    None); for a memfd, the name /proc shows it by (``memfd:NAME``).
    ``create``: make a new object (O_EXCL) and own it (unlink on close),
    else open an existing one (shm only: a memfd has no name to open).
    ``register_as``: the default ``register_as`` of the pool's regions
    (:meth:`region`); None leaves it out (the sidecar registers host
    memory as DRAM).

    ``shm`` is what the sidecar is told (``region()["shm"]``): the
    shared-memory name, or ``/proc/<pid>/fd/<fd>`` of a memfd pool.
    """

    def __init__(self, size: int, name: Optional[str] = None, *, create: bool = True,
                 register_as: Optional[str] = None, backing: str = "shm"):
        size = int(size)
        if size <= 0:
            raise ValueError("size must be positive, got %d" % size)
        if backing not in BACKINGS:
            raise ValueError("backing %r is neither 'shm' nor 'memfd'" % (backing,))
        self.register_as = _check_register_as(register_as)
        self.backing = backing
        if name is None:
            name = "/kvhost-%d-%d-%s" % (os.getpid(), next(_counter), secrets.token_hex(4))
        self.name = name if name.startswith("/") else "/" + name
        self.size = size
        self._fd = -1
        self._closed = False
        if backing == "memfd":
            if not create:
                raise ValueError("a memfd pool is always created: there is no memfd to open by name")
            self.path = None
            self.owner = False  # nothing to unlink
            self._mmap, self._fd = _memfd_map(self.name[1:], size)
        else:
            self.path = _shm_path(name)
            self.owner = create
            self._mmap = _shm_map(self.path, size, create)
        # The address of the mapping: a ctypes array over the mmap (it holds
        # an export of the buffer, which keeps the mapping alive as long as
        # this pool).
        self._cbuf = (ctypes.c_char * size).from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._cbuf)
        with _lock:
            _pools[self.addr] = self

    @property
    def shm(self) -> str:
        """``register_memory``'s ``shm`` of this pool: its shared-memory
        name, or ``/proc/<pid>/fd/<fd>`` of a memfd pool (this process's
        pid when called: a forked child names its own copy of the
        descriptor)."""
        if self.backing == "memfd":
            if self._closed:
                raise ValueError("memfd pool %s is closed: its descriptor is gone" % self.name)
            return "/proc/%d/fd/%d" % (os.getpid(), self._fd)
        return self.name

    # -- views -------------------------------------------------------------

    def populate(self) -> None:
        """Allocates every page of the pool now and maps it into this
        process, contents unchanged (MADV_POPULATE_WRITE, Linux 5.14; else
        a write of each page's first byte to itself). An engine's KV
        memory is allocated up front (GPU memory, or host memory a
        backend pins when it registers it; kvhost demo maps its pools with
        MAP_POPULATE): without this the first transfer into or out of each
        page also pays for allocating, zeroing and mapping it."""
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, 0, self.size)
            return
        except (OSError, ValueError, AttributeError):
            pass
        mv = memoryview(self._mmap)
        try:
            for off in range(0, self.size, mmap.PAGESIZE):
                mv[off] = mv[off]
        finally:
            mv.release()

    @property
    def buffer(self) -> memoryview:
        """A writable memoryview of the whole pool."""
        return memoryview(self._cbuf).cast("B")

    def ndarray(self, dtype: Any = "uint8", shape: Any = None, offset: int = 0):
        """A numpy view of the pool from byte ``offset``: ``shape`` (default:
        as many ``dtype`` items as fit)."""
        import numpy as np

        dt = np.dtype(dtype)
        if shape is None:
            count = (self.size - offset) // dt.itemsize
            shape = (count,)
        elif isinstance(shape, int):
            shape = (shape,)
        count = 1
        for d in shape:
            count *= int(d)
        if offset < 0 or offset + count * dt.itemsize > self.size:
            raise ValueError("view of %d bytes at %d does not fit a %d-byte pool" % (
                count * dt.itemsize, offset, self.size))
        return np.frombuffer(self._cbuf, dtype=dt, count=count, offset=offset).reshape(shape)

    def tensor(self, dtype: Any = None, shape: Any = None, offset: int = 0):
        """A torch tensor over the same bytes (torch is imported here, only
        when called). ``dtype`` is a torch dtype (default uint8)."""
        import torch

        dtype = dtype or torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = ((self.size - offset) // itemsize,)
        elif isinstance(shape, int):
            shape = (shape,)
        count = 1
        for d in shape:
            count *= int(d)
        if offset < 0 or offset + count * itemsize > self.size:
            raise ValueError("view does not fit the pool")
        return torch.frombuffer(self._cbuf, dtype=dtype, count=count, offset=offset).view(*shape)

    # -- registration --------------------------------------------------------

    def region(self, addr: Optional[int] = None, length: Optional[int] = None,
               register_as: Optional[str] = None) -> dict:
        """The ``register_memory`` region of ``length`` bytes at this
        process's address ``addr`` (default: the whole pool).

        ``register_as`` (default: the pool's): the memory kind the sidecar
        registers the region with its plugin as, ``"dram"`` or ``"vram"``
        (docs/engine-api.md, "Memory"). ``"vram"`` is for plugins that
        model GPU memory with host memory (the fake plugin), so transfers
        that only go into GPU memory (heterogeneous-TP MHA pushed as
        SGLang's NIXL connector pushes it) work with host-memory pools; a
        plugin that refuses host memory as VRAM fails ``open_rank``."""
        register_as = _check_register_as(register_as) or self.register_as
        if addr is None:
            addr = self.addr
        if length is None:
            length = self.addr + self.size - addr
        off = addr - self.addr
        if off < 0 or length < 0 or off + length > self.size:
            raise ValueError("range [%#x, +%d) is not inside pool %s" % (addr, length, self.name))
        r = {"kind": "dram", "addr": int(addr), "length": int(length), "shm": self.shm, "offset": int(off)}
        if register_as is not None:
            r["register_as"] = register_as
        return r

    def contains(self, addr: int, length: int = 1) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.size

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Unlinks the object (when this pool created it) or closes the
        memfd's descriptor, and drops the pool's own reference to the
        mapping; views keep it mapped until they are gone."""
        if self._closed:
            return
        self._closed = True
        with _lock:
            if _pools.get(self.addr) is self:
                del _pools[self.addr]
        if self.owner:
            _unlink(self.path)
        self._close_fd()
        self._cbuf = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still export it; the mapping goes with the last one

    def __enter__(self) -> "SharedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        try:
            if not self._closed:
                if self.owner:
                    _unlink(self.path)
                self._close_fd()
        except Exception:
            pass

    def __repr__(self) -> str:
        return "SharedPool(%s, %d bytes at %#x)" % (self.name, self.size, self.addr)


def _shm_map(path: str, size: int, create: bool) -> mmap.mmap:
    """Maps ``size`` bytes of the shm object at ``path``, created (O_EXCL)
    or opened."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError("%s holds %d bytes, fewer than %d" % (path, os.fstat(fd).st_size, size))
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        if create:
            _unlink(path)
        raise
    finally:
        os.close(fd)


def _memfd_map(name: str, size: int) -> Tuple[mmap.mmap, int]:
    """A new memfd of ``size`` bytes, sealed (_MEMFD_SEALS) and mapped:
    (mapping, descriptor). The descriptor is close-on-exec (an engine's
    child processes do not keep the memory) and stays open: the sidecar
    opens the memfd through it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _MEMFD_SEALS)
        return m, fd
    except BaseException:
        os.close(fd)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_all() -> None:
    with _lock:
        pools = list(_pools.values())
    for p in pools:
        if p.owner and not p._closed:
            _unlink(p.path)


def find_pool(addr: int, length: int = 1) -> Optional[SharedPool]:
    """The live pool of this process that holds ``[addr, addr+length)``."""
    with _lock:
        pools = list(_pools.values())
    for p in pools:
        if not p._closed and p.contains(addr, length):
            return p
    return None


def find_region(addr: int, length: int) -> dict:
    """The ``register_memory`` region of a range of this process's memory
    that lies in a :class:`SharedPool`; ValueError if none holds it (host
    memory that is not shared cannot be registered)."""
    p = find_pool(addr, length)
    if p is None:
        raise ValueError("host memory [%#x, +%d) is not in a kvhost.shm pool: allocate host KV "
                         "buffers with kvhost.shm so the sidecar can map them" % (addr, length))
    return p.region(addr, length)


def regions_for(ranges: Sequence[Tuple[int, int]]) -> List[dict]:
    """One region per pool touched by ``ranges`` ((addr, length) pairs),
    each the whole pool: registering whole pools keeps regions from
    overlapping when several buffers share one pool."""
    seen: Dict[int, SharedPool] = {}
    for addr, length in ranges:
        p = find_pool(addr, length)
        if p is None:
            find_region(addr, length)  # raises with the message
        seen[p.addr] = p  # type: ignore[union-attr]
    return [p.region() for p in seen.values()]


class KVPool:
    """An SGLang-style KV pool in one shared-memory object: per layer a K
    and a V buffer (MLA: one latent buffer) of ``num_pages`` pages of
    ``item_len`` bytes, plus aux buffers, laid out back to back.

    ``kv_data_ptrs``, ``kv_data_lens`` and ``kv_item_lens`` are in the order
    of SGLang's KVArgs (K of every layer, then V of every layer);
    ``kv[i]`` is a numpy (num_pages, item_len) uint8 view of buffer i.
    ``register_as`` and ``backing`` are the pool's (:class:`SharedPool`):
    ``"vram"`` has the sidecar register its KV buffers with the plugin as
    GPU memory; ``"memfd"`` allocates a sealed memfd.
    """

    def __init__(self, num_layers: int, num_pages: int, item_len: int, *, mla: bool = False,
                 aux_item_lens: Sequence[int] = (), aux_slots: int = 0, name: Optional[str] = None,
                 register_as: Optional[str] = None, backing: str = "shm"):
        self.num_layers = int(num_layers)
        self.num_pages = int(num_pages)
        self.item_len = int(item_len)
        nbuf = self.num_layers * (1 if mla else 2)
        buf_len = self.num_pages * self.item_len
        aux_lens = [int(x) * int(aux_slots) for x in aux_item_lens]
        self.pool = SharedPool(nbuf * buf_len + sum(aux_lens) or 1, name, register_as=register_as,
                               backing=backing)
        base = self.pool.addr
        self.kv_data_ptrs = [base + i * buf_len for i in range(nbuf)]
        self.kv_data_lens = [buf_len] * nbuf
        self.kv_item_lens = [self.item_len] * nbuf
        off = nbuf * buf_len
        self.aux_data_ptrs, self.aux_data_lens, self.aux_item_lens = [], [], []
        for il, ln in zip(aux_item_lens, aux_lens):
            self.aux_data_ptrs.append(base + off)
            self.aux_data_lens.append(ln)
            self.aux_item_lens.append(int(il))
            off += ln
        self.kv = [self.pool.ndarray("uint8", (self.num_pages, self.item_len), i * buf_len) for i in range(nbuf)]
        self.aux = [self.pool.ndarray("uint8", (int(aux_slots), int(il)), p - base)
                    for p, il in zip(self.aux_data_ptrs, self.aux_item_lens)]

    def regions(self) -> List[dict]:
        return [self.pool.region()]

    def close(self) -> None:
        self.kv = []
        self.aux = []
        self.pool.close()
