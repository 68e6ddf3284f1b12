"""``make demo-engine`` at CI scale: both styles end to end (engine
processes beside their own ``kvhost serve``), and the mutation check: one
byte flipped in a decode engine's memory after its transfer makes the run
fail, naming the request, page and byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvhost

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KVHOST = os.environ.get("KVHOST_BIN", os.path.join(ROOT, "bin", "kvhost"))
CI_SCALE = ["--requests", "24", "--layers", "4", "--max-tokens", "160", "--concurrency", "8"]


def run_demo(*args, timeout=300):
    if not os.access(KVHOST, os.X_OK):
        pytest.fail("%s is missing: run make (the demo needs the kvhost binary)" % KVHOST)
    # The kvhost package under test, wherever pytest imported it from.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kvhost.__file__))))
    return subprocess.run(
        [sys.executable, "-m", "kvhost.demo_engine", "--kvhost", KVHOST, "--timeout", "240"] + CI_SCALE + list(args),
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


@pytest.mark.parametrize("style,pool", [("vllm", "memfd"), ("sglang", "memfd"), ("vllm", "shm"), ("sglang", "shm")])
def test_demo_engine_every_byte(style, pool):
    args = ("--pool", pool) if pool != "memfd" else ()  # memfd: the default
    out = run_demo("--styles", style, "--json", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads(out.stdout)
    assert s["style"] == style and s["ok"] == 24 and s["failed"] == 0 and not s["failures"], s
    # Every rank's pool went to its sidecar as the pool kind names it:
    # a memfd by the engine's descriptor, else a POSIX shm name.
    assert s["pool"] == pool, s
    tp = {"prefill": s["prefill_tp"], "decode": s["decode_tp"]}
    for role, names in s["shm"].items():
        assert len(names) == tp[role], s["shm"]
        for n in names:
            assert (n.startswith("/proc/") and "/fd/" in n) == (pool == "memfd"), s["shm"]
    assert set(s["shm"]) == {"prefill", "decode"}, s["shm"]
    assert s["bytes_verified"] > 0 and s["gb_per_s"] > 0
    # The transfer rate, defined as kvhost demo --in-process defines its
    # own: the bytes the sidecars' transfers moved (their metrics: every
    # byte the engines verified, plus sglang's aux slots) over the time
    # the sidecars had a transfer in flight.
    assert s["bytes_verified"] == s["bytes_moved"], s
    aux = 24 * 4 * 64 if style == "sglang" else 0  # each decode rank's aux slot, 64 bytes
    assert s["transfer_bytes"] == s["bytes_moved"] + aux, s
    assert s["transfers"] >= 24 and 0 < s["transfer_seconds"] and s["transfer_gb_per_s"] > 0, s
    assert abs(s["transfer_gb_per_s"] - s["transfer_bytes"] / s["transfer_seconds"] / 1e9) < 1e-9, s
    # The engine's view: from handing each request to kvhost to seeing it
    # done, one interval per request; it holds the transfers' own time.
    assert s["requests_timed"] == 24 and s["engine_view_seconds"] > 0, s
    assert abs(s["engine_view_gb_per_s"] - s["bytes_moved"] / s["engine_view_seconds"] / 1e9) < 1e-9, s
    for role in ("prefill", "decode"):
        p = s["phases"][role]
        assert p["wall"] > 0 and p["adapter"] > 0 and p["poll"] > 0, p
        assert abs(sum(v for k, v in p.items() if k != "wall") - p["wall"]) < 1e-6, p
        # Thread CPU time inside the calls: never more than their wall time.
        assert 0 < s["cpu"][role]["adapter"] <= p["adapter"] and s["cpu"][role]["poll"] <= p["poll"], s["cpu"]
        c = s["control_us_per_request"][role]
        assert s["counts"][role]["poll"] == c["polls"] > 0, (s["counts"], c)
        assert abs(c["engine"] - p["adapter"] / 24 * 1e6) < 1e-6 and c["per_rank"] == c["engine"] / s[role + "_tp"], c
    # The stand-in GPU work ran on each engine's device thread, at idle
    # priority (the default), one fill job per request (sglang) or per
    # step and rank (vllm), one verify job per request.
    dev = s["device"]
    assert dev["prefill"]["fill"] > 0 and dev["decode"]["verify"] > 0, dev
    assert dev["prefill"]["policy"] == dev["decode"]["policy"] == "SCHED_IDLE", dev
    assert dev["decode"]["jobs"] == {"verify": 24}, dev
    assert dev["prefill"]["jobs"]["fill"] == (24 if style == "sglang" else dev["prefill"]["jobs"]["fill"]) > 0, dev
    assert "fill" not in s["phases"]["prefill"] and "verify" not in s["phases"]["decode"], s["phases"]
    if style == "sglang":
        # Every request's wait split at its last rank's Success event, on
        # both engines (the clients' listeners saw every Success).
        for role in ("prefill", "decode"):
            w = s["waits"][role]
            assert w["requests"] == 24 and w["kvhost_p50_ms"] > 0 and w["loop_p50_ms"] >= 0, s["waits"]
    # Both pairs are prefill TP 2 -> decode TP 4 (issue 15); the sglang
    # pair's host-memory pools are registered as VRAM with the fake
    # plugin, since SGLang's NIXL connector pushes heterogeneous-TP MHA KV
    # only into GPU memory.
    assert (s["prefill_tp"], s["decode_tp"]) == (2, 4), s
    assert s["register_as"] == ("vram" if style == "sglang" else "dram"), s
    # Each sidecar's threads ran (they served the engines and moved the
    # KV) and the summary says how long they waited for a core.
    c = s["sidecar_cpu"]
    assert "error" not in c, c
    for role in ("prefill", "decode", "total"):
        u = c[role]
        assert u["run_seconds"] > 0 and u["wait_seconds"] >= 0 and u["threads"] > 0, c
        assert u["wait_per_run"] == pytest.approx(u["wait_seconds"] / u["run_seconds"]), c
    assert c["total"]["run_seconds"] == pytest.approx(c["prefill"]["run_seconds"] + c["decode"]["run_seconds"]), c


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_demo_engine_waits_for_a_slow_device(style):
    """Each device job first waits 25 ms (a slower GPU): a loop that sent
    a request's KV before its fill was done would move stale pages (the
    check fails), one that freed pages before their check was done would
    see them overwritten; every byte still verifies, and the loops spent
    time blocked on the device. --device-priority normal: the thread keeps
    the engine's policy."""
    out = run_demo("--styles", style, "--json", "--device-delay-ms", "25", "--device-priority", "normal")
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads(out.stdout)
    assert s["ok"] == 24 and s["bytes_verified"] == s["bytes_moved"] > 0, s
    dev = s["device"]
    assert dev["prefill"]["policy"].startswith("normal") and dev["decode"]["policy"].startswith("normal"), dev
    assert dev["decode"]["verify"] >= 24 * 0.025 and dev["prefill"]["fill"] >= dev["prefill"]["jobs"]["fill"] * 0.025, dev
    assert s["phases"]["prefill"]["wait_device"] > 0 and s["phases"]["decode"]["wait_device"] > 0, s["phases"]


def test_device_thread_idle_priority():
    """The device thread runs its jobs, in order, at SCHED_IDLE (the
    kernel's own account: /proc/self/task/<tid>/stat's policy field), named
    "device"; "normal" keeps the caller's policy; a job's exception comes
    back through value()."""
    import threading

    from kvhost import demo_device as dd

    def policy(tid):
        with open("/proc/self/task/%d/stat" % tid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[41 - 3])  # field 41 (1-based), after pid and (comm)

    dev = dd.Device("idle")
    normal = dd.Device("normal")
    try:
        assert dev.policy == "SCHED_IDLE" and os.sched_getscheduler(dev.tid) == os.SCHED_IDLE, dev.policy
        assert policy(dev.tid) == os.SCHED_IDLE == 5
        with open("/proc/self/task/%d/comm" % dev.tid) as f:
            assert f.read().strip() == "device"
        assert policy(threading.get_native_id()) == os.sched_getscheduler(0) != os.SCHED_IDLE
        order = []
        jobs = [dev.submit("fill", lambda i: (order.append(i), threading.get_native_id())[1], i) for i in range(5)]
        assert dev.wait(jobs, timeout=60) == [dev.tid] * 5 and order == list(range(5))
        assert dev.report()["jobs"] == {"fill": 5} and dev.pending() == 0
        bad = dev.submit("verify", lambda: 1 // 0)
        assert bad._ev.wait(60)
        with pytest.raises(dd.DeviceError, match="ZeroDivisionError"):
            bad.value()
        assert normal.policy.startswith("normal") and policy(normal.tid) == os.sched_getscheduler(0)
        with pytest.raises(ValueError):
            dd.Device("realtime")
    finally:
        dev.close()
        normal.close()


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_demo_engine_baselines(style):
    """--baseline --baseline-procs: kvhost demo on the same shape, in one
    process and in separate processes, each with its transfer rate; the
    ratios are the pair's rate over theirs, and the text says which is
    which."""
    from kvhost import demo_engine as de

    out = run_demo("--styles", style, "--json", "--baseline", "--baseline-procs")
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads(out.stdout)
    assert "baseline_error" not in s, s
    for k in ("baseline_gb_per_s", "baseline_transfer_gb_per_s", "procs_transfer_gb_per_s"):
        assert s[k] > 0, (k, s)
    assert abs(s["transfer_ratio"] - s["transfer_gb_per_s"] / s["baseline_transfer_gb_per_s"]) < 1e-9, s
    assert abs(s["procs_transfer_ratio"] - s["procs_transfer_gb_per_s"] / s["baseline_transfer_gb_per_s"]) < 1e-9, s
    assert abs(s["transfer_ratio_to_procs"] - s["transfer_gb_per_s"] / s["procs_transfer_gb_per_s"]) < 1e-9, s
    txt = de.text(s, de._parse(["--baseline", "--baseline-procs"]))
    assert "(kvhost demo --in-process, same shape and definition: %.2f GB/s; ratio %.2f)" % (
        s["baseline_transfer_gb_per_s"], s["transfer_ratio"]) in txt, txt
    assert "separate processes: kvhost demo" in txt and "engine's view" in txt, txt
    # The baselines' threads' CPU time, from their --json, beside the
    # sidecars' (kvhost demo's workers ran: they moved every byte).
    for key in ("baseline_cpu", "procs_cpu"):
        b = s[key]
        assert b["run_seconds"] > 0 and b["wait_seconds"] >= 0, (key, b)
        assert b["wait_per_run"] == pytest.approx(b["wait_seconds"] / b["run_seconds"]), (key, b)
    c = s["sidecar_cpu"]["total"]
    assert "%.2f s waited per 1 s run" % c["wait_per_run"] in txt, txt
    assert "kvhost demo --in-process: %.2f (ran %.2f s, waited %.2f s)" % (
        s["baseline_cpu"]["wait_per_run"], s["baseline_cpu"]["run_seconds"], s["baseline_cpu"]["wait_seconds"]) in txt, txt
    line = de.medians(style, [s])
    assert "%.2f transfer rate" % s["transfer_ratio"] in line and "separate processes" in line, line
    assert "CPU wait per run: sidecars %.2f, kvhost demo --in-process %.2f" % (
        c["wait_per_run"], s["baseline_cpu"]["wait_per_run"]) in line, line


def test_sidecar_cpu_text():
    """The sidecar CPU line carries the summary's numbers, per sidecar and
    for the baselines; what was not measured says why instead of printing
    zeros; --repeat's line takes the medians."""
    from kvhost import demo_engine as de

    def usage(run, wait):
        return {"run_seconds": run, "wait_seconds": wait, "wait_per_run": wait / run, "timeslices": 1, "threads": 1}

    s = {"sidecar_cpu": {"prefill": usage(0.8, 1.2), "decode": usage(0.4, 0.2), "total": usage(1.2, 1.4)},
         "baseline_cpu": {"run_seconds": 2.0, "wait_seconds": 0.1, "wait_per_run": 0.05, "scope": "x"},
         "procs_cpu": {"run_seconds": None, "wait_seconds": None, "wait_per_run": None,
                       "scope": "not measured: 1 of 5 worker processes reported theirs"}}
    (line,) = de.cpu_lines(s)
    for want in ("ran 1.20 s and waited 1.40 s for a core", "1.17 s waited per 1 s run",
                 "prefill 1.50: ran 0.80 s, waited 1.20 s", "decode 0.50: ran 0.40 s, waited 0.20 s",
                 "kvhost demo --in-process: 0.05 (ran 2.00 s, waited 0.10 s)",
                 "kvhost demo, separate processes: not measured: 1 of 5 worker processes reported theirs"):
        assert want in line, (want, line)
    assert de.cpu_lines({"sidecar_cpu": {"error": "not measured: no schedstat"}}) == [
        "  sidecar CPU   not measured: no schedstat"]
    assert de.cpu_lines({}) == []
    other = dict(s, sidecar_cpu=dict(s["sidecar_cpu"], total=usage(1.0, 3.0)),
                 baseline_cpu=dict(s["baseline_cpu"], wait_per_run=0.25))
    third = dict(s, sidecar_cpu=dict(s["sidecar_cpu"], total=usage(1.0, 2.0)),
                 baseline_cpu=dict(s["baseline_cpu"], wait_per_run=0.15))
    assert "CPU wait per run: sidecars 2.00, kvhost demo --in-process 0.15" in de.medians("sglang", [s, other, third])
    # The CPU fields of kvhost demo --json, null where it did not measure.
    assert de.cpu_of_demo({"cpu_run_seconds": 1.0, "cpu_wait_seconds": 0.5, "cpu_wait_per_run": 0.5,
                           "cpu_scope": "this process"}) == {
        "run_seconds": 1.0, "wait_seconds": 0.5, "wait_per_run": 0.5, "scope": "this process"}
    assert de.cpu_of_demo({"cpu_run_seconds": None})["wait_per_run"] is None


def test_union_seconds():
    """The transfer rate's denominator: overlapping intervals count once,
    gaps not at all."""
    from kvhost import demo_engine as de

    assert de.union_seconds([]) == 0.0
    assert de.union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.75)]) == 3.0
    assert de.union_seconds([(5.0, 6.0), (1.0, 2.0), (1.5, 1.75)]) == 2.0


def test_demo_engine_sglang_options():
    """The sglang pair's TP and register_as: VRAM with the fake plugin
    (decode TP 4), DRAM otherwise (decode TP = prefill TP, which SGLang's
    NIXL connector moves into host memory); --sglang-decode-tp wins."""
    from kvhost import demo_engine as de

    def pick(*argv):
        ns = de._parse(list(argv))
        return de.sglang_register_as(ns), de.sglang_decode_tp(ns)

    assert pick() == ("vram", 4)
    assert pick("--backend", "nixl") == ("dram", 2)
    assert pick("--backend", "nixl", "--kv-register-as", "vram") == ("vram", 4)
    assert pick("--kv-register-as", "dram") == ("dram", 2)
    assert pick("--sglang-decode-tp", "1") == ("vram", 1)
    assert pick("--kv-register-as", "dram", "--decode-tp", "8", "--prefill-tp", "4") == ("dram", 4)


def test_demo_engine_sglang_host_memory_as_dram():
    """--kv-register-as dram: the sglang pair registers its pools as host
    memory and runs decode TP = prefill TP, every byte verified."""
    out = run_demo("--styles", "sglang", "--kv-register-as", "dram", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads(out.stdout)
    assert s["ok"] == 24 and (s["prefill_tp"], s["decode_tp"], s["register_as"]) == (2, 2, "dram"), s


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_demo_engine_fails_on_one_wrong_byte(style):
    out = run_demo("--styles", style, "--corrupt", "req-1-0005")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout
    assert "request req-1-0005: decode rank 0: page 0" in out.stdout and "byte 0: got" in out.stdout, out.stdout
    assert "23 ok, 1 failed" in out.stdout, out.stdout
    assert "  transfer rate " in out.stdout and "over the" in out.stdout, out.stdout
    head = out.stdout.splitlines()[0]
    assert "prefill TP 2 -> decode TP 4" in head, head
    if style == "sglang":
        assert "KV pools registered as VRAM (the fake plugin models GPU memory with host memory)" in head, head
    else:
        assert "VRAM" not in head, head


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_engine_terminated_leaves_no_shared_memory(tmpdir_short, style):
    """The demo terminates its engines when the run stops early (a timeout,
    the other engine failing): their shared-memory pools must not stay in
    /dev/shm."""
    import multiprocessing as mp
    import time

    from kvhost import demo_engine as de

    if not os.access(KVHOST, os.X_OK):
        pytest.fail("%s is missing: run make" % KVHOST)
    side = de.Sidecar(KVHOST, tmpdir_short, "decode", "fake", [])
    try:
        side.wait_ready()
        mod = __import__("kvhost.demo_" + style, fromlist=["decode_engine"])
        args = {"layers": 2, "kv_heads": 4, "head_bytes": 32, "page_size": 4, "prefill_tp": 2, "decode_tp": 2,
                "sglang_decode_tp": 2, "concurrency": 2, "prefill_inflight": 4, "num_blocks": 8, "timeout": 60,
                "corrupt": None, "chunk_pages": 2, "pool": "shm"}
        ctx = mp.get_context("spawn")
        inbox, results = ctx.Queue(), ctx.Queue()  # referenced until the child has them
        p = ctx.Process(target=mod.decode_engine, args=(args, side.control, 1, inbox, results))
        p.start()
        prefix = "kvhost-%d-" % p.pid
        deadline = time.monotonic() + 60
        while len([f for f in os.listdir("/dev/shm") if f.startswith(prefix)]) < 2:
            if not p.is_alive() or time.monotonic() > deadline:
                pytest.fail("the engine made no pools: %s" % (results.get(timeout=5) if p.exitcode is not None else "timeout"))
            time.sleep(0.05)
        time.sleep(0.2)
        p.terminate()
        p.join(30)
        left = [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
        for f in left:
            os.unlink(os.path.join("/dev/shm", f))
        assert left == [], "left in /dev/shm: %s" % left
    finally:
        side.stop()


@pytest.mark.parametrize("layout,head_bytes", [("HND", 16), ("NHD", 16), ("HND", 6), ("NHD", 6)])
def test_pattern_fill_check_every_byte(layout, head_bytes):
    """demo_pattern's fill writes exactly expected() (the reference
    formula) and check, compared 8 bytes at a time in the pool's own order
    into reused buffers, still finds any one wrong byte and names it."""
    import numpy as np

    from kvhost import demo_pattern as pat

    shape = pat.Shape(2, 4, head_bytes, 4)
    h0, h1 = shape.heads_of(1, 2)
    dims = (shape.layers, 2, 9, 2, shape.page_size, head_bytes)
    if layout == "NHD":
        dims = dims[:3] + (shape.page_size, 2, head_bytes)
    pool = np.zeros(dims, dtype=np.uint8)
    if layout == "NHD":  # SGLang's: K buffers then V buffers, a non-contiguous view
        pool = np.zeros((2, shape.layers) + dims[2:], dtype=np.uint8).transpose(1, 0, 2, 3, 4, 5)
    ids = [7, 2, 4]
    pat.fill(pool, ids, 11, shape, h0, h1, layout=layout)
    pat.fill(pool, [0, 1], 12, shape, h0, h1, layout=layout)  # reuses the buffers, other shape
    got = pat._hnd(pool[:, :, ids], layout)
    assert np.array_equal(got, pat.expected(11, shape, 3, h0, h1))
    assert pat.check(pool, ids, 11, shape, h0, h1, layout=layout) is None
    assert pat.check(pool, [0, 1], 12, shape, h0, h1, layout=layout) is None
    assert "wrong bytes" in pat.check(pool, ids, 12, shape, h0, h1, layout=layout)
    rng = np.random.default_rng(5)
    for _ in range(20):
        at = tuple(int(rng.integers(0, n)) for n in pool[:, :, ids].shape)
        idx = at[:2] + (ids[at[2]],) + at[3:]
        pool[idx] ^= 0x01
        why = pat.check(pool, ids, 11, shape, h0, h1, layout=layout)
        pool[idx] ^= 0x01
        assert why is not None and "(1 wrong bytes)" in why and "block %d" % ids[at[2]] in why, (at, why)
    with pytest.raises(IndexError):
        pat.check(pool, [9], 11, shape, h0, h1, layout=layout)


def test_sidecar_cpu_window_starts_at_first_request():
    """SidecarCPU measures from begin() (the first request done: start-up
    left out) to end(); begin() again keeps the first start; without any
    begin() the numbers are refused, not taken from an empty window."""
    import threading
    import time

    from kvhost import demo_engine as de

    class Side:
        class proc:
            pid = os.getpid()

    cpu = de.SidecarCPU([Side()], ("prefill",))
    assert cpu.end() == {"error": "not measured: no request finished"}

    stop = time.monotonic() + 0.2
    cpu = de.SidecarCPU([Side()], ("prefill",))
    spin = lambda: [None for _ in iter(lambda: time.monotonic() > stop, True)]
    t = threading.Thread(target=spin)
    t.start()  # before begin(): its run time until begin() is left out
    time.sleep(0.1)
    cpu.begin()
    first = cpu.before
    cpu.begin()
    assert cpu.before is first
    t.join()
    got = cpu.end()
    run = got["prefill"]["run_seconds"]
    assert 0 < run < 0.19, got  # the spinning thread's last ~0.1 s, not its 0.2 s
    assert got["total"]["run_seconds"] == run
