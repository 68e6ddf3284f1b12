"""A vLLM NIXL connector side-channel peer for host/pull's interop tests.

It speaks the handshake of two generations of vLLM's NIXL connector with
Debian's python3-zmq and python3-msgpack (msgspec is not packaged;
msgpack.packb of the same dicts gives msgspec's bytes: dataclasses encode as
maps keyed by field name in declaration order, bytes as bin, a tuple as an
array):

  - NIXL_CONNECTOR_VERSION 2, vLLM 0.13's kv_connector/v1/nixl_connector.py;
  - NIXL_CONNECTOR_VERSION 6, vllm-project/vllm's kv_connector/v1/nixl/
    package (metadata.py at version 6; base_scheduler.py's
    _nixl_handshake_listener; base_worker.py's _nixl_handshake and
    _send_heartbeats; pull_worker.py's READ notification);
  - NIXL_CONNECTOR_VERSION 10, the same package @ 0316d25ab528
    (metadata.py: block_strides after block_lens, dcp_size and pcp_size
    last, default 1; base_scheduler.py: the version-6 handshake;
    pull_worker.py _read_blocks: the READ notification
    "{remote_request_id}:{expected_consumers}", the decode ranks reading
    that prefill rank).

  req ENDPOINT RANK [VERSION [DECODE_TP REQ_ID [PREFILL_TP]]]
                      as _nixl_handshake: REQ, RCVTIMEO 5 s, send
                      (GET_META_MSG, RANK) (version 6: (GET_META_MSG, 0,
                      RANK), and the reply has a second frame, the prefill's
                      perf_counter()), decode NixlHandshakePayload then
                      NixlAgentMetadata with msgspec's type rules; print
                      JSON. Version 6 with DECODE_TP and REQ_ID also prints
                      the READ notification and the heartbeat such a decode
                      rank sends for REQ_ID (version 10 also needs
                      PREFILL_TP: its notification counts readers).
  router SPEC N [VERSION]
                      as _nixl_handshake_listener: bind a ROUTER on a random
                      loopback port, print "PORT <n>", answer N requests
                      [identity, b"", msg] with SPEC's payload of the rank
                      asked (version 6: and the clock frame), print "OK <n>".
                      A request of the other generation's shape is answered
                      in this generation's shape, rank taken from its end
                      (where vLLM's listener would fail to unpack it).
"""
import json
import sys
import time

import msgpack
import zmq

GET_META_MSG = b"get_meta_msg"

# NixlAgentMetadata's fields in declaration order, with their types.
METADATA = [
    ("engine_id", str),
    ("agent_metadata", bytes),
    ("kv_caches_base_addr", list),
    ("device_id", int),
    ("num_blocks", int),
    ("block_lens", list),
    ("kv_cache_layout", str),
    ("block_size", int),
]
# Version 6 appends these (metadata.py, NIXL_CONNECTOR_VERSION = 6).
METADATA_V6 = [
    ("ssm_sizes", list),  # tuple[int, int]
    ("attn_backend_name", str),
    ("physical_blocks_per_logical_kv_block", int),
]
PAYLOAD = [("compatibility_hash", str), ("agent_metadata_bytes", bytes)]


# Version 10 (metadata.py @ 0316d25): block_strides (version 9) after
# block_lens, and dcp_size, pcp_size (version 8; defaults 1) at the end.
METADATA_V10_DEFAULTS = [("dcp_size", int), ("pcp_size", int)]


def metadata_fields(version):
    fields = METADATA + (METADATA_V6 if version >= 6 else [])
    if version >= 10:
        at = [n for n, _ in fields].index("block_lens") + 1
        fields = fields[:at] + [("block_strides", list)] + fields[at:] + METADATA_V10_DEFAULTS
    return fields


def check(obj, fields, what):
    if not isinstance(obj, dict):
        sys.exit(f"{what}: a {type(obj).__name__}, want a map")
    for name, ty in fields:
        if name not in obj:
            sys.exit(f"{what}: no field {name}")
        v = obj[name]
        if not isinstance(v, ty) or (ty is int and isinstance(v, bool)):
            sys.exit(f"{what}.{name}: a {type(v).__name__}, want {ty.__name__}")
    if list(obj)[: len(fields)] != [n for n, _ in fields]:
        sys.exit(f"{what}: fields out of declaration order: {list(obj)}")


def encode_metadata(md, version=2):
    return msgpack.packb({n: md[n] for n, _ in metadata_fields(version)}, use_bin_type=True)


def encode_payload(compat_hash, md_bytes):
    return msgpack.packb({"compatibility_hash": compat_hash, "agent_metadata_bytes": md_bytes}, use_bin_type=True)


def req(endpoint, rank, version=2, decode_tp=None, req_id=None, prefill_tp=None):
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    query = (GET_META_MSG, 0, rank) if version >= 6 else (GET_META_MSG, rank)
    start = time.perf_counter()
    s.send(msgpack.packb(query, use_bin_type=True))
    parts = s.recv_multipart()
    recv = time.perf_counter()
    out = {}
    if version >= 6:
        if len(parts) != 2:
            sys.exit(f"reply of {len(parts)} frames, version 6 has 2")
        remote = msgpack.unpackb(parts[1], raw=False)
        if not isinstance(remote, float) or parts[1] != msgpack.packb(remote):
            sys.exit(f"clock frame {parts[1]!r}: want msgspec's float")
        out["clock_offset"] = remote - (start + recv) / 2
    elif len(parts) != 1:
        sys.exit(f"reply of {len(parts)} frames, version 2 has 1")
    reply = parts[0]
    payload = msgpack.unpackb(reply, raw=False)
    check(payload, PAYLOAD, "NixlHandshakePayload")
    md = msgpack.unpackb(payload["agent_metadata_bytes"], raw=False)
    fields = metadata_fields(version)
    check(md, fields, "NixlAgentMetadata")
    ints = ["kv_caches_base_addr", "block_lens"] + (["ssm_sizes"] if version >= 6 else []) + (
        ["block_strides"] if version >= 10 else [])
    for name in ints:
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in md[name]):
            sys.exit(f"NixlAgentMetadata.{name}: not a list of int")
    if version >= 6 and len(md["ssm_sizes"]) != 2:
        sys.exit("NixlAgentMetadata.ssm_sizes: not a tuple[int, int]")
    byte_exact = (encode_payload(payload["compatibility_hash"], payload["agent_metadata_bytes"]) == reply
                  and encode_metadata(md, version) == payload["agent_metadata_bytes"])
    meta = dict(md)
    meta["agent_metadata"] = md["agent_metadata"].hex()
    out.update({"compatibility_hash": payload["compatibility_hash"], "metadata": meta, "byte_exact": byte_exact})
    if version >= 6 and decode_tp is not None:
        # pull_worker.py: f"{remote_request_id}:{self.world_size}" (version
        # 6), f"{remote_request_id}:{expected_consumers}" (version 10: the
        # decode ranks reading one prefill rank);
        # base_worker.py _send_heartbeats: "HB:" + ",".join(req_ids).
        if version >= 10:
            out["notif"] = f"{req_id}:{max(decode_tp // prefill_tp, 1)}"
        else:
            out["notif"] = f"{req_id}:{decode_tp}"
        out["heartbeat"] = "HB:" + ",".join([req_id])
    print(json.dumps(out), flush=True)
    s.close()
    ctx.term()


def router(spec_path, n, version=2):
    with open(spec_path) as f:
        spec = json.load(f)
    payloads = {}
    for rank, p in spec.items():
        md = dict(p["metadata"])
        md["agent_metadata"] = bytes.fromhex(md["agent_metadata"])
        md.setdefault("ssm_sizes", (0, 0))
        md.setdefault("attn_backend_name", "FLASH_ATTN")
        md.setdefault("physical_blocks_per_logical_kv_block", 1)
        md.setdefault("block_strides", md["block_lens"])
        md.setdefault("dcp_size", 1)
        md.setdefault("pcp_size", 1)
        payloads[int(rank)] = encode_payload(p["compatibility_hash"], encode_metadata(md, version))
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 20000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print("PORT", port, flush=True)
    for _ in range(n):
        identity, _, msg = s.recv_multipart()
        parts = msgpack.unpackb(msg, raw=False)
        tag, rank = parts[0], parts[-1]
        if tag != GET_META_MSG:
            sys.exit(f"unexpected message {tag!r}")
        if version >= 6:
            ts = msgpack.packb(time.perf_counter())
            s.send_multipart((identity, b"", payloads[rank], ts))
        else:
            s.send_multipart((identity, b"", payloads[rank]))
    print("OK", n, flush=True)
    s.close()
    ctx.term()


def main():
    mode = sys.argv[1]
    if mode == "req":
        version = int(sys.argv[4]) if len(sys.argv) > 4 else 2
        decode_tp = int(sys.argv[5]) if len(sys.argv) > 5 else None
        req_id = sys.argv[6] if len(sys.argv) > 6 else None
        prefill_tp = int(sys.argv[7]) if len(sys.argv) > 7 else None
        if version >= 10 and decode_tp is not None and prefill_tp is None:
            sys.exit("version 10's READ notification needs PREFILL_TP")
        req(sys.argv[2], int(sys.argv[3]), version, decode_tp, req_id, prefill_tp)
    elif mode == "router":
        router(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
