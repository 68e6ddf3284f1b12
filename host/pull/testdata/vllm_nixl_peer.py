"""A vLLM NIXL connector side-channel peer for host/pull's interop tests.

It speaks the handshake of these generations of vLLM's NIXL connector with
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
    that prefill rank);
  - NIXL_CONNECTOR_VERSION 11 and 12, metadata.py @ 02cfb534df56 (11:
    region_num_blocks, region_group_ids, region_names, region_mem_types,
    each a list or None, default None, between
    physical_blocks_per_logical_kv_block and dcp_size; 12: region_members,
    list[list[str]], default [], last); the handshake, kv_transfer_params
    and READ notification of version 10 (pull_worker.py of version 12, as
    the search index stores it: "{remote_request_id}:{expected_consumers}").
    A one-group worker fills the region lists per region with num_blocks,
    group 0, the layer's name and its NIXL memory type, and a pull worker
    leaves region_members empty (vLLM PR #53780's register_kv_caches, as
    vllm-gaudi copies it; pull_worker.py's _validate_peer).

  req ENDPOINT RANK [VERSION [DECODE_TP REQ_ID [PREFILL_TP]]]
                      as _nixl_handshake: REQ, RCVTIMEO 5 s, send
                      (GET_META_MSG, RANK) (version 6: (GET_META_MSG, 0,
                      RANK), and the reply has a second frame, the prefill's
                      perf_counter()), decode NixlHandshakePayload then
                      NixlAgentMetadata with msgspec's type rules; print
                      JSON. Version 6 with DECODE_TP and REQ_ID also prints
                      the READ notification and the heartbeat such a decode
                      rank sends for REQ_ID (version 10 also needs
                      PREFILL_TP: its notification counts readers, as
                      11 and 12 do).
  router SPEC N [VERSION]
                      as _nixl_handshake_listener: bind a ROUTER on a random
                      loopback port, print "PORT <n>", answer N requests
                      [identity, b"", msg] with SPEC's payload of the rank
                      asked (version 6: and the clock frame), print "OK <n>".
                      A rank's "none" lists the fields it sends as None.
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


# Version 11 (metadata.py @ 02cfb534): the per-region lists, list or None,
# before dcp_size; version 12: region_members last.
OPTIONAL_LIST = (list, type(None))
METADATA_V11_REGIONS = [("region_num_blocks", OPTIONAL_LIST), ("region_group_ids", OPTIONAL_LIST),
                        ("region_names", OPTIONAL_LIST), ("region_mem_types", OPTIONAL_LIST)]


def metadata_fields(version):
    fields = METADATA + (METADATA_V6 if version >= 6 else [])
    if version >= 10:
        at = [n for n, _ in fields].index("block_lens") + 1
        fields = fields[:at] + [("block_strides", list)] + fields[at:]
        fields += (METADATA_V11_REGIONS if version >= 11 else []) + METADATA_V10_DEFAULTS
    if version >= 12:
        fields += [("region_members", list)]
    return fields


def region_defaults(md, regions):
    """What a one-group pull worker of version 11 or 12 advertises per
    region: num_blocks, group 0, the layer's name, its memory type (host
    memory: DRAM); no region members."""
    md.setdefault("region_num_blocks", [md["num_blocks"]] * regions)
    md.setdefault("region_group_ids", [0] * regions)
    md.setdefault("region_names", ["model.layers.%d.self_attn.attn" % i for i in range(regions)])
    md.setdefault("region_mem_types", ["DRAM"] * regions)
    md.setdefault("region_members", [])


def check_regions(md, version):
    """msgspec's types for the region fields: list[int] | None,
    list[str] | None, list[list[str]]."""
    def of(v, ty):
        return all(isinstance(x, ty) and not (ty is int and isinstance(x, bool)) for x in v)
    for name, ty in (("region_num_blocks", int), ("region_group_ids", int), ("region_names", str),
                     ("region_mem_types", str)):
        if md[name] is not None and not of(md[name], ty):
            sys.exit(f"NixlAgentMetadata.{name}: not a list of {ty.__name__} or None")
    if version >= 12 and not all(isinstance(m, list) and of(m, str) for m in md["region_members"]):
        sys.exit("NixlAgentMetadata.region_members: not a list of lists of str")


def check(obj, fields, what):
    if not isinstance(obj, dict):
        sys.exit(f"{what}: a {type(obj).__name__}, want a map")
    for name, ty in fields:
        if name not in obj:
            sys.exit(f"{what}: no field {name}")
        v = obj[name]
        if not isinstance(v, ty) or (ty is int and isinstance(v, bool)):
            want = " or ".join(t.__name__ for t in ty) if isinstance(ty, tuple) else ty.__name__
            sys.exit(f"{what}.{name}: a {type(v).__name__}, want {want}")
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
    if version >= 11:
        check_regions(md, version)
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
        for name in p.get("none", []):  # fields the worker leaves None
            md[name] = None
        md.setdefault("ssm_sizes", (0, 0))
        md.setdefault("attn_backend_name", "FLASH_ATTN")
        md.setdefault("physical_blocks_per_logical_kv_block", 1)
        md.setdefault("block_strides", md["block_lens"])
        md.setdefault("dcp_size", 1)
        md.setdefault("pcp_size", 1)
        if version >= 11:
            region_defaults(md, len(md["kv_caches_base_addr"]))
        payloads[int(rank)] = encode_payload(p["compatibility_hash"], encode_metadata(md, version))
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 20000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print("PORT", port, flush=True)
    def serve_one():
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

    for _ in range(n):
        serve_one()
    print("OK", n, flush=True)
    # Keep answering until the test kills this process (or 20 s of
    # silence): a request from a stray client that reached this port
    # (another test's ZMQ socket reconnecting to a port number the kernel
    # handed out again) may have taken one of the n turns, and the last
    # rank must still get its reply, not a closed socket.
    try:
        while True:
            serve_one()
    except zmq.Again:
        pass
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
            sys.exit("version 10's (and later) READ notification needs PREFILL_TP")
        req(sys.argv[2], int(sys.argv[3]), version, decode_tp, req_id, prefill_tp)
    elif mode == "router":
        router(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
