#!/usr/bin/python3
"""An SGLang-layout disaggregation peer for kvhost's interop tests.

It plays SGLang's decode side (NixlKVReceiver / MoriKVReceiver) or prefill
side (NixlKVManager / MoriKVManager bootstrap thread and transfer worker):
it builds and parses the ZeroMQ multipart messages with SGLang's disaggregation/{nixl,mori}/conn.py field
layouts (sglang/srt/disaggregation/{nixl,mori}/conn.py), talks HTTP to the
bootstrap server as CommonKVManager does, and owns real memory and an agent
on the kvhost fake plugin through ctypes (kvfake.py), so bytes really move
between it and a kvhost worker.

    sglang_peer.py SPEC.json

The spec (JSON) says the role, the wire variant, the plugin library, the
bootstrap address, the pool geometry and the requests; results go to
spec["out"] (JSON) and, for decode, the received memory to spec["dump"].
Only TP 1 on both sides, as an SGLang peer of one rank.
"""
import json
import os
import random
import struct
import sys
import time
import urllib.request

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvfake  # noqa: E402

NIXL_GUARD = b"NixlMsgGuard"
MORI_GUARD = b"MoriMsgGuard"
AUX_DATA_HEADER = b"AUX_DATA"
KV_SUCCESS, KV_FAILED = 4, 0


def log(*a):
    print("[sglang_peer]", *a, file=sys.stderr, flush=True)


def http(method, url, body=None, timeout=5):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def pack_ptrs(ptrs):
    return b"".join(struct.pack("Q", p) for p in ptrs)


class Pool:
    """Memory laid out as kvhost's kvpool lays out a rank (KV regions of
    layers x K/V in SGLang's order, then the aux buffer), in one array."""

    def __init__(self, spec, content=None):
        self.regions = 2 * spec["layers"]
        self.item = spec["item_len"]
        self.pages = spec["pages"]
        self.kv_len = self.item * self.pages
        self.aux_item = spec["aux_item_len"]
        self.aux_len = self.aux_item * spec["aux_slots"]
        total = self.regions * self.kv_len + self.aux_len
        self.mem = np.zeros(total, dtype=np.uint8)
        if content is not None:
            self.mem[:] = np.frombuffer(content, dtype=np.uint8)
        self.kv = [self.mem[i * self.kv_len:(i + 1) * self.kv_len] for i in range(self.regions)]
        self.aux = self.mem[self.regions * self.kv_len:]

    def register(self, agent):
        bufs = [(k, kvfake.KVP_MEM_VRAM) for k in self.kv] + [(self.aux, kvfake.KVP_MEM_DRAM)]
        regs = agent.register(bufs)
        self.kv_regions, self.aux_region = regs[:-1], regs[-1]

    def kv_ptrs(self):
        return [k.ctypes.data for k in self.kv]


# ---------------------------------------------------------------- decode ---


class TransferStatus:
    """NixlKVManager's TransferStatus, tracked from notification tags."""

    def __init__(self, responses):
        self.received = {}
        self.expected = {}
        self.responses = responses
        self.num_pp = None
        self.aux = False

    def apply(self, tag):
        c = tag.split("_", 8)
        room, kind = int(c[0]), c[1]
        if kind == "kv":
            chunk, last = int(c[2]), bool(int(c[3]))
            pp = int(c[4]) if len(c) > 4 else 0
            if len(c) > 7 and c[5] == "part":
                raise RuntimeError("mixed-kind parts are not expected in this test")
            self.received.setdefault(pp, set()).add(chunk)
            if last:
                self.expected[pp] = chunk + 1
                if self.num_pp is None:
                    self.num_pp = self.responses
        elif kind == "aux":
            self.aux = True
            if len(c) > 3 and c[2] == "nokv":
                self.expected[int(c[3])] = 0
            if self.num_pp is None:
                self.num_pp = self.responses
        return room

    def done(self):
        if self.num_pp is None or not self.aux:
            return False
        if len(self.expected) < self.num_pp:
            return False
        return all(len(self.received.get(pp, ())) == n for pp, n in self.expected.items())


def run_decode(spec):
    variant = spec["variant"]
    plugin = kvfake.Plugin(spec["plugin"])
    agent = kvfake.Agent(plugin, "py-decode-%d" % os.getpid())
    pool = Pool(spec)
    pool.register(agent)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ip = "127.0.0.1"
    boot = spec["bootstrap"]
    deadline = time.time() + spec.get("timeout", 60)

    # try_ensure_parallel_info: the all -1 query until every prefill rank
    # registered (503 before).
    while True:
        try:
            st, body = http("GET", f"http://{boot}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
            info = json.loads(body)
            break
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.time() > deadline:
                raise
            time.sleep(0.05)
    assert info["page_size"] == spec["page_size"], info
    assert info["attn_tp_size"] == 1 and info["pp_size"] == 1, info
    _, body = http("GET", f"http://{boot}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
    rank = json.loads(body)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")
    md = agent.metadata()

    if variant == "nixl":
        # NixlKVReceiver._register_kv_args
        push.send_multipart([
            NIXL_GUARD, b"None", ip.encode(), str(port).encode(), agent.name.encode(), md,
            pack_ptrs(pool.kv_ptrs()), pack_ptrs([pool.aux.ctypes.data]), b"",
            b"0", b"1", b"0", str(pool.item).encode(), b"", b"", b"", b"",
            str(pool.pages).encode(), ",".join(["VRAM"] * pool.regions).encode(),
            pack_ptrs([pool.item] * pool.regions),
        ])
    else:
        # MoriKVReceiver._register_kv_args. The fake plugin's metadata is not
        # a MORI EngineDesc, so it travels in kvhost's EngineDesc-shaped
        # wrapper: [key, gpu, "kvhost-wrapped", metadata, nil].
        desc = msgpack.packb([agent.name, 0, "kvhost-wrapped", md, None], use_bin_type=True)
        kv_descs = msgpack.packb([agent.export(r) for r in pool.kv_regions], use_bin_type=True)
        aux_descs = msgpack.packb([agent.export(pool.aux_region)], use_bin_type=True)
        push.send_multipart([
            MORI_GUARD, b"None", ip.encode(), str(port).encode(), desc, kv_descs, aux_descs, b"",
            b"0", b"1", b"0", str(pool.item).encode(), b"", b"",
        ])

    rng = random.Random(spec.get("seed", 1))
    free = list(range(pool.pages))
    results = []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    for i, req in enumerate(spec["requests"]):
        room, tokens = req["room"], req["tokens"]
        n = (tokens + spec["page_size"] - 1) // spec["page_size"]
        if n > len(free):
            raise RuntimeError(f"pool of {pool.pages} pages is too small for the requests")
        pages = rng.sample(free, n)
        aux_slot = i % spec["aux_slots"]
        idx = np.array(pages, dtype=np.int32).tobytes()
        if variant == "nixl":
            # NixlKVReceiver.send_metadata
            push.send_multipart([NIXL_GUARD, str(room).encode(), ip.encode(), str(port).encode(), agent.name.encode(),
                                 idx, str(aux_slot).encode(), b"1", b"", b"0"])
        else:
            # MoriKVReceiver.send_metadata
            push.send_multipart([MORI_GUARD, str(room).encode(), ip.encode(), str(port).encode(), agent.name.encode(),
                                 idx, str(aux_slot).encode(), b"", b"1", b""])
        status = TransferStatus(responses=1)
        outcome, reason = None, ""
        while outcome is None:
            if time.time() > deadline:
                outcome, reason = False, "timeout"
                break
            if variant == "nixl":
                for sender, msg in agent.notifs():
                    if status.apply(msg.decode()) != room:
                        raise RuntimeError(f"notification {msg!r} for another room")
                if status.done():
                    outcome = True
                    break
            for sock, _ in poller.poll(timeout=2):
                frames = sock.recv_multipart()
                if frames[0] == AUX_DATA_HEADER:
                    # MoriKVManager._handle_aux_data
                    r, b, slot = int(frames[1]), int(frames[2]), int(frames[3])
                    n_bytes = struct.unpack(">I", frames[4])[0]
                    assert r == room and b == 0 and n_bytes == len(frames[5]), frames[:5]
                    pool.aux[slot * pool.aux_item:slot * pool.aux_item + n_bytes] = np.frombuffer(frames[5], dtype=np.uint8)
                elif frames[0] == MORI_GUARD:
                    r, code, prank = int(frames[1]), int(frames[2]), int(frames[3])
                    why = frames[4].decode() if len(frames) > 4 else ""
                    if r != room:
                        raise RuntimeError(f"status for room {r}, waiting for {room}")
                    if code == KV_SUCCESS:
                        outcome = True
                    elif code == KV_FAILED:
                        outcome, reason = False, why
                else:
                    raise RuntimeError(f"unexpected message {frames[0]!r}")
        results.append({"room": room, "ok": bool(outcome), "reason": reason, "pages": pages, "aux": aux_slot})
        # Every request keeps its pages: the memory is checked after the run.
        for p in pages:
            free.remove(p)
    with open(spec["dump"], "wb") as f:
        f.write(pool.mem.tobytes())
    agent.close()
    return {"results": results}


# --------------------------------------------------------------- prefill ---


def run_prefill(spec):
    variant = spec["variant"]
    plugin = kvfake.Plugin(spec["plugin"])
    agent = kvfake.Agent(plugin, "py-prefill-%d" % os.getpid())
    with open(spec["content"], "rb") as f:
        pool = Pool(spec, f.read())
    pool.register(agent)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    # CommonKVManager.register_to_bootstrap
    http("PUT", f"http://{spec['bootstrap']}/route", {
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": spec["page_size"], "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False, "prefill_http_port": None,
    })
    reqs = {r["room"]: r for r in spec["requests"]}
    peers = {}
    pushes = {}
    served = []
    deadline = time.time() + spec.get("timeout", 60)
    while len(served) < len(reqs):
        if time.time() > deadline:
            raise RuntimeError(f"served {len(served)} of {len(reqs)} rooms before the deadline")
        if not pull.poll(100):
            continue
        msg = pull.recv_multipart()
        if msg[0] == b"ABORT":
            log("ABORT", msg[1:])
            continue
        guard = NIXL_GUARD if variant == "nixl" else MORI_GUARD
        assert msg[0] == guard, msg[0]
        p = msg[1:]
        if p[0] == b"None":
            peers.update(register_peer(variant, agent, pool, p))
            continue
        # TransferInfo.from_zmq (both variants put room, ip, port, name first)
        room, ip, dport, name = int(p[0]), p[1].decode(), int(p[2]), p[3].decode()
        dst_pages = np.frombuffer(p[4], dtype=np.int32).tolist()
        dst_aux = int(p[5]) if p[5] else -1
        req = reqs[room]
        peer = peers[name]
        src_pages = req["pages"]
        assert len(dst_pages) == len(src_pages), (dst_pages, src_pages)
        endpoint = f"tcp://{ip}:{dport}"
        if endpoint not in pushes:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            pushes[endpoint] = s
        # KV: every region's pages (send_kvcache), one transfer.
        pairs = [(pool.kv_regions[i], peer["kv"][i]) for i in range(pool.regions)]
        entries = [(i, sp * pool.item, dp * pool.item, pool.item)
                   for i in range(pool.regions) for sp, dp in zip(src_pages, dst_pages)]
        aux_off = req["aux"] * pool.aux_item
        if variant == "nixl":
            agent.write(pairs, entries, notif=f"{room}_kv_0_1_0".encode())
            # send_aux: the prefill aux item to the decode slot
            agent.write([(pool.aux_region, peer["aux"])], [(0, aux_off, dst_aux * pool.aux_item, pool.aux_item)],
                        notif=f"{room}_aux".encode())
        else:
            agent.write(pairs, entries)
            # send_aux_tcp, then notify_decode_status
            data = pool.aux[aux_off:aux_off + pool.aux_item].tobytes()
            pushes[endpoint].send_multipart([AUX_DATA_HEADER, str(room).encode(), b"0", str(dst_aux).encode(),
                                             struct.pack(">I", len(data)), data])
            pushes[endpoint].send_multipart([MORI_GUARD, str(room).encode(), str(KV_SUCCESS).encode(), b"0", b""])
        served.append(room)
    time.sleep(0.2)  # let the last messages leave
    agent.close()
    return {"served": served}


def register_peer(variant, agent, pool, p):
    """KVArgsRegisterInfo.from_zmq, then _add_remote_peer."""
    if variant == "nixl":
        name, md = p[3].decode(), p[4]
        kv_ptrs = list(struct.unpack(f"{len(p[5]) // 8}Q", p[5]))
        aux_ptrs = list(struct.unpack(f"{len(p[6]) // 8}Q", p[6]))
        item_len = int(p[11])
        num_slots = int(p[16]) if len(p) > 16 and p[16] else pool.pages
        kinds = p[17].decode().split(",") if len(p) > 17 and p[17] else ["VRAM"] * len(kv_ptrs)
        item_lens = list(struct.unpack(f"{len(p[18]) // 8}Q", p[18])) if len(p) > 18 and p[18] else [item_len] * len(kv_ptrs)
        assert agent.load_remote(md) == name
        kv = [agent.import_range(name, ptr, il * num_slots,
                                 kvfake.KVP_MEM_VRAM if k == "VRAM" else kvfake.KVP_MEM_DRAM)
              for ptr, il, k in zip(kv_ptrs, item_lens, kinds)]
        # SGLang's layout carries no aux lengths; kvhost appends them after
        # frame 18 ("kvhost.lens.v1", lengths); SGLang ignores those frames.
        aux_len = pool.aux_len
        if len(p) > 21 and p[19] == b"kvhost.lens.v1":
            aux_len = struct.unpack("Q", p[20][:8])[0]
        aux = agent.import_range(name, aux_ptrs[0], aux_len, kvfake.KVP_MEM_DRAM)
    else:
        desc = msgpack.unpackb(p[3], raw=False)
        name = desc[0]
        md = desc[3] if len(desc) == 5 and desc[2] == "kvhost-wrapped" else p[3]
        assert agent.load_remote(md) == name
        kv = [agent.import_blob(name, b)[0] for b in msgpack.unpackb(p[4], raw=False)]
        aux = agent.import_blob(name, msgpack.unpackb(p[5], raw=False)[0])[0]
    log("registered decode peer", name, "with", len(kv), "KV regions")
    return {name: {"kv": kv, "aux": aux}}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = run_decode(spec) if spec["role"] == "decode" else run_prefill(spec)
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
