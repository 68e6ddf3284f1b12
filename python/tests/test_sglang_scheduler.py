"""SGLang's own scheduler call order, replayed over kvhost.sglang against
live ``kvhost serve`` sidecars (fake plugin), for the SGLang of the
reference connectors and for SGLang's newest main (tests/sglang_replay.py
names every upstream function and commit), with a dense and a hybrid
(Mamba + SWA state) model, on SGLang's NIXL and MORI wires; every byte the decode engine holds afterwards
is checked: what was sent equals the prefill's, everything else is what it
was."""

from __future__ import annotations

import numpy as np
import pytest

import sglang_replay as rp
from conftest import BACKEND, free_port
from kvhost import client as kc
from kvhost import sglang as ks
from kvhost.sglang import KVPoll


# SGLang's state tensors (hybrid models) and MORI's KV are GPU memory: the
# fake plugin models it with host memory registered as VRAM, which a real
# backend built without CUDA refuses (NIXL's registerMem; the sidecar
# refuses state in host memory; SGLang's MORI wire also needs the
# remote_blob capability NIXL lacks). On such a backend (KVHOST_TEST_BACKEND)
# those cases must fail so, and fail the run if they ever pass.
def _gpu_memory_only(needs_gpu):
    return pytest.mark.xfail(BACKEND != "fake" and needs_gpu, strict=True, raises=(kc.BackendError, kc.BadRegion),
                             reason="GPU memory on a backend without CUDA (KVHOST_TEST_BACKEND=%s)" % BACKEND)


def engines(sidecar_factory, model, tp, profile, pages=160, variant="nixl"):
    a = sidecar_factory("prefill")
    b = sidecar_factory("decode")
    # The prefill engine's bootstrap server (KVBootstrapServer from
    # get_kv_class), on a port the sidecar picks (no race with other tests).
    boot = rp.get_kv_class("kvhost", rp.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", 0, endpoint=a.endpoint)
    port = int(boot.addr.rsplit(":", 1)[1])
    # SGLang's MORI connector registers KV as GPU memory only: with the
    # fake plugin, host memory registered as VRAM.
    reg = "vram" if variant == "mori" else None
    pm = [rp.RankMem(model, tp, pages, 100 + r, reg) for r in range(tp)]
    dm = [rp.RankMem(model, tp, pages, 200 + r, reg) for r in range(tp)]
    p = rp.Prefill(model, tp, pm, [rp.server_args(tp, port, a.endpoint, model.page_size, variant)] * tp, port, profile)
    d = rp.Decode(model, tp, dm, [rp.server_args(tp, port, b.endpoint, model.page_size, variant)] * tp, profile)
    return boot, p, d, "127.0.0.1:%d" % port


def requests(model, n, seed):
    rng = np.random.default_rng(seed)
    ps = model.page_size
    reqs = []
    for i in range(n):
        prompt = int(rng.integers(1, 41))
        prefix = 0
        if i % 3 == 1 and prompt > 2 * ps:  # decode's radix cache holds a page-aligned prefix
            prefix = int(rng.integers(1, prompt // ps)) * ps
        reqs.append(rp.Req(room=5000 + i, prompt=prompt, chunk_tokens=int(rng.integers(1, 3 * ps)),
                           decode_prefix_tokens=prefix))
    # Decode holds the whole prompt: prefill inits 0 pages and its last
    # send has none, only aux and state (should_send_kv_chunk(0, True)).
    reqs.append(rp.Req(room=5900, prompt=4 * ps, chunk_tokens=3, decode_prefix_tokens=4 * ps))
    return reqs


def check_bytes(model, p: rp.Prefill, d: rp.Decode, reqs, before):
    """Every decode byte: the pages, aux slots and state items of each
    request equal the prefill's; every other byte is what it was."""
    ps = model.page_size
    checked = 0
    for r, (dmem, pmem) in enumerate(zip(d.mems, p.mems)):
        kv0, st0 = before[r]
        touched = np.zeros(dmem.kv.num_pages, dtype=bool)
        for q in reqs:
            skip = q.decode_prefix_tokens // ps
            dst, src = q.d_pages[skip:], q.p_pages[skip:]
            touched[dst] = True
            for b in range(len(dmem.kv.kv)):
                np.testing.assert_array_equal(dmem.kv.kv[b][dst], pmem.kv.kv[b][src],
                                              "room %d rank %d KV buffer %d" % (q.bootstrap_room, r, b))
                # decode's own prefix pages are left alone
                np.testing.assert_array_equal(dmem.kv.kv[b][q.d_pages[:skip]], kv0[b][q.d_pages[:skip]])
                checked += dmem.kv.kv[b][dst].size
            for a in range(2):
                np.testing.assert_array_equal(dmem.kv.aux[a][q.d_meta], pmem.kv.aux[a][q.metadata_buffer_index],
                                              "room %d rank %d aux %d" % (q.bootstrap_room, r, a))
                checked += rp.AUX_ITEM
            assert dmem.output_ids[q.d_meta, 0] == q.output_id
            assert dmem.bootstrap_room[q.d_meta, 0] == q.bootstrap_room
        for b in range(len(dmem.kv.kv)):
            np.testing.assert_array_equal(dmem.kv.kv[b][~touched], kv0[b][~touched], "untouched pages changed")
        if not model.hybrid:
            assert not dmem.state
            continue
        # Mamba: one slot per request; SWA: the window's pages.
        for c, (dst_of, src_of) in enumerate([(lambda q: [q.d_slot], lambda q: [q.p_slot]),
                                              (lambda q: q.d_swa, lambda q: q.p_swa)]):
            touched = np.zeros(dmem.state[c][0].shape[0], dtype=bool)
            for q in reqs:
                dst, src = np.asarray(dst_of(q)), np.asarray(src_of(q))
                assert len(dst) == len(src) > 0
                touched[dst] = True
                for t in range(len(dmem.state[c])):
                    np.testing.assert_array_equal(dmem.state[c][t][dst], pmem.state[c][t][src],
                                                  "room %d rank %d state %d tensor %d" % (q.bootstrap_room, r, c, t))
                    checked += dmem.state[c][t][dst].size
            for t in range(len(dmem.state[c])):
                np.testing.assert_array_equal(dmem.state[c][t][~touched], st0[c][t][~touched],
                                              "untouched state items changed")
    return checked


@pytest.mark.parametrize("profile,hybrid,variant", [
    pytest.param(profile, hybrid, variant, id="%s-%s-%s" % (profile, "mamba+swa" if hybrid else "dense", variant),
                 marks=_gpu_memory_only(hybrid or variant == "mori"))
    for profile in ("reference", "main") for hybrid in (False, True) for variant in ("nixl", "mori")])
def test_scheduler_replay(sidecar_factory, profile, hybrid, variant):
    model = rp.Model(hybrid=hybrid)
    boot, p, d, addr = engines(sidecar_factory, model, 2, rp.PROFILES[profile], variant=variant)
    try:
        before = [m.snapshot() for m in d.mems]
        reqs = requests(model, 10, 7)
        rp.run(p, d, reqs, addr)
        for q in reqs:
            assert q.prefill_result == KVPoll.Success, (q.bootstrap_room, q.prefill_reason)
            assert q.decode_result == KVPoll.Success, (q.bootstrap_room, q.decode_reason)
            # prefill sent exactly the pages after decode's prefix
            assert q.disagg_decode_prefix_len == q.decode_prefix_tokens
            pages = rp.kv_to_page_num(q.prompt, model.page_size) - q.decode_prefix_tokens // model.page_size
            assert sum(q.sent_chunks) == pages, (q.bootstrap_room, q.sent_chunks, pages)
            assert len(q.metrics) == 2 and all(m.transfer_latency_s is not None and m.transfer_latency_s >= 0
                                               for m in q.metrics)
        assert any(q.decode_prefix_tokens for q in reqs)
        assert reqs[-1].sent_chunks == [0]  # the zero-page last chunk was sent and completed
        assert check_bytes(model, p, d, reqs, before) > 0
        # The decode managers learned the prefill's parallel info once.
        assert all(addr in mgr.prefill_info_table and mgr.prefill_info_table[addr].dp_size == 1
                   for mgr in d.managers)
    finally:
        p.close()
        d.close()
        boot.close()
        for m in p.mems + d.mems:
            m.close()


@_gpu_memory_only(True)
def test_kvargs_state_reaches_the_sidecar_per_type(sidecar_factory):
    """open_rank gets SGLang's state lists per state type as they are in
    KVArgs (state_types with lists of lists)."""
    model = rp.Model(hybrid=True)
    a = sidecar_factory("one")
    mem = rp.RankMem(model, 1, 16, 1)
    try:
        mgr = rp.init_kv_manager(model, mem, 1, 0, ks.DisaggregationMode.DECODE,
                                 rp.server_args(1, free_port(), a.endpoint, model.page_size))
        f = mgr.rank_fields()
        assert f["state_types"] == ["mamba", "swa"]
        assert f["state_data_ptrs"] == mem.state_ptrs and f["state_item_lens"] == mem.state_items
        mgr.close()
        # A flat list where SGLang gives one list per type is refused
        # before anything reaches the sidecar, naming the field.
        bad = rp.get_kv_class("kvhost", rp.KVClassType.KVARGS)()
        bad.state_types = ["mamba"]
        bad.state_data_ptrs = mem.state_ptrs[0]
        with pytest.raises(ValueError, match="state_data_ptrs"):
            ks.state_components(bad)
    finally:
        mem.close()


def test_try_ensure_parallel_info_bounded(sidecar_factory):
    """try_ensure_parallel_info answers False (the scheduler retries, then
    aborts the requests) for a bootstrap server that is not there or whose
    page size differs, and caches nothing."""
    model = rp.Model()
    a = sidecar_factory("p")
    b = sidecar_factory("d")
    boot = ks.KVBootstrapServer("127.0.0.1", 0, endpoint=a.endpoint)
    port = int(boot.addr.rsplit(":", 1)[1])
    pmem, dmem = rp.RankMem(model, 1, 8, 1), rp.RankMem(model, 1, 8, 2)
    try:
        pm = rp.init_kv_manager(model, pmem, 1, 0, ks.DisaggregationMode.PREFILL,
                                rp.server_args(1, port, a.endpoint, model.page_size))
        dm = rp.init_kv_manager(model, dmem, 1, 0, ks.DisaggregationMode.DECODE,
                                rp.server_args(1, port, b.endpoint, model.page_size))
        nobody = "127.0.0.1:%d" % free_port()
        assert dm.try_ensure_parallel_info(nobody) is False and nobody not in dm.prefill_info_table
        addr = "127.0.0.1:%d" % port
        dm.kv_args.page_size = model.page_size * 2  # this decode rank's pages differ
        assert dm.try_ensure_parallel_info(addr) is False and addr not in dm.prefill_info_table
        dm.kv_args.page_size = model.page_size
        assert dm.try_ensure_parallel_info(addr) is True
        info = dm.prefill_info_table[addr]
        assert info.dp_size == 1 and info.follow_bootstrap_room and info.page_size == model.page_size
        pm.close()
        dm.close()
    finally:
        boot.close()
        pmem.close()
        dmem.close()


def test_pack_state_shapes():
    """SGLang's state_indices shapes become the API's per-component lists."""
    u = kc.unpack_pages
    # one entry per state type: Mamba as [0-d array], SWA pages, an unknown type None
    got = kc.pack_state([[np.array(5, dtype=np.int64)], np.array([3, 4], dtype=np.int32), None])
    assert [None if x is None else u(x) for x in got] == [[5], [3, 4], None]
    assert kc.pack_state(got) == got  # packing twice changes nothing
    assert kc.pack_state([]) is None and kc.pack_state(None) is None
    assert u(kc.pack_state([7, 8])) == [7, 8]  # older SGLang: one flat list, one component
    with pytest.raises(ValueError):
        kc.pack_state([[1 << 40]])


class _TorchLike:
    """What pack_pages needs of a torch tensor (torch is not installed
    here): SGLang's newer schedulers may pass page indices as tensors."""

    __module__ = "torch"

    def __init__(self, a):
        self.a = a

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a

    def __len__(self):
        return len(self.a)


def test_pack_pages_takes_tensors():
    t = _TorchLike(np.array([[3, 4], [5, 6]], dtype=np.int64))
    assert kc.unpack_pages(kc.pack_pages(t)) == [3, 4, 5, 6]


def test_classes_implement_sglang_bases():
    """kvhost.sglang's classes are SGLang's base classes (its own when
    SGLang is importable, the stand-ins otherwise) with nothing left
    abstract, and keep the base defaults they do not override."""
    from kvhost.sglang import base

    for cls, parent in [(ks.KVManager, base.BaseKVManager), (ks.KVSender, base.BaseKVSender),
                        (ks.KVReceiver, base.BaseKVReceiver), (ks.KVBootstrapServer, base.BaseKVBootstrapServer)]:
        assert issubclass(cls, parent), cls
        assert not getattr(cls, "__abstractmethods__", None), (cls, cls.__abstractmethods__)
    # BaseKVSender's defaults, which kvhost's sender overrides: no prefix
    # unless decode sent one, and a zero-page last chunk is still sent.
    assert base.BaseKVSender.pop_decode_prefix_len(None) == 0
    assert base.BaseKVSender.should_send_kv_chunk(None, 0, True) is False
    assert ks.KVSender.should_send_kv_chunk(None, 0, True) is True
    assert ks.KVSender.should_send_kv_chunk(None, 0, False) is False
    assert {"mamba", "swa", "dsa", "minimax_index_k", "swa_ring", "c128_state"} <= {t.value for t in ks.StateType}
