"""vLLM-side peer for host/wire/vllm interop tests.

Speaks the NIXL connector handshake of vLLM 0.13 (nixl_connector.py):
a REQ socket sends msgspec.msgpack.encode((GET_META_MSG, rank)) and decodes
NixlHandshakePayload, then NixlAgentMetadata; a ROUTER socket answers
[identity, b"", request] with [identity, b"", payload]. msgspec encodes the
two dataclasses as maps keyed by field name in declaration order, and bytes
as bin; msgpack.packb of the same dicts produces the same bytes, which is
what this peer uses (Debian has python3-msgpack, not msgspec).

  req ENDPOINT RANK       fetch and decode; print the result as JSON
  router SPEC N           serve SPEC's payloads (by TP rank) for N requests;
                          print "PORT <n>" first and "OK <n>" at the end
  badreq ENDPOINT         send malformed requests; each must get a reply
                          (empty) within 2 s; print "OK"
  hash SPEC               print the compatibility hash of each factor set
  encode6 SPEC            print, as hex, msgpack.packb (msgspec's bytes) of
                          SPEC's version-6 handshake request
                          (GET_META_MSG, pp_rank, tp_rank), its
                          NixlAgentMetadata (version 6 fields in
                          declaration order) and its clock (a float)
  encode10 SPEC           the same for version 10 (vllm-project/vllm
                          nixl/metadata.py @ 0316d25): block_strides after
                          block_lens, dcp_size and pcp_size at the end
  encode12 SPEC           the same for version 12 (nixl/metadata.py @
                          02cfb534): region_num_blocks, region_group_ids,
                          region_names, region_mem_types (list or None)
                          before dcp_size, region_members last; version 11
                          without region_members when SPEC has "version": 11
  notif SPEC              parse each notification of SPEC (hex strings) as
                          _get_new_notifs does; print [[id, tp_ratio] or
                          null, ...] (tp_ratio as a decimal string)
"""
import hashlib
import json
import sys

import msgpack
import zmq

GET_META_MSG = b"get_meta_msg"
METADATA_FIELDS = [
    ("engine_id", str), ("agent_metadata", bytes), ("kv_caches_base_addr", list),
    ("device_id", int), ("num_blocks", int), ("block_lens", list),
    ("kv_cache_layout", str), ("block_size", int),
]


# NixlAgentMetadata's field order per encode mode: 6 appends three fields
# to 2's; 10 adds block_strides after block_lens and dcp_size/pcp_size
# last; 11 the four region lists before dcp_size; 12 region_members last
# (encode12 with "version": 11 in its spec writes 11's).
_ORDER6 = [n for n, _ in METADATA_FIELDS] + ["ssm_sizes", "attn_backend_name", "physical_blocks_per_logical_kv_block"]
_ORDER10 = (_ORDER6[:_ORDER6.index("block_lens") + 1] + ["block_strides"]
            + _ORDER6[_ORDER6.index("block_lens") + 1:] + ["dcp_size", "pcp_size"])
_ORDER11 = (_ORDER10[:_ORDER10.index("dcp_size")]
            + ["region_num_blocks", "region_group_ids", "region_names", "region_mem_types", "dcp_size", "pcp_size"])
ENCODE_ORDER = {
    "encode6": lambda spec: _ORDER6,
    "encode10": lambda spec: _ORDER10,
    "encode12": lambda spec: _ORDER11 + (["region_members"] if spec.get("version", 12) >= 12 else []),
}

def hash_factors(items):
    # vllm.config.utils.hash_factors
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def encode_metadata(md):
    return msgpack.packb({
        "engine_id": md["engine_id"],
        "agent_metadata": bytes.fromhex(md["agent_metadata"]),
        "kv_caches_base_addr": md["kv_caches_base_addr"],
        "device_id": md["device_id"],
        "num_blocks": md["num_blocks"],
        "block_lens": md["block_lens"],
        "kv_cache_layout": md["kv_cache_layout"],
        "block_size": md["block_size"],
    }, use_bin_type=True)


def encode_payload(h, md_bytes):
    return msgpack.packb({"compatibility_hash": h, "agent_metadata_bytes": md_bytes}, use_bin_type=True)


def typed(obj, fields, what):
    if not isinstance(obj, dict):
        raise SystemExit(f"{what} is {type(obj).__name__}, want a map")
    for name, ty in fields:
        if name not in obj:
            raise SystemExit(f"{what} lacks field {name}")
        if not isinstance(obj[name], ty) or (ty is int and isinstance(obj[name], bool)):
            raise SystemExit(f"{what}.{name} is {type(obj[name]).__name__}, want {ty.__name__}")


def parse_notif(notif):
    # NixlConnectorWorker._get_new_notifs: the request id and the count.
    try:
        req_id, tp_ratio = notif.decode("utf-8").rsplit(":", 1)
        return [req_id, str(int(tp_ratio))]
    except ValueError:  # UnicodeDecodeError is a ValueError
        return None


def main():
    mode = sys.argv[1]
    ctx = zmq.Context()
    if mode == "req":
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(sys.argv[2])
        s.send(msgpack.packb((GET_META_MSG, int(sys.argv[3])), use_bin_type=True))
        reply = s.recv()
        payload = msgpack.unpackb(reply, raw=False)
        typed(payload, [("compatibility_hash", str), ("agent_metadata_bytes", bytes)], "NixlHandshakePayload")
        md = msgpack.unpackb(payload["agent_metadata_bytes"], raw=False)
        typed(md, METADATA_FIELDS, "NixlAgentMetadata")
        out = dict(md)
        out["agent_metadata"] = md["agent_metadata"].hex()
        # The bytes must be exactly what msgspec would have produced.
        exact = (encode_metadata(out) == payload["agent_metadata_bytes"]
                 and encode_payload(payload["compatibility_hash"], payload["agent_metadata_bytes"]) == reply)
        print(json.dumps({"compatibility_hash": payload["compatibility_hash"], "metadata": out,
                          "byte_exact": exact}), flush=True)
        s.close()
    elif mode == "router":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        n = int(sys.argv[3])
        payloads = {int(r): encode_payload(p["compatibility_hash"], encode_metadata(p["metadata"]))
                    for r, p in spec.items()}
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        print("PORT", port, flush=True)
        for _ in range(n):
            identity, _, msg = s.recv_multipart()
            tag, rank = msgpack.unpackb(msg, raw=False)
            if tag != GET_META_MSG:
                raise SystemExit(f"unexpected request tag {tag!r}")
            s.send_multipart((identity, b"", payloads[rank]))
        print("OK", n, flush=True)
        s.close()
    elif mode == "badreq":
        bad = [b"", b"\xc1", msgpack.packb((b"other", 0)),
               msgpack.packb((GET_META_MSG, 999)), msgpack.packb((GET_META_MSG, -1)),
               msgpack.packb([GET_META_MSG]), b"\xdd\xff\xff\xff\xff"]
        for i, b in enumerate(bad):
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 2000)
            s.connect(sys.argv[2])
            s.send(b)
            try:
                rep = s.recv()
            except zmq.Again:
                raise SystemExit(f"bad request {i} got no reply within 2 s")
            if rep != b"":
                raise SystemExit(f"bad request {i} got a non-empty reply")
            s.close()
        print("OK", flush=True)
    elif mode == "hash":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        print(json.dumps([hash_factors(items) for items in spec]), flush=True)
    elif mode in ENCODE_ORDER:
        # msgspec's encoding of a spec'd NixlAgentMetadata (fields in
        # declaration order) and the handshake request of that generation;
        # version 6 also its clock frame.
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        md = dict(spec["metadata"])
        md["agent_metadata"] = bytes.fromhex(md["agent_metadata"])
        md["ssm_sizes"] = tuple(md["ssm_sizes"])
        order = ENCODE_ORDER[mode](spec)
        out = {
            "request": msgpack.packb((GET_META_MSG, spec["pp_rank"], spec["tp_rank"]), use_bin_type=True).hex(),
            "metadata": msgpack.packb({n: md[n] for n in order}, use_bin_type=True).hex(),
        }
        if mode == "encode6":
            out["clock"] = msgpack.packb(float(spec["clock"]), use_bin_type=True).hex()
        print(json.dumps(out), flush=True)
    elif mode == "notif":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        print(json.dumps([parse_notif(bytes.fromhex(h)) for h in spec]), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
    ctx.term()


if __name__ == "__main__":
    main()
