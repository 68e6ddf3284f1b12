"""kvhost.shm's region builder: ``register_as`` (docs/engine-api.md,
"Memory"), alone and against a live sidecar."""

from __future__ import annotations

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
