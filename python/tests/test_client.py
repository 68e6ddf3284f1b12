"""kvhost.client against a live ``kvhost serve`` (fake plugin): every op,
the error codes of docs/engine-api.md, and losing and regaining the
sidecar."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvhost import client as kc
from kvhost import shm

PAGE = 4096  # bytes per page (item length) of the small test pools


def sglang_fields(pool: shm.KVPool, role: str, **kw):
    f = dict(
        kv_data_ptrs=pool.kv_data_ptrs, kv_data_lens=pool.kv_data_lens, kv_item_lens=pool.kv_item_lens,
        aux_data_ptrs=pool.aux_data_ptrs, aux_data_lens=pool.aux_data_lens, aux_item_lens=pool.aux_item_lens,
        page_size=16, kv_head_num=2, total_kv_head_num=2, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
        dp_size=1, dp_rank=0, is_mla=False, host="127.0.0.1")
    f.update(kw)
    return f


@pytest.fixture
def pool():
    p = shm.KVPool(num_layers=2, num_pages=8, item_len=PAGE, aux_item_lens=[64], aux_slots=4)
    yield p
    p.close()


def prefill_fields(c: kc.Client, pool: shm.KVPool, **kw):
    """A prefill rank registers with a bootstrap server: the sidecar's."""
    from conftest import free_port

    addr = c.start_bootstrap("127.0.0.1", free_port())
    return sglang_fields(pool, "prefill", bootstrap_addr=addr, **kw)


def open_client(sc, **kw) -> kc.Client:
    kw.setdefault("timeout", 20)
    return kc.Client(sc.endpoint, **kw)


def test_hello(sidecar):
    with open_client(sidecar) as c:
        h = c.hello
        assert h.version[0] == 1
        assert c.session
        assert h.backend == "fake"
        for cap in ("sglang", "dram_shm", "dram_memfd", "events", "poll"):
            assert cap in h.capabilities, h.capabilities
        assert h.max_message > 0
        assert c.generation == 1


def test_default_endpoint(monkeypatch):
    monkeypatch.setenv("KVHOST_CONTROL", "ipc:///x/y.sock")
    assert kc.default_endpoint() == "ipc:///x/y.sock"
    monkeypatch.delenv("KVHOST_CONTROL")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert kc.default_endpoint() == "ipc:///run/user/7/kvhost.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert kc.default_endpoint() == "ipc:///tmp/kvhost-%d.sock" % os.getuid()


def test_pack_pages_forms():
    want = b"\x01\x00\x00\x00\x02\x00\x00\x00\xff\xff\xff\x7f"
    assert kc.pack_pages([1, 2, 2**31 - 1]) == want
    assert kc.pack_pages(np.array([1, 2, 2**31 - 1], dtype=np.int64)) == want
    assert kc.pack_pages(np.array([1, 2, 2**31 - 1], dtype=">i4")) == want
    assert kc.pack_pages(want) == want
    assert kc.pack_pages(memoryview(want)) == want
    assert kc.unpack_pages(want) == [1, 2, 2**31 - 1]
    with pytest.raises(ValueError):
        kc.pack_pages(b"\x00\x00\x00")
    with pytest.raises(ValueError):
        kc.pack_pages([2**31])
    with pytest.raises(ValueError):
        kc.pack_pages(np.array([2**40]))
    with pytest.raises(TypeError):
        kc.pack_pages(np.array([1.5]))


def test_register_and_deregister(sidecar, pool):
    with open_client(sidecar) as c:
        ids = c.register_memory(pool.regions())
        assert len(ids) == 1
        c.deregister_memory(ids)
        with pytest.raises(kc.UnknownObject):
            c.deregister_memory(ids)


def test_bad_regions(sidecar, pool):
    with open_client(sidecar) as c:
        good = pool.pool.region()
        with pytest.raises(kc.BadRegion) as e:
            c.register_memory([dict(good, shm="/kvhost-no-such-object-%d" % os.getpid())])
        assert "kvhost-no-such-object" in e.value.message
        with pytest.raises(kc.BadRegion):  # longer than the object
            c.register_memory([dict(good, length=good["length"] + 4096)])
        # Overlapping regions in one request: the whole request is refused,
        # so the good region can be registered afterwards.
        half = dict(good, length=good["length"] // 2)
        with pytest.raises(kc.BadRegion):
            c.register_memory([good, half])
        ids = c.register_memory([good])
        with pytest.raises(kc.BadRegion):  # overlaps a region of this connection
            c.register_memory([half])
        assert len(ids) == 1
        with pytest.raises(kc.BadRequest) as e:
            c.call("register_memory", regions=[{"kind": "dram", "addr": "x", "length": 1, "shm": "/a", "offset": 0}])
        assert "addr" in e.value.message


def test_open_rank_errors(sidecar, pool):
    with open_client(sidecar) as c:
        # Pointers outside every registered region.
        with pytest.raises(kc.BadRegion):
            c.open_rank("sglang", "decode", **sglang_fields(pool, "decode"))
        c.register_memory(pool.regions())
        # A KV buffer whose length is not pages x item length.
        bad = sglang_fields(pool, "decode", kv_item_lens=[PAGE - 1] * len(pool.kv_item_lens))
        with pytest.raises(kc.GeometryError):
            c.open_rank("sglang", "decode", **bad)
        with pytest.raises(kc.BadRequest):
            c.open_rank("sglang", "sideways", **sglang_fields(pool, "decode"))
        rank = c.open_rank("sglang", "decode", **sglang_fields(pool, "decode"))
        assert rank["rank"] >= 0 and rank["endpoint"]
        with pytest.raises(kc.Busy):
            c.deregister_memory([1])  # a region the open rank uses
        c.close_rank(rank["rank"])
        with pytest.raises(kc.UnknownObject):
            c.close_rank(rank["rank"])


def test_protocol_errors(sidecar):
    with open_client(sidecar) as c:
        with pytest.raises(kc.UnknownOp):
            c.call("no_such_op")
        with pytest.raises(kc.BadRequest) as e:
            c.call("close_rank", rank="seven")
        assert "rank" in e.value.message
        with pytest.raises(kc.OutOfOrder):  # a second hello
            c.call("hello", version=[1, 0], client="t", pid=1)
        with pytest.raises(kc.UnknownObject):
            c.sender_create(12345, 1)
        assert c.state(12345, 1) is None  # a refused create is not tracked


def test_version_mismatch(sidecar):
    import msgpack
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sidecar.endpoint)
    try:
        s.send(msgpack.packb({"op": "hello", "seq": 1, "version": [2, 0], "client": "t", "pid": 1}))
        assert s.poll(20000)
        r = msgpack.unpackb(s.recv(), raw=False)
        assert r["ok"] is False and r["code"] == "version"
        # The connection stays usable for another hello.
        s.send(msgpack.packb({"op": "hello", "seq": 2, "version": [1, 0], "client": "t", "pid": 1}))
        assert s.poll(20000)
        r = msgpack.unpackb(s.recv(), raw=False)
        assert r["ok"] is True and r["seq"] == 2
        # A request before hello on a fresh connection.
        s2 = ctx.socket(zmq.DEALER)
        s2.setsockopt(zmq.LINGER, 0)
        s2.connect(sidecar.endpoint)
        s2.send(msgpack.packb({"op": "poll", "seq": 9, "rank": 1, "rooms": b""}))
        assert s2.poll(20000)
        r = msgpack.unpackb(s2.recv(), raw=False)
        assert r["code"] == "no_hello" and r["seq"] == 9
        s2.close(0)
    finally:
        s.close(0)


def test_rooms_poll_and_errors(sidecar, pool):
    with open_client(sidecar) as c:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 7)
        assert c.state(rank, 7) == kc.BOOTSTRAPPING
        with pytest.raises(kc.Exists):
            c.sender_create(rank, 7)
        with pytest.raises(kc.OutOfOrder):  # send before init
            c.sender_send(rank, 7, [0, 1])
        with pytest.raises(kc.UnknownObject):
            c.sender_init(rank, 8, 2, 0)
        states = c.poll(rank, [7, 8])
        assert states == [kc.BOOTSTRAPPING, None]
        c.abort(rank, 7)
        deadline = time.monotonic() + 20
        while c.state(rank, 7) != kc.FAILED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.state(rank, 7) == kc.FAILED
        assert c.failure_reason(rank, 7)
        # The event stream said the same.
        evs = [e for e in c.drain_events() if e.get("event") == "room" and e.get("room") == 7]
        assert evs and evs[-1]["state"] == kc.FAILED and evs[-1]["reason"]
        c.close_room(rank, 7)
        assert c.state(rank, 7) is None
        assert c.poll(rank, [7]) == [None]


def test_other_connection_cannot_touch(sidecar, pool):
    with open_client(sidecar) as a, open_client(sidecar) as b:
        ids = a.register_memory(pool.regions())
        rank = a.open_rank("sglang", "prefill", **prefill_fields(a, pool))["rank"]
        a.sender_create(rank, 1)
        with pytest.raises(kc.UnknownObject):
            b.deregister_memory(ids)
        with pytest.raises(kc.UnknownObject):
            b.sender_init(rank, 1, 1, 0)
        with pytest.raises(kc.UnknownObject):
            b.close_rank(rank)
        # b may register the same memory: regions are per connection.
        b.register_memory(pool.regions())


def test_concurrent_callers(sidecar, pool):
    """Many threads share one client: every call gets its own reply."""
    with open_client(sidecar) as c:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        errors = []

        def worker(base):
            try:
                for i in range(40):
                    room = base * 1000 + i
                    c.sender_create(rank, room)
                    assert c.poll(rank, [room]) == [kc.BOOTSTRAPPING]
                    c.close_room(rank, room)
            except Exception as e:  # pragma: no cover: reported below
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(1, 7)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors


def test_sidecar_killed_fails_rooms_and_reconnect(sidecar, pool):
    c = open_client(sidecar)
    try:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        for room in (1, 2, 3):
            c.sender_create(rank, room)
        lost_events = []
        c.add_listener(lambda ev: lost_events.append(ev) if ev.get("event") == "connection_lost" else None)
        old_session = c.session
        sidecar.kill()
        deadline = time.monotonic() + 20
        while c.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.lost is not None, "the client did not notice the sidecar die"
        for room in (1, 2, 3):
            assert c.state(rank, room) == kc.FAILED
            assert c.failure_reason(rank, room) == kc.LOST_REASON
        assert lost_events
        with pytest.raises(kc.ConnectionLost):
            c.sender_create(rank, 4)
        sidecar.start()
        assert c.reconnect() is True
        assert c.session != old_session
        assert c.generation == 2
        # Register again on the new sidecar.
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 1)
        assert c.state(rank, 1) == kc.BOOTSTRAPPING
    finally:
        c.close()


def test_sidecar_hung_mid_request(sidecar, pool):
    """A sidecar that stops answering (SIGSTOP): the request in flight
    raises ConnectionLost after the timeout and the rooms fail with the
    reason."""
    c = kc.Client(sidecar.endpoint, timeout=1.0, connect_timeout=20)
    try:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 5)
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        wait_stopped(sidecar.proc.pid)
        try:
            with pytest.raises(kc.ConnectionLost) as e:
                c.sender_create(rank, 6)
            assert "no reply" in e.value.message
            assert c.state(rank, 5) == kc.FAILED
            assert c.failure_reason(rank, 5) == kc.LOST_REASON
        finally:
            os.kill(sidecar.proc.pid, signal.SIGCONT)
    finally:
        c.close()


def wait_stopped(pid, timeout=20.0):
    """Waits until every thread of pid is stopped (SIGSTOP takes effect
    asynchronously on threads running on other cores)."""
    deadline = time.monotonic() + timeout
    task = "/proc/%d/task" % pid
    while True:
        states = []
        for t in os.listdir(task):
            try:
                with open(os.path.join(task, t, "stat")) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, "pid %d not stopped: %s" % (pid, states)
        time.sleep(0.005)


def test_connect_refused_when_no_sidecar(tmpdir_short):
    with pytest.raises(kc.ConnectionLost):
        kc.Client("ipc://" + os.path.join(tmpdir_short, "none.sock"), timeout=0.5)


def test_message_too_large_is_refused_locally(sidecar):
    with open_client(sidecar) as c:
        with pytest.raises(kc.TooLarge):
            c.call("sender_send", rank=1, room=1, pages=b"\0" * (c.hello.max_message + 8))
        # The connection still works.
        with pytest.raises(kc.UnknownObject):
            c.close_rank(99)


def test_no_leaked_threads_or_fds(sidecar, pool):
    """Clients opened, lost, reconnected and closed leave no thread or file
    descriptor behind."""
    import gc

    def fds():
        return len(os.listdir("/proc/self/fd"))

    # One client first: ZeroMQ's context threads and sockets are per process.
    open_client(sidecar).close()
    gc.collect()
    base_fds, base_threads = fds(), threading.active_count()
    for _ in range(10):
        c = open_client(sidecar)
        c.register_memory(pool.regions())
        c.reconnect()
        c.close()
    gc.collect()
    deadline = time.monotonic() + 10
    while (fds() > base_fds or threading.active_count() > base_threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == base_threads
    assert fds() <= base_fds


def test_sidecar_sigterm_fails_rooms_with_its_reason(sidecar, pool):
    """SIGTERM: the sidecar fails every unfinished room "sidecar shutting
    down" and sends those events before it closes; the client keeps that
    reason (not "connection lost") and then sees the connection go."""
    c = open_client(sidecar)
    try:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 1)
        sidecar.stop()
        deadline = time.monotonic() + 20
        while c.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.lost is not None
        assert c.state(rank, 1) == kc.FAILED
        assert "shutting down" in c.failure_reason(rank, 1)
        assert not os.path.exists(sidecar.sock)
    finally:
        c.close()


def test_sidecar_refuses_too_large_and_stays_usable(sidecar_factory):
    sc = sidecar_factory("small", ["--max-message", str(1 << 20)])
    with open_client(sc) as c:
        assert c.hello.max_message == 1 << 20
        c.hello.max_message = 1 << 30  # bypass the client's own check
        with pytest.raises(kc.TooLarge):
            c.call("sender_send", rank=1, room=1, pages=b"\0" * ((1 << 20) + 8))
        with pytest.raises(kc.UnknownObject):
            c.close_rank(99)
        # The refusal (seq nil) finds its request among others in flight.
        stop, errors = threading.Event(), []

        def others():
            while not stop.is_set():
                try:
                    c.close_rank(98)
                except kc.UnknownObject:
                    pass
                except Exception as e:  # pragma: no cover: reported below
                    errors.append(e)
                    return

        ts = [threading.Thread(target=others) for _ in range(3)]
        for t in ts:
            t.start()
        try:
            for _ in range(5):
                with pytest.raises(kc.TooLarge):
                    c.call("sender_send", rank=1, room=1, pages=b"\0" * ((1 << 20) + 8))
        finally:
            stop.set()
            for t in ts:
                t.join(30)
        assert not errors, errors


def test_start_bootstrap_once_per_sidecar(sidecar):
    from conftest import free_port

    with open_client(sidecar) as c:
        port = free_port()
        addr = c.start_bootstrap("127.0.0.1", port)
        assert addr.endswith(":%d" % port)
        assert c.start_bootstrap("127.0.0.1", port) == addr
        with pytest.raises(kc.Exists):
            c.start_bootstrap("127.0.0.1", free_port())


def test_pages_and_roles_checked(sidecar, pool):
    """Pages outside the pool, an aux index outside the aux buffers and a
    room op on a rank of the other role are bad_request naming the field."""
    with open_client(sidecar) as c:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 1)
        with pytest.raises(kc.BadRequest):
            c.receiver_create(rank, 2, "127.0.0.1:1", 0)  # a prefill rank
        assert c.state(rank, 2) is None
        # The room events include its creation (state 1) and nothing else yet.
        evs = [e for e in c.drain_events() if e.get("event") == "room" and e.get("room") == 1]
        assert evs and all(e["state"] == kc.BOOTSTRAPPING for e in evs)
        drank = c.open_rank("sglang", "decode", **sglang_fields(pool, "decode"))["rank"]
        with pytest.raises(kc.BadRequest):
            c.sender_create(drank, 3)  # a decode rank
        c.receiver_create(drank, 4, "127.0.0.1:1", 0)  # the right role: accepted
        c.close_room(drank, 4)
        c.sender_init(rank, 1, 2, 0)
        with pytest.raises(kc.BadRequest) as e:
            c.sender_send(rank, 1, [0, pool.num_pages])  # one past the last page
        assert "pages" in e.value.message
        with pytest.raises(kc.BadRequest):
            c.sender_send(rank, 1, b"\xff\xff\xff\xff")  # -1


def test_sender_init_aux_index_out_of_range(sidecar, pool):
    with open_client(sidecar) as c:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        c.sender_create(rank, 1)
        with pytest.raises(kc.BadRequest) as e:
            c.sender_init(rank, 1, 2, 99)  # 4 aux slots
        assert "aux_index" in e.value.message


def test_no_hello_after_hello_means_restarted(tmpdir_short):
    """A sidecar that answers no_hello to a connection that said hello is
    another process on the endpoint (the monitor missed the restart): the
    client declares the connection lost and fails its rooms. A scripted
    ROUTER plays that sidecar."""
    import msgpack
    import zmq

    ep = "ipc://" + os.path.join(tmpdir_short, "fake.sock")
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ep)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, data = router.recv_multipart()
            m = msgpack.unpackb(data, raw=False)
            if m["op"] == "hello":
                r = {"seq": m["seq"], "ok": True, "version": [1, 0], "session": "s1", "capabilities": [],
                     "max_message": 1 << 20}
            elif m["op"] == "sender_create":
                r = {"seq": m["seq"], "ok": True}
            else:
                r = {"seq": m["seq"], "ok": False, "code": "no_hello", "message": "say hello first"}
            router.send_multipart([ident, msgpack.packb(r)])

    t = threading.Thread(target=serve)
    t.start()
    try:
        with kc.Client(ep, timeout=20) as c:
            c.sender_create(1, 5)
            with pytest.raises(kc.NoHello):
                c.sender_init(1, 5, 1, 0)
            assert c.lost and "restarted" in c.lost
            assert c.state(1, 5) == kc.FAILED
            with pytest.raises(kc.ConnectionLost):
                c.sender_create(1, 6)
    finally:
        stop.set()
        t.join(10)
        router.close(0)


def test_waiting_and_pipelined_callers_share_the_socket(sidecar, pool):
    """Threads waiting for replies (which receive for everyone while they
    wait) and threads sending without waiting share one client: every
    reply reaches its caller, every refusal fails its own room with the
    sidecar's reason, and every room's events arrive in the sidecar's
    order (one receiver at a time)."""
    with open_client(sidecar) as c:
        c.register_memory(pool.regions())
        rank = c.open_rank("sglang", "prefill", **prefill_fields(c, pool))["rank"]
        seen = {}
        mu = threading.Lock()

        def on_event(ev):
            if ev.get("event") == "room":
                with mu:
                    seen.setdefault(ev["room"], []).append(ev["state"])

        c.add_listener(on_event)
        errors = []

        def waiting(base):
            try:
                for i in range(30):
                    room = base * 1000 + i
                    c.sender_create(rank, room)
                    assert c.poll(rank, [room]) == [kc.BOOTSTRAPPING]
                    c.close_room(rank, room)
            except Exception as e:  # pragma: no cover: reported below
                errors.append(e)

        def pipelined(base):
            try:
                rooms = [base * 1000 + i for i in range(30)]
                for room in rooms:
                    c.sender_create_nowait(rank, room)
                    c.sender_init_nowait(rank, room, 1, 1 << 20)  # aux out of range: refused
                deadline = time.monotonic() + 30
                for room in rooms:
                    while c.state(rank, room) != kc.FAILED:
                        assert time.monotonic() < deadline, (room, c.state(rank, room))
                        time.sleep(0.001)
                    reason = c.failure_reason(rank, room)
                    assert reason.startswith("kvhost serve: bad_request: ") and "aux" in reason, reason
                    c.close_room_nowait(rank, room)
            except Exception as e:  # pragma: no cover: reported below
                errors.append(e)

        ts = [threading.Thread(target=waiting, args=(k,)) for k in (1, 2, 3)]
        ts += [threading.Thread(target=pipelined, args=(k,)) for k in (4, 5, 6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors
        c.call("deregister_memory", regions=[])  # every earlier reply and event is in
        for room, states in seen.items():
            assert states[0] == kc.BOOTSTRAPPING, (room, states)
            if room >= 4000:
                assert states[-1] == kc.FAILED, (room, states)
