"""A vLLM engine that is not kvhost: its NIXL connector's workers, written
from vLLM's connector (the generations and sources of vllm_peer.wire),
moving real KV bytes through ``nixl._api`` (NIXL's, or the stand-in
vllm_peer.fake_nixl over kvhost's fake plugin).

What each step does and where vLLM does it (0.13's nixl_connector.py,
the reference; the later package's files where they differ, wire.py):

- register_kv_caches: a NIXL agent per TP worker, its KV caches
  registered in DRAM (MHA: K and V of each layer, one region each; MLA:
  one per layer), the local descriptor list prepared block by block
  (register_local_xfer_handler), NixlAgentMetadata built with the agent's
  metadata and wrapped in NixlHandshakePayload with the compatibility hash.
- as PREFILL: the side channel (_nixl_handshake_listener) answers every
  rank's payload; request_finished holds the request's blocks and returns
  its kv_transfer_params; get_finished (_get_new_notifs) counts READ
  notifications per request and frees after as many as the generation
  says, extends leases on "HB:" (generations with leases), and frees
  expired holds (abort timeout or lease) as timed out.
- as DECODE: _nixl_handshake with the remote rank this worker reads
  (tp_rank // tp_ratio), the hash checked before the metadata is decoded,
  add_remote_agent and one remote descriptor per block of every region
  (the worker's head slice when decode TP > prefill TP, MHA; MLA's latent
  is whole on every rank); _read_blocks: a full prefix hit only notifies,
  a partial one reads the last blocks, else one make_prepped_xfer READ
  over region-major descriptor ids (_get_block_descs_ids) with the
  notification, started by transfer() and polled by check_xfer_state
  (_pop_done_transfers); heartbeats to every agent of the prefill engine
  while requests wait (_send_heartbeats).

Each worker's KV is private memory of this process, filled and checked
with kvhost.demo_pattern, so every byte moved is verified where it lands.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

from kvhost import demo_pattern as pat
from kvhost import vllm_standins as vs
from kvhost.vllm import generations, settings

from vllm_engine import check_pool

from .wire import DEFAULTED, GET_META_MSG, HEARTBEAT_PREFIX, wire

MEM = "DRAM"


def _layer_name(layer: int) -> str:
    """vLLM's kv_caches key of a layer (region_names' entries)."""
    return "model.layers.%d.self_attn.attn" % layer


def _check_regions(md: dict, mem: str):
    """What a one-group vLLM decode of version 11 or later requires of a
    prefill's per-region fields: each list None or one entry per region,
    every region of num_blocks blocks, of group 0 and of this worker's
    memory type, one layer each."""
    n = len(md["kv_caches_base_addr"])
    for f in ("region_num_blocks", "region_group_ids", "region_names", "region_mem_types"):
        v = md.get(f)
        if v is not None and len(v) != n:
            raise HandshakeError("%s has %d entries for %d regions" % (f, len(v), n))
    if any(b != md["num_blocks"] for b in md.get("region_num_blocks") or ()):
        raise HandshakeError("region_num_blocks %s, num_blocks %d" % (md["region_num_blocks"], md["num_blocks"]))
    if any(g != 0 for g in md.get("region_group_ids") or ()):
        raise HandshakeError("region_group_ids %s: one KV cache group" % md["region_group_ids"])
    if any(t != mem for t in md.get("region_mem_types") or ()):
        raise HandshakeError("region_mem_types %s, this worker's %s" % (md["region_mem_types"], mem))
    if any(len(m) > 1 for m in md.get("region_members") or ()):
        raise HandshakeError("region_members %s: one layer per region" % md["region_members"])


class HandshakeError(RuntimeError):
    pass


def compat_config(engine_id, gen, tp, shape, mla, vllm_version):
    """The vLLM config whose factors the peer hashes: the config the
    kvhost engine of the pair is made with (tests/vllm_engine.py), as two
    vLLM engines of one deployment share their model and version."""
    cfg = vs.make_config(engine_id, "kv_both", "ipc:///nonexistent", tp_size=tp, layers=shape.layers,
                         kv_heads=shape.kv_heads, head_size=shape.head_bytes // 2, block_size=shape.page_size,
                         extra={"kvhost_nixl_connector_version": gen}, vllm_version=vllm_version)
    cfg.model_config.use_mla = mla
    return cfg


def lease_times(lease):
    """(heartbeat interval, extension) of a lease, as vLLM computes them in
    whole seconds (lease // 6, lease * 2 // 3); a lease under 6 s gets a
    sub-second interval, as host/wire/vllm.LeaseTimes (vLLM's would be 0:
    a heartbeat every step)."""
    s = int(lease)
    interval = s // 6 or lease / 6
    extension = s * 2 // 3 or lease * 2 / 3
    return float(interval), float(extension)


@dataclass
class Remote:
    """A handshaken prefill rank, as one decode worker sees it."""

    agent_name: object
    dlist: object
    num_blocks: int
    metadata: dict
    clock_offset: float = 0.0


@dataclass
class Load:
    """A decode request on one worker."""

    local_blocks: list
    seed: int
    handles: list = field(default_factory=list)
    done: bool = False
    ok: bool = False
    bytes_read: int = 0


class Worker:
    """One TP worker of the peer engine: its NIXL agent and KV caches."""

    def __init__(self, eng, rank):
        self.eng, self.rank = eng, rank
        shape = eng.shape
        heads = 1 if eng.mla else shape.kv_heads // eng.tp
        self.heads = (0, 1) if eng.mla else shape.heads_of(rank, eng.tp)
        self.pool = np.zeros((shape.layers, 2, eng.num_blocks, heads, shape.page_size, shape.head_bytes), np.uint8)
        regions = [self.pool[i, 0] for i in range(shape.layers)] if eng.mla else [
            self.pool[i, kv] for i in range(shape.layers) for kv in (0, 1)]
        name = "%s-rank%d-%s" % (eng.engine_id, rank, uuid.uuid4().hex[:8])
        self.agent = eng.api.nixl_agent(name, eng.api.nixl_agent_config(backends=["UCX"]))
        # register_kv_caches: one region per cache tensor.
        caches_data = [(r.ctypes.data, r.nbytes, 0, "") for r in regions]
        self.reg_descs = self.agent.get_reg_descs(caches_data, MEM)
        self.agent.register_memory(self.reg_descs)
        self.base_addrs = [r.ctypes.data for r in regions]
        self.block_len = regions[0].nbytes // eng.num_blocks
        # register_local_xfer_handler: every block of every region.
        blocks_data = [(base + b * self.block_len, self.block_len, 0)
                       for base in self.base_addrs for b in range(eng.num_blocks)]
        self.src = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.agent.get_xfer_descs(blocks_data, MEM))
        self.payload = self._payload()
        # PREFILL state: request -> expiry (perf_counter), notifications.
        self.to_send: dict = {}
        self.notif_counts: dict = {}
        self.released: dict = {}  # request -> "notified" | "timeout"
        self.unrecognized: list = []
        # DECODE state.
        self.remotes: dict = {}  # (engine_id, remote rank) -> Remote
        self.loads: dict = {}

    def _payload(self) -> bytes:
        w, eng = self.eng.wire, self.eng
        values = {
            "engine_id": eng.engine_id,
            "agent_metadata": self.agent.get_agent_metadata(),
            "kv_caches_base_addr": self.base_addrs,
            "device_id": 0,
            "num_blocks": eng.num_blocks,
            "block_lens": [self.block_len] * len(self.base_addrs),
            "block_strides": [self.block_len] * len(self.base_addrs),  # back to back: cache.stride(0)
            "kv_cache_layout": "HND",
            "block_size": eng.shape.page_size,
            "ssm_sizes": [0, 0],
            "attn_backend_name": eng.attn_backend,
            "physical_blocks_per_logical_kv_block": 1,
            "dcp_size": 1,
            "pcp_size": 1,
            # Versions 11 and 12, as register_kv_caches fills them for one
            # KV cache group: per region its blocks, group 0, its layer
            # (K and V of a layer share one) and memory type; no members.
            "region_num_blocks": [eng.num_blocks] * len(self.base_addrs),
            "region_group_ids": [0] * len(self.base_addrs),
            "region_names": [_layer_name(i if eng.mla else i // 2) for i in range(len(self.base_addrs))],
            "region_mem_types": [MEM] * len(self.base_addrs),
            "region_members": [],
        }
        # msgspec encodes a Struct as a map in declaration order.
        md = msgpack.packb({k: values[k] for k in w.metadata_fields}, use_bin_type=True)
        return msgpack.packb({"compatibility_hash": eng.compat_hash, "agent_metadata_bytes": md}, use_bin_type=True)

    # -- PREFILL: get_finished --

    def poll_prefill(self, now):
        w = self.eng.wire
        for _sender, notifs in self.agent.get_new_notifs().items():
            for raw in notifs:
                msg = raw.decode()
                if w.leases and msg.startswith(HEARTBEAT_PREFIX):
                    _, ext = lease_times(self.eng.lease)
                    for rid in msg[len(HEARTBEAT_PREFIX):].split(","):
                        if rid in self.to_send:
                            self.to_send[rid] = now + ext
                            self.eng.heartbeats_seen += 1
                    continue
                rid, n = msg.rsplit(":", 1)
                if rid not in self.to_send:
                    self.unrecognized.append(msg)
                    continue
                self.notif_counts[rid] = self.notif_counts.get(rid, 0) + 1
                if self.notif_counts[rid] == w.consumers(int(n), self.eng.tp):
                    del self.notif_counts[rid]
                    del self.to_send[rid]
                    self.released[rid] = "notified"
        for rid, expiry in list(self.to_send.items()):
            if now >= expiry:
                del self.to_send[rid]
                self.notif_counts.pop(rid, None)
                self.released[rid] = "timeout"

    # -- DECODE --

    def handshake(self, engine_id, host, port, remote_tp):
        """_nixl_handshake with the remote rank this worker reads, then
        add_remote_agent. Returns the Remote."""
        eng, w = self.eng, self.eng.wire
        tp_ratio = max(eng.tp // remote_tp, 1)
        remote_rank = self.rank // tp_ratio
        key = (engine_id, remote_rank)
        if key in self.remotes:
            return self.remotes[key]
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        try:
            sock.connect("tcp://%s:%d" % (host, port))
            query = (GET_META_MSG, 0, remote_rank) if w.request_pp_rank else (GET_META_MSG, remote_rank)
            start = time.perf_counter()
            sock.send(msgpack.packb(query, use_bin_type=True))
            frames = sock.recv_multipart()
            got = time.perf_counter()
        finally:
            sock.close()
        if len(frames) != (2 if w.reply_clock else 1):
            raise HandshakeError("version %d reply of %d frames" % (w.version, len(frames)))
        offset = msgpack.unpackb(frames[1]) - (start + got) / 2 if w.reply_clock else 0.0
        payload = msgpack.unpackb(frames[0], raw=False)
        # The hash before the metadata (vLLM: enforce_handshake_compat).
        if payload.get("compatibility_hash") != eng.compat_hash:
            raise HandshakeError("NIXL compatibility hash mismatch: local %s, remote %s"
                                 % (eng.compat_hash, payload.get("compatibility_hash")))
        md = msgpack.unpackb(payload["agent_metadata_bytes"], raw=False)
        # msgspec's decoder: every field without a default, and, as
        # msgspec writes them, in declaration order.
        required = [f for f in w.metadata_fields if f not in DEFAULTED]
        missing = [f for f in required if f not in md]
        if missing:
            raise HandshakeError("NixlAgentMetadata of version %d without %s" % (w.version, missing))
        if [k for k in md if k in w.metadata_fields][: len(required)] != required:
            raise HandshakeError("NixlAgentMetadata fields out of declaration order: %s" % list(md))
        if md["engine_id"] != engine_id:
            raise HandshakeError("remote engine id %r, expected %r" % (md["engine_id"], engine_id))
        if md["block_size"] != eng.shape.page_size:
            raise HandshakeError("remote block size %d, this engine's %d" % (md["block_size"], eng.shape.page_size))
        _check_regions(md, MEM)
        name = self.agent.add_remote_agent(md["agent_metadata"])
        # add_remote_agent's descriptors: every block of every remote
        # region, this worker's heads of it (HND: a head slice of a block
        # is one byte range), MLA's whole latent.
        rank_offset = 0 if eng.mla else (self.rank % tp_ratio) * self.block_len
        blocks_data = []
        for base, rlen in zip(md["kv_caches_base_addr"], md["block_lens"]):
            if rlen != self.block_len * (1 if eng.mla else tp_ratio):
                raise HandshakeError("remote block_len %d for local %d at tp_ratio %d" % (rlen, self.block_len, tp_ratio))
            for b in range(md["num_blocks"]):
                blocks_data.append((base + b * rlen + rank_offset, self.block_len, md["device_id"]))
        dlist = self.agent.prep_xfer_dlist(name, self.agent.get_xfer_descs(blocks_data, MEM))
        r = Remote(name, dlist, md["num_blocks"], md, offset)
        self.remotes[key] = r
        return r

    def read(self, req_id, params, local_blocks, hit, seed):
        """_read_blocks: the request's blocks not in the local prefix hit."""
        eng, w = self.eng, self.eng.wire
        remote_tp = int(params.get("tp_size", 1))
        remote = self.handshake(params["remote_engine_id"], params["remote_host"], params["remote_port"], remote_tp)
        ids = params["remote_block_ids"]
        if w.grouped_block_ids:
            (ids,) = ids
        notif = ("%s:%d" % (params["remote_request_id"], w.notif_number(eng.tp, remote_tp))).encode()
        read_local = local_blocks[hit:]
        ld = Load(local_blocks, seed)
        self.loads[req_id] = ld
        if not read_local:  # full prefix hit: only tell the prefill
            self.agent.send_notif(remote.agent_name, notif)
            ld.done = ld.ok = True
            return
        remote_ids = ids[-len(read_local):] if len(read_local) < len(ids) else ids
        nreg = len(self.base_addrs)
        local_desc = [r * eng.num_blocks + b for r in range(nreg) for b in read_local]
        remote_desc = [r * remote.num_blocks + b for r in range(nreg) for b in remote_ids]
        handle = self.agent.make_prepped_xfer("READ", self.src, local_desc, remote.dlist, remote_desc, notif_msg=notif)
        self.agent.transfer(handle)
        ld.handles.append(handle)
        ld.bytes_read = len(local_desc) * self.block_len

    def poll_decode(self):
        """_pop_done_transfers."""
        for ld in self.loads.values():
            if ld.done:
                continue
            pending = []
            for h in ld.handles:
                state = self.agent.check_xfer_state(h)
                if state == "PROC":
                    pending.append(h)
                    continue
                self.agent.release_xfer_handle(h)
                if state != "DONE":
                    ld.done, ld.ok = True, False
            ld.handles = pending
            if not pending and not ld.done:
                ld.done = ld.ok = True

    def heartbeat(self, engine_id, remote_request_ids):
        """_send_heartbeats: one message to every agent of that engine."""
        msg = (HEARTBEAT_PREFIX + ",".join(remote_request_ids)).encode()
        for (eid, _), r in self.remotes.items():
            if eid == engine_id:
                self.agent.send_notif(r.agent_name, msg)

    def close(self):
        for ld in self.loads.values():
            for h in ld.handles:
                self.agent.release_xfer_handle(h)
        for r in self.remotes.values():
            self.agent.release_dlist_handle(r.dlist)
            self.agent.remove_remote_agent(r.agent_name)
        self.agent.release_dlist_handle(self.src)
        self.agent.deregister_memory(self.reg_descs)
        self.agent = None


class PeerEngine:
    """A vLLM engine with the NIXL connector of generation ``gen``: TP
    workers in this process, one NIXL agent each, its own block pool, the
    side channel when it prefills."""

    def __init__(self, api, engine_id, gen, tp, shape, num_blocks, vllm_version, mla=False, lease=30.0,
                 abort_timeout=480.0, host="127.0.0.1"):
        self.api, self.engine_id, self.tp, self.shape, self.mla = api, engine_id, tp, shape, mla
        self.num_blocks, self.lease, self.abort_timeout, self.host = num_blocks, float(lease), abort_timeout, host
        self.wire = wire(gen)
        cfg = compat_config(engine_id, gen, tp, shape, mla, vllm_version)
        self.attn_backend = settings.attn_backend_name(cfg)
        self.compat_hash = generations.compatibility_hash(settings.compat_factors(cfg, self.attn_backend))
        self.free = list(range(num_blocks - 1, -1, -1))
        self.workers = [Worker(self, r) for r in range(tp)]
        self.heartbeats_seen = 0
        self.heartbeats_sent = 0
        self.bytes_verified = 0
        self.port = None
        self._stop = threading.Event()
        self._listener = None
        self.listener_errors: list = []
        # PREFILL: request -> its blocks, freed once every worker released.
        self.held: dict = {}
        self.release_reasons: dict = {}
        # DECODE: request -> (params, local blocks), heartbeated while queued.
        self.queued: dict = {}
        self.loaded: dict = {}  # request -> bool (every byte right on every worker)
        self._next_heartbeat = 0.0

    # -- the side channel (prefill) --

    def listen(self):
        """_nixl_handshake_listener on a random loopback port."""
        ready = threading.Event()
        self._listener = threading.Thread(target=self._serve, args=(ready,), daemon=True, name="peer-listener")
        self._listener.start()
        if not ready.wait(10):
            raise RuntimeError("the peer's side channel did not start")
        return self.port

    def _serve(self, ready):
        payloads = {w.rank: w.payload for w in self.workers}
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 100)
        self.port = sock.bind_to_random_port("tcp://" + self.host)
        ready.set()
        try:
            while not self._stop.is_set():
                try:
                    identity, _, msg = sock.recv_multipart()
                except zmq.Again:
                    continue
                try:
                    query = msgpack.unpackb(msg, raw=False)
                    if self.wire.request_pp_rank:
                        tag, _pp_rank, rank = query
                    else:
                        tag, rank = query
                except (ValueError, TypeError) as e:
                    # vLLM's listener dies here; the peer records it.
                    self.listener_errors.append("%r: %s" % (msg, e))
                    continue
                if tag != GET_META_MSG or rank not in payloads:
                    self.listener_errors.append("unexpected %r" % (query,))
                    continue
                frames = [identity, b"", payloads[rank]]
                if self.wire.reply_clock:
                    frames.append(msgpack.packb(time.perf_counter()))
                sock.send_multipart(frames)
        finally:
            sock.close()

    # -- PREFILL --

    def prefill(self, req_id, ntok, seed):
        """The prefill's forward (the request's KV written into its
        blocks on every worker), then request_finished: the blocks held,
        kv_transfer_params returned in the generation's shape."""
        pages = self.shape.pages(ntok)
        if pages > len(self.free):
            raise RuntimeError("peer out of blocks")
        blocks = [self.free.pop() for _ in range(pages)]
        for w in self.workers:
            pat.fill(w.pool, blocks, seed, self.shape, *w.heads)
        now = time.perf_counter()
        hold = self.lease if self.wire.leases else self.abort_timeout
        for w in self.workers:
            w.to_send[req_id] = now + hold
        self.held[req_id] = blocks
        values = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(blocks)] if self.wire.grouped_block_ids else list(blocks),
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp,
            "remote_num_tokens": ntok,
            "remote_blocks_expiry_time": None,
            "dcp_size": 1,
            "pp_size": 1,
            "transfer_mode": "pull",
        }
        return {k: values[k] for k in self.wire.params_fields}

    # -- DECODE --

    def queue(self, req_id, params, heartbeat=True):
        """A decode request waiting in the scheduler's queue: its prefill
        is handshaken (so heartbeats reach it) and, with ``heartbeat``,
        renewed until load() (vLLM's heartbeats from the request's
        arrival); without, its lease lapses as if heartbeats were lost."""
        self.queued[req_id] = (params, heartbeat)
        for w in self.workers:
            w.handshake(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                        int(params.get("tp_size", 1)))

    def abort(self, req_id):
        """The queued request is dropped without being read."""
        self.queued.pop(req_id, None)

    def load(self, req_id, params, seed, hit=0):
        """The scheduler allocated the request's blocks: the first ``hit``
        a local prefix-cache hit (holding the request's KV already), the
        rest read from the prefill."""
        self.queued.pop(req_id, None)
        ids = params["remote_block_ids"]
        n = len(ids[0] if self.wire.grouped_block_ids else ids)
        blocks = [self.free.pop() for _ in range(n)]
        try:
            for w in self.workers:
                if hit:  # the request's first pages (the pattern depends on its length)
                    w.pool[:, :, blocks[:hit]] = pat.expected(seed, self.shape, n, *w.heads)[:, :, :hit]
                w.read(req_id, params, blocks, hit, seed)
        except Exception:
            # A failed handshake or read set-up: vLLM recomputes; the
            # blocks go back (a read already started on another worker
            # is released with its handle).
            for w in self.workers:
                ld = w.loads.pop(req_id, None)
                for h in ld.handles if ld else ():
                    w.agent.release_xfer_handle(h)
            self.free.extend(blocks)
            raise

    def _heartbeat(self, now):
        if not self.wire.leases or not self.queued or now < self._next_heartbeat:
            return
        interval, _ = lease_times(self.lease)
        self._next_heartbeat = now + interval
        by_engine: dict = {}
        for params, beat in self.queued.values():
            if not beat:
                continue
            by_engine.setdefault(params["remote_engine_id"], []).append(params["remote_request_id"])
        for eid, ids in by_engine.items():
            for w in self.workers:
                w.heartbeat(eid, ids)
            self.heartbeats_sent += 1

    # -- one step (the model runner's get_finished, the executor's aggregation) --

    def step(self):
        now = time.perf_counter()
        self._heartbeat(now)
        for w in self.workers:
            w.poll_prefill(now)
            w.poll_decode()
        for rid in list(self.held):
            reasons = [w.released.get(rid) for w in self.workers]
            if all(reasons):
                self.free.extend(self.held.pop(rid))
                self.release_reasons[rid] = reasons[0] if len(set(reasons)) == 1 else reasons
        for rid in {r for w in self.workers for r in w.loads} - set(self.loaded):
            lds = [w.loads[rid] for w in self.workers]
            if not all(ld.done for ld in lds):
                continue
            ok = all(ld.ok for ld in lds)
            if ok:
                for w, ld in zip(self.workers, lds):
                    why = check_pool(w.pool, ld.local_blocks, ld.seed, self.shape, *w.heads, self.mla)
                    if why is not None:
                        raise AssertionError("peer %s rank %d, request %s: %s" % (self.engine_id, w.rank, rid, why))
                    self.bytes_verified += len(ld.local_blocks) * w.block_len * len(w.base_addrs)
            self.loaded[rid] = ok
            self.free.extend(lds[0].local_blocks)

    def bytes_read(self, req_id):
        return [w.loads[req_id].bytes_read for w in self.workers]

    def idle(self):
        return not self.held and not self.queued and all(r in self.loaded for w in self.workers for r in w.loads)

    def close(self):
        self._stop.set()
        if self._listener is not None:
            self._listener.join(5)
        for w in self.workers:
            w.close()
