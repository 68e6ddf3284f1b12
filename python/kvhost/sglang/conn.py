"""SGLang's KV connector classes, backed by ``kvhost serve``.

KVManager, KVSender, KVReceiver and KVBootstrapServer have the constructor
arguments and methods of SGLang's connectors (SGLang's
python/sglang/srt/disaggregation/nixl/conn.py and mori/conn.py, on the base
classes of python/sglang/srt/disaggregation/base/conn.py), so SGLang's
scheduler drives them exactly as it drives NixlKVSender and friends; the
transfer itself runs in the sidecar, which speaks SGLang's NIXL or MORI wire
to the peers (``variant``).

What SGLang's scheduler does, and what each call becomes here:

prefill (python/sglang/srt/disaggregation/prefill.py)
  ``KVSender(mgr, bootstrap_addr, room, dest_tp_ranks, pp_rank)`` →
  ``sender_create``; ``poll()`` until WaitingForInput (the decode's metadata
  arrived: a room event); ``init(num_kv_indices, aux_index)`` →
  ``sender_init``; ``send(kv_indices[, state_indices])`` per chunk →
  ``sender_send`` (the chunk that reaches ``num_kv_indices`` is the last;
  the sidecar sends aux and state with it), sent without waiting for the
  reply, as SGLang's connectors queue the chunk to a transfer thread: a
  refusal fails the room, seen by the next ``poll()`` once the reply came
  (the sidecar handles the rank's requests in order); ``poll()`` until Success or
  Failed; ``failure_exception()`` raises the reason; ``clear()`` forgets it.
decode (python/sglang/srt/disaggregation/decode.py)
  ``KVReceiver(mgr, bootstrap_addr, room)``; ``init(prefill_dp_rank)`` →
  ``receiver_create`` (the sidecar bootstraps: fetches the prefill's rank
  mapping); ``poll()`` until WaitingForInput; ``send_metadata(kv_indices,
  aux_index, state_indices, decode_prefix_len)`` → ``receiver_init``;
  ``poll()`` until Success. Older SGLang releases call ``init(kv_indices,
  aux_index)`` instead of ``send_metadata`` (and pass the prefill DP rank to
  the constructor): both forms are accepted.

``poll()`` never makes a round trip: the client's state cache, fed by the
sidecar's room events, answers. A sidecar that goes away fails every room in
flight with "sidecar connection lost" (the next ``poll()`` returns Failed,
``failure_exception()`` says so).

Memory: every pointer in KVArgs (kv, aux, state) must lie in memory the
sidecar can map: host memory allocated with :mod:`kvhost.shm` (found by
address), or CUDA memory (shared by CUDA IPC handle, taken through
libcudart when torch and CUDA are present).

SGLang is imported only if it is installed; without it the module uses
stand-ins for SGLang's own KVPoll, KVArgs, DisaggregationMode and
KVTransferError (tests and ``import kvhost.sglang`` without SGLang).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvhost import client as _client
from kvhost import shm as _shm

logger = logging.getLogger("kvhost.sglang")

# --------------------------------------------------------------------------
# SGLang's own types, or stand-ins when SGLang is not installed.

try:  # pragma: no cover: SGLang is not installed in CI
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # type: ignore

    HAVE_SGLANG = True
except Exception:  # ImportError, or an SGLang that fails to import without a GPU
    HAVE_SGLANG = False

    class KVPoll:  # type: ignore[no-redef]
        """Stand-in for SGLang's KVPoll (base/conn.py)."""

        Failed = 0
        Bootstrapping = 1
        WaitingForInput = 2
        Transferring = 3
        Success = 4

    class KVArgs:  # type: ignore[no-redef]
        """Stand-in for SGLang's KVArgs (base/conn.py): the fields the
        connectors read, with SGLang's meaning."""

        engine_rank: int = 0
        kv_data_ptrs: List[int]
        kv_data_lens: List[int]
        kv_item_lens: List[int]
        aux_data_ptrs: List[int]
        aux_data_lens: List[int]
        aux_item_lens: List[int]
        state_data_ptrs: List[int]
        state_data_lens: List[int]
        state_item_lens: List[int]
        state_type: str = "none"
        state_dim_per_tensor: List[int]
        ib_device: str = ""
        ib_traffic_class: str = ""
        gpu_id: int = 0
        kv_head_num: int = 0
        total_kv_head_num: int = 0
        page_size: int = 1
        pp_rank: int = 0
        prefill_start_layer: int = 0
        system_dp_rank: int = 0
        decode_tp_size: int = 0
        prefill_pp_size: int = 1

        def __init__(self, **kw: Any):
            for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "aux_data_ptrs", "aux_data_lens",
                         "aux_item_lens", "state_data_ptrs", "state_data_lens", "state_item_lens",
                         "state_dim_per_tensor"):
                setattr(self, name, [])
            for k, v in kw.items():
                setattr(self, k, v)

try:  # pragma: no cover
    from sglang.srt.disaggregation.common.conn import KVTransferError  # type: ignore
except Exception:

    class KVTransferError(Exception):  # type: ignore[no-redef]
        """Stand-in for SGLang's KVTransferError (common/conn.py)."""

        def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False):
            super().__init__(failure_reason)
            self.bootstrap_room = bootstrap_room
            self.failure_reason = failure_reason
            self.is_from_another_rank = is_from_another_rank

        def __str__(self) -> str:
            return "KVTransferError(bootstrap_room=%s): %s" % (self.bootstrap_room, self.failure_reason)

try:  # pragma: no cover
    from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore
except Exception:
    import enum

    class DisaggregationMode(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for SGLang's DisaggregationMode (disaggregation/utils.py)."""

        NULL = "null"
        PREFILL = "prefill"
        DECODE = "decode"


def _poll(state: int):
    """A state as the KVPoll SGLang compares with (an IntEnum member in
    SGLang, plain ints in the stand-in)."""
    try:
        return KVPoll(state)  # type: ignore[call-arg]
    except TypeError:
        return state


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


def _mode(m: Any) -> str:
    v = getattr(m, "value", m)
    v = str(v).lower()
    if v not in ("prefill", "decode"):
        raise ValueError("unsupported disaggregation mode %r" % (m,))
    return v


class KVManager:
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

    def _ranges(self) -> List[Tuple[int, int]]:
        a = self.kv_args
        out = list(zip(_ints(a.kv_data_ptrs), _ints(a.kv_data_lens)))
        out += list(zip(_ints(getattr(a, "aux_data_ptrs", [])), _ints(getattr(a, "aux_data_lens", []))))
        out += list(zip(_ints(getattr(a, "state_data_ptrs", [])), _ints(getattr(a, "state_data_lens", []))))
        return out

    def rank_fields(self) -> Dict[str, Any]:
        """open_rank's SGLang fields (docs/engine-api.md, "Ranks")."""
        a = self.kv_args
        state_type = getattr(a, "state_type", None)
        if state_type is None:
            types = getattr(a, "state_types", None) or []
            state_type = types[0] if len(types) == 1 else ("none" if not types else ",".join(map(str, types)))
        state_type = str(getattr(state_type, "value", state_type) or "none").lower()
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
        if state_type != "none" and getattr(a, "state_data_ptrs", None):
            f.update(state_type=state_type,
                     state_data_ptrs=_ints(a.state_data_ptrs),
                     state_data_lens=_ints(a.state_data_lens),
                     state_item_lens=_ints(a.state_item_lens),
                     state_dim_per_tensor=_ints(getattr(a, "state_dim_per_tensor", [])))
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
        record the error and report Failed on the next poll)."""
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
            self._call(self.kv_mgr.client.abort, self._rank, self.bootstrap_room)
        self._fail_local("Aborted by AbortReq.")

    def clear(self) -> None:
        """Forgets the room on the sidecar (idempotent)."""
        if not self._created:
            return
        self._created = False
        mgr = self.kv_mgr
        if self._stale():
            return
        try:
            mgr.client.close_room(self._rank, self.bootstrap_room)
        except _client.KVHostError as e:
            logger.debug("close_room %s: %s", self.bootstrap_room, e)


class KVSender(_Room):
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
        if self._stale():
            self._fail_local(_client.LOST_REASON)
        elif self._call(mgr.client.sender_create, self._rank, bootstrap_room):
            self._created = True

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        if self._created and self.conclude_state is None:
            self._call(self.kv_mgr.client.sender_init, self._rank, self.bootstrap_room,
                       self.num_kv_indices, -1 if aux_index is None else int(aux_index))

    def send(self, kv_indices: Any, state_indices: Optional[Any] = None):
        if not self._created or self.conclude_state is not None:
            return
        n = len(kv_indices)
        last = self.num_kv_indices is not None and self.curr_idx + n >= self.num_kv_indices
        if n == 0 and not last and state_indices is None:
            return  # SGLang's _prepare_send_indices skips an empty middle chunk
        self.curr_idx += n
        try:
            state = _flat_state(state_indices) if last else None
        except ValueError as e:
            self._fail_local(str(e))
            return
        # Not waited for (SGLang's NixlKVSender.send queues the chunk and
        # reports failures through poll()): a refusal fails the room in the
        # client's state cache, which poll() reads.
        if self._call(self.kv_mgr.client.sender_send_nowait, self._rank, self.bootstrap_room, kv_indices,
                      state) and last:
            self.has_sent = True


class KVReceiver(_Room):
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
        elif self._call(mgr.client.receiver_create, self._rank, self.bootstrap_room, self.bootstrap_addr,
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
        import time

        try:
            state = _flat_state(state_indices)
        except ValueError as e:
            self._fail_local(str(e))
            return
        self._call(self.kv_mgr.client.receiver_init, self._rank, self.bootstrap_room, kv_indices,
                   -1 if aux_index is None else int(aux_index), state, int(decode_prefix_len or 0))
        self.init_time = time.time()


def _flat_state(state_indices: Any) -> Any:
    """SGLang passes state indices as a list (one entry per state
    component, each an int list or array, or None) or as one flat list;
    protocol 1.0 carries one packed int32 list, so one component is sent
    as it is and several are refused."""
    if state_indices is None:
        return None
    items = list(state_indices)
    if not items:
        return None
    if all(not hasattr(x, "__len__") for x in items):
        return items
    comps = [x for x in items if x is not None]
    if len(comps) > 1:
        raise ValueError("%d state components: protocol 1.0 carries one state index list" % len(comps))
    return list(comps[0]) if comps else None


# --------------------------------------------------------------------------
# Bootstrap server


class KVBootstrapServer:
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
