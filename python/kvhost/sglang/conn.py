"""SGLang's KV connector classes, backed by ``kvhost serve``.

KVManager, KVSender, KVReceiver and KVBootstrapServer subclass SGLang's
BaseKVManager, BaseKVSender, BaseKVReceiver and BaseKVBootstrapServer
(python/sglang/srt/disaggregation/base/conn.py; :mod:`kvhost.sglang.base`
has stand-ins when SGLang is not installed) and have every method and
attribute SGLang's schedulers use on a connector, so SGLang drives them as
it drives NixlKVSender and friends; the transfer itself runs in the
sidecar, which speaks SGLang's NIXL or MORI wire to the peers
(``variant``).

What SGLang's scheduler does, and what each call becomes here (the
replay tests, python/tests/test_sglang_scheduler.py, follow the upstream
functions step by step):

prefill (python/sglang/srt/disaggregation/prefill.py)
  ``PrefillBootstrapQueue.add``: ``KVSender(mgr=, bootstrap_addr=,
  bootstrap_room=, dest_tp_ranks=, pp_rank=)`` → ``sender_create``.
  ``pop_bootstrapped`` / ``finalize_bootstrap``: ``poll()`` until
  WaitingForInput (a room event, no round trip), then
  ``pop_decode_prefix_len()`` → ``sender_prefix_len`` (the tokens decode
  already holds) and ``init(num_pages, aux_index)`` → ``sender_init``.
  ``send_kv_chunk``: ``should_send_kv_chunk(num_pages, last_chunk)`` (a
  zero-page last chunk is sent: it carries aux and state), then
  ``send(page_indices, state_indices[, num_kv_tokens])`` → ``sender_send``
  without waiting for the reply (SGLang's connectors queue the chunk to a
  transfer thread; a refusal fails the room, seen by the next ``poll()``).
  ``process_disagg_prefill_inflight_queue``: ``poll()`` until Success or
  Failed; ``clear()`` → ``close_room``; ``get_transfer_metric()``;
  ``failure_exception()`` raises the reason.
decode (python/sglang/srt/disaggregation/decode.py)
  ``DecodePreallocQueue.add``: ``KVReceiver(mgr=, bootstrap_addr=,
  bootstrap_room=)``; ``kv_manager.prefill_info_table`` and
  ``try_ensure_parallel_info(addr)`` (the prefill's parallel info, from
  its bootstrap server) resolve the prefill DP rank; ``init(dp_rank)`` →
  ``receiver_create`` (the sidecar bootstraps). ``pop_preallocated``:
  ``poll()`` until WaitingForInput, then ``send_metadata(page_indices,
  aux_index, state_indices, decode_prefix_len=)`` → ``receiver_init``.
  ``DecodeTransferQueue.pop_transferred``: ``poll()`` until Success,
  ``clear()``. Older SGLang releases call ``init(kv_indices, aux_index)``
  instead of ``send_metadata`` (and pass the prefill DP rank to the
  constructor): both forms are accepted.

Nothing here waits for the sidecar on the scheduler's thread: every room
request (``sender_create``, ``sender_init``, ``sender_send``,
``receiver_create``, ``receiver_init``, ``abort``, ``close_room``) is
sent with the client's pipelined forms (``*_nowait``) and returns at once,
as SGLang's NIXL and MORI connectors only enqueue work for background
threads; the sidecar handles one connection's requests in order, so none
needs an answer before the next, and a refusal fails the room in the
client's state cache with the sidecar's code and message, which the next
``poll()`` and ``failure_exception()`` report. ``sender_prefix_len``
needs its answer: the client's I/O thread asks it the moment the room's
WaitingForInput event arrives (before the scheduler can see that state),
so ``pop_decode_prefix_len`` finds it answered.

Hybrid models: ``kv_args.state_types`` lists the state components (mamba,
swa, dsa, minimax_index_k, swa_ring, c128_state), ``state_data_ptrs[i]``
... their tensors, and ``state_indices`` one entry per component; they go
to the sidecar in that shape (older SGLang's single ``state_type`` with
flat lists is one component).

``poll()`` never makes a round trip: the client's state cache, fed by the
sidecar's room events, answers. A sidecar that goes away fails every room in
flight with "sidecar connection lost" (the next ``poll()`` returns Failed,
``failure_exception()`` says so).

Memory: every pointer in KVArgs (kv, aux, state) must lie in memory the
sidecar can map: host memory allocated with :mod:`kvhost.shm` (found by
address), or CUDA memory (shared by CUDA IPC handle, taken through
libcudart when torch and CUDA are present).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvhost import client as _client
from kvhost import shm as _shm
from kvhost.sglang.base import (  # noqa: F401  (re-exported)
    HAVE_SGLANG,
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    DisaggregationMode,
    KVArgs,
    KVPoll,
    KVTransferError,
    KVTransferMetric,
    StateType,
)

logger = logging.getLogger("kvhost.sglang")


def _poll_member(state: int):
    try:
        return KVPoll(state)  # type: ignore[call-arg]
    except TypeError:
        return state


# poll() runs for every request on every scheduler step: its states are
# looked up, not converted.
_POLL_STATES = {st: _poll_member(st) for st in range(5)}


def _poll(state: int):
    """A state as the KVPoll SGLang compares with (an IntEnum member in
    SGLang, plain ints in the stand-in)."""
    v = _POLL_STATES.get(state)
    return _poll_member(state) if v is None else v


# --------------------------------------------------------------------------
# Settings (server_args attributes the launcher adds, else environment)


def _setting(server_args: Any, attr: str, env: str, default: Any = None) -> Any:
    v = getattr(server_args, attr, None)
    if v not in (None, ""):
        return v
    v = os.environ.get(env)
    return v if v not in (None, "") else default


def local_ip() -> str:
    """The IP address this host's ranks advertise: ``$KVHOST_HOST``, else
    the address of the interface of the default route, else 127.0.0.1
    (SGLang's get_local_ip_auto does the same search)."""
    env = os.environ.get("KVHOST_HOST")
    if env:
        return env
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


# --------------------------------------------------------------------------
# Memory: which regions hold the engine's pointers


def _cuda_region(ptr: int, length: int) -> Optional[dict]:
    """The vram region of a CUDA device pointer, or None when ``ptr`` is not
    device memory or CUDA is not there. Imported lazily: kvhost.cuda."""
    from kvhost import cuda

    return cuda.region_of(ptr, length)


def regions_for_pointers(ranges: Sequence[Tuple[int, int]]) -> List[dict]:
    """``register_memory`` regions covering every (ptr, length): whole
    kvhost.shm pools for host memory (one region per pool, so buffers that
    share a pool do not overlap), one region per CUDA allocation for device
    memory. ValueError names a range that is neither."""
    host: Dict[int, dict] = {}
    dev: Dict[Tuple[bytes, int], dict] = {}
    for ptr, length in ranges:
        if length <= 0:
            continue
        pool = _shm.find_pool(ptr, length)
        if pool is not None:
            host[pool.addr] = pool.region()
            continue
        r = _cuda_region(ptr, length)
        if r is None:
            raise ValueError("memory [%#x, +%d) is neither in a kvhost.shm pool nor CUDA device memory: "
                             "the sidecar cannot reach it" % (ptr, length))
        key = (r["cuda_ipc"], r["device"])
        old = dev.get(key)
        if old is None:
            dev[key] = r
        else:  # one region per allocation, covering every range in it
            lo = min(old["addr"], r["addr"])
            hi = max(old["addr"] + old["length"], r["addr"] + r["length"])
            old["offset"] -= old["addr"] - lo
            old["addr"], old["length"] = lo, hi - lo
    return list(host.values()) + list(dev.values())


# --------------------------------------------------------------------------
# KVManager


def _ints(xs: Any) -> List[int]:
    return [int(x) for x in (xs or [])]


def _type_name(t: Any) -> str:
    return str(getattr(t, "value", t)).lower()


def state_components(a: Any) -> List[Tuple[str, List[int], List[int], List[int], List[int]]]:
    """KVArgs' hybrid state as (type, ptrs, lens, item lens, dims) per
    component: SGLang's ``state_types`` with one list per type in
    ``state_data_ptrs`` etc., or older SGLang's single ``state_type`` with
    flat lists (one component). ValueError names a field of the wrong
    shape."""
    types = list(getattr(a, "state_types", None) or [])
    if types:
        out = []
        for i, t in enumerate(types):
            comp = []
            for field in ("state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor"):
                lists = list(getattr(a, field, None) or [])
                if i >= len(lists):
                    if field == "state_dim_per_tensor":
                        comp.append([])
                        continue
                    raise ValueError("kv_args.%s has %d entries for %d state types" % (field, len(lists), len(types)))
                x = lists[i]
                if x is not None and not isinstance(x, (list, tuple)) and not hasattr(x, "tolist"):
                    raise ValueError("kv_args.%s[%d] is %r: SGLang gives one list per state type" % (field, i, x))
                comp.append(_ints(x.tolist() if hasattr(x, "tolist") else x))
            out.append((_type_name(t),) + tuple(comp))
        return out
    st = getattr(a, "state_type", None)
    if st is None or _type_name(st) == "none" or not getattr(a, "state_data_ptrs", None):
        return []
    return [(_type_name(st), _ints(a.state_data_ptrs), _ints(a.state_data_lens), _ints(a.state_item_lens),
             _ints(getattr(a, "state_dim_per_tensor", None)))]


class PrefillServerInfo:
    """A prefill server's parallel info as its bootstrap server answers
    ``GET /route`` with every rank -1 (SGLang's PrefillServerInfo,
    python/sglang/srt/disaggregation/common/conn.py): every field of the
    answer as an attribute; the decode scheduler reads ``dp_size`` and
    ``follow_bootstrap_room``."""

    def __init__(self, fields: Dict[str, Any]):
        self.follow_bootstrap_room = True
        self.dp_size = 1
        self.__dict__.update(fields)
        self.dp_size = int(self.dp_size)
        self.follow_bootstrap_room = bool(self.follow_bootstrap_room)

    def __repr__(self) -> str:
        return "PrefillServerInfo(%r)" % self.__dict__


# A bootstrap server's parallel info is a few hundred bytes of JSON.
_MAX_INFO_BYTES = 64 << 10
# SGLang's own try_ensure_parallel_info waits 5 s for the answer.
_INFO_TIMEOUT = 5.0


def _mode(m: Any) -> str:
    v = getattr(m, "value", m)
    v = str(v).lower()
    if v not in ("prefill", "decode"):
        raise ValueError("unsupported disaggregation mode %r" % (m,))
    return v


class KVManager(BaseKVManager):
    """One engine rank: SGLang's KVManager (BaseKVManager's constructor).

    Opens a connection to the sidecar (endpoint: ``server_args.kvhost_control``,
    ``$KVHOST_CONTROL``, or the default), registers the memory behind
    ``args``' pointers and opens an SGLang rank with KVArgs' geometry and
    the server's parallel layout.
    """

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.role = _mode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.bootstrap_host = _bootstrap_host(server_args)
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998) or 8998)
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        dp_size = int(getattr(server_args, "dp_size", 1) or 1)
        dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
        self.attn_tp_size = int(getattr(args, "attn_tp_size", 0) or (tp_size // dp_size if dp_attention else tp_size))
        self.attn_dp_size = dp_size if dp_attention else 1
        self.attn_tp_rank = int(args.engine_rank) % self.attn_tp_size
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        # Attributes SGLang's scheduler and utils read on a manager
        # (disaggregation/utils.py filter_kv_indices_for_cp_rank; the
        # staging checks of decode.py). Context parallelism and staging
        # buffers are not part of protocol 1.0.
        self.attn_cp_size = 1
        self.attn_cp_rank = 0
        self.enable_staging = False
        # prefill.py process_disagg_prefill_inflight_queue skips metrics of
        # a dummy CP rank; kvhost has no CP, so none is.
        self.is_dummy_cp_rank = False
        # decode.py DecodePreallocQueue: the prefill servers' parallel info
        # by bootstrap address (try_ensure_parallel_info fills it).
        self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
        self.state_types = [c[0] for c in state_components(args)]
        self.local_ip = _setting(server_args, "kvhost_host", "KVHOST_HOST") or local_ip()
        self.variant = _setting(server_args, "kvhost_variant", "KVHOST_SGLANG_VARIANT", "nixl")
        endpoint = _setting(server_args, "kvhost_control", "KVHOST_CONTROL")
        self.reconnect_interval = float(_setting(server_args, "kvhost_reconnect_interval",
                                                 "KVHOST_RECONNECT_INTERVAL", 1.0))
        self.client = _client.Client(endpoint, queue_events=False)
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._open()
        except BaseException:
            self.client.close()  # the sidecar releases what was registered
            raise
        self._reconnector = _Reconnector(self.client, self._reopen, self.reconnect_interval, "rank")
        # decode_prefix_len asked ahead (see _on_room_event): rooms whose
        # sender wants it, and the answers under way, by room.
        self._prefix_lock = threading.Lock()
        self._prefix_wanted: Dict[int, int] = {}
        self._prefix_asked: Dict[int, Any] = {}
        if self.role == "prefill":
            self.client.add_listener(self._on_room_event)

    def _on_room_event(self, ev: dict) -> None:
        """On the client's I/O thread: a prefill room that reached
        WaitingForInput gets its ``sender_prefix_len`` asked at once, so
        the answer is here when the scheduler pops it (SGLang's
        pop_bootstrapped calls pop_decode_prefix_len right after the poll
        that saw WaitingForInput; a round trip there would hold the
        scheduler)."""
        if ev.get("event") != "room" or ev.get("state") != KVPoll.WaitingForInput:
            return
        room = ev.get("room")
        with self._prefix_lock:
            rank = self._prefix_wanted.pop(room, None)
            if rank is None or rank != ev.get("rank"):
                return
            try:
                self._prefix_asked[room] = self.client.sender_prefix_len_async(rank, room)
            except _client.KVHostError:
                pass  # lost or closing: pop_decode_prefix_len asks (and fails) itself

    def _want_prefix_len(self, rank: int, room: int) -> None:
        if self.role == "prefill":
            with self._prefix_lock:
                self._prefix_wanted[room] = rank

    def _prefix_len(self, rank: int, room: int) -> int:
        """decode_prefix_len of the room: the answer asked ahead, else a
        round trip. Raises the sidecar's refusal."""
        with self._prefix_lock:
            self._prefix_wanted.pop(room, None)
            f = self._prefix_asked.pop(room, None)
        if f is None:
            return self.client.sender_prefix_len(rank, room)
        return f.result(self.client.timeout)

    def _drop_prefix(self, room: int) -> None:
        with self._prefix_lock:
            self._prefix_wanted.pop(room, None)
            self._prefix_asked.pop(room, None)

    def _ranges(self) -> List[Tuple[int, int]]:
        a = self.kv_args
        out = list(zip(_ints(a.kv_data_ptrs), _ints(a.kv_data_lens)))
        out += list(zip(_ints(getattr(a, "aux_data_ptrs", [])), _ints(getattr(a, "aux_data_lens", []))))
        for _, ptrs, lens, _, _ in state_components(a):
            out += list(zip(ptrs, lens))
        return out

    def register_to_bootstrap(self) -> None:
        """BaseKVManager's hook: the sidecar registers the prefill rank
        with its bootstrap server when the rank opens (open_rank)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt to fetch and cache the prefill server's parallel
        info from its bootstrap server (SGLang's
        CommonKVManager.try_ensure_parallel_info): True when it is in
        ``prefill_info_table``. Bounded: the answer's size and the wait
        (5 s, as SGLang's)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = "http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1" % (
            bootstrap_addr,)
        try:
            # No proxy: the bootstrap server is a peer on the cluster network.
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url, timeout=_INFO_TIMEOUT) as resp:
                body = resp.read(_MAX_INFO_BYTES + 1)
            if len(body) > _MAX_INFO_BYTES:
                raise ValueError("answer over %d bytes" % _MAX_INFO_BYTES)
            fields = json.loads(body)
            if not isinstance(fields, dict):
                raise ValueError("answer is not a JSON object")
            info = PrefillServerInfo(fields)
        except Exception as e:  # not reachable yet, not all ranks registered (503), or nonsense
            logger.warning("kvhost: prefill parallel info from %s: %s", bootstrap_addr, e)
            return False
        page_size = self.rank_fields()["page_size"]
        dtype = str(getattr(self.server_args, "kv_cache_dtype", "auto") or "auto")
        for name, mine in (("page_size", page_size), ("kv_cache_dtype", dtype)):
            theirs = getattr(info, name, None)
            if theirs is not None and str(theirs) != str(mine):
                logger.error("kvhost: prefill %s has %s %s, this decode rank %s", bootstrap_addr, name, theirs, mine)
                return False
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def rank_fields(self) -> Dict[str, Any]:
        """open_rank's SGLang fields (docs/engine-api.md, "Ranks")."""
        a = self.kv_args
        f: Dict[str, Any] = {
            "kv_data_ptrs": _ints(a.kv_data_ptrs),
            "kv_data_lens": _ints(a.kv_data_lens),
            "kv_item_lens": _ints(a.kv_item_lens),
            "aux_data_ptrs": _ints(getattr(a, "aux_data_ptrs", [])),
            "aux_data_lens": _ints(getattr(a, "aux_data_lens", [])),
            "aux_item_lens": _ints(getattr(a, "aux_item_lens", [])),
            "page_size": int(getattr(a, "page_size", 0) or getattr(self.server_args, "page_size", 1) or 1),
            "kv_head_num": int(getattr(a, "kv_head_num", 0) or 0),
            "total_kv_head_num": int(getattr(a, "total_kv_head_num", 0) or 0),
            "prefill_start_layer": int(getattr(a, "prefill_start_layer", 0) or 0),
            "gpu_id": int(getattr(a, "gpu_id", 0) or 0),
            "tp_size": self.attn_tp_size,
            "tp_rank": self.attn_tp_rank,
            "pp_size": self.pp_size,
            "pp_rank": int(getattr(a, "pp_rank", 0) or 0),
            "dp_size": self.attn_dp_size,
            "dp_rank": self.system_dp_rank,
            "is_mla": self.is_mla_backend,
            "kv_cache_dtype": str(getattr(self.server_args, "kv_cache_dtype", "auto") or "auto"),
            "variant": self.variant,
            "host": self.local_ip,
        }
        comps = state_components(a)
        if comps:
            f.update(state_types=[c[0] for c in comps],
                     state_data_ptrs=[c[1] for c in comps],
                     state_data_lens=[c[2] for c in comps],
                     state_item_lens=[c[3] for c in comps],
                     state_dim_per_tensor=[c[4] for c in comps])
        if self.role == "prefill":
            f["bootstrap_addr"] = "%s:%d" % (self.bootstrap_host, self.bootstrap_port)
        return f

    def _open(self) -> None:
        self.regions = regions_for_pointers(self._ranges())
        self.region_ids = self.client.register_memory(self.regions) if self.regions else []
        reply = self.client.open_rank("sglang", self.role, **self.rank_fields())
        self.rank = int(reply["rank"])
        self.agent_name = str(reply.get("agent", ""))
        self.endpoint = str(reply.get("endpoint", ""))
        self.generation = self.client.generation
        # What new rooms use, published in one assignment once the rank is
        # open: a room made while a reconnect is under way sees the old
        # generation, counts as stale and fails at once (no request with a
        # rank id of another connection).
        self.conn = (self.rank, self.generation)

    def reconnect(self, connect_timeout: Optional[float] = None) -> bool:
        """Connects again, registers the memory and opens the rank again
        (rooms of the old connection stay Failed). Returns True when the
        sidecar is a new process. The manager does this by itself after it
        lost the sidecar, every ``reconnect_interval`` seconds
        (``server_args.kvhost_reconnect_interval`` or
        ``$KVHOST_RECONNECT_INTERVAL``, default 1; 0: never) until it
        succeeds: SGLang never calls this."""
        with self._lock:
            restarted = self.client.reconnect(connect_timeout)
            self._open()
            return restarted

    def _reopen(self, connect_timeout: float) -> None:
        with self._lock:
            if self._closed or self.client.lost is None:
                return  # closed, or someone reconnected already
            self.client.reconnect(connect_timeout)
            self._open()

    def check_status(self, bootstrap_room: int) -> int:
        """The room's KVPoll state from the client's cache (no round trip)."""
        st = self.client.state(self.rank, bootstrap_room)
        return KVPoll.Failed if st is None else st

    def failure_reason(self, bootstrap_room: int) -> Optional[str]:
        return self.client.failure_reason(self.rank, bootstrap_room)

    def close(self) -> None:
        """Closes the rank's connection (the sidecar fails its rooms and
        releases its mappings)."""
        with self._lock:
            self._closed = True
        self._reconnector.stop()
        self.client.close()


class _Reconnector:
    """Reconnects a client after it lost the sidecar: on the client's
    ``connection_lost`` event, a thread calls ``reopen(connect_timeout)``
    every ``interval`` seconds until it succeeds (or :meth:`stop`). New
    rooms fail fast (ConnectionLost) meanwhile; none waits for it."""

    def __init__(self, client: _client.Client, reopen, interval: float, what: str):
        self.client, self.reopen, self.interval, self.what = client, reopen, interval, what
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mu = threading.Lock()
        if interval > 0:
            client.add_listener(self._on_event)

    def _on_event(self, ev: dict) -> None:
        if ev.get("event") != "connection_lost" or self._stop.is_set():
            return
        with self._mu:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="kvhost-reconnect", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self.reopen(max(1.0, min(5.0, 2 * self.interval)))
                logger.info("kvhost: %s reconnected to the sidecar (session %s)", self.what, self.client.session)
                return
            except Exception as e:  # the sidecar is still down, or refuses: try again
                if failures % 30 == 0:
                    logger.warning("kvhost: %s cannot reconnect to the sidecar yet: %s", self.what, e)
                failures += 1

    def stop(self) -> None:
        self._stop.set()
        with self._mu:
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(10)


def _bootstrap_host(server_args: Any) -> str:
    h = _setting(server_args, "kvhost_bootstrap_host", "KVHOST_BOOTSTRAP_HOST") or getattr(server_args, "host", None)
    if not h or h in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return str(h)


# --------------------------------------------------------------------------
# Rooms


class _Room:
    """What KVSender and KVReceiver share: the room's rank, the connection
    generation it was made in, and the concluded state."""

    kv_mgr: KVManager
    bootstrap_room: Optional[int]

    def _setup(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int]) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: Optional[int] = None
        self._error: Optional[BaseException] = None
        self._reason: Optional[str] = None
        self._rank, self._generation = mgr.conn  # a reconnect opens another rank
        self._created = False

    def _stale(self) -> bool:
        """True when the connection this room was made on is gone."""
        c = self.kv_mgr.client
        return c.generation != self._generation or c.lost is not None

    def _fail_local(self, reason: str, exc: Optional[BaseException] = None) -> None:
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
            self._reason = reason
            self._error = exc

    def _call(self, fn, *args, **kw) -> bool:
        """Runs a room request; a refusal fails the room (SGLang's senders
        record the error and report Failed on the next poll). The room
        requests are the client's pipelined forms (``*_nowait``): this
        raises only what the client knows before sending (connection
        lost, too large, a room id in use); the sidecar's refusal fails
        the room in the client's state cache, which poll() reads."""
        try:
            fn(*args, **kw)
            return True
        except _client.KVHostError as e:
            self._fail_local(e.message if e.code == "connection_lost" else "kvhost serve: %s" % e, e)
            return False

    def poll(self):
        if self.conclude_state is not None:
            return _poll(self.conclude_state)
        if not self._created:
            return _poll(KVPoll.Bootstrapping)
        mgr = self.kv_mgr
        if mgr.client.generation != self._generation:
            self._fail_local(_client.LOST_REASON)
            return _poll(KVPoll.Failed)
        # The cache first: a room that reached Success before the sidecar
        # went away did move its KV (Success is final; the client fails
        # only unfinished rooms when the connection is lost).
        st = mgr.client.state(self._rank, self.bootstrap_room)
        if st != KVPoll.Success and mgr.client.lost is not None:
            self._fail_local(_client.LOST_REASON)
            return _poll(KVPoll.Failed)
        if st is None:
            self._fail_local("room %s is unknown to the sidecar" % self.bootstrap_room)
            return _poll(KVPoll.Failed)
        if st == KVPoll.Failed:
            self._fail_local(mgr.client.failure_reason(self._rank, self.bootstrap_room) or "KV transfer failed")
        elif st == KVPoll.Success:
            self.conclude_state = KVPoll.Success
        return _poll(st)

    def failure_exception(self):
        if self.conclude_state is None:
            self.poll()
        if self.conclude_state is None:
            self._fail_local("KV transfer failed")
        reason = self._reason or "KV transfer failed"
        self.clear()
        raise KVTransferError(self.bootstrap_room, reason)

    def abort(self):
        """Fails the room and tells the peers (SGLang's AbortReq)."""
        if self._created and self.conclude_state is None and not self._stale():
            self._call(self.kv_mgr.client.abort_nowait, self._rank, self.bootstrap_room)
        self._fail_local("Aborted by AbortReq.")

    def clear(self) -> None:
        """Forgets the room on the sidecar (idempotent)."""
        if not self._created:
            return
        self._created = False
        mgr = self.kv_mgr
        mgr._drop_prefix(self.bootstrap_room)
        if self._stale():
            return
        try:
            mgr.client.close_room_nowait(self._rank, self.bootstrap_room)
        except _client.KVHostError as e:
            logger.debug("close_room %s: %s", self.bootstrap_room, e)


class KVSender(_Room, BaseKVSender):
    """SGLang's KVSender (prefill side): ``KVSender(mgr, bootstrap_addr,
    bootstrap_room, dest_tp_ranks, pp_rank[, req_has_disagg_prefill_dp_rank])``."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: Any = None,
                 pp_rank: int = 0, req_has_disagg_prefill_dp_rank: bool = False):
        self._setup(mgr, bootstrap_addr, bootstrap_room)
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.curr_idx = 0
        self.has_sent = False
        self._prefix_popped = False
        self._transfer_start: Optional[float] = None
        self._metric = KVTransferMetric()
        if self._stale():
            self._fail_local(_client.LOST_REASON)
        else:
            mgr._want_prefix_len(self._rank, bootstrap_room)  # before the request: its event may come first
            if self._call(mgr.client.sender_create_nowait, self._rank, bootstrap_room):
                self._created = True
            else:
                mgr._drop_prefix(bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        """The tokens the decode side already holds (its decode_prefix_len),
        asked once the room is WaitingForInput; the scheduler sends only the
        pages after them. Popped: a second call returns 0, as SGLang's
        CommonKVSender does. A refusal fails the room (poll says so)."""
        if self._prefix_popped or not self._created or self.conclude_state is not None or self._stale():
            return 0
        self._prefix_popped = True
        try:
            return self.kv_mgr._prefix_len(self._rank, self.bootstrap_room)
        except _client.KVHostError as e:
            self._fail_local(e.message if e.code == "connection_lost" else "kvhost serve: %s" % e, e)
            return 0

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        if self._created and self.conclude_state is None:
            self._call(self.kv_mgr.client.sender_init_nowait, self._rank, self.bootstrap_room,
                       self.num_kv_indices, -1 if aux_index is None else int(aux_index))

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A chunk with pages is sent; so is a last chunk without any (a
        prompt whose pages went with earlier chunks, or a full decode prefix
        hit): it carries aux and state and completes the room."""
        return num_pages > 0 or bool(last_chunk)

    def send(self, kv_indices: Any, state_indices: Optional[Any] = None, num_kv_tokens: Optional[int] = None,
             **_: Any):
        """One chunk of page indices; the chunk that reaches ``init``'s page
        count is the last and carries the state indices (one entry per
        state type of ``kv_args.state_types``). ``num_kv_tokens`` (newer
        SGLang; decode context parallelism, which kvhost does not do) and
        other keywords (``token_position_offset``, ``producer_event``) are
        accepted and not needed."""
        if not self._created or self.conclude_state is not None:
            return
        n = len(kv_indices)
        last = self.num_kv_indices is not None and self.curr_idx + n >= self.num_kv_indices
        if n == 0 and not last:
            return  # SGLang's _prepare_send_indices skips an empty middle chunk
        self.curr_idx += n
        try:
            state = _client.pack_state(state_indices) if last else None
        except (TypeError, ValueError) as e:
            self._fail_local("state_indices: %s" % e)
            return
        if self._transfer_start is None:
            self._transfer_start = time.perf_counter()
        # Not waited for (SGLang's NixlKVSender.send queues the chunk and
        # reports failures through poll()): a refusal fails the room in the
        # client's state cache, which poll() reads.
        if self._call(self.kv_mgr.client.sender_send_nowait, self._rank, self.bootstrap_room, kv_indices,
                      state) and last:
            self.has_sent = True

    def poll(self):
        st = super().poll()
        if st == KVPoll.Success and self._transfer_start is not None and self._metric.transfer_latency_s is None:
            self._metric.transfer_latency_s = time.perf_counter() - self._transfer_start
        return st

    def get_transfer_metric(self):
        """SGLang's KVTransferMetric: the time from the first chunk sent to
        Success seen by poll (as NixlKVSender measures it); bytes are the
        sidecar's to count (its metrics), so None here."""
        return self._metric


class KVReceiver(_Room, BaseKVReceiver):
    """SGLang's KVReceiver (decode side): ``KVReceiver(mgr, bootstrap_addr,
    bootstrap_room)``, then ``init(prefill_dp_rank)`` and
    ``send_metadata(...)``; older SGLang's ``KVReceiver(mgr, addr, room,
    data_parallel_rank)`` and ``init(kv_indices, aux_index)`` also work."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, data_parallel_rank: Optional[int] = None, **_: Any):
        self._setup(mgr, bootstrap_addr, bootstrap_room)
        self.prefill_dp_rank: Optional[int] = None
        self.init_time = None
        # Read by SGLang's poll_and_all_reduce_with_staging
        # (disaggregation/utils.py): the sidecar writes into the pages
        # themselves, never through a staging buffer.
        self.require_staging = False
        dp = prefill_dp_rank if prefill_dp_rank is not None else data_parallel_rank
        if dp is not None:
            self._create(dp)

    def _create(self, prefill_dp_rank: Optional[int]) -> None:
        if self._created or self.bootstrap_room is None or self.conclude_state is not None:
            return
        self.prefill_dp_rank = prefill_dp_rank
        mgr = self.kv_mgr
        if self._stale():
            self._fail_local(_client.LOST_REASON)
        elif self._call(mgr.client.receiver_create_nowait, self._rank, self.bootstrap_room, self.bootstrap_addr,
                      None if prefill_dp_rank is None else int(prefill_dp_rank)):
            self._created = True

    def init(self, *args: Any, **kw: Any):
        """``init(prefill_dp_rank)`` (SGLang's CommonKVReceiver.init), or the
        older ``init(kv_indices, aux_index[, state_indices])``."""
        first = args[0] if args else kw.get("kv_indices", kw.get("prefill_dp_rank"))
        if "kv_indices" in kw or (first is not None and hasattr(first, "__len__")):
            if not self._created:
                self._create(kw.pop("prefill_dp_rank", None))
            return self.send_metadata(*args, **kw)
        self._create(first)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[Any] = None,
                      decode_prefix_len: Optional[int] = None):
        if not self._created or self.conclude_state is not None:
            return
        try:
            state = _client.pack_state(state_indices)
        except (TypeError, ValueError) as e:
            self._fail_local("state_indices: %s" % e)
            return
        self._call(self.kv_mgr.client.receiver_init_nowait, self._rank, self.bootstrap_room, kv_indices,
                   -1 if aux_index is None else int(aux_index), state, int(decode_prefix_len or 0))
        self.init_time = time.time()


# --------------------------------------------------------------------------
# Bootstrap server


class KVBootstrapServer(BaseKVBootstrapServer):
    """SGLang's KVBootstrapServer(host, port): the sidecar hosts it
    (``start_bootstrap``); this object holds the connection that started it
    and answers where it is (``addr``)."""

    def __init__(self, host: str, port: int, *args: Any, endpoint: Optional[str] = None, **kw: Any):
        self.host = "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else str(host)
        self.port = int(port)
        self.client = _client.Client(endpoint or os.environ.get("KVHOST_CONTROL") or None, queue_events=False)
        self.addr = self.client.start_bootstrap(self.host, self.port)
        interval = float(kw.get("reconnect_interval") or os.environ.get("KVHOST_RECONNECT_INTERVAL") or 1.0)
        self._reconnector = _Reconnector(self.client, self._reopen, interval, "bootstrap server")

    def _reopen(self, connect_timeout: float) -> None:
        """After a sidecar restart: start the bootstrap server on the new
        one (the prefill ranks register with it again)."""
        if self.client.lost is None:
            return
        self.client.reconnect(connect_timeout)
        self.addr = self.client.start_bootstrap(self.host, self.port)

    def run(self) -> None:
        """SGLang starts the server in the constructor; kept for callers
        that call run()."""

    def close(self) -> None:
        self._reconnector.stop()
        self.client.close()
