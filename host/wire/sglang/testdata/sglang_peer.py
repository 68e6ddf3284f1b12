"""SGLang-side peer for host/wire/sglang interop tests.

Builds and parses SGLang's NIXL and MORI control messages with the field
layouts of SGLang's disaggregation/{nixl,mori}/conn.py (sglang/srt/disaggregation/{nixl,mori}/
conn.py and common/{conn,utils}.py), using struct, numpy and msgpack the way
those files do. Message contents come from a JSON spec file written by the
Go test (one object per message, "kind" selects the layout; bytes are hex).

  send SPEC ENDPOINT   build every message of SPEC and PUSH it to ENDPOINT
  recv SPEC            bind a PULL socket, print "PORT <n>", receive one
                       message per SPEC entry, parse it as SGLang's disaggregation/{nixl,mori}/conn.py
                       does, compare with the entry; print "OK <n>"
"""
import json
import struct
import sys

import msgpack
import numpy as np
import zmq

NIXL_GUARD = b"NixlMsgGuard"
MORI_GUARD = b"MoriMsgGuard"


# --- common/utils.py -------------------------------------------------------

def pack_list_of_buffers(buffers):
    if not buffers:
        return b""
    n = len(buffers)
    return struct.pack(f"<{n + 1}I", n, *(len(b) for b in buffers)) + b"".join(buffers)


def unpack_list_of_buffers(buf):
    if buf == b"":
        return []
    (n,) = struct.unpack("<I", buf[:4])
    lens = struct.unpack(f"<{n}I", buf[4:4 + 4 * n])
    out, off = [], 4 + 4 * n
    for length in lens:
        out.append(buf[off:off + length])
        off += length
    return out


def pack_int_lists(lists, fmt):
    return pack_list_of_buffers([struct.pack(f"<{len(a)}{fmt}", *a) for a in lists])


def unpack_int_lists(buf, fmt):
    w = struct.calcsize(fmt)
    return [list(struct.unpack(f"<{len(b) // w}{fmt}", b)) for b in unpack_list_of_buffers(buf)]


# --- builders (decode -> prefill, prefill -> decode) -----------------------

def h(s):
    return bytes.fromhex(s)


def build(m):
    k = m["kind"]
    if k == "nixl_register":
        st = m["staging"]
        return [
            NIXL_GUARD,
            "None".encode("ascii"),
            m["endpoint"].encode("ascii"),
            str(m["port"]).encode("ascii"),
            m["agent_name"].encode("ascii"),
            h(m["agent_metadata"]),
            b"".join(struct.pack("Q", p) for p in m["kv_ptrs"]),
            b"".join(struct.pack("Q", p) for p in m["aux_ptrs"]),
            pack_int_lists(m["state_ptrs"], "Q"),
            str(m["gpu_id"]).encode("ascii"),
            str(m["decode_tp_size"]).encode("ascii"),
            str(m["decode_tp_rank"]).encode("ascii"),
            str(m["kv_item_len"]).encode("ascii"),
            pack_int_lists(m["state_item_lens"], "I"),
            pack_int_lists(m["state_dim_per_tensor"], "I"),
            struct.pack("Q", st["base_ptr"]) if st else b"",
            str(st["total_size"]).encode("ascii") if st else b"",
            str(m["num_slots"]).encode("ascii"),
            ",".join(m["kv_mem_kinds"]).encode("ascii"),
            b"".join(struct.pack("Q", x) for x in m["kv_item_lens"]),
        ]
    if k == "nixl_transfer":
        state = m["dst_state_indices"]
        return [
            NIXL_GUARD,
            str(m["room"]).encode("ascii"),
            m["endpoint"].encode("ascii"),
            str(m["port"]).encode("ascii"),
            m["agent_name"].encode("ascii"),
            np.asarray(m["dst_kv_indices"], dtype=np.int32).tobytes(),
            str(m["dst_aux_index"]).encode("ascii"),
            str(m["required_dst_info_num"]).encode("ascii"),
            pack_int_lists([(i if i is not None else []) for i in state], "i") if state else b"",
            str(m["decode_prefix_len"] or 0).encode("ascii"),
        ]
    if k == "mori_register":
        def descs(lst):
            return msgpack.packb([h(x) for x in lst], use_bin_type=True) if lst else b""

        nested = m["state_mem_descs"]
        return [
            MORI_GUARD,
            "None".encode("ascii"),
            m["endpoint"].encode("ascii"),
            str(m["port"]).encode("ascii"),
            h(m["engine_desc"]),
            descs(m["kv_mem_descs"]),
            descs(m["aux_mem_descs"]),
            msgpack.packb([[h(x) for x in c] for c in nested], use_bin_type=True) if nested else b"",
            str(m["gpu_id"]).encode("ascii"),
            str(m["decode_tp_size"]).encode("ascii"),
            str(m["decode_tp_rank"]).encode("ascii"),
            str(m["kv_item_len"]).encode("ascii"),
            pack_int_lists(m["state_item_lens"], "I"),
            pack_int_lists(m["state_dim_per_tensor"], "I"),
        ]
    if k == "mori_transfer":
        kv = np.asarray(m["dst_kv_indices"], dtype=np.int32)
        aux = m["dst_aux_index"]
        state = m["dst_state_indices"]
        dpl = m["decode_prefix_len"]
        return [
            MORI_GUARD,
            str(m["room"]).encode("ascii"),
            m["endpoint"].encode("ascii"),
            str(m["port"]).encode("ascii"),
            m["engine_key"].encode("ascii"),
            kv.tobytes() if kv.size else b"",
            str(aux).encode("ascii") if aux >= 0 else b"",
            pack_int_lists(state, "i") if state else b"",
            str(m["required_dst_info_num"]).encode("ascii"),
            str(int(dpl)).encode("ascii") if dpl is not None and dpl > 0 else b"",
        ]
    if k == "abort":
        return [b"ABORT", str(m["room"]).encode("ascii"), m["endpoint"].encode("ascii"), str(m["port"]).encode("ascii")]
    if k == "mori_status":
        reason = m["reason"]
        return [
            MORI_GUARD,
            str(m["room"]).encode("ascii"),
            str(int(m["status"])).encode("ascii"),
            str(m["prefill_unique_rank"]).encode("ascii"),
            reason.encode("utf-8") if reason else b"",
        ]
    if k == "aux_data":
        data = h(m["data"])
        return [
            b"AUX_DATA",
            str(m["room"]).encode("ascii"),
            str(m["buffer_index"]).encode("ascii"),
            str(m["aux_index"]).encode("ascii"),
            struct.pack(">I", len(data)),
            data,
        ]
    raise SystemExit(f"unknown kind {k}")


# --- parsers (SGLang's disaggregation/{nixl,mori}/conn.py's from_zmq and handlers) -----------------------

def parse(kind, frames):
    if kind == "abort":
        assert frames[0] == b"ABORT"
        return {"room": int(frames[1].decode("ascii")), "endpoint": frames[2].decode("ascii"),
                "port": int(frames[3].decode("ascii"))}
    if kind == "aux_data":
        assert frames[0] == b"AUX_DATA"
        (n,) = struct.unpack(">I", frames[4])
        assert n == len(frames[5]), "AUX_DATA length mismatch"
        return {"room": int(frames[1].decode("ascii")), "buffer_index": int(frames[2].decode("ascii")),
                "aux_index": int(frames[3].decode("ascii")), "data": frames[5].hex()}
    guard = NIXL_GUARD if kind.startswith("nixl") else MORI_GUARD
    assert frames[0] == guard, f"First message should be {guard}"
    msg = frames[1:]
    if kind == "nixl_register":
        assert msg[0] == b"None"
        kv_ptrs = list(struct.unpack(f"{len(msg[5]) // 8}Q", msg[5]))
        kinds = msg[17].decode("ascii").split(",") if len(msg) > 17 and msg[17] else ["VRAM"] * len(kv_ptrs)
        assert len(kinds) == len(kv_ptrs)
        item_len = int(msg[11].decode("ascii"))
        item_lens = (list(struct.unpack(f"{len(msg[18]) // 8}Q", msg[18])) if len(msg) > 18 and msg[18] != b""
                     else [item_len] * len(kv_ptrs))
        base_ptr = struct.unpack("Q", msg[14])[0] if len(msg) > 14 and len(msg[14]) == 8 else 0
        total = int(msg[15].decode("ascii")) if len(msg) > 15 and len(msg[15]) > 0 else 0
        return {
            "endpoint": msg[1].decode("ascii"), "port": int(msg[2].decode("ascii")),
            "agent_name": msg[3].decode("ascii"), "agent_metadata": msg[4].hex(),
            "kv_ptrs": kv_ptrs, "aux_ptrs": list(struct.unpack(f"{len(msg[6]) // 8}Q", msg[6])),
            "state_ptrs": unpack_int_lists(msg[7], "Q") if len(msg) > 7 and msg[7] != b"" else [],
            "gpu_id": int(msg[8].decode("ascii")), "decode_tp_size": int(msg[9].decode("ascii")),
            "decode_tp_rank": int(msg[10].decode("ascii")), "kv_item_len": item_len,
            "state_item_lens": unpack_int_lists(msg[12], "I") if len(msg) > 12 and len(msg[12]) > 0 else [],
            "state_dim_per_tensor": unpack_int_lists(msg[13], "I") if len(msg) > 13 and len(msg[13]) > 0 else [],
            "staging": None if base_ptr == 0 and total == 0 else {"base_ptr": base_ptr, "total_size": total},
            "num_slots": int(msg[16].decode("ascii")) if len(msg) > 16 and msg[16] != b"" else None,
            "kv_mem_kinds": kinds, "kv_item_lens": item_lens,
        }
    if kind == "nixl_transfer":
        return {
            "room": int(msg[0].decode("ascii")), "endpoint": msg[1].decode("ascii"),
            "port": int(msg[2].decode("ascii")), "agent_name": msg[3].decode("ascii"),
            "dst_kv_indices": np.frombuffer(msg[4], dtype=np.int32).tolist(),
            "dst_aux_index": int(msg[5].decode("ascii")),
            "required_dst_info_num": int(msg[6].decode("ascii")),
            "dst_state_indices": unpack_int_lists(msg[7], "i") if len(msg) > 7 and msg[7] != b"" else [],
            "decode_prefix_len": int(msg[8].decode("ascii")) if len(msg) > 8 and msg[8] != b"" else None,
        }
    if kind == "mori_register":
        def descs(blob):
            return [b.hex() for b in msgpack.unpackb(blob, raw=False)] if blob else []

        desc = msgpack.unpackb(msg[3], raw=False)
        return {
            "endpoint": msg[1].decode("ascii"), "port": int(msg[2].decode("ascii")),
            "engine_desc": msg[3].hex(), "engine_key": desc[0],
            "kv_mem_descs": descs(msg[4]), "aux_mem_descs": descs(msg[5]),
            "state_mem_descs": [[b.hex() for b in c] for c in msgpack.unpackb(msg[6], raw=False)] if msg[6] else [],
            "gpu_id": int(msg[7].decode("ascii")), "decode_tp_size": int(msg[8].decode("ascii")),
            "decode_tp_rank": int(msg[9].decode("ascii")), "kv_item_len": int(msg[10].decode("ascii")),
            "state_item_lens": unpack_int_lists(msg[11], "I") if len(msg) > 11 and msg[11] else [],
            "state_dim_per_tensor": unpack_int_lists(msg[12], "I") if len(msg) > 12 and msg[12] else [],
        }
    if kind == "mori_transfer":
        kv = np.frombuffer(msg[4], dtype=np.int32) if msg[4] else np.array([], dtype=np.int32)
        aux = int(msg[5].decode("ascii")) if msg[5] else -1
        dpl = int(msg[8].decode("ascii")) if len(msg) > 8 and msg[8] else None
        return {
            "room": int(msg[0].decode("ascii")), "endpoint": msg[1].decode("ascii"),
            "port": int(msg[2].decode("ascii")), "engine_key": msg[3].decode("ascii"),
            "dst_kv_indices": kv.tolist(), "dst_aux_index": aux,
            "dst_state_indices": unpack_int_lists(msg[6], "i") if len(msg) > 6 and msg[6] else [],
            "required_dst_info_num": int(msg[7].decode("ascii")) if len(msg) > 7 else 1,
            "decode_prefix_len": dpl,
            "is_dummy": bool(kv.size == 0 and aux < 0 and not dpl),
        }
    if kind == "mori_status":
        return {
            "room": int(msg[0].decode("ascii")), "status": int(msg[1].decode("ascii")),
            "prefill_unique_rank": int(msg[2].decode("ascii")),
            "reason": msg[3].decode("utf-8") if len(msg) > 3 and msg[3] else None,
        }
    raise SystemExit(f"unknown kind {kind}")


def main():
    mode, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    ctx = zmq.Context()
    if mode == "send":
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 10000)
        s.connect(sys.argv[3])
        for m in spec:
            s.send_multipart(build(m))
        s.close()
    elif mode == "recv":
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        print("PORT", port, flush=True)
        for i, want in enumerate(spec):
            frames = s.recv_multipart()
            if frames != build(want):
                raise SystemExit(f"message {i} ({want['kind']}): bytes differ from SGLang's disaggregation/{nixl,mori}/conn.py layout:\n"
                                 f"  go:  {[f.hex() for f in frames]}\n  ref: {[f.hex() for f in build(want)]}")
            got = parse(want["kind"], frames)
            expected = {k: v for k, v in want.items() if k != "kind"}
            if got != expected:
                raise SystemExit(f"message {i} ({want['kind']}): parsed\n  {got}\nwant\n  {expected}")
        print("OK", len(spec), flush=True)
        s.close()
    else:
        raise SystemExit(f"unknown mode {mode}")
    ctx.term()


if __name__ == "__main__":
    main()
