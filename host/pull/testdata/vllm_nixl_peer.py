"""A vLLM NIXL connector side-channel peer for host/pull's interop tests.

It speaks the handshake of vLLM 0.13's nixl_connector.py with Debian's
python3-zmq and python3-msgpack (msgspec is not packaged; msgpack.packb of
the same dicts gives msgspec's bytes: dataclasses encode as maps keyed by
field name in declaration order, bytes as bin, a tuple as an array).

  req ENDPOINT RANK   as _nixl_handshake: REQ, RCVTIMEO 5 s, send
                      (GET_META_MSG, RANK), decode NixlHandshakePayload then
                      NixlAgentMetadata with msgspec's type rules; print JSON
  router SPEC N       as _nixl_handshake_listener: bind a ROUTER on a random
                      loopback port, print "PORT <n>", answer N requests
                      [identity, b"", msg] with SPEC's payload of the rank
                      asked, print "OK <n>"
"""
import json
import sys

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
PAYLOAD = [("compatibility_hash", str), ("agent_metadata_bytes", bytes)]


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


def encode_metadata(md):
    return msgpack.packb({n: md[n] for n, _ in METADATA}, use_bin_type=True)


def encode_payload(compat_hash, md_bytes):
    return msgpack.packb({"compatibility_hash": compat_hash, "agent_metadata_bytes": md_bytes}, use_bin_type=True)


def req(endpoint, rank):
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    s.send(msgpack.packb((GET_META_MSG, rank), use_bin_type=True))
    reply = s.recv()
    payload = msgpack.unpackb(reply, raw=False)
    check(payload, PAYLOAD, "NixlHandshakePayload")
    md = msgpack.unpackb(payload["agent_metadata_bytes"], raw=False)
    check(md, METADATA, "NixlAgentMetadata")
    for name in ("kv_caches_base_addr", "block_lens"):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in md[name]):
            sys.exit(f"NixlAgentMetadata.{name}: not a list of int")
    byte_exact = (encode_payload(payload["compatibility_hash"], payload["agent_metadata_bytes"]) == reply
                  and encode_metadata(md) == payload["agent_metadata_bytes"])
    out = dict(md)
    out["agent_metadata"] = md["agent_metadata"].hex()
    print(json.dumps({"compatibility_hash": payload["compatibility_hash"], "metadata": out,
                      "byte_exact": byte_exact}), flush=True)
    s.close()
    ctx.term()


def router(spec_path, n):
    with open(spec_path) as f:
        spec = json.load(f)
    payloads = {}
    for rank, p in spec.items():
        md = dict(p["metadata"])
        md["agent_metadata"] = bytes.fromhex(md["agent_metadata"])
        payloads[int(rank)] = encode_payload(p["compatibility_hash"], encode_metadata(md))
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 20000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print("PORT", port, flush=True)
    for _ in range(n):
        identity, _, msg = s.recv_multipart()
        tag, rank = msgpack.unpackb(msg, raw=False)
        if tag != GET_META_MSG:
            sys.exit(f"unexpected message {tag!r}")
        s.send_multipart((identity, b"", payloads[rank]))
    print("OK", n, flush=True)
    s.close()
    ctx.term()


def main():
    mode = sys.argv[1]
    if mode == "req":
        req(sys.argv[2], int(sys.argv[3]))
    elif mode == "router":
        router(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
