"""Interop: kvhost.sglang's prefill classes, beside a sidecar, push KV into
today's `kvhost decode` worker (the SGLang-style push wire, unchanged),
which checks every byte against kvhost's own formula and exits 0 only when
every request succeeded and every byte was right."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import sglang_engine as se
from conftest import REPO, free_port, kvhost_bin
from kvhost import sglang as ks
from kvhost.sglang import KVPoll


def test_kvpool_formula_matches_go():
    """The Python copy of kvpool's formula agrees with values the Go code
    computes (seedKey{1, 0, 0, 0, 0}.seed() and the aux seed of room 1)."""
    s = se.kvpool_seeds(1, 0, 0, [0], [0])
    assert s.shape == (1, 1)
    # Independent recomputation with Python ints.
    M = (1 << 64) - 1

    def mix(z):
        z = (z + 0x9E3779B97F4A7C15) & M
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    h = mix(1 ^ 0x6B76686F7374)
    h = mix(h ^ 0 ^ 0)
    h = mix(h ^ 0)
    assert int(s[0, 0]) == mix(h ^ 0)
    a = se.kvpool_seeds(1, -1, 0, [0], [0])
    h = mix(1 ^ 0x6B76686F7374)
    h = mix(h ^ (((-1) << 1) & M))
    h = mix(h ^ 0)
    assert int(a[0, 0]) == mix(h ^ 0)


# SGLang's MORI connector registers KV as GPU memory only: the mori case
# keeps the prefill's KV in the stand-in libcudart's "GPU memory".
@pytest.mark.parametrize("variant,d_tp,vram", [("nixl", 1, False), ("nixl", 2, False), ("mori", 2, True)])
def test_sidecar_prefill_into_kvhost_decode_worker(sidecar_factory, tmpdir_short, standin_cudart, monkeypatch,
                                                   variant, d_tp, vram):
    from test_sglang import use_standin

    geo = se.Geometry(layers=2, heads=2, head_bytes=16, page_size=4, aux_bytes=64)
    n_req, tokens, room_base, seed = 6, 22, 5000, 3
    if vram:
        use_standin(monkeypatch, standin_cudart)
    a = sidecar_factory("prefill", ["--cudart", standin_cudart] if vram else None)
    port = free_port()
    boot = ks.KVBootstrapServer("127.0.0.1", port, endpoint=a.endpoint)
    sa = se.server_args(1, port, a.endpoint, geo.page_size, variant)
    rank = se.Rank(geo, 1, 0, "prefill", 128, 8, sa, 1, vram=vram)
    summary = os.path.join(tmpdir_short, "decode.json")
    args = [kvhost_bin(), "--backend", "fake", "decode", "--bootstrap-addr", "127.0.0.1:%d" % port,
            "--tp-size", str(d_tp), "--variant", variant, "--requests", str(n_req), "--seed", str(seed),
            "--room-base", str(room_base), "--min-tokens", str(tokens), "--max-tokens", str(tokens),
            "--layers", str(geo.layers), "--kv-heads", str(geo.heads), "--head-dim", str(geo.head_bytes // 2),
            "--dtype-bytes", "2", "--page-size", str(geo.page_size), "--aux-bytes", str(geo.aux_bytes),
            "--summary", summary]
    log = open(os.path.join(tmpdir_short, "decode.log"), "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        reqs = [se.Request(room=room_base + i, tokens=tokens, chunk_pages=2) for i in range(n_req)]
        npages = -(-tokens // geo.page_size)
        senders = {r.room: ks.KVSender(rank.mgr, "127.0.0.1:%d" % port, r.room, [0], 0) for r in reqs}
        pending = set(senders)
        import time

        deadline = time.monotonic() + 120
        state = {room: "bootstrap" for room in senders}
        while pending:
            assert time.monotonic() < deadline, "timed out: %s" % state
            assert proc.poll() is None or proc.returncode == 0, open(log.name).read()
            for room in list(pending):
                s = senders[room]
                p = s.poll()
                if state[room] == "bootstrap" and p == KVPoll.WaitingForInput:
                    pages = rank.alloc(npages)
                    slot = (room - room_base) % 8
                    se.fill_like_kvhost(rank, room, pages, tokens, slot)
                    s.init(npages, slot)
                    for i in range(0, npages, 2):
                        s.send(pages[i:i + 2])
                    state[room] = "inflight"
                elif p in (KVPoll.Success, KVPoll.Failed) and state[room] == "inflight":
                    assert p == KVPoll.Success, (room, s._reason)
                    s.clear()
                    pending.discard(room)
                elif p == KVPoll.Failed:
                    pytest.fail("room %d failed in %s: %s" % (room, state[room], s._reason))
            time.sleep(0.005)
        rc = proc.wait(60)
        out = open(log.name).read() if os.path.exists(log.name) else ""
        assert rc == 0, out
        with open(summary) as f:
            sm = json.load(f)
        assert sm["checked"] is True and sm["ok"] == n_req and sm["verify_errors"] == 0, sm
        assert sm["bytes"] > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        rank.close()
        boot.close()


@pytest.mark.parametrize("variant,d_tp,vram", [("nixl", 1, False), ("nixl", 2, True), ("mori", 2, True)])
def test_kvhost_prefill_worker_into_sidecar_decode(sidecar_factory, tmpdir_short, standin_cudart, monkeypatch,
                                                   variant, d_tp, vram):
    """Today's `kvhost prefill` worker (serving its own bootstrap server)
    pushes into kvhost.sglang's decode classes beside a sidecar; every byte
    is checked in the decode engine's pools against kvhost's formula."""
    import time

    from test_sglang import use_standin

    geo = se.Geometry(layers=2, heads=2, head_bytes=16, page_size=4, aux_bytes=64)
    n_req, tokens, room_base, seed = 6, 22, 7000, 5
    if vram:
        use_standin(monkeypatch, standin_cudart)
    b = sidecar_factory("decode", ["--cudart", standin_cudart] if vram else None)
    port = free_port()
    args = [kvhost_bin(), "--backend", "fake", "prefill", "--bootstrap-port", str(port), "--tp-size", "1",
            "--variant", variant, "--requests", str(n_req), "--seed", str(seed), "--room-base", str(room_base),
            "--min-tokens", str(tokens), "--max-tokens", str(tokens), "--layers", str(geo.layers),
            "--kv-heads", str(geo.heads), "--head-dim", str(geo.head_bytes // 2), "--dtype-bytes", "2",
            "--page-size", str(geo.page_size), "--aux-bytes", str(geo.aux_bytes), "--chunk-pages", "2",
            "--summary", os.path.join(tmpdir_short, "prefill.json")]
    log = open(os.path.join(tmpdir_short, "prefill.log"), "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    ranks = []
    try:
        sa = se.server_args(d_tp, port, b.endpoint, geo.page_size, variant)
        ranks = [se.Rank(geo, d_tp, r, "decode", 128, 8, sa, 1 + r, vram=vram) for r in range(d_tp)]
        addr = "127.0.0.1:%d" % port
        npages = -(-tokens // geo.page_size)
        rooms = [room_base + i for i in range(n_req)]
        recv = {room: [ks.KVReceiver(rk.mgr, addr, room) for rk in ranks] for room in rooms}
        pages = {}
        deadline = time.monotonic() + 120
        # The prefill worker serves its bootstrap server once its ranks
        # registered; SGLang's decode retries the bootstrap the same way.
        for room in rooms:
            for rc in recv[room]:
                rc.init(0)
        pending = set(rooms)
        while pending:
            assert time.monotonic() < deadline, "timed out; prefill log:\n" + open(log.name).read()
            for room in list(pending):
                polls = [rc.poll() for rc in recv[room]]
                p = min(int(x) for x in polls)
                if room not in pages and p == KVPoll.WaitingForInput:
                    pages[room] = [rk.alloc(npages) for rk in ranks]
                    for rk, rc, pg in zip(ranks, recv[room], pages[room]):
                        rc.send_metadata(pg, (room - room_base) % 8, None, 0)
                elif p == KVPoll.Failed:
                    pytest.fail("room %d failed: %s\nprefill log:\n%s" % (
                        room, [rc._reason for rc in recv[room]], open(log.name).read()))
                elif p == KVPoll.Success:
                    for rk, pg in zip(ranks, pages[room]):
                        se.check_like_kvhost(rk, room, pg, tokens, (room - room_base) % 8)
                    for rc in recv[room]:
                        rc.clear()
                    pending.discard(room)
            time.sleep(0.005)
        assert proc.wait(60) == 0, open(log.name).read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        for rk in ranks:
            rk.close()
