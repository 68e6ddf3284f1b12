"""Minimal ctypes binding of a kvhost plugin (abi/kvplugin.h, ABI v1), enough
for the interop peers to own memory and an agent on the fake plugin: create
an agent, register numpy buffers, exchange metadata and region blobs, post
batch writes with notifications, and read notifications.

Test helper only (kvhost's own code talks to plugins through host/plugin).
"""
import ctypes as C

KVP_MEM_DRAM, KVP_MEM_VRAM = 0, 1
KVP_OP_WRITE = 1
KVP_SUCCESS, KVP_IN_PROG = 0, 1

VP, SZ, U32, U64, I32 = C.c_void_p, C.c_size_t, C.c_uint32, C.c_uint64, C.c_int32


def _struct(name, fields):
    cls = type(name, (C.Structure,), {"_fields_": [("struct_size", SZ), ("ext", VP)] + fields})
    last = fields[-1][0]
    cls.SIZE = getattr(cls, last).offset + C.sizeof(fields[-1][1])  # KVP_STRUCT_SIZE
    return cls


GetAPIArgs = _struct("GetAPIArgs", [("host_abi_major", U32), ("host_abi_minor", U32),
                                    ("plugin_abi_major_min", U32), ("plugin_abi_major_max", U32), ("api", VP)])
ErrorArgs = _struct("ErrorArgs", [("error", VP)])
ErrorMessageArgs = _struct("ErrorMessageArgs", [("error", VP), ("message", VP), ("message_len", SZ)])


class Param(C.Structure):
    _fields_ = [("key", C.c_char_p), ("key_len", SZ), ("value", C.c_char_p), ("value_len", SZ)]


AgentCreateArgs = _struct("AgentCreateArgs", [("name", C.c_char_p), ("name_len", SZ), ("params", VP),
                                              ("num_params", SZ), ("agent", U64), ("caps", U64)])
AgentDestroyArgs = _struct("AgentDestroyArgs", [("agent", U64)])


class MemDesc(C.Structure):
    _fields_ = [("addr", U64), ("len", U64), ("dev_id", U64), ("mem_kind", U32), ("reserved", U32)]


RegisterMemArgs = _struct("RegisterMemArgs", [("agent", U64), ("descs", VP), ("num_descs", SZ), ("regions", VP)])
RegionExportArgs = _struct("RegionExportArgs", [("agent", U64), ("region", U64), ("buf", VP), ("cap", SZ), ("size", SZ)])
LocalMetadataArgs = _struct("LocalMetadataArgs", [("agent", U64), ("buf", VP), ("cap", SZ), ("size", SZ)])
LoadRemoteArgs = _struct("LoadRemoteArgs", [("agent", U64), ("metadata", VP), ("metadata_len", SZ),
                                            ("peer_name", VP), ("peer_name_len", SZ)])
RemoteRegionImportArgs = _struct("RemoteRegionImportArgs", [
    ("agent", U64), ("peer_name", C.c_char_p), ("peer_name_len", SZ), ("blob", VP), ("blob_len", SZ),
    ("addr", U64), ("len", U64), ("dev_id", U64), ("mem_kind", U32), ("reserved", U32), ("rregion", U64)])


class Notif(C.Structure):
    _fields_ = [("msg", VP), ("msg_len", SZ), ("has_notif", U32), ("reserved", U32)]


class RegionPair(C.Structure):
    _fields_ = [("local", U64), ("remote", U64)]


class BatchEntry(C.Structure):
    _fields_ = [("pair", U32), ("reserved", U32), ("local_offset", U64), ("remote_offset", U64), ("len", U64),
                ("local_stride", U64), ("remote_stride", U64), ("count", U64)]


MakeBatchXferArgs = _struct("MakeBatchXferArgs", [("agent", U64), ("op", U32), ("reserved", U32), ("pairs", VP),
                                                  ("num_pairs", SZ), ("entries", VP), ("num_entries", SZ),
                                                  ("notif", Notif), ("xfer", U64)])
XferArgs = _struct("XferArgs", [("agent", U64), ("xfer", U64), ("status", I32)])
ReleaseXferArgs = _struct("ReleaseXferArgs", [("agent", U64), ("xfer", U64)])
GetNotifsArgs = _struct("GetNotifsArgs", [("agent", U64), ("buf", VP), ("cap", SZ), ("size", SZ), ("count", SZ),
                                          ("needed", SZ)])

_FUNCS = ["error_destroy", "error_message", "error_code", "plugin_info", "agent_create", "agent_destroy",
          "register_mem", "deregister_mem", "region_export", "local_metadata", "load_remote", "remove_remote",
          "remote_region_import", "remote_region_release", "prep_dlist", "release_dlist", "make_prepped_xfer",
          "make_batch_xfer", "post_xfer", "poll_xfer", "release_xfer", "xfer_telemetry", "get_notifs", "send_notif"]


class API(C.Structure):
    _fields_ = [("struct_size", SZ), ("ext", VP), ("abi_major", U32), ("abi_minor", U32)] + [(f, VP) for f in _FUNCS]


class PluginError(Exception):
    pass


class Plugin:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        get = self.lib.kvp_plugin_get_api
        get.argtypes, get.restype = [C.POINTER(GetAPIArgs)], I32
        args = GetAPIArgs(struct_size=GetAPIArgs.SIZE, host_abi_major=1, host_abi_minor=0)
        if get(C.byref(args)) != 0 or not args.api:
            raise PluginError("plugin does not serve ABI 1")
        self.api = API.from_address(args.api)
        self.fn = {}
        for f in _FUNCS:
            restype = None if f.startswith("error_") else VP
            self.fn[f] = C.CFUNCTYPE(restype, VP)(getattr(self.api, f))

    def call(self, name, args):
        err = self.fn[name](C.addressof(args))
        if err:
            m = ErrorMessageArgs(struct_size=ErrorMessageArgs.SIZE, error=err)
            self.fn["error_message"](C.addressof(m))
            text = C.string_at(m.message, m.message_len).decode("utf-8", "replace")
            d = ErrorArgs(struct_size=ErrorArgs.SIZE, error=err)
            self.fn["error_destroy"](C.addressof(d))
            raise PluginError(f"{name}: {text}")
        return args


class Agent:
    def __init__(self, plugin, name, params=()):
        self.p, self.name = plugin, name
        ps = (Param * max(1, len(params)))()
        keep = []
        for i, (k, v) in enumerate(params):
            kb, vb = k.encode(), v.encode()
            keep += [kb, vb]
            ps[i] = Param(kb, len(kb), vb, len(vb))
        nb = name.encode()
        a = AgentCreateArgs(struct_size=AgentCreateArgs.SIZE, name=nb, name_len=len(nb),
                            params=C.addressof(ps), num_params=len(params))
        plugin.call("agent_create", a)
        self.h, self.caps = a.agent, a.caps

    def close(self):
        self.p.call("agent_destroy", AgentDestroyArgs(struct_size=AgentDestroyArgs.SIZE, agent=self.h))

    def register(self, buffers):
        """buffers: list of (numpy array, mem kind); returns region handles."""
        descs = (MemDesc * len(buffers))()
        for i, (arr, kind) in enumerate(buffers):
            descs[i] = MemDesc(arr.ctypes.data, arr.nbytes, 0, kind, 0)
        regions = (U64 * len(buffers))()
        self.p.call("register_mem", RegisterMemArgs(struct_size=RegisterMemArgs.SIZE, agent=self.h,
                                                    descs=C.addressof(descs), num_descs=len(buffers),
                                                    regions=C.addressof(regions)))
        return list(regions)

    def _blob(self, name, cls, **kw):
        a = cls(struct_size=cls.SIZE, agent=self.h, **kw)
        self.p.call(name, a)
        buf = C.create_string_buffer(a.size)
        a = cls(struct_size=cls.SIZE, agent=self.h, buf=C.addressof(buf), cap=a.size, **kw)
        self.p.call(name, a)
        return buf.raw[:a.size]

    def metadata(self):
        return self._blob("local_metadata", LocalMetadataArgs)

    def export(self, region):
        return self._blob("region_export", RegionExportArgs, region=region)

    def load_remote(self, md):
        buf = C.create_string_buffer(md, len(md))
        a = LoadRemoteArgs(struct_size=LoadRemoteArgs.SIZE, agent=self.h, metadata=C.addressof(buf),
                           metadata_len=len(md))
        self.p.call("load_remote", a)
        return C.string_at(a.peer_name, a.peer_name_len).decode()

    def import_blob(self, peer, blob):
        pb, bb = peer.encode(), C.create_string_buffer(blob, len(blob))
        a = RemoteRegionImportArgs(struct_size=RemoteRegionImportArgs.SIZE, agent=self.h, peer_name=pb,
                                   peer_name_len=len(pb), blob=C.addressof(bb), blob_len=len(blob))
        self.p.call("remote_region_import", a)
        return a.rregion, a.addr, a.len

    def import_range(self, peer, addr, length, kind):
        pb = peer.encode()
        a = RemoteRegionImportArgs(struct_size=RemoteRegionImportArgs.SIZE, agent=self.h, peer_name=pb,
                                   peer_name_len=len(pb), addr=addr, len=length, mem_kind=kind)
        self.p.call("remote_region_import", a)
        return a.rregion

    def write(self, pairs, entries, notif=None):
        """Posts one batch WRITE and waits for it. pairs: [(local, remote)];
        entries: [(pair, local_off, remote_off, len)]."""
        ps = (RegionPair * len(pairs))(*[RegionPair(l, r) for l, r in pairs])
        es = (BatchEntry * len(entries))(*[BatchEntry(p, 0, lo, ro, n, 0, 0, 1) for p, lo, ro, n in entries])
        nb = C.create_string_buffer(notif or b"", len(notif or b""))
        nt = Notif(C.addressof(nb), len(notif or b""), 1 if notif is not None else 0, 0)
        a = MakeBatchXferArgs(struct_size=MakeBatchXferArgs.SIZE, agent=self.h, op=KVP_OP_WRITE,
                              pairs=C.addressof(ps), num_pairs=len(pairs), entries=C.addressof(es),
                              num_entries=len(entries), notif=nt)
        self.p.call("make_batch_xfer", a)
        x = a.xfer
        try:
            st = self.p.call("post_xfer", XferArgs(struct_size=XferArgs.SIZE, agent=self.h, xfer=x)).status
            while st == KVP_IN_PROG:
                st = self.p.call("poll_xfer", XferArgs(struct_size=XferArgs.SIZE, agent=self.h, xfer=x)).status
        finally:
            self.p.call("release_xfer", ReleaseXferArgs(struct_size=ReleaseXferArgs.SIZE, agent=self.h, xfer=x))

    def notifs(self):
        """Returns [(sender, message bytes)] received since the last call."""
        out = []
        cap = 1 << 16
        while True:
            buf = C.create_string_buffer(cap)
            a = GetNotifsArgs(struct_size=GetNotifsArgs.SIZE, agent=self.h, buf=C.addressof(buf), cap=cap)
            self.p.call("get_notifs", a)
            raw, off = buf.raw[:a.size], 0
            for _ in range(a.count):
                sl = int.from_bytes(raw[off:off + 4], "little")
                ml = int.from_bytes(raw[off + 4:off + 8], "little")
                off += 8
                out.append((raw[off:off + sl].decode(), raw[off + sl:off + sl + ml]))
                off += sl + ml
            if a.needed:
                cap = max(cap, a.needed) * 2
                continue
            return out
