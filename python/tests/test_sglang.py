"""kvhost.sglang's connector classes driven in SGLang's scheduler order,
two engines each beside its own ``kvhost serve``, every byte verified in
the engines' numpy pools."""

from __future__ import annotations

import numpy as np
import pytest

import sglang_engine as se
from conftest import free_port
from kvhost import client as kc
from kvhost import sglang as ks
from kvhost.sglang import KVPoll


def engines(sidecar_factory, geo, p_tp, d_tp, pages=256, variant="nixl", cudart=None, backing="shm"):
    """Two engines (prefill TP p_tp, decode TP d_tp), each beside its own
    sidecar. With ``cudart`` (the stand-in libcudart) the KV pools are
    "GPU memory" registered by CUDA IPC handle; else host memory of
    ``backing`` (kvhost.shm)."""
    extra = ["--cudart", cudart] if cudart else None
    a = sidecar_factory("prefill", extra)
    b = sidecar_factory("decode", extra)
    port = free_port()
    boot = ks.KVBootstrapServer("127.0.0.1", port, endpoint=a.endpoint)
    prefill = [se.Rank(geo, p_tp, r, "prefill", pages, 8, se.server_args(p_tp, port, a.endpoint, geo.page_size, variant), 100 + r,
                       vram=cudart is not None, backing=backing)
               for r in range(p_tp)]
    decode = [se.Rank(geo, d_tp, r, "decode", pages, 8, se.server_args(d_tp, port, b.endpoint, geo.page_size, variant), 200 + r,
                      vram=cudart is not None, backing=backing)
              for r in range(d_tp)]
    return a, b, boot, prefill, decode, "127.0.0.1:%d" % port


def close_all(boot, ranks):
    for r in ranks:
        r.close()
    boot.close()


# SGLang's NIXL connector refuses heterogeneous TP into host memory
# (nixl/conn.py: "direct-to-host KV transfer is not implemented safely
# yet") and its MORI connector registers KV as GPU memory only, so the
# heterogeneous-TP cases keep KV in "GPU memory": the stand-in libcudart's
# allocations, shared by CUDA IPC handle.
@pytest.mark.parametrize("p_tp,d_tp,mla,variant,vram", [
    (1, 1, False, "nixl", False), (1, 1, True, "nixl", False), (2, 2, False, "nixl", False),
    (2, 4, False, "nixl", True), (2, 4, False, "mori", True), (1, 1, False, "mori", True),
    (2, 4, True, "nixl", True), (4, 2, False, "nixl", True),
])
def test_two_engines_move_kv(sidecar_factory, standin_cudart, monkeypatch, p_tp, d_tp, mla, variant, vram):
    cudart = None
    if vram:
        cudart = use_standin(monkeypatch, standin_cudart)
    geo = se.Geometry(layers=2, heads=1 if mla else 4, mla=mla)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, p_tp, d_tp, variant=variant, cudart=cudart)
    try:
        move_and_verify(geo, prefill, decode, addr, seed=7, room0=1000)
    finally:
        close_all(boot, prefill + decode)


def move_and_verify(geo, prefill, decode, addr, seed, room0):
    """Moves 12 requests of random length and chunking through the
    engines; every room succeeds on both sides and every byte lands."""
    rng = np.random.default_rng(seed)
    reqs = [se.Request(room=room0 + i, tokens=int(rng.integers(1, 40)), chunk_pages=int(rng.integers(1, 4)))
            for i in range(12)]
    se.run(geo, prefill, decode, reqs, addr)
    total = 0
    for r in reqs:
        assert r.prefill_result == KVPoll.Success, (r.room, r.failure)
        assert r.decode_result == KVPoll.Success, (r.room, r.failure)
        total += se.verify(geo, prefill, decode, r)
    assert total > 0


@pytest.mark.parametrize("p_tp,d_tp,mla", [(1, 1, False), (2, 2, False), (1, 1, True)])
def test_two_engines_move_kv_memfd_pools(sidecar_factory, p_tp, d_tp, mla):
    """Host-memory pools in sealed memfds (kvhost.shm backing="memfd"),
    registered through the adapter's pointer lookup: every byte lands."""
    geo = se.Geometry(layers=2, heads=1 if mla else 4, mla=mla)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, p_tp, d_tp, backing="memfd")
    try:
        assert all(r.pool.pool.shm.startswith("/proc/") for r in prefill + decode)
        move_and_verify(geo, prefill, decode, addr, seed=11, room0=3000)
    finally:
        close_all(boot, prefill + decode)


def test_nixl_hetero_tp_into_host_memory_fails_with_reason(sidecar_factory):
    """What SGLang's NIXL connector refuses, the sidecar refuses the same
    way: the room fails with the reason, nothing hangs."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 2, pages=32)
    try:
        reqs = [se.Request(room=9, tokens=9, chunk_pages=2)]
        se.run(geo, prefill, decode, reqs, addr)
        assert reqs[0].prefill_result == KVPoll.Failed
    finally:
        close_all(boot, prefill + decode)


def test_a_wrong_byte_is_caught(sidecar_factory):
    """The check fails when one byte differs (proves verify looks)."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        reqs = [se.Request(room=5, tokens=9, chunk_pages=2)]
        se.run(geo, prefill, decode, reqs, addr)
        se.verify(geo, prefill, decode, reqs[0])
        decode[0].pool.kv[0][reqs[0].dst_pages[0][1], 3] ^= 0xFF
        with pytest.raises(AssertionError):
            se.verify(geo, prefill, decode, reqs[0])
    finally:
        close_all(boot, prefill + decode)


def test_abort_on_decode_fails_both_sides(sidecar_factory):
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        s = ks.KVSender(prefill[0].mgr, addr, 77, [0], 0)
        rc = ks.KVReceiver(decode[0].mgr, addr, 77)
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.abort()
        assert rc.poll() == KVPoll.Failed
        with pytest.raises(ks.KVTransferError):
            rc.failure_exception()
        # The prefill side hears of it (SGLang's decode sends ABORT).
        wait(lambda: s.poll() in (KVPoll.Failed, KVPoll.WaitingForInput))
        s.abort()
        assert s.poll() == KVPoll.Failed
        with pytest.raises(ks.KVTransferError) as e:
            s.failure_exception()
        assert "Abort" in str(e.value)
    finally:
        close_all(boot, prefill + decode)


def test_prefill_sidecar_killed_mid_transfer(sidecar_factory):
    """The prefill's sidecar dies with rooms in flight: every sender polls
    Failed with "sidecar connection lost", new senders fail fast; once the
    sidecar is back, the manager and the bootstrap server reconnect by
    themselves (SGLang never calls reconnect), register again and serve
    new rooms with every byte right."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=64)
    try:
        mgr = prefill[0].mgr
        senders = [ks.KVSender(mgr, addr, 300 + i, [0], 0) for i in range(3)]
        assert all(s.poll() == KVPoll.Bootstrapping for s in senders)
        a.kill()
        wait(lambda: mgr.client.lost is not None)
        for s in senders:
            assert s.poll() == KVPoll.Failed
            with pytest.raises(ks.KVTransferError) as e:
                s.failure_exception()
            assert kc.LOST_REASON in str(e.value)
        late = ks.KVSender(mgr, addr, 310, [0], 0)  # while the sidecar is down
        assert late.poll() == KVPoll.Failed
        old_session = mgr.client.session
        a.start()
        wait(lambda: mgr.client.lost is None and mgr.client.session != old_session
             and mgr.conn[1] == mgr.client.generation)
        wait(lambda: boot.client.lost is None and boot.client.session == mgr.client.session)
        reqs = [se.Request(room=400 + i, tokens=17, chunk_pages=2) for i in range(3)]
        se.run(geo, prefill, decode, reqs, addr)
        for r in reqs:
            assert r.prefill_result == KVPoll.Success and r.decode_result == KVPoll.Success, r.failure
            se.verify(geo, prefill, decode, r)
    finally:
        close_all(boot, prefill + decode)


def test_host_memory_must_be_shared():
    """A pointer outside every kvhost.shm pool (and not CUDA memory) is
    refused before anything reaches the sidecar, naming the range."""
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError) as e:
        ks.regions_for_pointers([(buf.ctypes.data, buf.nbytes)])
    assert "kvhost.shm" in str(e.value)


def test_regions_one_per_pool():
    from kvhost import shm

    p = shm.KVPool(2, 4, 64, aux_item_lens=[8], aux_slots=2)
    try:
        regs = ks.regions_for_pointers(list(zip(p.kv_data_ptrs, p.kv_data_lens)) +
                                       list(zip(p.aux_data_ptrs, p.aux_data_lens)))
        assert regs == [p.pool.region()]
    finally:
        p.close()


def use_standin(monkeypatch, path):
    """Points kvhost.cuda (this process, the engine) at the stand-in."""
    from kvhost import cuda

    monkeypatch.setenv("KVHOST_CUDART", path)
    cuda.reset()
    monkeypatch.setattr(cuda, "_libs", None)
    assert cuda.available()
    return path


def wait(cond, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within %.0f s" % timeout)
        time.sleep(0.005)


@pytest.mark.parametrize("variant", ["nixl", "mori"])
def test_decode_engine_gone_fails_prefill_room(sidecar_factory, standin_cudart, monkeypatch, variant):
    """The decode engine's connection closes after its metadata went out:
    its sidecar fails the room "engine disconnected", destroys its agent and
    tells the prefill; the prefill's sender ends Failed, never Success for
    KV that had nowhere to go (if the prefill has not heard, SGLang's
    scheduler inits and sends, and that transfer must fail)."""
    cudart = use_standin(monkeypatch, standin_cudart) if variant == "mori" else None
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32, variant=variant,
                                                cudart=cudart)
    try:
        s = ks.KVSender(prefill[0].mgr, addr, 88, [0], 0)
        rc = ks.KVReceiver(decode[0].mgr, addr, 88)
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.send_metadata(decode[0].alloc(2), 0, None, 0)
        wait(lambda: s.poll() == KVPoll.WaitingForInput)
        decode[0].mgr.close()
        try:  # the peers-told path
            wait(lambda: s.poll() == KVPoll.Failed, timeout=10)
        except AssertionError:
            s.init(2, 0)
            s.send(prefill[0].alloc(2))
        wait(lambda: s.poll() in (KVPoll.Failed, KVPoll.Success))
        assert s.poll() == KVPoll.Failed
        with pytest.raises(ks.KVTransferError) as e:
            s.failure_exception()
        assert str(e.value)
    finally:
        close_all(boot, prefill + decode)


def test_refusals_fail_the_room_not_the_scheduler(sidecar_factory):
    """What the sidecar (or protocol 1.0) refuses fails the room with the
    reason; nothing raises into SGLang's scheduler loop but
    failure_exception."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        mgr = decode[0].mgr
        rc = ks.KVReceiver(mgr, addr, 61)
        rc.send_metadata(decode[0].alloc(1), 0)  # before init: nothing was created, nothing sent
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.send_metadata(decode[0].alloc(1), 0, [[1], [2]])  # two state components
        wait(lambda: rc.poll() == KVPoll.Failed)  # send_metadata does not wait for the refusal
        with pytest.raises(ks.KVTransferError) as e:
            rc.failure_exception()
        assert "state" in str(e.value)
        # A sender whose room already exists on the rank.
        s1 = ks.KVSender(prefill[0].mgr, addr, 62, [0], 0)
        s2 = ks.KVSender(prefill[0].mgr, addr, 62, [0], 0)
        assert s1.poll() == KVPoll.Bootstrapping
        assert s2.poll() == KVPoll.Failed
        with pytest.raises(ks.KVTransferError) as e:
            s2.failure_exception()
        assert "exists" in str(e.value)
        # A sender that sends before init is refused by the sidecar.
        s3 = ks.KVSender(prefill[0].mgr, addr, 63, [0], 0)
        s3.num_kv_indices = 1
        s3.send(np.array([0], dtype=np.int32))
        wait(lambda: s3.poll() == KVPoll.Failed)  # send does not wait for the refusal
    finally:
        close_all(boot, prefill + decode)


def test_refused_send_fails_the_room_through_poll(sidecar_factory):
    """KVSender.send does not wait for the sidecar's reply (SGLang's
    NixlKVSender.send queues the chunk to a transfer thread): a chunk the
    sidecar refuses (pages out of range) fails the room in the client's
    state cache with the sidecar's message, which poll() and
    failure_exception() report."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        mgr = prefill[0].mgr
        c = mgr.client
        waited = []
        real = c._request

        def request(msg, timeout=None):  # every request a caller waits for
            waited.append(msg["op"])
            return real(msg, timeout)

        c._request = request
        events = []
        c.add_listener(lambda ev: events.append(ev) if ev.get("event") == "room" else None)
        s = ks.KVSender(mgr, addr, 71, [0], 0)
        s.num_kv_indices = 2
        s.send(np.array([1000], dtype=np.int32))  # the rank has 32 pages
        assert "sender_send" not in waited, waited
        want = "page 1000 at index 0 is outside the rank's 32 pages"
        wait(lambda: c.state(mgr.rank, 71) == kc.FAILED)
        assert want in (c.failure_reason(mgr.rank, 71) or "")
        assert any(ev["room"] == 71 and ev["state"] == kc.FAILED and want in ev["reason"] for ev in events), events
        assert s.poll() == KVPoll.Failed
        s.send(np.array([0], dtype=np.int32))  # a Failed room sends nothing more
        assert waited.count("sender_send") == 0
        with pytest.raises(ks.KVTransferError) as e:
            s.failure_exception()
        assert want in str(e.value)
        assert "bad_request" in str(e.value)
    finally:
        close_all(boot, prefill + decode)


def test_manager_refused_closes_its_connection(sidecar):
    """A KVManager whose memory is refused raises and leaves nothing open."""
    import threading

    from kvhost import shm

    p = shm.KVPool(1, 4, 64)
    try:
        args = ks.KVArgs()
        args.engine_rank = 0
        args.kv_head_num = 1  # a decode rank must say (docs/engine-api.md)
        args.kv_data_ptrs = p.kv_data_ptrs
        args.kv_data_lens = [x + 64 for x in p.kv_data_lens]  # past the pool
        args.kv_item_lens = p.kv_item_lens
        before = threading.active_count()
        with pytest.raises(ValueError):
            ks.KVManager(args, ks.DisaggregationMode.DECODE, se.server_args(1, 1, sidecar.endpoint, 4))
        args.kv_data_lens = p.kv_data_lens
        args.kv_item_lens = [63, 63]  # not a whole number of pages
        with pytest.raises(kc.GeometryError):
            ks.KVManager(args, ks.DisaggregationMode.DECODE, se.server_args(1, 1, sidecar.endpoint, 4))
        assert threading.active_count() == before
    finally:
        p.close()


def test_success_before_the_sidecar_died_stays_success(sidecar_factory):
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        # The rooms conclude on the sidecars; SGLang's scheduler has not
        # polled them yet.
        s = ks.KVSender(prefill[0].mgr, addr, 21, [0], 0)
        rc = ks.KVReceiver(decode[0].mgr, addr, 21)
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.send_metadata(decode[0].alloc(3), 0, None, 0)
        wait(lambda: s.poll() == KVPoll.WaitingForInput)
        s.init(3, 0)
        s.send(prefill[0].alloc(3))
        wait(lambda: decode[0].mgr.client.state(rc._rank, 21) == KVPoll.Success)
        wait(lambda: prefill[0].mgr.client.state(s._rank, 21) == KVPoll.Success)
        b.kill()
        a.kill()
        wait(lambda: decode[0].mgr.client.lost is not None and prefill[0].mgr.client.lost is not None)
        # The scheduler polls only now: both rooms concluded before the loss.
        assert rc.poll() == KVPoll.Success
        assert s.poll() == KVPoll.Success
    finally:
        close_all(boot, prefill + decode)


def _waits(*clients):
    """Records the ops of every request a caller waits for on ``clients``."""
    waited = []
    for c in clients:
        real = c._request

        def request(msg, timeout=None, real=real):
            waited.append(msg["op"])
            return real(msg, timeout)

        c._request = request
    return waited


def _failed_with(room, text):
    wait(lambda: room.poll() == KVPoll.Failed)
    with pytest.raises(ks.KVTransferError) as e:
        room.failure_exception()
    assert text in str(e.value), str(e.value)


def test_scheduler_calls_never_wait(sidecar_factory):
    """Every call SGLang's schedulers make on a room returns without
    waiting for the sidecar (issue 24): the room requests are pipelined,
    and decode_prefix_len is asked by the client's I/O thread as soon as
    the room is WaitingForInput, so pop_decode_prefix_len finds it here."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=64)
    try:
        waited = _waits(prefill[0].mgr.client, decode[0].mgr.client)
        reqs = [se.Request(room=300 + i, tokens=9, chunk_pages=1) for i in range(4)]
        se.run(geo, prefill, decode, reqs, addr)
        for r in reqs:
            assert r.prefill_result == KVPoll.Success and r.decode_result == KVPoll.Success, r.failure
            assert se.verify(geo, prefill, decode, r) > 0
        mgr = prefill[0].mgr
        s = ks.KVSender(mgr, addr, 310, [0], 0)
        rc = ks.KVReceiver(decode[0].mgr, addr, 310)
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.send_metadata(decode[0].alloc(1), 0)
        wait(lambda: s.poll() == KVPoll.WaitingForInput)
        wait(lambda: 310 in mgr._prefix_asked and mgr._prefix_asked[310].done())
        assert s.pop_decode_prefix_len() == 0
        assert s.pop_decode_prefix_len() == 0  # popped
        s.abort()
        rc.abort()
        s.clear()
        rc.clear()
        assert waited == [], waited
    finally:
        close_all(boot, prefill + decode)


def test_each_pipelined_room_op_refused_fails_its_room(sidecar_factory):
    """A refusal of any pipelined room request fails exactly that room
    with the sidecar's code and message (poll() then failure_exception());
    other rooms go on."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        pm, dm = prefill[0].mgr, decode[0].mgr
        bystander_s = ks.KVSender(pm, addr, 400, [0], 0)
        bystander_r = ks.KVReceiver(dm, addr, 400)
        bystander_r.init(0)
        # sender_create on a decode rank: bad_request.
        s = ks.KVSender(dm, addr, 401, [0], 0)
        _failed_with(s, "kvhost serve: bad_request")
        # receiver_create on a prefill rank: bad_request.
        rc = ks.KVReceiver(pm, addr, 402)
        rc.init(0)
        _failed_with(rc, "kvhost serve: bad_request")
        # sender_init with an aux slot outside the rank's aux buffers.
        s = ks.KVSender(pm, addr, 403, [0], 0)
        r3 = ks.KVReceiver(dm, addr, 403)
        r3.init(0)
        wait(lambda: r3.poll() == KVPoll.WaitingForInput)
        r3.send_metadata(decode[0].alloc(1), 0)
        wait(lambda: s.poll() == KVPoll.WaitingForInput)
        s.init(1, 1 << 20)
        _failed_with(s, "kvhost serve: bad_request")
        r3.abort()
        r3.clear()
        # sender_prefix_len before WaitingForInput (no receiver): out_of_order.
        s = ks.KVSender(pm, addr, 404, [0], 0)
        assert s.pop_decode_prefix_len() == 0
        _failed_with(s, "kvhost serve: out_of_order")
        # receiver_init with an aux slot outside the rank's aux buffers.
        s5 = ks.KVSender(pm, addr, 405, [0], 0)
        rc = ks.KVReceiver(dm, addr, 405)
        rc.init(0)
        wait(lambda: rc.poll() == KVPoll.WaitingForInput)
        rc.send_metadata(decode[0].alloc(1), 1 << 20)
        _failed_with(rc, "kvhost serve: bad_request")
        s5.abort()
        s5.clear()
        # The bystander room was untouched by all of it, and still moves KV.
        assert bystander_r.poll() == KVPoll.WaitingForInput
        src, dst = prefill[0].alloc(1), decode[0].alloc(1)
        bystander_r.send_metadata(dst, 0)
        wait(lambda: bystander_s.poll() == KVPoll.WaitingForInput)
        bystander_s.init(1, 0)
        bystander_s.send(src)
        wait(lambda: bystander_s.poll() == KVPoll.Success and bystander_r.poll() == KVPoll.Success)
    finally:
        close_all(boot, prefill + decode)


def test_close_room_refusal_fails_no_later_room(sidecar_factory):
    """close_room is pipelined and forgets the room at once; its refusal
    (here: the room was never made, its create was refused) must not fail
    a room made with the same id right after, nor may the old room's
    late refusals (the client tracks each incarnation of an id)."""
    geo = se.Geometry(layers=1, heads=4)
    a, b, boot, prefill, decode, addr = engines(sidecar_factory, geo, 1, 1, pages=32)
    try:
        c, rank = decode[0].mgr.client, decode[0].mgr.rank
        c.sender_create_nowait(rank, 500)  # refused: a decode rank
        c.sender_init_nowait(rank, 500, 1, 0)  # refused too, answered later
        c.close_room_nowait(rank, 500)  # refused: unknown
        s = ks.KVSender(prefill[0].mgr, addr, 500, [0], 0)
        c.receiver_create_nowait(rank, 500, addr, 0)
        wait(lambda: c.state(rank, 500) == kc.WAITING_FOR_INPUT)
        c.call("poll", rank=rank, rooms=kc.pack_u64([500]))  # every earlier reply is in
        assert c.state(rank, 500) == kc.WAITING_FOR_INPUT, c.failure_reason(rank, 500)
        with pytest.raises(kc.Exists):
            c.receiver_create_nowait(rank, 500, addr, 0)  # tracked: refused here, room untouched
        assert c.state(rank, 500) == kc.WAITING_FOR_INPUT
        s.abort()
        s.clear()
    finally:
        close_all(boot, prefill + decode)
