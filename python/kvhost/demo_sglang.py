"""The engine demo's SGLang-style pair: a prefill engine and a decode
engine, each a Python process that owns its KV pools (kvhost.shm.KVPool:
per layer a K and a V buffer of pages, SGLang's KVArgs layout, plus an aux
buffer) and drives kvhost.sglang's KVManager, KVSender, KVReceiver and
KVBootstrapServer in the order SGLang's scheduler drives its connectors
(SGLang's python/sglang/srt/disaggregation/prefill.py and decode.py),
beside its own ``kvhost serve``.

prefill, per request and rank: KVSender(mgr, bootstrap_addr, room, ...);
poll until WaitingForInput; init(num_pages, aux_index); the forward pass
writes the request's KV and aux (on the engine's device thread,
kvhost.demo_device: the loop keeps polling and sends nothing of the
request until the device reports it written); send(chunk) per chunk of
pages (chunked prefill), the last one also carrying aux; poll until
Success; clear.

decode, per request and rank: KVReceiver(mgr, bootstrap_addr, room);
init(prefill_dp_rank) (bootstrap); poll until WaitingForInput; allocate
pages; send_metadata(pages, aux_index); poll until Success; then every
byte of every rank's pages and aux slot is checked (kvhost.demo_pattern,
on the device thread), and once the device reports the check done the
verdict is recorded, the rooms cleared and the pages freed.

A request moves on when every TP rank's room reached the state (SGLang's
scheduler polls all ranks and reduces with all_reduce(min)).
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
import types

import numpy as np

from kvhost import demo_pattern as pat
from kvhost.demo_device import Device
from kvhost.demo_vllm import BlockPool, Phases, exit_on_sigterm

AUX_LEN = 64  # bytes per aux slot (SGLang's metadata buffers: output ids, logprobs...)


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _server_args(control, tp, port, page_size):
    """The ServerArgs fields the adapter reads (SGLang's ServerArgs)."""
    return types.SimpleNamespace(
        tp_size=tp, dp_size=1, enable_dp_attention=False, pp_size=1,
        disaggregation_bootstrap_port=port, host="127.0.0.1", page_size=page_size,
        kv_cache_dtype="auto", kvhost_control=control, kvhost_host="127.0.0.1",
    )


def _ranks(shape, tp, num_pages, aux_slots, mode, server_args, register_as=None, backing="shm"):
    """Per rank: (KVManager, KVPool, KV view (layers, 2, pages, page_size,
    heads, head_bytes), aux view (slots, AUX_LEN)). ``register_as`` is the
    pools' (kvhost.shm.KVPool): "vram" has the sidecar register the host
    memory as GPU memory (for the fake plugin, which models GPU memory with
    host memory), which heterogeneous-TP MHA KV needs. ``backing`` is the
    pools' too: "memfd" (sealed memfds, which the fake plugin may map) or
    "shm"."""
    from kvhost import shm
    from kvhost import sglang as ksg

    heads = shape.kv_heads // tp
    item = shape.page_size * heads * shape.head_bytes
    out = []
    for r in range(tp):
        pool = shm.KVPool(shape.layers, num_pages, item, aux_item_lens=[AUX_LEN], aux_slots=aux_slots,
                          register_as=register_as, backing=backing)
        pool.pool.populate()  # allocated up front, as an engine's KV memory is
        kv = pool.pool.ndarray("uint8", (2, shape.layers, num_pages, shape.page_size, heads, shape.head_bytes))
        kv = kv.transpose(1, 0, 2, 3, 4, 5)
        args = ksg.KVArgs(
            engine_rank=r, kv_data_ptrs=pool.kv_data_ptrs, kv_data_lens=pool.kv_data_lens,
            kv_item_lens=pool.kv_item_lens, aux_data_ptrs=pool.aux_data_ptrs, aux_data_lens=pool.aux_data_lens,
            aux_item_lens=pool.aux_item_lens, kv_head_num=heads, total_kv_head_num=shape.kv_heads,
            page_size=shape.page_size, gpu_id=0, prefill_start_layer=0, pp_rank=0, system_dp_rank=0,
        )
        mgr = ksg.KVManager(args, mode, server_args, False)
        out.append((mgr, pool, kv, pool.aux[0]))
    return out


def _all(polls, state):
    return all(int(p) == int(state) for p in polls)


class SuccessTimes:
    """When each rank's client received its rooms' Success events (a
    listener on every rank's client, kvhost.client's add_listener): with
    the engine's own times it splits a request's wait into the part
    before the last rank's Success event reached this process (prefill:
    from its last chunk handed to kvhost, kvhost's part; decode: from
    send_metadata, the prefill engine's fill and sends included) and the
    engine loop's part (that event to the loop seeing it)."""

    def __init__(self, ranks):
        from kvhost import sglang as ksg

        self.success = int(ksg.KVPoll.Success)
        self.at = {}  # (rank index, room) -> time.monotonic()
        self.kvhost, self.loop = [], []
        for r, (mgr, _, _, _) in enumerate(ranks):
            mgr.client.add_listener(self._listener(r))

    def _listener(self, r):
        def on_event(ev):  # on the client's receiving thread: quick
            if ev.get("event") == "room" and ev.get("state") == self.success:
                self.at[(r, ev.get("room"))] = time.monotonic()
        return on_event

    def seen(self, room, nranks, handed, now):
        """Room done on every rank, seen at now; handed: when the engine
        handed it to kvhost."""
        got = [self.at.pop((r, room), None) for r in range(nranks)]
        if None in got or handed is None:
            return
        last = max(got)
        self.kvhost.append(last - handed)
        self.loop.append(now - last)

    def report(self):
        return {"kvhost_ms": self.kvhost, "loop_ms": self.loop}


def prefill_engine(args, control, requests, to_decode, results):
    """The prefill engine; it also plays the proxy: each request it admits
    goes to the decode with the bootstrap address and room."""
    from kvhost import sglang as ksg

    exit_on_sigterm()
    ranks = []
    dev = None
    try:
        shape = pat.Shape(args["layers"], args["kv_heads"], args["head_bytes"], args["page_size"])
        tp = args["prefill_tp"]
        num_pages = args["num_blocks"]
        port = _free_port()
        boot = ksg.KVBootstrapServer("127.0.0.1", port, endpoint=control)
        sa = _server_args(control, tp, port, shape.page_size)
        slots = args["prefill_inflight"]
        ranks = _ranks(shape, tp, num_pages, slots, ksg.DisaggregationMode.PREFILL, sa, args.get("register_as"),
                       args.get("pool", "shm"))
        waits = SuccessTimes(ranks)
        pages = BlockPool(num_pages)
        aux_free = list(range(slots))
        ph = Phases()
        dev = Device(args.get("device_priority", "idle"), delay=args.get("device_delay", 0.0))

        def forward(ids, seed, aux_slot):
            """The forward pass: the request's KV and aux on every rank."""
            for r, (_, _, kv, aux) in enumerate(ranks):
                h0, h1 = shape.heads_of(r, tp)
                pat.fill(kv, ids, seed, shape, h0, h1, layout="NHD")
                aux[aux_slot] = pat.aux_bytes(seed, AUX_LEN)

        todo = list(requests)
        live = {}  # room -> dict
        chunk = args["chunk_pages"]
        deadline = time.monotonic() + args["timeout"]
        while todo or live:
            if time.monotonic() > deadline:
                raise TimeoutError("prefill: %d requests waiting, %d in flight" % (len(todo), len(live)))
            busy = False
            while todo and len(live) < args["prefill_inflight"] and aux_free:
                rid, ntok, seed = todo[0]
                ids = pages.take(shape.pages(ntok))
                if ids is None:
                    break
                todo.pop(0)
                room = int(rid.rsplit("-", 1)[1]) + 1
                with ph.timed("adapter"):
                    senders = [ksg.KVSender(mgr, boot.addr, room, None, 0) for mgr, _, _, _ in ranks]
                live[room] = {"rid": rid, "seed": seed, "ids": ids, "aux": aux_free.pop(), "senders": senders,
                              "sent": 0, "inited": False}
                to_decode.put((rid, ntok, seed, boot.addr, room))
                busy = True
            # SGLang's scheduler polls a request's senders while it
            # bootstraps and once its batch ran (the inflight queue), all
            # in one sweep (poll_and_all_reduce in
            # python/sglang/srt/disaggregation/prefill.py,
            # process_disagg_prefill_inflight_queue), not while the batch runs:
            # rooms in the forward pass are left out, as the decode below
            # leaves out rooms being checked. One timer for the sweep: a
            # thread CPU clock read is a system call (about 2 us here),
            # which per room cost more than the poll() it timed.
            sweep = [(room, st) for room, st in live.items() if not (st["inited"] and not st["fill"].done)]
            polled = []
            if sweep:
                with ph.timed("poll", sum(len(st["senders"]) for _, st in sweep)):
                    polled = [(room, st, [s.poll() for s in st["senders"]]) for room, st in sweep]
            for room, st, polls in polled:
                if any(int(p) == int(ksg.KVPoll.Failed) for p in polls):
                    # SGLang's prefill: failure_exception() raises the
                    # reason (logged), the request is dropped; the decode
                    # reports it failed.
                    for s in st["senders"]:
                        try:
                            s.failure_exception()
                        except Exception:
                            pass
                    pages.give(st["ids"])
                    aux_free.append(st["aux"])
                    del live[room]
                    busy = True
                    continue
                if not st["inited"]:
                    if not _all(polls, ksg.KVPoll.WaitingForInput):
                        continue
                    with ph.timed("adapter"):
                        for s in st["senders"]:
                            s.init(len(st["ids"]), st["aux"])
                    # The forward pass, launched: the KV is sent once the
                    # device reports it written.
                    st["fill"] = dev.submit("fill", forward, st["ids"], st["seed"], st["aux"])
                    st["inited"] = True
                    busy = True
                if not st["fill"].done:
                    continue
                if st["sent"] == 0:
                    st["fill"].value()  # raises what the forward pass raised
                if st["sent"] < len(st["ids"]):
                    part = st["ids"][st["sent"]:st["sent"] + chunk]
                    if "t_send" not in st:
                        # In flight from the first chunk sent to Success.
                        st["t_send"] = time.monotonic()
                    with ph.timed("adapter"):
                        for s in st["senders"]:
                            s.send(np.asarray(part, dtype=np.int32))
                    st["sent"] += len(part)
                    if st["sent"] >= len(st["ids"]):
                        st["t_last"] = time.monotonic()  # every chunk handed to kvhost
                    busy = True
                elif _all(polls, ksg.KVPoll.Success):
                    now = time.monotonic()
                    ph.spans.append((st["t_send"], now))
                    waits.seen(room, tp, st.get("t_last"), now)
                    with ph.timed("adapter"):
                        for s in st["senders"]:
                            s.clear()
                    pages.give(st["ids"])
                    aux_free.append(st["aux"])
                    del live[room]
                    busy = True
            if not busy:
                dev.idle(ph)
        rep = ph.report()
        rep["waits"] = waits.report()
        rep["device"] = dev.report()
        rep["shm"] = [r[1].pool.shm for r in ranks]
        results.put(("prefill_done", rep))
        boot.close()
    except Exception as e:
        results.put(("error", "prefill engine: %s\n%s" % (e, traceback.format_exc())))
    finally:
        if dev is not None:
            dev.close()
        for mgr, pool, _, _ in ranks:
            mgr.close()


def decode_engine(args, control, nreq, from_prefill, results):
    from kvhost import sglang as ksg

    exit_on_sigterm()
    ranks = []
    dev = None
    try:
        shape = pat.Shape(args["layers"], args["kv_heads"], args["head_bytes"], args["page_size"])
        tp = args["sglang_decode_tp"]
        num_pages = args["num_blocks"]
        slots = args["concurrency"]
        sa = _server_args(control, tp, 0, shape.page_size)
        ranks = _ranks(shape, tp, num_pages, slots, ksg.DisaggregationMode.DECODE, sa, args.get("register_as"),
                       args.get("pool", "shm"))
        waits = SuccessTimes(ranks)
        pages = BlockPool(num_pages)
        aux_free = list(range(slots))
        waiting, live = [], {}
        ph = Phases()
        dev = Device(args.get("device_priority", "idle"), delay=args.get("device_delay", 0.0))

        def verify(ids, seed, aux_slot):
            """Every byte of every rank's pages and aux slot: None, or what
            is wrong."""
            for r, (_, _, kv, aux) in enumerate(ranks):
                h0, h1 = shape.heads_of(r, tp)
                why = pat.check(kv, ids, seed, shape, h0, h1, layout="NHD")
                want = pat.aux_bytes(seed, AUX_LEN)
                if why is None and not np.array_equal(aux[aux_slot], want):
                    bad = int(np.flatnonzero(aux[aux_slot] != want)[0])
                    why = "aux slot %d byte %d wrong" % (aux_slot, bad)
                if why:
                    return "decode rank %d: %s" % (r, why)
            return None

        done = 0
        corrupt = args.get("corrupt")
        deadline = time.monotonic() + args["timeout"]
        t_first = None

        def finish(room, st, err, failed):
            """The request's verdict, and its pages and aux slot freed."""
            nonlocal done
            n = len(st["ids"]) if st["ids"] else 0
            nbytes = shape.layers * 2 * shape.kv_heads * n * shape.page_size * shape.head_bytes
            results.put(("request", {
                "request_id": st["rid"], "ok": err is None, "error": err or "",
                "bytes": nbytes if not failed else 0, "verified": 0 if err else nbytes,
                "latency": time.monotonic() - st["t0"], "pages": n,
            }))
            if st["ids"]:
                pages.give(st["ids"])
                aux_free.append(st["aux"])
            del live[room]
            done += 1

        while done < nreq:
            if time.monotonic() > deadline:
                raise TimeoutError("decode: %d of %d requests done" % (done, nreq))
            busy = False
            while True:
                try:
                    waiting.append(from_prefill.get_nowait())
                except queue.Empty:
                    break
            while waiting and len(live) < args["concurrency"]:
                rid, ntok, seed, addr, room = waiting.pop(0)
                recvs = []
                with ph.timed("adapter"):
                    for mgr, _, _, _ in ranks:
                        rv = ksg.KVReceiver(mgr, addr, room)
                        rv.init(0)  # prefill DP rank 0: starts the bootstrap
                        recvs.append(rv)
                live[room] = {"rid": rid, "ntok": ntok, "seed": seed, "recvs": recvs, "ids": None, "aux": None,
                              "t0": time.monotonic()}
                if t_first is None:
                    t_first = time.monotonic()
                busy = True
            for room, st in list(live.items()):
                # Transferred; the device is checking it.
                if "verify" in st and st["verify"].done:
                    err = st["verify"].value()
                    with ph.timed("adapter"):
                        for rv in st["recvs"]:
                            rv.clear()
                    finish(room, st, err, False)
                    busy = True
            # The rest in one sweep, as the prefill's.
            sweep = [(room, st) for room, st in live.items() if "verify" not in st]
            polled = []
            if sweep:
                with ph.timed("poll", sum(len(st["recvs"]) for _, st in sweep)):
                    polled = [(room, st, [rv.poll() for rv in st["recvs"]]) for room, st in sweep]
            for room, st, polls in polled:
                failed = any(int(p) == int(ksg.KVPoll.Failed) for p in polls)
                if st["ids"] is None and not failed:
                    if not _all(polls, ksg.KVPoll.WaitingForInput) or not aux_free:
                        continue
                    ids = pages.take(shape.pages(st["ntok"]))
                    if ids is None:
                        continue
                    st["ids"], st["aux"] = ids, aux_free.pop()
                    st["t_meta"] = time.monotonic()
                    with ph.timed("adapter"):
                        for rv in st["recvs"]:
                            rv.send_metadata(np.asarray(ids, dtype=np.int32), st["aux"])
                    busy = True
                    continue
                if not failed and not _all(polls, ksg.KVPoll.Success):
                    continue
                busy = True
                if failed:
                    reasons = []
                    for rv in st["recvs"]:
                        try:
                            rv.failure_exception()
                        except Exception as e:
                            reasons.append(str(e))
                    finish(room, st, "transfer failed: " + "; ".join(reasons), True)
                    continue
                waits.seen(room, tp, st.get("t_meta"), time.monotonic())
                ids = st["ids"]
                if corrupt is not None and corrupt == st["rid"]:
                    ranks[0][2][0, 0, ids[0], 0, 0, 0] ^= 0xFF  # the mutation check
                # The check, launched: the verdict is recorded, the rooms
                # cleared and the pages freed once the device reports it.
                st["verify"] = dev.submit("verify", verify, ids, st["seed"], st["aux"])
            if not busy:
                dev.idle(ph)
        rep = ph.report()
        rep["waits"] = waits.report()
        rep["device"] = dev.report()
        rep["shm"] = [r[1].pool.shm for r in ranks]
        rep["seconds"] = time.monotonic() - (t_first or time.monotonic())
        results.put(("decode_done", rep))
    except Exception as e:
        results.put(("error", "decode engine: %s\n%s" % (e, traceback.format_exc())))
    finally:
        if dev is not None:
            dev.close()
        for mgr, pool, _, _ in ranks:
            mgr.close()
