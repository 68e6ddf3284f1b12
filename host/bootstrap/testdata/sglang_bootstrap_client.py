"""SGLang-side bootstrap client for host/bootstrap interop tests.

Does what SGLang's prefill and decode do against a bootstrap server
(sglang/srt/disaggregation/common/conn.py), with urllib instead of requests:
each prefill rank PUTs its registration; decode fetches the parallel info and
rebuilds PrefillServerInfo(**data) (which fails on any unexpected field),
then queries one rank and builds PrefillRankInfo(**data). Prints "OK".

  run ADDR TP PP     register TP*PP ranks (DP 1, CP 1) at ADDR, then query
"""
import dataclasses
import json
import sys
import urllib.error
import urllib.request
from typing import List, Optional


@dataclasses.dataclass
class PrefillServerInfo:
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: Optional[int] = None
    target_tp_rank: Optional[int] = None
    target_tp_ranks: Optional[List[int]] = None
    target_cp_ranks: Optional[List[int]] = None
    target_pp_ranks: Optional[List[int]] = None
    required_dst_info_num: Optional[int] = None
    required_prefill_response_num: Optional[int] = None


@dataclasses.dataclass
class PrefillRankInfo:
    rank_ip: str
    rank_port: int


def call(method, url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def main():
    _, addr, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    base = f"http://{addr}"
    info_url = f"{base}/route?prefill_dp_rank={-1}&prefill_cp_rank={-1}&target_tp_rank={-1}&target_pp_rank={-1}"
    status, _ = call("GET", info_url)
    assert status == 503, f"parallel info before registration: {status}"
    for t in range(tp):
        for p in range(pp):
            payload = {
                "attn_tp_size": tp, "attn_tp_rank": t, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": pp, "pp_rank": p,
                "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
                "rank_port": 20000 + 10 * t + p, "page_size": 16, "kv_cache_dtype": "auto",
                "load_balance_method": "follow_bootstrap_room", "enable_dsa_cache_layer_split": False,
                "prefill_http_port": 30000,
            }
            status, text = call("PUT", f"{base}/route", payload)
            assert status == 200 and text == "OK", (status, text)
    status, text = call("GET", info_url)
    assert status == 200, (status, text)
    info = PrefillServerInfo(**json.loads(text))
    assert (info.attn_tp_size, info.pp_size, info.dp_size, info.page_size, info.kv_cache_dtype) == (tp, pp, 1, 16, "auto"), info
    assert info.follow_bootstrap_room and info.prefill_http_port == 30000, info
    for t in range(tp):
        for p in range(pp):
            status, text = call("GET", f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={t}&target_pp_rank={p}")
            assert status == 200, (status, text)
            rank = PrefillRankInfo(**json.loads(text))
            assert rank == PrefillRankInfo("127.0.0.1", 20000 + 10 * t + p), rank
    status, _ = call("GET", f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}&target_pp_rank=0")
    assert status == 404, status
    status, text = call("GET", f"{base}/health")
    assert (status, text) == (200, "OK"), (status, text)
    status, _ = call("POST", f"{base}/register_dp_rank", {"bootstrap_room": 12345, "dp_rank": 0})
    assert status == 200
    status, text = call("POST", f"{base}/query_dp_ranks", {"bootstrap_rooms": [12345, 999]})
    assert status == 200 and json.loads(text) == {"12345": 0}, text
    print("OK", flush=True)


if __name__ == "__main__":
    main()
