"""``make demo-engine``: the real integration, end to end.

Two Python "engines" per style, each a separate process that owns its KV
pools (numpy arrays in shared memory, kvhost.shm: memfds sealed against
shrinking, which the sidecars' fake plugin may map, or with ``--pool shm``
POSIX shared-memory objects) and runs beside its own ``kvhost serve`` (a
separate process too), move the KV cache of a few hundred requests
through the adapters an engine would load:

- vLLM style (kvhost.demo_vllm): prefill TP 2 and decode TP 4 engines
  driving kvhost.vllm.KvhostConnector in vLLM's scheduler/worker call
  order; decode pulls.
- SGLang style (kvhost.demo_sglang): prefill TP 2 and decode TP 4 engines
  driving kvhost.sglang's KVManager/KVSender/KVReceiver in SGLang's
  bootstrap/init/send/poll order; prefill pushes. SGLang's NIXL connector
  pushes heterogeneous-TP MHA KV only into GPU memory, and these pools are
  host memory: with the fake plugin (which models GPU memory with host
  memory) the engines register them with ``register_as: "vram"``, as
  ``kvhost demo`` registers its pools, and the summary says so; with
  another plugin (``--kv-register-as dram``) the pair runs decode TP =
  prefill TP unless ``--sglang-decode-tp`` says otherwise.

Every decode rank checks every byte of every request in its own memory
(kvhost.demo_pattern).

The engines' stand-in GPU work (the prefill's forward pass writing each
request's KV, the decode's check of every byte) runs on a "device" thread
per engine process (kvhost.demo_device: one CUDA stream), launched by
the engine's scheduler loop, which proceeds with a request (sends its KV;
frees its pages) only once the device reports its job done: SGLang's
loops keep polling meanwhile (its overlap scheduler does), vLLM's step
waits for it (its step waits for the sampled tokens). That
thread runs at SCHED_IDLE (``--device-priority idle``, the default;
nice 19 where SCHED_IDLE is refused): in a deployment this work runs on
the GPU, not on the host cores the sidecars' copies and the scheduler
threads use, and on a machine with fewer cores than processes a
normal-priority stand-in preempts the sidecars' copy threads (thousands
of times a run on 2 cores), which real GPU kernels do not.
``--device-priority normal`` keeps it at the engine's priority, for
comparison. The run prints a progress bar (stderr, on a
terminal) and a summary like ``kvhost demo``'s, with the throughput beside
``kvhost demo --in-process`` on the same shape (``--baseline``), and exits
0 only when every byte of every request verified; otherwise non-zero with
the request, page and byte that were wrong.

Rates, and what each compares (issue 24):

- throughput: bytes over the decode engine's wall time from its first
  request to its last; ``kvhost demo``'s end-to-end rate is the same
  (both include their engines' fill and verify);
- without fill/verify: bytes over the slower engine's loop wall time less
  its device's busy time (the seconds the device thread ran fill or
  verify jobs);
- transfer rate: the bytes kvhost's transfers moved over the time kvhost
  had at least one in flight, the union of the transfers'
  post-to-completion intervals as the completion engine saw them (the
  sidecars' kvhost_transfer_busy_seconds_total and
  kvhost_nixl_bytes_transferred_sum). ``kvhost demo`` computes its
  transfer rate the same way (host/internal/span over the same events;
  vLLM style: the union over every decode rank), so the ratio compares
  one definition on the same shape, and fill and verify are outside both
  windows. The pair's copies cross processes (the fake plugin's
  process_vm_*) where ``--in-process`` copies with memcpy:
  ``--baseline-procs`` adds ``kvhost demo`` with its Go workers in
  separate processes, the same copies without Python engines or sidecars;
- engine's view: the same bytes over the union of the intervals from an
  engine handing a request to kvhost to the engine seeing it done (the
  control path, notifications and the engine loop's cadence included);
  SGLang's "waits" line splits a request's wait at the moment its Success
  event reached the engine process;
- sidecar CPU: how long each ``kvhost serve``'s threads ran and waited,
  runnable, for a core (the kernel's per-thread schedstat,
  kvhost.schedstat) from the first request done to both engines done
  (the steady state: the ranks' registration and peer loading are over),
  as seconds waited per second run, beside
  ``kvhost demo --in-process``'s threads' own (its ``--json``
  ``cpu_wait_per_run``). With the fake plugin a transfer's copy runs on
  the sidecar thread that posts it: where the sidecars wait far longer
  than the baseline (more busy processes than cores), the pair's
  transfer rate is bounded by CPU availability, not by kvhost; on a
  machine with a core per process the two should be near;
- adapter cost: time inside the adapter calls a request makes, per
  request (and per rank), beside their thread CPU time; the calls the
  engine's loop makes on every pass (poll(), vLLM's per-step calls) are
  counted apart: this loop passes far more often than a scheduler steps.

    python3 -m kvhost.demo_engine [--styles vllm,sglang] [--requests 300] ...

(``make demo-engine`` runs it with PYTHONPATH=python and bin/kvhost.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvhost import demo_pattern as pat
from kvhost import schedstat


def _parse(argv):
    p = argparse.ArgumentParser(prog="python3 -m kvhost.demo_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--kvhost", default=os.environ.get("KVHOST_BIN", "bin/kvhost"), help="the kvhost binary (default bin/kvhost, $KVHOST_BIN)")
    p.add_argument("--styles", default="vllm,sglang", help="comma-separated: vllm, sglang (default both)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=4)
    p.add_argument("--sglang-decode-tp", type=int, default=0,
                   help="decode TP of the sglang pair (default: --decode-tp when its pools are registered as VRAM, "
                        "else the prefill TP: SGLang's NIXL connector moves heterogeneous-TP MHA KV only into "
                        "GPU memory, and these pools are host memory)")
    p.add_argument("--kv-register-as", choices=("auto", "dram", "vram"), default="auto",
                   help="what the sglang pair's host-memory KV pools are registered with the plugin as "
                        "(register_as; default auto: vram with the fake plugin, which models GPU memory "
                        "with host memory, else dram)")
    p.add_argument("--pool", choices=("memfd", "shm"), default="memfd",
                   help="what the engines' host-memory KV pools are (kvhost.shm's backing): memfd (default: "
                        "memfds sealed against shrinking, which the sidecars' fake plugin may map) or shm "
                        "(POSIX shared-memory objects in /dev/shm, which an engine could truncate under it)")
    p.add_argument("--concurrency", type=int, default=16, help="requests loading at once on decode")
    p.add_argument("--chunk-pages", type=int, default=8, help="sglang: pages per send (chunked prefill)")
    p.add_argument("--device-priority", choices=("idle", "normal"), default="idle",
                   help="CPU priority of each engine's device thread, which runs the stand-in GPU work (fill, "
                        "verify): idle (default: SCHED_IDLE, as GPU kernels take no host core from the sidecars' "
                        "copies) or normal (the engine's own, for comparison)")
    p.add_argument("--device-delay-ms", type=float, default=0.0,
                   help="each device job first waits this long: a slower GPU (every byte must still verify, the "
                        "engines acting on a job's result only once the device reports it done)")
    p.add_argument("--backend", default="fake")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--baseline", action="store_true",
                   help="also run `kvhost demo --in-process` on the same shape and print the ratio")
    p.add_argument("--baseline-procs", action="store_true",
                   help="with --baseline, also run `kvhost demo` with its workers in separate processes (Go "
                        "engines, the plugin's cross-process copies the pair makes too) and print the ratio")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per style, each followed by its baseline (alternated, so a loaded machine's drift "
                        "hits both); the ratios' medians are printed")
    p.add_argument("--corrupt", metavar="REQUEST",
                   help="mutation check: flip one byte of REQUEST's KV in decode memory after its transfer (the run must fail)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    p.add_argument("--work-dir", help="keep the sidecars' logs here (default: a temporary folder, removed)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for every kvhost serve (repeatable)")
    return p.parse_args(argv)


def workload(n, seed, min_tokens, max_tokens):
    """(request id, tokens, pattern seed) of every request."""
    import numpy as np

    rng = np.random.default_rng([0x64656D6F, seed])
    lens = rng.integers(min_tokens, max_tokens + 1, n)
    return [("req-%d-%04d" % (seed, i), int(lens[i]), seed * 1_000_003 + i) for i in range(n)]


class Sidecar:
    """One ``kvhost serve`` process on an ipc:// control socket."""

    def __init__(self, exe, workdir, name, backend, extra):
        self.sock = os.path.join(workdir, name + ".sock")
        self.control = "ipc://" + self.sock
        self.log_path = os.path.join(workdir, name + ".log")
        self.name = name
        # Its Prometheus /metrics (a port it picks, named in its log):
        # kvhost's own account of the transfers it made (metrics()).
        cmd = [exe, "--backend", backend, "serve", "--control", self.control,
               "--metrics-addr", "127.0.0.1:0"] + list(extra)
        self.metrics_url = None
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metrics_url is None:
                m = re.search(r'msg="serving metrics" addr=(127\.0\.0\.1:\d+)', self.tail(50))
                if m:
                    self.metrics_url = "http://%s/metrics" % m.group(1)
            if os.path.exists(self.sock) and self.metrics_url:
                return
            if self.proc.poll() is not None:
                raise RuntimeError("kvhost serve (%s) exited with %s:\n%s" % (self.name, self.proc.returncode, self.tail()))
            time.sleep(0.02)
        raise RuntimeError("kvhost serve (%s) did not create %s within %.0f s:\n%s" % (self.name, self.sock, timeout, self.tail()))

    # The sidecar's metrics metrics() reads: kvhost's own account of its
    # transfers (host/metrics).
    METRICS = {
        "kvhost_transfer_busy_seconds_total": "busy_seconds",
        "kvhost_nixl_bytes_transferred_sum": "bytes",
        "kvhost_nixl_xfer_time_seconds_sum": "xfer_seconds_sum",
        "kvhost_nixl_xfer_time_seconds_count": "transfers",
    }

    def metrics(self):
        """{busy_seconds, bytes, xfer_seconds_sum, transfers} from the
        sidecar's /metrics: the union of its transfers' post-to-completion
        intervals (the time it had a transfer in flight), the bytes they
        moved, the sum of their durations and their count."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            body = r.read().decode()
        out = {}
        for line in body.splitlines():
            name, _, rest = line.partition("{")
            if name in self.METRICS:
                out[self.METRICS[name]] = float(rest.rsplit("}", 1)[1].split()[0])
        missing = set(self.METRICS.values()) - set(out)
        if missing:
            raise RuntimeError("kvhost serve (%s): %s lacks %s" % (self.name, self.metrics_url, sorted(missing)))
        return out

    def tail(self, n=20):
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class SidecarCPU:
    """What the sidecars' threads did over the pair's steady state
    (kvhost.schedstat): seconds on a CPU, and seconds runnable but waiting
    for one. Begun when the first request is done (begin(): by then every
    rank registered its memory and loaded its peers, start-up work that
    is not a transfer's), ended once both engines reported done: the
    window of all but the first request's transfers, as ``kvhost demo``
    measures from its workers ready to done. A kernel without per-thread
    schedstat (or a sidecar gone) leaves an error in place of the numbers,
    not a failed run."""

    def __init__(self, sidecars, roles):
        self.sidecars, self.roles = sidecars, roles
        self.error = None
        self.before = None

    def begin(self):
        """Starts the window (once; later calls do nothing)."""
        if self.before is not None or self.error is not None:
            return
        try:
            self.before = [schedstat.snapshot(s.proc.pid) for s in self.sidecars]
        except (schedstat.Unavailable, OSError, ValueError) as e:
            self.error = str(e)

    def end(self):
        """{role: usage, ..., "total": usage}, each usage {run_seconds,
        wait_seconds, wait_per_run, timeslices, threads}; {"error": why}
        when not measured."""
        if self.error is None and self.before is None:
            self.error = "no request finished"
        if self.error is None:
            try:
                after = [schedstat.snapshot(s.proc.pid) for s in self.sidecars]
            except (schedstat.Unavailable, OSError, ValueError) as e:
                self.error = str(e)
        if self.error is not None:
            return {"error": "not measured: " + self.error}
        out = {}
        total = {"run_seconds": 0.0, "wait_seconds": 0.0, "timeslices": 0, "threads": 0}
        for role, b, a in zip(self.roles, self.before, after):
            u = schedstat.delta(b, a)
            for k in total:
                total[k] += u[k]
            u["wait_per_run"] = schedstat.wait_per_run(u)
            out[role] = u
        total["wait_per_run"] = schedstat.wait_per_run(total)
        out["total"] = total
        return out


def cpu_of_demo(got):
    """The CPU fields of a ``kvhost demo --json`` summary: {run_seconds,
    wait_seconds, wait_per_run, scope}, the numbers None where it did not
    measure them (scope says why)."""
    return {"run_seconds": got.get("cpu_run_seconds"), "wait_seconds": got.get("cpu_wait_seconds"),
            "wait_per_run": got.get("cpu_wait_per_run"), "scope": got.get("cpu_scope", "not reported")}


class Progress:
    """A one-line progress bar on stderr (only on a terminal)."""

    def __init__(self, total, label, enabled):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0

    def add(self, n=1):
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            width = 30
            fill = int(width * self.done / max(1, self.total))
            sys.stderr.write("\r%-14s [%s%s] %d/%d requests %.1fs" % (
                self.label, "=" * fill, " " * (width - fill), self.done, self.total, now - self.t0))
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def union_seconds(spans):
    """Seconds covered by the union of [start, end) intervals: the time
    transfers were in flight (kvhost's host/internal/span)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def sglang_register_as(ns):
    """register_as of the sglang pair's pools: --kv-register-as, auto
    being vram with the fake plugin (it models GPU memory with host memory,
    as ``kvhost demo`` finds by probing it) and dram otherwise (real
    backends refuse host memory as VRAM)."""
    if ns.kv_register_as != "auto":
        return ns.kv_register_as
    return "vram" if ns.backend == "fake" else "dram"


def sglang_decode_tp(ns):
    """Decode TP of the sglang pair: --sglang-decode-tp, else --decode-tp
    when the pools are registered as VRAM, else the prefill TP (SGLang's
    NIXL connector refuses heterogeneous-TP MHA KV into host memory)."""
    if ns.sglang_decode_tp:
        return ns.sglang_decode_tp
    return ns.decode_tp if sglang_register_as(ns) == "vram" else ns.prefill_tp


def run_style(style, ns, workdir, reqs, progress):
    """Runs one pair (two sidecars, two engine processes); returns the
    style's summary dict."""
    shape = pat.Shape(ns.layers, ns.kv_heads, ns.head_dim * ns.dtype_bytes, ns.page_size)
    max_pages = shape.pages(ns.max_tokens)
    args = {
        "layers": ns.layers, "kv_heads": ns.kv_heads, "head_bytes": ns.head_dim * ns.dtype_bytes,
        "page_size": ns.page_size, "prefill_tp": ns.prefill_tp, "decode_tp": ns.decode_tp,
        "concurrency": ns.concurrency, "prefill_inflight": 2 * ns.concurrency,
        "num_blocks": 2 * ns.concurrency * max_pages + max_pages, "timeout": ns.timeout,
        "corrupt": ns.corrupt, "chunk_pages": ns.chunk_pages,
        "sglang_decode_tp": sglang_decode_tp(ns), "register_as": sglang_register_as(ns),
        "device_priority": ns.device_priority, "device_delay": ns.device_delay_ms / 1e3,
        "pool": ns.pool,
    }
    if style == "vllm":
        from kvhost import demo_vllm as mod
    elif style == "sglang":
        from kvhost import demo_sglang as mod
    else:
        raise ValueError("unknown style %r: want vllm or sglang" % style)
    ctx = mp.get_context("spawn")
    sidecars = [Sidecar(ns.kvhost, workdir, "%s-%s" % (style, role), ns.backend, ns.serve_arg) for role in ("prefill", "decode")]
    procs = []
    decode_tp = ns.decode_tp if style == "vllm" else args["sglang_decode_tp"]
    summary = {"style": style, "requests": len(reqs), "ok": 0, "failed": 0, "bytes_moved": 0, "bytes_verified": 0,
               "seconds": 0.0, "gb_per_s": 0.0, "failures": [], "prefill_tp": ns.prefill_tp, "decode_tp": decode_tp,
               "register_as": "dram" if style == "vllm" else args["register_as"], "pool": ns.pool, "shm": {}}
    lat = []
    spans = []
    kv = []
    summary["phases"] = {}
    summary["counts"] = {}
    summary["cpu"] = {}
    summary["waits"] = {}
    summary["device"] = {}
    try:
        for s in sidecars:
            s.wait_ready()
        to_decode, results = ctx.Queue(), ctx.Queue()
        procs = [
            ctx.Process(target=mod.prefill_engine, args=(args, sidecars[0].control, reqs, to_decode, results), name=style + "-prefill"),
            ctx.Process(target=mod.decode_engine, args=(args, sidecars[1].control, len(reqs), to_decode, results), name=style + "-decode"),
        ]
        cpu = SidecarCPU(sidecars, ("prefill", "decode"))
        for p in procs:
            p.start()
        deadline = time.monotonic() + ns.timeout + 30
        finished = set()
        while finished != {"prefill_done", "decode_done"}:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("%s: timed out after %.0f s" % (style, ns.timeout))
            try:
                kind, body = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError("%s exited with %s" % (dead[0].name, dead[0].exitcode))
                for s in sidecars:
                    if s.proc.poll() is not None:
                        raise RuntimeError("kvhost serve (%s) exited with %s:\n%s" % (s.name, s.proc.returncode, s.tail()))
                continue
            if kind == "error":
                raise RuntimeError(body)
            if kind == "request":
                cpu.begin()
                if body["ok"]:
                    summary["ok"] += 1
                else:
                    summary["failed"] += 1
                    if len(summary["failures"]) < 10:
                        summary["failures"].append("request %s: %s" % (body["request_id"], body["error"]))
                summary["bytes_moved"] += body["bytes"]
                summary["bytes_verified"] += body["verified"]
                lat.append(body["latency"])
                progress.add()
            else:
                # Each engine's time per phase, and the intervals its
                # transfers were in flight (time.monotonic is one clock
                # for every process on the machine).
                if kind == "decode_done":
                    summary["seconds"] = body["seconds"]
                summary["phases"][kind.split("_")[0]] = body.get("phases", {})
                summary["counts"][kind.split("_")[0]] = body.get("counts", {})
                summary["cpu"][kind.split("_")[0]] = body.get("cpu", {})
                summary["device"][kind.split("_")[0]] = body.get("device", {})
                summary["shm"][kind.split("_")[0]] = body.get("shm", [])
                w = body.get("waits")
                if w:
                    summary["waits"][kind.split("_")[0]] = {
                        "requests": len(w["kvhost_ms"]),
                        "kvhost_p50_ms": _pct(w["kvhost_ms"], 0.5) * 1e3,
                        "loop_p50_ms": _pct(w["loop_ms"], 0.5) * 1e3}
                spans.extend(body.get("spans", ()))
                finished.add(kind)
        summary["sidecar_cpu"] = cpu.end()
        for p in procs:
            p.join(30)
        # kvhost's own account, before the sidecars stop: only the side
        # that makes the transfers has any (sglang: the prefill's pushes,
        # vllm: the decode's reads).
        kv = [s.metrics() for s in sidecars]
    except Exception as e:
        summary["failures"].append(str(e))
        summary["failed"] = summary["requests"] - summary["ok"]
        crashed = True
    else:
        crashed = False
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        for s in sidecars:
            s.stop()
    if crashed:
        # Not a wrong byte: something stopped; the sidecars may say what.
        for s in sidecars:
            t = s.tail(8)
            if t:
                summary["failures"].append("kvhost serve (%s) log (%s):\n%s" % (s.name, s.log_path, t))
    if summary["seconds"] > 0:
        summary["gb_per_s"] = summary["bytes_moved"] / summary["seconds"] / 1e9
    summary.update(transfer_summary(kv, spans, summary["bytes_moved"]))
    summary["control_us_per_request"] = adapter_costs(
        style, summary["phases"], summary["cpu"], summary["counts"], summary["requests"],
        {"prefill": ns.prefill_tp, "decode": decode_tp})
    # The pair's rate with the engines' own work (the prefill's fill, the
    # decode's verify: numpy in these Python engines, the device thread's
    # busy time) taken out of each engine's wall time: what kvhost and the
    # adapters leave to the slower engine.
    busy = [ph.get("wall", 0.0) - sum(summary["device"].get(role, {}).get(k, 0.0) for k in ("fill", "verify"))
            for role, ph in summary["phases"].items()]
    summary["engine_work_excluded_seconds"] = max(busy) if busy else 0.0
    summary["engine_work_excluded_gb_per_s"] = (
        summary["bytes_moved"] / summary["engine_work_excluded_seconds"] / 1e9
        if summary["engine_work_excluded_seconds"] > 0 else 0.0)
    summary["latency_p50_ms"] = _pct(lat, 0.5) * 1e3
    summary["latency_p99_ms"] = _pct(lat, 0.99) * 1e3
    summary["processes"] = 2 + 2
    return summary


def transfer_summary(kv, spans, bytes_moved):
    """The pair's transfer rate, defined as ``kvhost demo --in-process``
    defines its own: the bytes kvhost's transfers moved over the time at
    least one of them was in flight (the union of their post-to-completion
    intervals as kvhost's completion engine saw them: the sidecars'
    kvhost_transfer_busy_seconds_total and kvhost_nixl_bytes_transferred_sum,
    kv: their metrics()). The engines' fill and verify are outside it on
    both sides, by definition.

    Beside it, the engine's view (``engine_view_*``): the same bytes over
    the union of the intervals from an engine handing a request's KV to
    kvhost to the engine seeing it done (spans), which adds what the
    control path, the notifications and the engine's own loop (its polling
    cadence, and any fill or verify of other requests it runs before it
    polls again) put around each transfer."""
    out = {"transfer_seconds": 0.0, "transfer_bytes": 0, "transfers": 0, "transfer_gb_per_s": 0.0,
           "xfer_mean_ms": 0.0}
    if kv:
        busy = sum(m["busy_seconds"] for m in kv)
        nbytes = int(sum(m["bytes"] for m in kv))
        n = int(sum(m["transfers"] for m in kv))
        out.update(transfer_seconds=busy, transfer_bytes=nbytes, transfers=n,
                   transfer_gb_per_s=nbytes / busy / 1e9 if busy > 0 else 0.0,
                   xfer_mean_ms=sum(m["xfer_seconds_sum"] for m in kv) / n * 1e3 if n else 0.0)
    view = union_seconds(spans)
    out["requests_timed"] = len(spans)
    out["engine_view_seconds"] = view
    out["engine_view_gb_per_s"] = bytes_moved / view / 1e9 if view > 0 else 0.0
    out["engine_view_p50_ms"] = _pct([e - s for s, e in spans], 0.5) * 1e3
    return out


def adapter_costs(style, phases, cpu, counts, requests, ranks):
    """Per engine: time inside adapter calls on its scheduler thread.
    "engine"/"per_rank": the calls each request makes (phase "adapter") per
    request, and per request and rank. "poll_us": one call of the engine
    loop's every-pass calls (phase "poll": sglang, one poll() of one rank's
    room; vllm, one step's build_connector_meta plus every worker's step
    calls), and "polls" how many the demo made: its loop passes far more
    often than a scheduler steps, so their total is the demo's cadence,
    not a cost per request. "with_polls_per_rank" (sglang): per request
    and rank with the three poll() calls a scheduler needs (one per state
    it waits for), the definition of ``make bench-engine``. "cpu_engine":
    the thread CPU time of the request's calls per request (cpu: the
    phases' CPU seconds): the wall time less the waits for a core."""
    out = {}
    for role, ph in phases.items():
        if not requests or "adapter" not in ph:
            continue
        per_req = ph["adapter"] / requests * 1e6
        n = counts.get(role, {}).get("poll", 0)
        poll_us = ph.get("poll", 0.0) / n * 1e6 if n else 0.0
        c = {"engine": per_req, "per_rank": per_req / ranks[role], "poll_us": poll_us, "polls": n,
             "poll_seconds": ph.get("poll", 0.0),
             "cpu_engine": cpu.get(role, {}).get("adapter", 0.0) / requests * 1e6}
        if style == "sglang":
            c["with_polls_per_rank"] = c["per_rank"] + 3 * poll_us
        out[role] = c
    return out


def baseline(ns, style, decode_tp, in_process=True):
    """``kvhost demo --in-process`` on the same shape (in_process False:
    ``kvhost demo``, its workers in separate processes): its end-to-end
    GB/s and its transfer rate (GB/s over the time its transfers were in
    flight; 0 when it does not report one) and its threads' CPU time over
    its requests phase (cpu_of_demo)."""
    cmd = [ns.kvhost, "--backend", ns.backend, "demo"] + (["--in-process"] if in_process else []) + [
           "--json", "--style", style,
           "--requests", str(ns.requests), "--seed", str(ns.seed), "--layers", str(ns.layers),
           "--kv-heads", str(ns.kv_heads), "--head-dim", str(ns.head_dim), "--dtype-bytes", str(ns.dtype_bytes),
           "--page-size", str(ns.page_size), "--min-tokens", str(ns.min_tokens), "--max-tokens", str(ns.max_tokens),
           "--prefill-tp", str(ns.prefill_tp), "--decode-tp", str(decode_tp)]
    out = subprocess.run(cmd, capture_output=True, timeout=ns.timeout)
    if out.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd), out.returncode, out.stderr.decode(errors="replace")[-2000:]))
    got = json.loads(out.stdout)
    return float(got["gb_per_s"]), float(got.get("transfer_gb_per_s", 0) or 0), cpu_of_demo(got)


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return "%.1f %s" % (n, unit) if unit != "B" else "%d B" % n
        n /= 1024.0


def text(s, ns):
    ok = s["ok"] == s["requests"] and not s["failed"] and not s["failures"]
    kind = "sealed-memfd" if s.get("pool") == "memfd" else "shared-memory"
    pools = "%s pools" % kind
    if s.get("register_as") == "vram":
        pools = "%s KV pools registered as VRAM (%s)" % (kind,
            "the fake plugin models GPU memory with host memory" if ns.backend == "fake" else "--kv-register-as vram")
    lines = ["kvhost demo-engine (%s style, MHA, prefill TP %d -> decode TP %d, %s plugin, %s, "
             "%d processes + 2 kvhost serve): %s" % (
                 s["style"], s["prefill_tp"], s["decode_tp"], ns.backend, pools, s["processes"] - 2,
                 "OK: every byte verified in the engines' memory" if ok else "FAILED")]
    lines.append("  requests      %d ok, %d failed (of %d)" % (s["ok"], s["failed"], s["requests"]))
    lines.append("  bytes         %s moved, %s verified on decode" % (human(s["bytes_moved"]), human(s["bytes_verified"])))
    base = ""
    if s.get("baseline_gb_per_s"):
        base = "   (kvhost demo --in-process, same shape: %.2f GB/s; ratio %.2f)" % (s["baseline_gb_per_s"], s["ratio"])
    lines.append("  throughput    %.2f GB/s over %.2f s%s" % (s["gb_per_s"], s["seconds"], base))
    tbase = ""
    if s.get("baseline_transfer_gb_per_s"):
        tbase = "   (kvhost demo --in-process, same shape and definition: %.2f GB/s; ratio %.2f)" % (
            s["baseline_transfer_gb_per_s"], s.get("transfer_ratio", 0.0))
    lines.append("  transfer rate %.2f GB/s: %s over the %.3f s kvhost had transfers in flight "
                 "(%d transfers, %.2f ms each on average)%s" % (
                     s["transfer_gb_per_s"], human(s["transfer_bytes"]), s["transfer_seconds"], s["transfers"],
                     s["xfer_mean_ms"], tbase))
    if s.get("procs_transfer_gb_per_s"):
        lines.append("  separate processes: kvhost demo (Go workers, the same cross-process copies) %.2f GB/s, "
                     "%.2f of --in-process; the pair %.2f of it" % (
                         s["procs_transfer_gb_per_s"], s["procs_transfer_ratio"], s["transfer_ratio_to_procs"]))
    lines.extend(cpu_lines(s))
    lines.append("  engine's view %.2f GB/s: over the %.2f s requests were in flight from hand-off to seen done "
                 "(p50 %.2f ms a request)" % (s["engine_view_gb_per_s"], s["engine_view_seconds"], s["engine_view_p50_ms"]))
    for role, since in (("prefill", "its last chunk handed to kvhost"),
                        ("decode", "send_metadata (the prefill engine's fill and sends included)")):
        w = s.get("waits", {}).get(role)
        if w:
            lines.append("  %-13s p50 %.2f ms from %s to the last rank's Success event in the engine process, "
                         "then p50 %.2f ms until the engine's loop sees it" % (
                             role + " waits", w["kvhost_p50_ms"], since, w["loop_p50_ms"]))
    polls = "poll() calls" if s["style"] == "sglang" else "per-step calls"
    for role in ("prefill", "decode"):
        p = s.get("phases", {}).get(role)
        if p:
            c = s.get("control_us_per_request", {}).get(role)
            cost = ""
            if c:
                cost = "; adapter calls %.0f µs per request (CPU %.0f; %.0f per rank%s); %s %.0f µs each, %d of them" % (
                    c["engine"], c["cpu_engine"], c["per_rank"],
                    ", %.0f with 3 poll() calls" % c["with_polls_per_rank"] if "with_polls_per_rank" in c else "",
                    polls, c["poll_us"], c["polls"])
            lines.append("  %-13s %.2f s wall: %s%s" % (role + " engine", p.get("wall", 0.0), ", ".join(
                "%s %.2f s" % (k, p[k]) for k in ("adapter", "poll", "wait_device", "idle", "other") if k in p), cost))
        d = s.get("device", {}).get(role)
        if d:
            lines.append("  %-13s %s thread: %s" % (role + " device", d.get("policy"), ", ".join(
                "%s %.2f s busy (CPU %.2f s, %d jobs)" % (k, d[k], d.get(k + "_cpu", 0.0), d["jobs"].get(k, 0))
                for k in ("fill", "verify") if k in d)))
    if s.get("engine_work_excluded_seconds"):
        ebase = ""
        if s.get("baseline_gb_per_s"):
            ebase = "   (ratio to --in-process end to end, its own fill and verify included: %.2f)" % (
                s["engine_work_excluded_ratio"])
        lines.append("  without fill/verify %.2f GB/s: the slower engine's wall less its device's fill or verify, %.2f s%s" % (
            s["engine_work_excluded_gb_per_s"], s["engine_work_excluded_seconds"], ebase))
    lines.append("  latency       request load p50 %.2f ms, p99 %.2f ms" % (s["latency_p50_ms"], s["latency_p99_ms"]))
    for f in s["failures"]:
        lines.append("  failure: " + f)
    return "\n".join(lines)


def cpu_lines(s):
    """The text of the sidecars' CPU time (summary["sidecar_cpu"]) beside
    the baselines' (--baseline: the threads of ``kvhost demo
    --in-process``; --baseline-procs: of its worker processes)."""
    c = s.get("sidecar_cpu")
    if not c:
        return []
    if "error" in c:
        return ["  sidecar CPU   %s" % c["error"]]
    t = c["total"]
    line = ("  sidecar CPU   kvhost serve's threads ran %.2f s and waited %.2f s for a core in the pair's steady state: "
            "%.2f s waited per 1 s run (%s)" % (
                t["run_seconds"], t["wait_seconds"], t["wait_per_run"], "; ".join(
                    "%s %.2f: ran %.2f s, waited %.2f s" % (role, c[role]["wait_per_run"], c[role]["run_seconds"],
                                                           c[role]["wait_seconds"])
                    for role in ("prefill", "decode") if role in c)))
    for key, name in (("baseline_cpu", "kvhost demo --in-process"), ("procs_cpu", "kvhost demo, separate processes")):
        b = s.get(key)
        if not b:
            continue
        if b.get("wait_per_run") is None:
            line += "; %s: %s" % (name, b.get("scope"))
        else:
            line += "; %s: %.2f (ran %.2f s, waited %.2f s)" % (name, b["wait_per_run"], b["run_seconds"],
                                                                b["wait_seconds"])
    return [line]


def run_with_baseline(style, ns, workdir, reqs):
    """One run of the pair, then (--baseline) ``kvhost demo --in-process``
    on the same shape, and the ratios."""
    prog = Progress(len(reqs), "demo-engine " + style, not ns.json)
    try:
        s = run_style(style, ns, workdir, reqs, prog)
    finally:
        prog.close()
    if ns.baseline:
        try:
            s["baseline_gb_per_s"], s["baseline_transfer_gb_per_s"], s["baseline_cpu"] = baseline(ns, style, s["decode_tp"])
            s["ratio"] = s["gb_per_s"] / s["baseline_gb_per_s"] if s["baseline_gb_per_s"] else 0.0
            s["transfer_ratio"] = (s["transfer_gb_per_s"] / s["baseline_transfer_gb_per_s"]
                                   if s["baseline_transfer_gb_per_s"] else 0.0)
            s["engine_work_excluded_ratio"] = (s["engine_work_excluded_gb_per_s"] / s["baseline_gb_per_s"]
                                               if s["baseline_gb_per_s"] else 0.0)
            if ns.baseline_procs:
                _, s["procs_transfer_gb_per_s"], s["procs_cpu"] = baseline(ns, style, s["decode_tp"], in_process=False)
                s["procs_transfer_ratio"] = (s["procs_transfer_gb_per_s"] / s["baseline_transfer_gb_per_s"]
                                             if s["baseline_transfer_gb_per_s"] else 0.0)
                s["transfer_ratio_to_procs"] = (s["transfer_gb_per_s"] / s["procs_transfer_gb_per_s"]
                                                if s["procs_transfer_gb_per_s"] else 0.0)
        except Exception as e:
            s["baseline_error"] = str(e)
    return s


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return 0.0
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def medians(style, runs):
    """The line --repeat adds: the ratios' and the adapter costs' medians
    over the alternated runs."""
    def cost(role):
        return _median([r.get("control_us_per_request", {}).get(role, {}).get("per_rank", 0.0) for r in runs])

    extra = ""
    waits = [r["sidecar_cpu"]["total"]["wait_per_run"] for r in runs if "total" in r.get("sidecar_cpu", {})]
    base = [r["baseline_cpu"]["wait_per_run"] for r in runs
            if r.get("baseline_cpu", {}).get("wait_per_run") is not None]
    if waits:
        extra += "; CPU wait per run: sidecars %.2f" % _median(waits)
        if base:
            extra += ", kvhost demo --in-process %.2f" % _median(base)
    if any(r.get("procs_transfer_gb_per_s") for r in runs):
        extra += "; kvhost demo in separate processes: %.2f of --in-process, the pair %.2f of it" % (
            _median([r.get("procs_transfer_ratio", 0.0) for r in runs]),
            _median([r.get("transfer_ratio_to_procs", 0.0) for r in runs]))
    return ("%s: median of %d alternated runs: ratio to --in-process %.2f end to end, %.2f transfer rate, "
            "%.2f without fill/verify; adapter calls per request per rank: prefill %.0f µs, decode %.0f µs%s" % (
                style, len(runs), _median([r.get("ratio", 0.0) for r in runs]),
                _median([r.get("transfer_ratio", 0.0) for r in runs]),
                _median([r.get("engine_work_excluded_ratio", 0.0) for r in runs]), cost("prefill"), cost("decode"),
                extra))


def main(argv=None):
    ns = _parse(sys.argv[1:] if argv is None else argv)
    styles = [x for x in ns.styles.split(",") if x]
    if not os.access(ns.kvhost, os.X_OK):
        print("demo-engine: %s is not an executable kvhost binary (run make, or pass --kvhost)" % ns.kvhost, file=sys.stderr)
        return 2
    ns.kvhost = os.path.abspath(ns.kvhost)
    workdir = ns.work_dir or tempfile.mkdtemp(prefix="kvhost-demo-engine-")
    os.makedirs(workdir, exist_ok=True)
    reqs = workload(ns.requests, ns.seed, ns.min_tokens, ns.max_tokens)
    summaries = []
    ok = False
    try:
        for style in styles:
            runs = []
            for _ in range(max(1, ns.repeat)):
                s = run_with_baseline(style, ns, workdir, reqs)
                runs.append(s)
                summaries.append(s)
                if not ns.json:
                    print(text(s, ns), flush=True)
            if len(runs) > 1 and ns.baseline and not ns.json:
                print(medians(style, runs), flush=True)
        ok = all(s["ok"] == s["requests"] and not s["failed"] and not s["failures"] for s in summaries)
    finally:
        if not ns.work_dir:
            if ok:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                print("demo-engine: the sidecars' logs are kept in %s" % workdir, file=sys.stderr)
    if ns.json:
        print(json.dumps(summaries, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
