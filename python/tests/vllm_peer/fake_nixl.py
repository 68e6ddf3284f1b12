"""A stand-in for NIXL's ``nixl._api`` over kvhost's fake plugin, so the
vLLM peer (vllm_peer.peer) runs where NIXL is not built (CI).

Only what vLLM's NIXL connector worker calls is here, with the signatures
and return values of ai-dynamo/nixl's python/nixl/_api.py (NIXL 1.4.0,
checked against /opt/nixl's nixl_cu12/_api.py on the build machine):
nixl_agent_config, and on nixl_agent get_reg_descs, register_memory,
deregister_memory, get_xfer_descs, prep_xfer_dlist, release_dlist_handle,
make_prepped_xfer, transfer, check_xfer_state, release_xfer_handle,
get_new_notifs, send_notif, get_agent_metadata, add_remote_agent and
remove_remote_agent. Descriptors are lists of (addr, len, dev_id) tuples
(registration: (addr, len, dev_id, meta)) with mem_type "DRAM" or "VRAM".

Underneath is lib/kvhost/libkvhost_fake.so through its C ABI
(abi/kvplugin.h), called with ctypes: an agent per nixl_agent, its
metadata the fake's (which proves to a loading peer that it is this
process's, plugins/fake/README.md), transfers moved with
process_vm_readv between this process and a ``kvhost serve --backend
fake`` sidecar. So the bytes really cross processes, as NIXL's do.
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
LIBRARY = os.environ.get("KVHOST_FAKE_PLUGIN") or os.path.join(REPO, "lib", "kvhost", "libkvhost_fake.so")

u32, u64, i32, sz, vp = C.c_uint32, C.c_uint64, C.c_int32, C.c_size_t, C.c_void_p

# abi/kvplugin.h constants.
KVP_ABI_MAJOR, KVP_ABI_MINOR = 1, 1
KVP_IN_PROG, KVP_SUCCESS = 1, 0
KVP_OP = {"READ": 0, "WRITE": 1}
MEM_KINDS = {"DRAM": 0, "VRAM": 1, "cpu": 0, "cuda": 1}
DEFAULT_COMM_PORT = 8888  # nixl._api's, unused here


def _args(name, *fields):
    """An args struct of kvplugin.h: struct_size and ext first; its
    struct_size is the end of its last field (KVP_STRUCT_SIZE)."""
    cls = type(name, (C.Structure,), {"_fields_": [("struct_size", sz), ("ext", vp)] + list(fields)})
    last = cls._fields_[-1]
    cls.SIZE = getattr(cls, last[0]).offset + C.sizeof(last[1])
    return cls


class _Param(C.Structure):
    _fields_ = [("key", C.c_char_p), ("key_len", sz), ("value", C.c_char_p), ("value_len", sz)]


class _MemDesc(C.Structure):
    _fields_ = [("addr", u64), ("len", u64), ("dev_id", u64), ("mem_kind", u32), ("reserved", u32)]


class _XferDesc(C.Structure):
    _fields_ = [("addr", u64), ("len", u64), ("stride", u64), ("count", u64), ("dev_id", u64)]


class _Notif(C.Structure):
    _fields_ = [("msg", vp), ("msg_len", sz), ("has_notif", u32), ("reserved", u32)]


_GetApi = _args("GetApi", ("host_abi_major", u32), ("host_abi_minor", u32), ("plugin_abi_major_min", u32),
                ("plugin_abi_major_max", u32), ("api", vp))
_ErrDestroy = _args("ErrDestroy", ("error", vp))
_ErrMessage = _args("ErrMessage", ("error", vp), ("message", vp), ("message_len", sz))
_ErrCode = _args("ErrCode", ("error", vp), ("code", i32))
_AgentCreate = _args("AgentCreate", ("name", C.c_char_p), ("name_len", sz), ("params", C.POINTER(_Param)),
                     ("num_params", sz), ("agent", u64), ("caps", u64))
_AgentDestroy = _args("AgentDestroy", ("agent", u64))
_RegisterMem = _args("RegisterMem", ("agent", u64), ("descs", C.POINTER(_MemDesc)), ("num_descs", sz),
                     ("regions", C.POINTER(u64)))
_DeregisterMem = _args("DeregisterMem", ("agent", u64), ("regions", C.POINTER(u64)), ("num_regions", sz))
_LocalMetadata = _args("LocalMetadata", ("agent", u64), ("buf", vp), ("cap", sz), ("size", sz))
_LoadRemote = _args("LoadRemote", ("agent", u64), ("metadata", vp), ("metadata_len", sz), ("peer_name", vp),
                    ("peer_name_len", sz))
_RemoveRemote = _args("RemoveRemote", ("agent", u64), ("peer_name", C.c_char_p), ("peer_name_len", sz))
_PrepDlist = _args("PrepDlist", ("agent", u64), ("peer_name", C.c_char_p), ("peer_name_len", sz),
                   ("mem_kind", u32), ("reserved", u32), ("descs", C.POINTER(_XferDesc)), ("num_descs", sz),
                   ("dlist", u64))
_ReleaseDlist = _args("ReleaseDlist", ("agent", u64), ("dlist", u64))
_MakePrepped = _args("MakePrepped", ("agent", u64), ("op", u32), ("reserved", u32), ("local_dlist", u64),
                     ("local_indices", C.POINTER(i32)), ("num_local_indices", sz), ("remote_dlist", u64),
                     ("remote_indices", C.POINTER(i32)), ("num_remote_indices", sz), ("notif", _Notif),
                     ("xfer", u64))
_PostXfer = _args("PostXfer", ("agent", u64), ("xfer", u64), ("status", i32))
# ABI 1.0's poll (no flags): the fake reads only what the caller sent.
_PollXfer = _args("PollXfer", ("agent", u64), ("xfer", u64), ("status", i32))
_ReleaseXfer = _args("ReleaseXfer", ("agent", u64), ("xfer", u64))
_GetNotifs = _args("GetNotifs", ("agent", u64), ("buf", vp), ("cap", sz), ("size", sz), ("count", sz),
                   ("needed", sz))
_SendNotif = _args("SendNotif", ("agent", u64), ("peer_name", C.c_char_p), ("peer_name_len", sz), ("msg", vp),
                   ("msg_len", sz))

# kvp_api's function pointers, in its order.
_API_FUNCS = ("error_destroy", "error_message", "error_code", "plugin_info", "agent_create", "agent_destroy",
              "register_mem", "deregister_mem", "region_export", "local_metadata", "load_remote", "remove_remote",
              "remote_region_import", "remote_region_release", "prep_dlist", "release_dlist",
              "make_prepped_xfer", "make_batch_xfer", "post_xfer", "poll_xfer", "release_xfer",
              "xfer_telemetry", "get_notifs", "send_notif", "submit_xfer", "get_event_fd")


class _Api(C.Structure):
    _fields_ = [("struct_size", sz), ("ext", vp), ("abi_major", u32), ("abi_minor", u32)] + [
        (n, vp) for n in _API_FUNCS]


_ERR_FN = C.CFUNCTYPE(vp, vp)
_VOID_FN = C.CFUNCTYPE(None, vp)


def _bytes(s) -> bytes:
    """A name or message as NIXL takes it: str or bytes."""
    return s.encode() if isinstance(s, str) else bytes(s)


class nixlError(RuntimeError):
    """A failed call: the plugin's code (NIXL's nixl_status_t) and message."""

    def __init__(self, fn, code, message):
        super().__init__(f"{fn}: {message} (status {code})")
        self.code = code


class _Plugin:
    """The fake plugin's function table, loaded once per process."""

    _lock = threading.Lock()
    _one: Optional["_Plugin"] = None

    @classmethod
    def get(cls) -> "_Plugin":
        with cls._lock:
            if cls._one is None:
                cls._one = cls(LIBRARY)
            return cls._one

    def __init__(self, path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run `make` (the stand-in nixl._api drives the fake plugin)")
        self.lib = C.CDLL(path)
        entry = self.lib.kvp_plugin_get_api
        entry.restype, entry.argtypes = i32, [vp]
        ga = _GetApi(struct_size=_GetApi.SIZE, host_abi_major=KVP_ABI_MAJOR, host_abi_minor=KVP_ABI_MINOR)
        if entry(C.byref(ga)) != KVP_SUCCESS or not ga.api:
            raise RuntimeError(f"{path}: ABI major {KVP_ABI_MAJOR} not served")
        self.api = _Api.from_address(ga.api)
        self.fns = {}
        for n in _API_FUNCS[: 24]:
            ptr = getattr(self.api, n)
            self.fns[n] = (_VOID_FN if n in ("error_destroy", "error_message", "error_code") else _ERR_FN)(ptr)

    def call(self, fn, args):
        args.struct_size = type(args).SIZE
        err = self.fns[fn](C.addressof(args))
        if err:
            code = _ErrCode(struct_size=_ErrCode.SIZE, error=err)
            self.fns["error_code"](C.addressof(code))
            msg = _ErrMessage(struct_size=_ErrMessage.SIZE, error=err)
            self.fns["error_message"](C.addressof(msg))
            text = C.string_at(msg.message, msg.message_len).decode(errors="replace")
            self.fns["error_destroy"](C.addressof(_ErrDestroy(struct_size=_ErrDestroy.SIZE, error=err)))
            raise nixlError(fn, code.code, text)
        return args


class nixl_agent_config:
    """nixl._api.nixl_agent_config's signature; the fake has no progress
    or listener thread to configure, and one backend."""

    def __init__(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=DEFAULT_COMM_PORT,
                 capture_telemetry=False, num_threads=0, backends=("UCX",), sync_mode=None):
        self.backends = list(backends)
        self.num_threads = num_threads
        self.capture_telemetry = capture_telemetry


class _DescList:
    """nixlRegDList / nixlXferDList: a memory type and its descriptors."""

    def __init__(self, mem_type, descs):
        if mem_type not in MEM_KINDS:
            raise ValueError(f"mem_type {mem_type!r}: the stand-in knows {sorted(MEM_KINDS)}")
        self.mem_type = mem_type
        self.descs = [tuple(int(x) if i < 3 else x for i, x in enumerate(d)) for d in descs]

    def __len__(self):
        return len(self.descs)


class nixl_prepped_dlist_handle:
    def __init__(self, agent, value):
        self._agent, self._handle, self._released = agent, int(value), False

    def release(self):
        if not self._released:
            self._released = True
            self._agent._release_dlist(self._handle)


class nixl_xfer_handle:
    def __init__(self, agent, value):
        self._agent, self._handle, self._released = agent, int(value), False

    def release(self):
        if not self._released:
            self._released = True
            self._agent._release_xfer(self._handle)


class nixl_agent:
    """One fake-plugin agent behind nixl._api.nixl_agent's methods."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all=False):
        self._p = _Plugin.get()
        self.name = agent_name
        name = agent_name.encode()
        a = self._p.call("agent_create", _AgentCreate(name=name, name_len=len(name)))
        self._agent = a.agent
        self._regions = {}  # id(reg dlist) -> region handles
        self._lock = threading.Lock()

    # -- memory --

    def get_reg_descs(self, descs, mem_type=None):
        if isinstance(descs, _DescList):
            return descs
        if not descs or len(descs[0]) != 4:
            raise ValueError("4-tuple list (addr, len, dev_id, meta) needed for registration")
        return _DescList(mem_type, descs)

    def register_memory(self, reg_list, mem_type=None, backends=()):
        descs = self.get_reg_descs(reg_list, mem_type)
        n = len(descs)
        arr = (_MemDesc * n)(*[_MemDesc(addr=d[0], len=d[1], dev_id=d[2], mem_kind=MEM_KINDS[descs.mem_type])
                               for d in descs.descs])
        regions = (u64 * n)()
        self._p.call("register_mem", _RegisterMem(agent=self._agent, descs=arr, num_descs=n, regions=regions))
        self._regions[id(descs)] = list(regions)
        return descs

    def deregister_memory(self, dereg_list, backends=()):
        regions = self._regions.pop(id(dereg_list))
        arr = (u64 * len(regions))(*regions)
        self._p.call("deregister_mem", _DeregisterMem(agent=self._agent, regions=arr, num_regions=len(regions)))

    # -- descriptor lists --

    def get_xfer_descs(self, descs, mem_type=None):
        if isinstance(descs, _DescList):
            return descs
        if not descs or len(descs[0]) != 3:
            raise ValueError("3-tuple list (addr, len, dev_id) needed for transfer")
        return _DescList(mem_type, descs)

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        descs = self.get_xfer_descs(xfer_list, mem_type)
        peer = _bytes(agent_name)
        if peer == b"NIXL_INIT_AGENT":
            peer = b""
        n = len(descs)
        arr = (_XferDesc * n)(*[_XferDesc(addr=d[0], len=d[1], stride=0, count=1, dev_id=d[2]) for d in descs.descs])
        a = self._p.call("prep_dlist", _PrepDlist(agent=self._agent, peer_name=peer or None, peer_name_len=len(peer),
                                                   mem_kind=MEM_KINDS[descs.mem_type], descs=arr, num_descs=n))
        return nixl_prepped_dlist_handle(self, a.dlist)

    def release_dlist_handle(self, handle):
        handle.release()

    def _release_dlist(self, h):
        self._p.call("release_dlist", _ReleaseDlist(agent=self._agent, dlist=h))

    # -- transfers --

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg=b"", backends=(), skip_desc_merge=False):
        li = [int(i) for i in local_indices]
        ri = [int(i) for i in remote_indices]
        la, ra = (i32 * len(li))(*li), (i32 * len(ri))(*ri)
        msg = _bytes(notif_msg)
        buf = C.create_string_buffer(msg, len(msg)) if msg else None
        notif = _Notif(msg=C.cast(buf, vp) if buf is not None else None, msg_len=len(msg), has_notif=1 if msg else 0)
        a = self._p.call("make_prepped_xfer", _MakePrepped(
            agent=self._agent, op=KVP_OP[operation], local_dlist=local_xfer_side._handle, local_indices=la,
            num_local_indices=len(li), remote_dlist=remote_xfer_side._handle, remote_indices=ra,
            num_remote_indices=len(ri), notif=notif))
        return nixl_xfer_handle(self, a.xfer)

    def transfer(self, handle, notif_msg=b""):
        if notif_msg:
            raise NotImplementedError("the stand-in takes the notification at make_prepped_xfer, as vLLM passes it")
        a = self._p.call("post_xfer", _PostXfer(agent=self._agent, xfer=handle._handle))
        return "DONE" if a.status == KVP_SUCCESS else "PROC"

    def check_xfer_state(self, handle):
        try:
            a = self._p.call("poll_xfer", _PollXfer(agent=self._agent, xfer=handle._handle))
        except nixlError:
            return "ERR"
        return "DONE" if a.status == KVP_SUCCESS else "PROC"

    def release_xfer_handle(self, handle):
        handle.release()

    def _release_xfer(self, h):
        self._p.call("release_xfer", _ReleaseXfer(agent=self._agent, xfer=h))

    # -- notifications --

    def get_new_notifs(self, backends=()):
        out: dict = {}
        cap = 1 << 16
        while True:
            buf = C.create_string_buffer(cap)
            a = self._p.call("get_notifs", _GetNotifs(agent=self._agent, buf=C.cast(buf, vp), cap=cap))
            raw = buf.raw[: a.size]
            at = 0
            for _ in range(a.count):
                slen = int.from_bytes(raw[at: at + 4], "little")
                mlen = int.from_bytes(raw[at + 4: at + 8], "little")
                at += 8
                sender = raw[at: at + slen].decode()
                at += slen
                out.setdefault(sender, []).append(raw[at: at + mlen])
                at += mlen
            if a.needed:
                cap = max(cap, a.needed)
                continue
            if a.count == 0:
                return out

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        msg = _bytes(notif_msg)
        name = _bytes(remote_agent_name)
        buf = C.create_string_buffer(msg, len(msg))
        self._p.call("send_notif", _SendNotif(agent=self._agent, peer_name=name, peer_name_len=len(name),
                                              msg=C.cast(buf, vp), msg_len=len(msg)))

    # -- metadata and peers --

    def get_agent_metadata(self) -> bytes:
        a = self._p.call("local_metadata", _LocalMetadata(agent=self._agent))
        buf = C.create_string_buffer(a.size)
        b = self._p.call("local_metadata", _LocalMetadata(agent=self._agent, buf=C.cast(buf, vp), cap=a.size))
        return buf.raw[: b.size]

    def add_remote_agent(self, metadata: bytes) -> str:
        buf = C.create_string_buffer(bytes(metadata), len(metadata))
        a = self._p.call("load_remote", _LoadRemote(agent=self._agent, metadata=C.cast(buf, vp),
                                                    metadata_len=len(metadata)))
        # bytes, as NIXL 1.4's binding returns loadRemoteMD's name.
        return C.string_at(a.peer_name, a.peer_name_len)

    def remove_remote_agent(self, agent: str):
        name = _bytes(agent)
        self._p.call("remove_remote", _RemoveRemote(agent=self._agent, peer_name=name, peer_name_len=len(name)))

    def __del__(self):
        # NIXL's agent is destroyed with the Python object; so is this one
        # (cancelling its transfers, releasing every handle it owns).
        agent = getattr(self, "_agent", 0)
        if agent:
            self._agent = 0
            try:
                self._p.call("agent_destroy", _AgentDestroy(agent=agent))
            except Exception:
                pass
