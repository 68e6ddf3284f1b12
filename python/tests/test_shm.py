"""kvhost.shm's region builder: ``register_as`` (docs/engine-api.md,
"Memory"), alone and against a live sidecar."""

from __future__ import annotations

import fcntl
import os

import pytest

from kvhost import client as kc
from kvhost import shm


def test_region_register_as_argument_and_pool_default():
    with shm.SharedPool(8192) as p:
        assert "register_as" not in p.region()  # the sidecar's default: DRAM
        assert p.region(register_as="vram")["register_as"] == "vram"
        assert p.region(p.addr + 4096, 4096, register_as="dram") == {
            "kind": "dram", "addr": p.addr + 4096, "length": 4096, "shm": p.name, "offset": 4096,
            "register_as": "dram"}
        with pytest.raises(ValueError, match="register_as"):
            p.region(register_as="gpu")
    with pytest.raises(ValueError, match="register_as"):
        shm.SharedPool(4096, register_as="hbm")


def test_kvpool_register_as_reaches_every_region_lookup():
    pool = shm.KVPool(2, 4, 256, aux_item_lens=[64], aux_slots=2, register_as="vram")
    try:
        assert [r["register_as"] for r in pool.regions()] == ["vram"]
        # What an adapter handed only pointers finds (kvhost.sglang,
        # kvhost.vllm): the pool's default too.
        (r,) = shm.regions_for([(pool.kv_data_ptrs[1], pool.kv_data_lens[1])])
        assert r["register_as"] == "vram" and r["addr"] == pool.pool.addr
        assert shm.find_region(pool.aux_data_ptrs[0], 64)["register_as"] == "vram"
        # The argument wins over the pool's default.
        assert pool.pool.region(register_as="dram")["register_as"] == "dram"
    finally:
        pool.close()


def test_sidecar_takes_register_as_and_names_a_bad_value(sidecar):
    pool = shm.KVPool(2, 4, 256, register_as="vram")
    try:
        with kc.Client(sidecar.endpoint, timeout=20) as c:
            ids = c.register_memory(pool.regions())
            assert len(ids) == 1
            c.deregister_memory(ids)
            bad = dict(pool.pool.region(), register_as="gpu")  # past the builder's check
            with pytest.raises(kc.BadRequest) as e:
                c.register_memory([bad])
            assert "regions[0].register_as" in e.value.message
            assert c.register_memory(pool.regions())  # nothing was registered by the refusal
    finally:
        pool.close()


def _resident(pool):
    """Bytes of ``pool``'s mapping resident in this process (its smaps
    entry's Rss): pages allocated and mapped here."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        lo, _, rest = line.partition("-")
        if rest and int(lo, 16) <= pool.addr < int(rest.split()[0], 16):
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError("no mapping holds %#x" % pool.addr)


@pytest.mark.parametrize("madvise", [True, False])
def test_populate_maps_every_page_and_keeps_contents(monkeypatch, madvise):
    """populate(): every page of the pool resident in this process, what it
    held unchanged; the fallback (a write per page) where MADV_POPULATE_WRITE
    is refused does the same."""
    if not madvise:
        monkeypatch.setattr(shm, "_MADV_POPULATE_WRITE", -1)  # EINVAL: the fallback runs
    size = 64 * 4096
    with shm.SharedPool(size) as p:
        buf = p.buffer
        buf[5 * 4096 + 7] = 0x5A
        assert _resident(p) < size
        p.populate()
        assert _resident(p) == size
        assert buf[5 * 4096 + 7] == 0x5A and buf[0] == 0 and buf[size - 1] == 0
        buf.release()


# -- memfd pools (backing="memfd") ---------------------------------------------


def _fd_targets(pid):
    """{descriptor: link target} of process ``pid``."""
    out = {}
    d = "/proc/%d/fd" % pid
    for n in os.listdir(d):
        try:
            out[int(n)] = os.readlink(os.path.join(d, n))
        except OSError:
            pass  # closed meanwhile
    return out


def test_memfd_pool_is_sealed_and_names_its_descriptor():
    with shm.SharedPool(3 * 4096, backing="memfd", register_as="vram") as p:
        assert p.backing == "memfd" and p.path is None
        fd = p._fd
        assert p.shm == "/proc/%d/fd/%d" % (os.getpid(), fd)
        assert os.readlink(p.shm).startswith("/memfd:" + p.name[1:])
        assert p.region() == {"kind": "dram", "addr": p.addr, "length": 3 * 4096, "shm": p.shm, "offset": 0,
                              "register_as": "vram"}
        assert p.region(p.addr + 4096, 100) == {"kind": "dram", "addr": p.addr + 4096, "length": 100, "shm": p.shm,
                                                "offset": 4096, "register_as": "vram"}
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        for size in (0, 4096, 3 * 4096 - 1, 3 * 4096 + 1):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        assert os.fstat(fd).st_size == 3 * 4096
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # F_SEAL_SEAL: no more seals
        # The descriptor is close-on-exec: an engine's children do not keep the memory.
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        # One memory: the view and the descriptor.
        buf = p.buffer
        buf[4096:4099] = b"kvh"
        assert os.pread(fd, 3, 4096) == b"kvh"
        buf.release()
        p.populate()
        # What an adapter handed only pointers finds names the memfd too.
        assert shm.find_region(p.addr + 8, 8)["shm"] == p.shm
        assert shm.regions_for([(p.addr, 1)]) == [p.region()]
    assert p._fd == -1  # closed: the number may name another file by now
    target = _fd_targets(os.getpid()).get(fd)
    assert target is None or not target.startswith("/memfd:" + p.name[1:]), target
    with pytest.raises(ValueError, match="closed"):
        p.region()
    assert shm.find_pool(p.addr) is None


def test_memfd_pool_arguments():
    with pytest.raises(ValueError, match="backing"):
        shm.SharedPool(4096, backing="file")
    with pytest.raises(ValueError, match="memfd"):
        shm.SharedPool(4096, "/kvhost-none", create=False, backing="memfd")
    pool = shm.KVPool(2, 4, 256, aux_item_lens=[64], aux_slots=2, backing="memfd")
    try:
        assert pool.pool.backing == "memfd"
        (r,) = pool.regions()
        assert r["shm"] == pool.pool.shm and r["length"] == pool.pool.size
        (r2,) = shm.regions_for([(pool.kv_data_ptrs[1], pool.kv_data_lens[1]), (pool.aux_data_ptrs[0], 64)])
        assert r2 == r
    finally:
        pool.close()


def test_adapters_register_memfd_pools():
    """kvhost.sglang's and kvhost.vllm's lookups of host pointers give the
    memfd form for memfd pools."""
    from kvhost.sglang import regions_for_pointers
    from kvhost.vllm import memory

    with shm.SharedPool(2 * 4096, backing="memfd") as p, shm.SharedPool(4096) as q:
        ranges = [(p.addr + 10, 100), (q.addr, 4096), (p.addr + 4096, 4096)]
        want = [p.region(), q.region()]
        assert regions_for_pointers(ranges) == want
        assert memory.dram_regions_for(ranges) == want


def test_memfd_pool_registered_with_a_sidecar(sidecar):
    """A live sidecar maps a memfd pool: registered, the sidecar holds a
    descriptor of it (which a plugin may map), dropped on deregister; an
    unsealed memfd and one of the sidecar's own descriptors are refused."""
    pool = shm.KVPool(2, 4, 256, aux_item_lens=[64], aux_slots=2, backing="memfd")
    memfd_link = os.readlink(pool.pool.shm)
    try:
        with kc.Client(sidecar.endpoint, timeout=20) as c:
            assert "dram_memfd" in c.hello.capabilities
            ids = c.register_memory(pool.regions())
            assert len(ids) == 1
            assert memfd_link in _fd_targets(sidecar.proc.pid).values()
            c.deregister_memory(ids)
            assert memfd_link not in _fd_targets(sidecar.proc.pid).values()

            fd = os.memfd_create("kvhost-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 4096)
                region = {"kind": "dram", "addr": 0x10000, "length": 4096, "shm": "/proc/%d/fd/%d" % (os.getpid(), fd),
                          "offset": 0}
                with pytest.raises(kc.KVHostError) as e:
                    c.register_memory([region])
                assert e.value.code == "bad_region"
                assert "not a memfd sealed against shrinking (F_SEAL_SHRINK)" in e.value.message
            finally:
                os.close(fd)
            sidecar_fd = min(_fd_targets(sidecar.proc.pid))
            with pytest.raises(kc.KVHostError) as e:
                c.register_memory([dict(pool.pool.region(), shm="/proc/%d/fd/%d" % (sidecar.proc.pid, sidecar_fd))])
            assert e.value.code == "bad_region" and "sidecar itself" in e.value.message
            assert c.register_memory(pool.regions())  # nothing was registered by the refusals
    finally:
        pool.close()
