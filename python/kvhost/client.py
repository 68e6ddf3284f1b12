"""The engine control API of ``kvhost serve`` (docs/engine-api.md, protocol 1.0).

One :class:`Client` is one engine connection (one ZeroMQ DEALER socket to the
sidecar's ROUTER). Everything the sidecar makes for this connection (regions,
ranks, rooms, held requests) lives as long as the connection.

Threading design
----------------
pyzmq sockets are not thread-safe, so every use of the DEALER socket
(send, recv, reading its options) happens under one lock, ``_sock_lock``,
whichever thread holds it. A caller sends its request itself, on its own
thread (no hand-off: the send is a few microseconds of the caller's time,
not a wake-up of another thread); only when the socket cannot take the
message at once (its high-water mark) does the request wait in an outbox
that the I/O thread flushes, and every later request queues behind it so
one thread's requests keep their order. The client's I/O thread owns the
monitor socket and receives (unless a waiting caller does, below): it
sleeps in ``poll`` on the DEALER's file descriptor (``ZMQ_FD``), the
monitor socket and a wake-up pipe, never on the DEALER itself, so it holds
no lock while it waits.
``ZMQ_FD`` is edge-triggered: any operation on the socket (a caller's
send included: libzmq's send processes the socket's pending commands
about once a millisecond) may consume the edge that announced a message.
Whoever receives does so until the socket says there is nothing more and
reads ``ZMQ_EVENTS`` again before it sleeps; a caller about to wait for
its reply reads ``ZMQ_EVENTS`` before it sleeps on ``ZMQ_FD``. A pipelined send
(:meth:`Client.call_nowait` and friends) does not: reading
``ZMQ_EVENTS`` is a system call in libzmq, several times the send's own
cost, and these sends are what an engine's scheduler makes per request.
Instead, while any request is in flight the I/O thread sleeps at most
``_BUSY_POLL_MS`` (1 ms), so a taken edge delays a message by at most
that; when nothing is in flight it sleeps up to 100 ms, and marks itself
idle first (``_io_idle``, then it looks at the in-flight requests), and
the first pipelined send that finds it idle wakes it through the pipe
(a sender registers its request before it reads the mark, so one of the
two sees the other). Replies and events are decoded and dispatched without
the socket lock, so a listener may send (lock order: ``_sock_lock``
before ``_lock``, never the other way).

One thread at a time receives (``_recv_lock``, which keeps messages in
order): a caller waiting for its reply takes that role when it is free,
polls the DEALER's file descriptor itself and reads its reply on its own
thread, dispatching whatever else comes meanwhile, so a round trip has no
hand-off between threads (the I/O thread leaves the DEALER to it and
looks at it again within ``_BUSY_POLL_MS`` of it leaving). A caller that
finds another receiving waits on its own flag (``_Done``, an Event on a
bare lock) for the reply routed to it by ``seq`` (a request sent with
:meth:`Client.call_nowait` or :meth:`Client.send_nowait` has no waiter:
an error reply fails its room in the state cache, or calls its
``on_error``). Events (messages the sidecar sends unasked) are decoded by
the thread that received them, which

- updates the per-room state cache, so :meth:`Client.state` answers without
  a round trip (KVPoll values; monotonic, Failed and Success final, Failed
  always wins: SGLang's rule);
- calls the listeners added with :meth:`Client.add_listener` (on the
  thread that received the event: the I/O thread, or a caller waiting for
  its own reply; they must be quick and must not call the client back and
  wait, but may send without waiting);
- appends the event to a bounded queue read with :meth:`Client.next_event`
  and :meth:`Client.drain_events` (when ``queue_events`` is true; on overflow
  the oldest event is dropped and ``events_dropped`` counts it; the state
  cache stays exact either way).

Losing the sidecar
------------------
The connection is declared lost when the ZeroMQ monitor reports the
connection closed, or when a request gets no reply within ``timeout``
seconds. Then every request in flight raises :class:`ConnectionLost`, every
room not yet final becomes Failed with the reason ``"sidecar connection
lost"`` (a room event with that reason is delivered like any other, then a
``{"event": "connection_lost", "reason": ...}`` event), later requests raise
:class:`ConnectionLost` at once, and :meth:`Client.reconnect` opens a new
connection and says ``hello`` again; its ``session`` tells whether the
sidecar restarted. Everything registered before is gone either way (the
sidecar tears a connection's objects down when it closes): register again.
The client tracks room states only; vLLM reads and holds in flight end
with the connection too (docs/engine-api.md, "Lifecycle"), and the adapter
that made them acts on the ``connection_lost`` event (kvhost.vllm marks the
reads' blocks invalid and reports the holds finished). A sidecar that
answers ``no_hello`` after this connection said hello is a restarted one
the monitor did not report yet: the connection is lost the same way.
"""

from __future__ import annotations

import array
import collections
import itertools
import os
import select
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

PROTOCOL_VERSION = (1, 0)
CLIENT_NAME = "kvhost-python/0.1"

# SGLang's KVPoll values (python/sglang/srt/disaggregation/base/conn.py).
FAILED = 0
BOOTSTRAPPING = 1
WAITING_FOR_INPUT = 2
TRANSFERRING = 3
SUCCESS = 4
_UNKNOWN_ROOM = 255

LOST_REASON = "sidecar connection lost"

# pyzmq's constants are IntEnum members, whose operators cost more than
# the socket calls they are passed to on the request path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

DEFAULT_TIMEOUT = float(os.environ.get("KVHOST_CONTROL_TIMEOUT", "30"))
"""Seconds a request waits for its reply before the sidecar is declared gone."""

MAX_QUEUED_EVENTS = 1 << 16


def default_endpoint() -> str:
    """The control endpoint of docs/engine-api.md ("Transport"):
    ``$KVHOST_CONTROL`` when set (the variable ``kvhost serve --control``
    reads), else ``ipc://$XDG_RUNTIME_DIR/kvhost.sock``, else
    ``ipc:///tmp/kvhost-<uid>.sock``."""
    env = os.environ.get("KVHOST_CONTROL")
    if env:
        return env
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return "ipc://" + os.path.join(run, "kvhost.sock")
    return "ipc:///tmp/kvhost-%d.sock" % os.getuid()


# --------------------------------------------------------------------------
# Errors


class KVHostError(Exception):
    """An error reply of the sidecar: ``code`` (docs/engine-api.md, "Error
    codes") and ``message``; raised as the subclass of its code."""

    code = "error"

    def __init__(self, code: str, message: str):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message


class BadRequest(KVHostError):
    code = "bad_request"


class UnknownOp(KVHostError):
    code = "unknown_op"


class VersionMismatch(KVHostError):
    code = "version"


class NoHello(KVHostError):
    code = "no_hello"


class OutOfOrder(KVHostError):
    code = "out_of_order"


class TooLarge(KVHostError):
    code = "too_large"


class BadRegion(KVHostError):
    code = "bad_region"


class GeometryError(KVHostError):
    code = "geometry"


class UnknownObject(KVHostError):
    code = "unknown"


class Exists(KVHostError):
    code = "exists"


class Busy(KVHostError):
    code = "busy"


class Unsupported(KVHostError):
    code = "unsupported"


class LimitReached(KVHostError):
    code = "limit"


class BackendError(KVHostError):
    code = "backend"


class ShuttingDown(KVHostError):
    code = "shutting_down"


class InternalError(KVHostError):
    code = "internal"


class ConnectionLost(KVHostError):
    """The sidecar is gone (connection closed, or no reply in time). Not a
    code the sidecar sends: the client's own."""

    code = "connection_lost"


ERRORS: Dict[str, type] = {
    cls.code: cls
    for cls in (
        BadRequest, UnknownOp, VersionMismatch, NoHello, OutOfOrder, TooLarge,
        BadRegion, GeometryError, UnknownObject, Exists, Busy, Unsupported,
        LimitReached, BackendError, ShuttingDown, InternalError, ConnectionLost,
    )
}


def error_for(code: str, message: str) -> KVHostError:
    """The exception of an error reply: the subclass of its code, or
    :class:`KVHostError` for a code this client does not know."""
    return ERRORS.get(code, KVHostError)(code, message)


# --------------------------------------------------------------------------
# Packed index lists


def pack_pages(pages: Any, field: str = "pages") -> bytes:
    """Page (block) indices as the API's ``pages`` bin: packed little-endian
    int32. Accepts bytes-like objects (taken as already packed; the length
    must be a multiple of 4), numpy arrays (any integer dtype, values must
    fit int32) and sequences of ints."""
    if isinstance(pages, (bytes, bytearray, memoryview)):
        b = bytes(pages)
        if len(b) % 4:
            raise ValueError("%s: %d bytes is not a whole number of int32" % (field, len(b)))
        return b
    np = _numpy()
    if np is not None and type(pages) is np.ndarray and pages.dtype == _I32:
        return pages.tobytes()  # the common case (SGLang's page indices): nothing to check or convert
    if np is not None and type(pages).__module__.startswith("torch") and hasattr(pages, "numpy"):
        pages = pages.detach().cpu().numpy()  # a torch tensor (SGLang's index lists may be)
    if np is not None and isinstance(pages, np.ndarray):
        if pages.dtype.kind not in "iu":
            raise TypeError("%s: want an integer array, got dtype %s" % (field, pages.dtype))
        flat = pages.reshape(-1)
        if flat.size and (flat.min() < -(1 << 31) or flat.max() >= (1 << 31)):
            raise ValueError("%s: values out of int32 range" % field)
        return flat.astype("<i4", copy=False).tobytes()
    a = array.array("i")
    try:
        a.extend(int(p) for p in pages)
    except OverflowError:
        raise ValueError("%s: values out of int32 range" % field) from None
    if a.itemsize != 4:  # pragma: no cover: every CPython platform has 4-byte int
        raise RuntimeError("array('i') is not 4 bytes here")
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _flat_ints(x: Any) -> List[int]:
    """The integers of a nested index list (lists, tuples, numpy arrays of
    any shape, numpy scalars), in order."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        out: List[int] = []
        for y in x:
            out.extend(_flat_ints(y))
        return out
    return [int(x)]


def _is_scalar(x: Any) -> bool:
    if isinstance(x, (bytes, bytearray, memoryview)):
        return False  # an already packed list
    if hasattr(x, "tolist"):
        x = x.tolist()
    return not isinstance(x, (list, tuple))


def pack_state(state_indices: Any) -> Any:
    """State indices as the API's ``state_indices``: SGLang passes one entry
    per state type of ``kv_args.state_types`` (an index list or array, a
    list holding one 0-d array for Mamba, or None), which becomes a list of
    packed int32 bins (None stays None); a flat list of ints (older SGLang,
    one state component) becomes one packed bin. None or an empty list:
    None (no state). Already packed entries (bytes) are kept, so packing
    twice changes nothing."""
    if state_indices is None:
        return None
    if isinstance(state_indices, (bytes, bytearray, memoryview)):
        return pack_pages(state_indices, "state_indices")
    items = state_indices.tolist() if hasattr(state_indices, "tolist") else list(state_indices)
    if not isinstance(items, list):  # a 0-d array: one index
        items = [items]
    if not items:
        return None
    if all(_is_scalar(x) for x in items):
        return pack_pages(_flat_ints(items), "state_indices")
    return [None if x is None else pack_pages(x if isinstance(x, (bytes, bytearray, memoryview)) else _flat_ints(x),
                                              "state_indices[%d]" % i) for i, x in enumerate(items)]


def pack_u64(values: Iterable[int]) -> bytes:
    """Room ids as the API's ``rooms`` bin: packed little-endian uint64."""
    a = array.array("Q", (int(v) for v in values))
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_pages(b: bytes) -> List[int]:
    """The inverse of :func:`pack_pages` (for invalid_blocks and tests)."""
    a = array.array("i")
    a.frombytes(bytes(b))
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tolist()


def _log():
    import logging

    return logging.getLogger("kvhost.client")


def _log_refusal(op: str) -> Callable[[Exception], None]:
    def log(e: Exception) -> None:
        _log().debug("kvhost client: %s refused: %s", op, e)

    return log


def _warn_refusal(op: str) -> Callable[[Exception], None]:
    """on_error for a pipelined request whose refusal an operator should
    see (the adapter's behaviour depends on it being accepted)."""
    def log(e: Exception) -> None:
        _log().warning("kvhost client: %s refused: %s", op, e)

    return log


def _numpy():
    return _np


try:
    import numpy as _np
except ImportError:  # numpy is optional
    _np = None
# Little-endian int32: packed pages' format.
_I32 = _np.dtype("<i4") if _np is not None else None


def _plain(v: Any) -> Any:
    """Converts numpy scalars and arrays, tuples and nested containers to
    what msgpack packs (ints, lists, dicts)."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, bytes, float)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    np = _numpy()
    if np is not None:
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.floating):
            return float(v)
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, np.ndarray):
            return _plain(v.tolist())
    return v


# --------------------------------------------------------------------------
# The client


class _Done:
    """threading.Event's is_set / set / wait for one waiter and one
    setter, on a bare lock (an Event is a Condition and two locks: making
    and setting one costs more than the rest of a request's bookkeeping)."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                self._lock.release()
            except RuntimeError:  # released already (two setters raced)
                pass

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=max(0.0, timeout)):
            self._lock.release()
        return self._set


class _Pending:
    __slots__ = ("op", "done", "reply", "error", "room", "on_error", "on_reply")

    def __init__(self, op: str, room: Optional[Tuple[int, int, int]] = None,
                 on_error: Optional[Callable[["KVHostError"], None]] = None,
                 on_reply: Optional[Callable[[dict], None]] = None, waited: bool = False):
        self.op = op
        # Only a request somebody waits for has an Event (making one costs
        # more than the rest of a pipelined request's bookkeeping).
        self.done: Optional[_Done] = _Done() if waited else None
        self.reply: Optional[dict] = None
        self.error: Optional[KVHostError] = None
        # (rank, room, token) of a request nobody waits for
        # (Client.call_nowait): its error reply fails that room in the
        # state cache, if the room is still the one tracked when it was
        # sent (token: a room id closed and made again is another room).
        self.room = room
        # Called on the I/O thread with the error of a request nobody
        # waits for (Client.send_nowait), or with its reply.
        self.on_error = on_error
        self.on_reply = on_reply


class PrefixLen:
    """The pending answer of :meth:`Client.sender_prefix_len_async`."""

    def __init__(self):
        self._ev = threading.Event()
        self._value = 0
        self._error: Optional[KVHostError] = None

    def _done(self, reply: dict) -> None:
        self._value = int(reply.get("prefix_len") or 0)
        self._ev.set()

    def _fail(self, e: KVHostError) -> None:
        self._error = e
        self._ev.set()

    def done(self) -> bool:
        return self._ev.is_set()

    def result(self, timeout: float) -> int:
        """The prefix length; raises the refusal, or ConnectionLost when no
        answer comes in ``timeout`` seconds (the connection is gone)."""
        if not self._ev.wait(timeout):
            raise ConnectionLost("connection_lost", "%s: no reply to sender_prefix_len" % LOST_REASON)
        if self._error is not None:
            raise self._error
        return self._value


class Hello:
    """The sidecar's answer to ``hello``."""

    def __init__(self, reply: dict):
        self.version = tuple(reply.get("version") or ())
        self.sidecar = reply.get("sidecar", "")
        self.session = reply.get("session", "")
        self.backend = reply.get("backend", "")
        self.capabilities = list(reply.get("capabilities") or [])
        self.max_message = int(reply.get("max_message") or 64 << 20)
        self.limits = dict(reply.get("limits") or {})

    def __repr__(self) -> str:
        return "Hello(sidecar=%r, session=%r, backend=%r, version=%r, capabilities=%r)" % (
            self.sidecar, self.session, self.backend, self.version, self.capabilities)


class Client:
    """A connection to ``kvhost serve``.

    ``endpoint``: the control socket (default :func:`default_endpoint`).
    ``timeout``: seconds a request waits for its reply; past it the sidecar
    is declared gone (:class:`ConnectionLost`). ``connect_timeout``: seconds
    the first ``hello`` may wait for the sidecar to come up. ``queue_events``:
    keep events for :meth:`next_event` / :meth:`drain_events` (an adapter
    that only needs room states turns it off and reads :meth:`state`).
    """

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: Optional[float] = None,
        queue_events: bool = True,
        max_queued_events: int = MAX_QUEUED_EVENTS,
        client_name: str = CLIENT_NAME,
        context: Optional[zmq.Context] = None,
    ):
        self.endpoint = endpoint or default_endpoint()
        self.timeout = float(timeout)
        self.connect_timeout = float(timeout if connect_timeout is None else connect_timeout)
        self.client_name = client_name
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()  # guards everything below that callers touch
        self._seq = itertools.count(1)
        self._pending: Dict[int, _Pending] = {}
        # seqs of requests sent larger than the sidecar's announced
        # max_message (only when a caller raised hello.max_message): the
        # sidecar discards them unread and answers too_large with seq nil.
        self._oversize: collections.deque = collections.deque()
        self._announced_max = 1 << 62
        self._outbox: collections.deque = collections.deque()
        self._rooms: Dict[Tuple[int, int], Tuple[int, str]] = {}
        # Which incarnation of a room id is tracked (see _Pending.room).
        self._room_tokens: Dict[Tuple[int, int], int] = {}
        self._tokens = itertools.count(1)
        # Guards every use of the DEALER socket (see "Threading design");
        # taken before _lock, never after.
        self._sock_lock = threading.Lock()
        self._sock: Optional[zmq.Socket] = None
        # True while the I/O thread sleeps its long poll (nothing in
        # flight): the first pipelined send wakes it (see "Threading
        # design").
        self._io_idle = False
        # One receiver at a time: the I/O thread, or a caller waiting for
        # its reply (_await). Taken before _sock_lock.
        self._recv_lock = threading.Lock()
        self._caller_receiving = False
        self._rpoll = None
        self._listeners: List[Callable[[dict], None]] = []
        self._queue_events = queue_events
        self._events: collections.deque = collections.deque()
        self._events_cv = threading.Condition(self._lock)
        self._max_events = max(1, int(max_queued_events))
        self.events_dropped = 0
        self._lost: Optional[str] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._wake_r = self._wake_w = -1
        self.generation = 0
        """Counts connections: 1 after the first hello, +1 per reconnect.
        Adapters compare it with the generation their rooms were made in."""
        self.hello: Optional[Hello] = None
        self._connect()

    # -- connection --------------------------------------------------------

    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A message to a peer that is not connected waits (no silent drop):
        # the first hello waits for the sidecar to come up.
        sock.setsockopt(zmq.IMMEDIATE, 0)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sock.connect(self.endpoint)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        with self._sock_lock, self._lock:
            self._lost = None
            self._outbox.clear()
            self._oversize.clear()
            self._announced_max = 1 << 62
            self._sock, self._mon = sock, mon
        rpoll = select.poll()
        rpoll.register(sock.getsockopt(zmq.FD), select.POLLIN)
        self._rpoll = rpoll
        self._stop = False
        self._thread = threading.Thread(
            target=self._io_loop, args=(sock, mon, self._wake_r, sock.getsockopt(zmq.FD)),
            name="kvhost-client-io", daemon=True)
        self._thread.start()
        try:
            reply = self._request(
                {"op": "hello", "version": list(PROTOCOL_VERSION), "client": self.client_name, "pid": os.getpid()},
                timeout=self.connect_timeout)
            hello = Hello(reply)
            if not hello.version or hello.version[0] != PROTOCOL_VERSION[0]:
                raise VersionMismatch("version", "sidecar speaks protocol %r, this client %d.%d" % (
                    hello.version, PROTOCOL_VERSION[0], PROTOCOL_VERSION[1]))
        except BaseException:
            self._shutdown_io("hello failed")
            raise
        self.hello = hello
        self._announced_max = hello.max_message
        self.generation += 1

    @property
    def session(self) -> str:
        """The sidecar's session (random per sidecar process)."""
        return self.hello.session if self.hello else ""

    @property
    def lost(self) -> Optional[str]:
        """Why the connection was lost, or None while it is up."""
        return self._lost

    def reconnect(self, connect_timeout: Optional[float] = None) -> bool:
        """Drops this connection (if still up, the sidecar tears down what it
        made) and opens a new one with a fresh ``hello`` (waiting up to
        ``connect_timeout`` seconds, default the client's). Returns True
        when the sidecar is another process (another ``session``).
        Everything registered before is gone: register regions and open
        ranks again. The room state cache is emptied (rooms of the old
        connection were Failed when it was lost). Listeners stay."""
        if self._closed:
            raise ConnectionLost("connection_lost", "client closed")
        old = self.session
        self._shutdown_io(LOST_REASON + ": reconnecting")
        with self._lock:
            self._rooms.clear()
            self._room_tokens.clear()
        saved = self.connect_timeout
        if connect_timeout is not None:
            self.connect_timeout = float(connect_timeout)
        try:
            self._connect()
        finally:
            self.connect_timeout = saved
        return self.session != old

    def close(self) -> None:
        """Closes the connection (the sidecar tears down everything this
        connection made). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_io("client closed")

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    def _shutdown_io(self, reason: str) -> None:
        t = self._thread
        if t is None:
            return
        self._stop = True
        self._wake()
        if t is not threading.current_thread():
            t.join(5)
        self._thread = None
        # The I/O thread closed its sockets; fail whatever was still waiting.
        self._declare_lost(reason, emit=False)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread will wake anyway) or closed

    # -- the I/O thread ----------------------------------------------------

    # Messages the I/O thread receives under one hold of the socket lock
    # before it dispatches them (and lets callers send again).
    _RECV_BATCH = 64
    # The I/O thread's poll timeout while requests are in flight: the
    # longest a reply or event waits when a pipelined send took the edge
    # of ZMQ_FD (see "Threading design").
    _BUSY_POLL_MS = 1

    def _io_loop(self, sock: zmq.Socket, mon: zmq.Socket, wake_r: int, sock_fd: int) -> None:
        # The DEALER is polled by its file descriptor only (see "Threading
        # design"): zmq_poll on the socket itself would use it unlocked.
        # While a caller receives (_caller_receiving) the I/O thread leaves
        # the DEALER to it and waits on the monitor and the pipe only.
        full = zmq.Poller()
        full.register(sock_fd, zmq.POLLIN)
        full.register(mon, zmq.POLLIN)
        full.register(wake_r, zmq.POLLIN)
        reduced = zmq.Poller()
        reduced.register(mon, zmq.POLLIN)
        reduced.register(wake_r, zmq.POLLIN)
        wait_ms = 100
        try:
            while not self._stop:
                if wait_ms == 100:
                    # See "Threading design": set before looking at
                    # _pending, read by senders after they added to it.
                    self._io_idle = True
                    if self._pending:
                        self._io_idle = False
                        wait_ms = self._BUSY_POLL_MS
                poller = full
                if self._caller_receiving:
                    # Back on the DEALER within a millisecond of the caller
                    # leaving it (it does not wake this thread: that would
                    # cost the next request a GIL hand-off). Messages that
                    # come meanwhile keep ZMQ_FD readable until read.
                    poller, wait_ms = reduced, min(wait_ms, self._BUSY_POLL_MS)
                got = poller.poll(wait_ms)
                # Receive when the DEALER's FD says so, or after a busy
                # poll timed out (a pipelined send may have taken the FD's
                # edge); not after the short wait of the reduced poller,
                # which only brings this thread back to the DEALER (a
                # waiting caller would find the receiving role taken).
                drain = not got if poller is full else False
                for ready, _ in got:
                    if ready == sock_fd:
                        drain = True
                    elif ready == wake_r:
                        drain = True  # woken by a sender: look at the DEALER too
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    elif ready is mon:
                        while True:
                            try:
                                ev = recv_monitor_message(mon, zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if ev["event"] == zmq.EVENT_DISCONNECTED:
                                # What the sidecar sent before it closed
                                # (a stopping sidecar's room events and
                                # reasons) comes first.
                                if self._recv_lock.acquire(timeout=1.0):
                                    try:
                                        while self._lost is None and self._drain_once(sock):
                                            pass
                                    finally:
                                        self._recv_lock.release()
                                self._declare_lost(LOST_REASON + ": the sidecar closed the connection")
                                return
                # Whatever woke us (or a timeout): receive what is there
                # (unless a caller is receiving) and flush the outbox.
                wait_ms = 100
                if drain and self._recv_lock.acquire(blocking=False):
                    try:
                        while not self._stop and self._lost is None and self._drain_once(sock):
                            pass
                    finally:
                        self._recv_lock.release()
                if self._flush_outbox(sock):
                    wait_ms = 1
                if self._lost is not None:
                    return
        except zmq.ZMQError as e:
            self._declare_lost("%s: %s" % (LOST_REASON, e))
        finally:
            with self._sock_lock:
                if self._sock is sock:
                    self._sock = None
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(0)
                sock.close(0)

    def _drain_once(self, sock: zmq.Socket, few: bool = False) -> bool:
        """Receives up to a batch under the socket lock, then dispatches it
        without the lock; True when more is waiting. The caller holds
        _recv_lock (one receiver at a time keeps messages in order).
        ``few``: a waiting caller, which expects its reply and little else,
        asks ZMQ_EVENTS after each message instead of reading until the
        socket refuses (a refusal is an exception, dearer than the ask)."""
        got: List[List[bytes]] = []
        more = None
        with self._sock_lock:
            if self._sock is not sock:
                return False  # closed under us: the connection is being torn down
            while len(got) < self._RECV_BATCH:
                try:
                    got.append(sock.recv_multipart(_NOBLOCK))
                except zmq.Again:
                    break
                if few and not sock.getsockopt(_EVENTS) & _POLLIN:
                    more = False
                    break
            if more is None:
                # Reading ZMQ_EVENTS re-arms the edge of ZMQ_FD for the
                # next message, and says whether one is waiting already.
                more = bool(sock.getsockopt(_EVENTS) & _POLLIN)
        for frames in got:
            self._dispatch(frames)
        return more

    def _flush_outbox(self, sock: zmq.Socket) -> bool:
        """Sends what waits in the outbox; True when the socket is still at
        its high-water mark (the rest waits, in order)."""
        if not self._outbox:
            return False
        with self._sock_lock:
            if self._sock is not sock:
                return False
            with self._lock:
                out = list(self._outbox)
                self._outbox.clear()
            for i, data in enumerate(out):
                try:
                    sock.send(data, _NOBLOCK, copy=len(data) < 65536)
                except zmq.Again:
                    with self._lock:
                        self._outbox.extendleft(reversed(out[i:]))
                    return True
        return False

    def _await(self, p: "_Pending", deadline: float) -> None:
        """Waits for ``p``'s reply until ``deadline``, receiving for
        everyone meanwhile when no other thread is (see "Threading
        design"): the reply is read on this thread, with no hand-off from
        the I/O thread."""
        while not p.done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._lost is not None:
                return
            if not self._recv_lock.acquire(blocking=False):
                # The I/O thread (or another caller) is receiving: it
                # dispatches this reply if it is there; else take over.
                p.done.wait(min(left, 0.001))
                continue
            try:
                self._caller_receiving = True
                sock, rpoll = self._sock, self._rpoll
                if sock is None or rpoll is None:
                    p.done.wait(min(left, 0.01))
                    continue
                # Whether a message is waiting is known after a drain; at
                # first ZMQ_EVENTS says (a send may have taken the edge of
                # ZMQ_FD for a message already there).
                with self._sock_lock:
                    ready = self._sock is sock and bool(sock.getsockopt(_EVENTS) & _POLLIN)
                while not p.done.is_set() and self._lost is None:
                    if not ready:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        # Short slices: the monitor (a lost sidecar) is the
                        # I/O thread's, which sets p.done then.
                        rpoll.poll(min(left, 0.1) * 1000)
                    ready = self._drain_once(sock, few=True)
            finally:
                self._caller_receiving = False
                self._recv_lock.release()

    def _dispatch(self, frames: List[bytes]) -> None:
        # One frame per message (docs/engine-api.md, "Transport"); a ROUTER
        # never adds frames on the DEALER side, so anything else is ignored.
        if len(frames) != 1:
            return
        try:
            msg = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception as e:
            _log().warning("kvhost client: dropped a message the sidecar sent that is not msgpack: %s", e)
            return  # a sidecar bug; nothing to route it to
        if not isinstance(msg, dict):
            return
        if "event" in msg:
            self._on_event(msg)
            return
        seq = msg.get("seq")
        with self._lock:
            if seq is None:
                seq = self._unnumbered_locked(msg)
            p = self._pending.pop(seq, None) if isinstance(seq, int) else None
        if p is None:
            if seq is None:
                _log().warning("kvhost client: the sidecar answered a request it could not number: %s: %s",
                               msg.get("code"), msg.get("message"))
            return  # a reply to a request that already timed out
        if msg.get("ok"):
            p.reply = msg
        else:
            p.error = error_for(str(msg.get("code", "internal")), str(msg.get("message", "")))
        if p.done is not None:
            p.done.set()
        if p.error is not None and p.room is not None:
            self._fail_room(p.room, "kvhost serve: %s" % p.error)
        cb = p.on_error if p.error is not None else p.on_reply
        if cb is not None:
            try:
                cb(p.error if p.error is not None else p.reply)
            except Exception:  # an adapter's bug must not kill the I/O thread
                _log().exception("kvhost client: callback of %s failed", p.op)
        if p.error is not None and p.error.code == "no_hello" and p.op != "hello":
            # This connection said hello, so the sidecar answering no_hello
            # is another process that took over the endpoint before the
            # monitor saw the old one go: everything registered is gone.
            self._declare_lost(LOST_REASON + ": the sidecar restarted (it answered no_hello)")

    def _unnumbered_locked(self, msg: dict) -> Optional[int]:
        """The request a reply with ``seq`` nil answers (docs/engine-api.md:
        a request whose seq cannot be read). This client always sends a
        seq, so it is a too_large refusal of an oversize request (the oldest
        one sent), or, with one request in flight, that request."""
        if msg.get("code") == "too_large":
            while self._oversize:
                seq = self._oversize.popleft()
                if seq in self._pending:
                    return seq
        if len(self._pending) == 1:
            return next(iter(self._pending))
        return None

    def _on_event(self, ev: dict) -> None:
        if ev.get("event") == "room":
            try:
                key = (int(ev["rank"]), int(ev["room"]))
                st = int(ev["state"])
            except (KeyError, TypeError, ValueError):
                return
            with self._lock:
                self._set_state_locked(key, st, str(ev.get("reason") or ""))
        self._emit(ev)

    def _emit(self, ev: dict) -> None:
        with self._lock:
            listeners = list(self._listeners)
            if self._queue_events:
                if len(self._events) >= self._max_events:
                    self._events.popleft()
                    self.events_dropped += 1
                self._events.append(ev)
                self._events_cv.notify_all()
        for fn in listeners:
            try:
                fn(ev)
            except Exception:  # a listener's bug must not kill the I/O thread
                _log().exception("kvhost client: event listener failed")

    def _set_state_locked(self, key: Tuple[int, int], st: int, reason: str) -> None:
        """SGLang's rule (CommonKVManager.update_status): a room's state only
        moves up, except Failed, which always wins; Failed and Success are
        final."""
        old = self._rooms.get(key)
        if old is not None:
            ost, oreason = old
            if ost in (FAILED, SUCCESS):
                return
            if st != FAILED and st <= ost:
                return
        self._rooms[key] = (st, reason if st == FAILED else "")

    def _fail_room(self, room: Tuple[int, int, int], reason: str) -> None:
        """Fails a tracked room in the state cache (a refused request
        nobody waited for) and reports it like a room event of the
        sidecar's; a room already final, forgotten, or made again since
        the request was sent (another token) stays as it is."""
        key = (room[0], room[1])
        with self._lock:
            old = self._rooms.get(key)
            if old is None or old[0] in (FAILED, SUCCESS) or self._room_tokens.get(key, 0) != room[2]:
                return
            self._rooms[key] = (FAILED, reason)
        self._emit({"event": "room", "rank": key[0], "room": key[1], "state": FAILED, "reason": reason})

    def _declare_lost(self, reason: str, emit: bool = True) -> None:
        with self._lock:
            first = self._lost is None
            if first:
                self._lost = reason
            pending = list(self._pending.values())
            self._pending.clear()
            failed = []
            for key, (st, _) in list(self._rooms.items()):
                if st not in (FAILED, SUCCESS):
                    self._rooms[key] = (FAILED, LOST_REASON)
                    failed.append(key)
        for p in pending:
            p.error = ConnectionLost("connection_lost", reason)
            if p.done is not None:
                p.done.set()
            if p.on_error is not None:
                try:
                    p.on_error(p.error)
                except Exception:
                    _log().exception("kvhost client: callback of %s failed", p.op)
        if emit and first:
            for rank, room in failed:
                self._emit({"event": "room", "rank": rank, "room": room, "state": FAILED, "reason": LOST_REASON})
            self._emit({"event": "connection_lost", "reason": reason})

    # -- requests ----------------------------------------------------------

    def _enqueue(self, msg: dict, p: _Pending) -> int:
        """Numbers a request and sends it on the caller's thread (see
        "Threading design"); raises ConnectionLost or TooLarge (nothing
        sent) at once."""
        op = msg["op"]
        wake = False
        with self._sock_lock:
            with self._lock:
                if self._lost is not None:
                    raise ConnectionLost("connection_lost", self._lost)
                if p.room is not None:
                    key = (p.room[0], p.room[1])
                    p.room = (key[0], key[1], self._room_tokens.get(key, 0))
                seq = next(self._seq)
                msg["seq"] = seq
                data = msgpack.packb(msg, use_bin_type=True)
                if self.hello is not None and len(data) > self.hello.max_message:
                    raise TooLarge("too_large", "%s is %d bytes, the sidecar's max_message is %d" % (
                        op, len(data), self.hello.max_message))
                self._pending[seq] = p
                if len(data) > self._announced_max:
                    self._oversize.append(seq)
                queued = bool(self._outbox)
                if queued:
                    self._outbox.append(data)
            sock = self._sock
            if not queued and sock is not None:
                try:
                    sock.send(data, _NOBLOCK, copy=len(data) < 65536)
                except zmq.Again:  # at the high-water mark: the I/O thread sends it when it can
                    with self._lock:
                        self._outbox.append(data)
                    wake = True
                except zmq.ZMQError:
                    # The socket is closing (the I/O thread is ending): the
                    # request fails with the connection, as any in flight.
                    wake = True
                else:
                    # ZMQ_FD is edge-triggered and this send may have taken
                    # the edge of a message that arrived meanwhile (see
                    # "Threading design" for when that is checked).
                    if self._io_idle and p.done is None:
                        self._io_idle = False
                        wake = True
            else:
                wake = True
        if wake:
            self._wake()
        return seq

    def _request(self, msg: dict, timeout: Optional[float] = None) -> dict:
        op = msg["op"]
        p = _Pending(op, waited=True)
        seq = self._enqueue(msg, p)
        t = self.timeout if timeout is None else timeout
        self._await(p, time.monotonic() + t)
        if not p.done.is_set():
            with self._lock:
                self._pending.pop(seq, None)
            self._declare_lost("%s: no reply to %s within %.1f s" % (LOST_REASON, op, t))
            # The I/O thread stops on the lost mark; a reply it races in is dropped.
            self._wake()
            if p.error is None:
                p.error = ConnectionLost("connection_lost", self._lost or LOST_REASON)
        if p.error is not None:
            raise p.error
        return p.reply  # type: ignore[return-value]

    def call(self, op: str, *, timeout: Optional[float] = None, **fields: Any) -> dict:
        """Sends one request (any op, for ops this client has no method for)
        and returns the reply map; raises the :class:`KVHostError` subclass
        of an error reply. ``timeout``: this request's wait (default the
        client's)."""
        msg = {k: _plain(v) for k, v in fields.items() if v is not None}
        msg["op"] = op
        return self._request(msg, timeout=timeout)

    def call_nowait(self, op: str, *, rank: int, room: int, **fields: Any) -> None:
        """Sends one request about room ``(rank, room)`` without waiting for
        its reply. Raises at once only what this side knows before sending
        (ConnectionLost, TooLarge); an error reply of the sidecar fails the
        room in the state cache with the reason ``"kvhost serve: <code>:
        <message>"`` (:meth:`state` and :meth:`failure_reason` answer it;
        listeners get a room event). The sidecar handles one connection's
        requests in order (docs/engine-api.md, "Messages"), so any request
        sent after this one sees its effect. The room must be tracked (made
        by this client's ``sender_create`` / ``receiver_create``) for a
        refusal to show; a reply after the connection is lost is moot (the
        room is Failed by then). A request about no room (vLLM's ``watch``)
        goes with :meth:`send_nowait`."""
        msg = {k: _plain(v) for k, v in fields.items() if v is not None}
        msg["op"] = op
        msg["rank"] = int(rank)
        msg["room"] = int(room)
        self._enqueue(msg, _Pending(op, (int(rank), int(room), 0)))

    def send_nowait(self, op: str, *, on_error: Optional[Callable[[KVHostError], None]] = None,
                    on_reply: Optional[Callable[[dict], None]] = None, **fields: Any) -> None:
        """Sends one request without waiting for its reply (as
        :meth:`call_nowait`, for requests that are not about a room):
        ``on_error(error)`` or ``on_reply(reply)`` is called on the I/O
        thread when the answer comes (it must be quick and must not wait
        on this client); with neither, a refusal is only logged at debug
        level. A request in flight when the connection is lost gets
        ``on_error(ConnectionLost)`` (before the ``connection_lost``
        event)."""
        msg = {k: _plain(v) for k, v in fields.items() if v is not None}
        msg["op"] = op
        if on_error is None and on_reply is None:
            on_error = _log_refusal(op)
        self._enqueue(msg, _Pending(op, on_error=on_error, on_reply=on_reply))

    # -- memory ------------------------------------------------------------

    def register_memory(self, regions: Sequence[dict]) -> List[int]:
        """Registers regions (``{"kind": "dram", "addr", "length", "shm",
        "offset"}`` or ``{"kind": "vram", "addr", "length", "cuda_ipc",
        "offset", "device"}``; :mod:`kvhost.shm` builds the first kind).
        All or nothing. Returns the region ids."""
        return [int(r) for r in self.call("register_memory", regions=list(regions))["regions"]]

    def deregister_memory(self, region_ids: Sequence[int]) -> None:
        self.call("deregister_memory", regions=[int(r) for r in region_ids])

    # -- ranks -------------------------------------------------------------

    # open_rank may take up to 30 s on the sidecar (an SGLang prefill rank
    # answers once it registered with its bootstrap server): its wait is
    # that bound plus the client's timeout, so a slow bootstrap server is
    # not mistaken for a lost sidecar.
    OPEN_RANK_BOUND = 30.0

    def open_rank(self, style: str, role: str, **fields: Any) -> dict:
        """Opens an engine rank (fields of docs/engine-api.md, "Ranks").
        Returns the reply (``rank``, ``agent``, ``endpoint``, ...)."""
        return self.call("open_rank", timeout=self.timeout + self.OPEN_RANK_BOUND, style=style, role=role, **fields)

    def close_rank(self, rank: int) -> None:
        self.call("close_rank", rank=rank)
        with self._lock:
            for key in [k for k in self._rooms if k[0] == rank]:
                st, _ = self._rooms[key]
                if st not in (FAILED, SUCCESS):
                    self._rooms[key] = (FAILED, "rank closed")

    # -- SGLang push rooms --------------------------------------------------

    def _track(self, rank: int, room: int, st: int) -> bool:
        """Starts tracking a room about to be created (before the request,
        so no event can come first); False when the id is tracked already
        (the create will be refused with ``exists``, and the room that has
        the id keeps its state). close_room forgets ids, so reuse works."""
        with self._lock:
            key = (int(rank), int(room))
            if key in self._rooms:
                return False
            self._rooms[key] = (st, "")
            self._room_tokens[key] = next(self._tokens)
            return True

    def sender_create(self, rank: int, room: int) -> None:
        added = self._track(rank, room, BOOTSTRAPPING)
        try:
            self.call("sender_create", rank=rank, room=room)
        except KVHostError:
            if added:
                self._forget(rank, room)
            raise

    def sender_init(self, rank: int, room: int, num_pages: int, aux_index: int) -> None:
        self.call("sender_init", rank=rank, room=room, num_pages=num_pages, aux_index=aux_index)

    # The pipelined forms of the room requests (the SGLang adapter's): each
    # returns once the request is sent, and a refusal fails the room in the
    # state cache with the reason "kvhost serve: <code>: <message>"
    # (call_nowait), which state() / failure_reason() and the adapter's
    # poll() report. SGLang's own connectors do the same: KVSender.__init__,
    # init, send and KVReceiver.init / send_metadata queue work to
    # background threads and report failures through poll()
    # (python/sglang/srt/disaggregation/nixl/conn.py). The sidecar handles
    # one connection's requests in order, so nothing needs a reply before
    # the next request.

    def sender_create_nowait(self, rank: int, room: int) -> None:
        """:meth:`sender_create` without waiting. A room id this client
        tracks already raises :class:`Exists` at once (the sidecar would
        refuse it, and its refusal must not fail the room that has the id)."""
        self._create_nowait("sender_create", rank, room)

    def receiver_create_nowait(self, rank: int, room: int, bootstrap_addr: str,
                               prefill_dp_rank: Optional[int] = None) -> None:
        """:meth:`receiver_create` without waiting (as
        :meth:`sender_create_nowait`)."""
        self._create_nowait("receiver_create", rank, room, bootstrap_addr=bootstrap_addr,
                            prefill_dp_rank=prefill_dp_rank)

    def _create_nowait(self, op: str, rank: int, room: int, **fields: Any) -> None:
        if not self._track(rank, room, BOOTSTRAPPING):
            raise Exists("exists", "room %d is in use on rank %d (this client made it)" % (int(room), int(rank)))
        try:
            self.call_nowait(op, rank=rank, room=room, **fields) if fields else self._room_nowait(
                {"op": op, "rank": int(rank), "room": int(room)})
        except KVHostError:
            self._forget(rank, room)
            raise

    def _room_nowait(self, msg: dict) -> None:
        """call_nowait for a message of plain values built by the caller
        (the per-request room requests: no conversion pass)."""
        self._enqueue(msg, _Pending(msg["op"], (msg["rank"], msg["room"], 0)))

    def sender_init_nowait(self, rank: int, room: int, num_pages: int, aux_index: int) -> None:
        self._room_nowait({"op": "sender_init", "rank": int(rank), "room": int(room), "num_pages": int(num_pages),
                           "aux_index": int(aux_index)})

    def receiver_init_nowait(self, rank: int, room: int, pages: Any, aux_index: int,
                             state_indices: Any = None, prefix_len: int = 0) -> None:
        msg = {"op": "receiver_init", "rank": int(rank), "room": int(room), "pages": pack_pages(pages),
               "aux_index": int(aux_index), "prefix_len": int(prefix_len or 0)}
        state = pack_state(state_indices)
        if state is not None:
            msg["state_indices"] = state
        self._room_nowait(msg)

    def abort_nowait(self, rank: int, room: int) -> None:
        self._room_nowait({"op": "abort", "rank": int(rank), "room": int(room)})

    def close_room_nowait(self, rank: int, room: int) -> None:
        """Forgets a room (state cache at once, sidecar in order). Its
        refusal fails nothing: the id may be made again before the answer
        comes, and that room is another one."""
        try:
            self.send_nowait("close_room", rank=rank, room=room)
        finally:
            self._forget(rank, room)

    def sender_prefix_len_async(self, rank: int, room: int) -> "PrefixLen":
        """Asks :meth:`sender_prefix_len` without waiting: the answer is
        ``.result()`` of the returned object (a refusal raises there)."""
        f = PrefixLen()
        self.send_nowait("sender_prefix_len", rank=rank, room=room, on_error=f._fail, on_reply=f._done)
        return f

    def sender_send(self, rank: int, room: int, pages: Any, state_indices: Any = None) -> None:
        """One chunk; ``state_indices`` (with the last chunk) as
        :func:`pack_state` takes them."""
        self.call("sender_send", rank=rank, room=room, pages=pack_pages(pages), state_indices=pack_state(state_indices))

    def sender_prefix_len(self, rank: int, room: int) -> int:
        """decode_prefix_len of a WaitingForInput prefill room: the tokens
        the decode side already holds."""
        return int(self.call("sender_prefix_len", rank=rank, room=room).get("prefix_len") or 0)

    def sender_send_nowait(self, rank: int, room: int, pages: Any, state_indices: Any = None) -> None:
        """:meth:`sender_send` without waiting for the reply
        (:meth:`call_nowait`): a refusal fails the room in the state cache.
        SGLang's connectors do the same: send queues the chunk to a
        transfer thread and failures surface through poll() (SGLang's
        python/sglang/srt/disaggregation/nixl/conn.py, NixlKVSender.send)."""
        msg = {"op": "sender_send", "rank": int(rank), "room": int(room), "pages": pack_pages(pages)}
        state = pack_state(state_indices)
        if state is not None:
            msg["state_indices"] = state
        self._room_nowait(msg)

    def receiver_create(self, rank: int, room: int, bootstrap_addr: str,
                        prefill_dp_rank: Optional[int] = None) -> None:
        added = self._track(rank, room, BOOTSTRAPPING)
        try:
            self.call("receiver_create", rank=rank, room=room, bootstrap_addr=bootstrap_addr,
                      prefill_dp_rank=prefill_dp_rank)
        except KVHostError:
            if added:
                self._forget(rank, room)
            raise

    def receiver_init(self, rank: int, room: int, pages: Any, aux_index: int,
                      state_indices: Any = None, prefix_len: int = 0) -> None:
        self.call("receiver_init", rank=rank, room=room, pages=pack_pages(pages), aux_index=aux_index,
                  state_indices=pack_state(state_indices), prefix_len=int(prefix_len or 0))

    def abort(self, rank: int, room: int) -> None:
        self.call("abort", rank=rank, room=room)

    def close_room(self, rank: int, room: int) -> None:
        """Forgets a room (sidecar and state cache)."""
        try:
            self.call("close_room", rank=rank, room=room)
        finally:
            self._forget(rank, room)

    def _forget(self, rank: int, room: int) -> None:
        with self._lock:
            self._rooms.pop((int(rank), int(room)), None)
            self._room_tokens.pop((int(rank), int(room)), None)

    def poll(self, rank: int, rooms: Sequence[int]) -> List[Optional[int]]:
        """Batched poll: the KVPoll state of each room (None for a room the
        sidecar does not know). Failure reasons go to the state cache
        (:meth:`failure_reason`)."""
        rooms = [int(r) for r in rooms]
        reply = self.call("poll", rank=rank, rooms=pack_u64(rooms))
        states = bytes(reply.get("states") or b"")
        if len(states) != len(rooms):
            raise InternalError("internal", "poll answered %d states for %d rooms" % (len(states), len(rooms)))
        reasons = reply.get("reasons") or {}
        out: List[Optional[int]] = []
        with self._lock:
            for room, st in zip(rooms, states):
                if st == _UNKNOWN_ROOM:
                    out.append(None)
                    continue
                self._set_state_locked((int(rank), room), st, str(reasons.get(str(room), "")))
                out.append(st)
        return out

    def state(self, rank: int, room: int) -> Optional[int]:
        """The room's KVPoll state as the events said, without a round trip;
        None for a room this client has not seen. (No lock: a dict read
        is atomic in CPython and the entry is replaced, never mutated;
        adapters call this for every request on every scheduler step.)"""
        v = self._rooms.get((int(rank), int(room)))
        return None if v is None else v[0]

    def failure_reason(self, rank: int, room: int) -> Optional[str]:
        """The reason of a Failed room, else None."""
        with self._lock:
            v = self._rooms.get((int(rank), int(room)))
        return v[1] if v is not None and v[0] == FAILED else None

    def start_bootstrap(self, host: str, port: int) -> str:
        """Starts the sidecar's bootstrap server (SGLang's KVBootstrapServer);
        returns its ``host:port``."""
        return str(self.call("start_bootstrap", host=host, port=port)["addr"])

    # -- vLLM pull requests ------------------------------------------------

    def hold(self, engine_id: str, request_id: str, block_ids: Any, num_tokens: Optional[int] = None) -> dict:
        """Holds a finished prefill request's blocks; returns vLLM's
        kv_transfer_params. ``num_tokens`` (the request's computed tokens)
        is what later NIXL generations send as ``remote_num_tokens``."""
        fields = dict(engine_id=engine_id, request_id=request_id, block_ids=pack_pages(block_ids, "block_ids"))
        if num_tokens is not None:
            fields["num_tokens"] = int(num_tokens)
        return dict(self.call("hold", **fields)["kv_transfer_params"])

    def hold_nowait(self, engine_id: str, request_id: str, block_ids: Any, num_tokens: Optional[int],
                    on_error: Callable[[KVHostError], None],
                    on_reply: Optional[Callable[[dict], None]] = None) -> None:
        """:meth:`hold` without waiting (:meth:`send_nowait`): a refusal
        calls ``on_error(error)``, the reply ``on_reply(kv_transfer_params)``,
        both on the I/O thread."""
        fields = dict(engine_id=engine_id, request_id=request_id, block_ids=pack_pages(block_ids, "block_ids"))
        if num_tokens is not None:
            fields["num_tokens"] = int(num_tokens)
        self.send_nowait("hold", on_error=on_error,
                         on_reply=(lambda r: on_reply(dict(r.get("kv_transfer_params") or {}))) if on_reply else None,
                         **fields)

    def release(self, engine_id: str, request_id: str) -> None:
        self.call("release", engine_id=engine_id, request_id=request_id)

    def read(self, rank: int, request_id: str, kv_transfer_params: dict, block_ids: Any) -> None:
        """Starts reading a request's blocks; a ``read`` event reports it."""
        self.call("read", rank=rank, request_id=request_id, kv_transfer_params=kv_transfer_params,
                  block_ids=pack_pages(block_ids, "block_ids"))

    def watch_nowait(self, rank: int, request_id: str, kv_transfer_params: dict) -> None:
        """Renew the prefill's lease of a request waiting in the decode's
        queue until its ``read`` ends (generations with leases); pipelined
        (:meth:`send_nowait`): a refusal is logged as a warning."""
        self.send_nowait("watch", on_error=_warn_refusal("watch"), rank=rank, request_id=request_id,
                         kv_transfer_params=kv_transfer_params)

    def unwatch_nowait(self, rank: int, request_id: str) -> None:
        """Stop renewing it (the request ended before its read);
        pipelined, as :meth:`watch_nowait`."""
        self.send_nowait("unwatch", on_error=_warn_refusal("unwatch"), rank=rank, request_id=request_id)

    def read_nowait(self, rank: int, request_id: str, kv_transfer_params: dict, block_ids: Any,
                    on_error: Callable[[KVHostError], None]) -> None:
        """:meth:`read` without waiting for the reply (:meth:`send_nowait`):
        a refusal calls ``on_error(error)`` on the I/O thread; the ``read``
        event reports an accepted read as before."""
        self.send_nowait("read", on_error=on_error, rank=rank, request_id=request_id,
                         kv_transfer_params=kv_transfer_params, block_ids=pack_pages(block_ids, "block_ids"))

    # -- events ------------------------------------------------------------

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Calls ``fn(event)`` for every event, on the I/O thread."""
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def next_event(self, timeout: Optional[float] = None) -> Optional[dict]:
        """The oldest queued event, waiting up to ``timeout`` seconds (None:
        forever); None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._events_cv:
            while not self._events:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._events_cv.wait(left)
            return self._events.popleft()

    def drain_events(self) -> List[dict]:
        """Every queued event, oldest first, without waiting."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out
