"""How long a process's threads ran on a CPU and waited for one.

The kernel keeps, per thread, ``/proc/<pid>/task/<tid>/schedstat``: three
decimal numbers, nanoseconds on a CPU, nanoseconds runnable but waiting on
a runqueue, timeslices run. On a machine with fewer cores than busy
threads the wait is what a process lost to the others: ``make
demo-engine`` reads it for each ``kvhost serve`` sidecar over the pair's
run, beside ``kvhost demo``'s own (host/internal/schedstat, the same
reading in Go).

Kernels built without CONFIG_SCHED_INFO have no such file: ``snapshot``
raises ``Unavailable``, which callers report as "not measured".
Pure Python (the engines depend on pyzmq and msgpack only).
"""

from __future__ import annotations

import os

# Three uint64s in decimal and their separators need under 64 bytes.
_MAX_BYTES = 256
_MAX_NS = (1 << 63) - 1


class Unavailable(Exception):
    """The kernel keeps no per-thread schedstat (CONFIG_SCHED_INFO)."""


def parse(text):
    """(run_ns, wait_ns, timeslices) of one schedstat file's content:
    three unsigned decimal numbers separated by single spaces, then an
    optional newline. ValueError otherwise."""
    s = text[:-1] if text.endswith("\n") else text
    fields = s.split(" ")
    if len(fields) != 3:
        raise ValueError("schedstat: want 3 numbers, got %r" % s)
    out = []
    for i, f in enumerate(fields):
        if not f or not f.isascii() or not f.isdigit():
            raise ValueError("schedstat: field %d of %r: not an unsigned number" % (i + 1, s))
        out.append(int(f))
    if out[0] > _MAX_NS or out[1] > _MAX_NS:
        raise ValueError("schedstat: %r: nanoseconds out of range" % s)
    return tuple(out)


def snapshot(pid="self", root="/proc"):
    """{tid: (run_ns, wait_ns, timeslices)} of every thread of process pid
    ("self" or a number). A thread that ends while it is read is left out;
    a process that does not exist raises FileNotFoundError; a kernel
    without the files raises Unavailable; a malformed file ValueError
    naming it."""
    task = os.path.join(root, str(pid), "task")
    snap = {}
    for name in os.listdir(task):
        if not name.isdigit():
            continue
        path = os.path.join(task, name, "schedstat")
        try:
            with open(path, "rb") as f:
                b = f.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            if os.path.isdir(os.path.join(task, name)):
                raise Unavailable("this kernel keeps no per-thread schedstat (CONFIG_SCHED_INFO): %s" % path) from None
            continue  # the thread ended after the listing
        except ProcessLookupError:
            continue  # the thread ended while being read
        if not b:
            continue  # the thread ended between the open and the read
        if len(b) > _MAX_BYTES:
            raise ValueError("schedstat: %s: longer than %d bytes" % (path, _MAX_BYTES))
        try:
            snap[int(name)] = parse(b.decode("ascii", errors="replace"))
        except ValueError as e:
            raise ValueError("%s: %s" % (path, e)) from None
    return snap


def delta(before, after):
    """What the threads of ``after`` did since ``before``:
    {run_seconds, wait_seconds, timeslices, threads} (threads: those that
    ran or waited). A thread that started between the snapshots counts
    from zero; one that ended between them is lost (the kernel drops its
    counters with it); a reused thread id (counters below the old ones)
    counts from zero too."""
    run = wait = slices = threads = 0
    for tid, a in after.items():
        b = before.get(tid, (0, 0, 0))
        if any(x < y for x, y in zip(a, b)):
            b = (0, 0, 0)
        r, w = a[0] - b[0], a[1] - b[1]
        run, wait, slices = run + r, wait + w, slices + a[2] - b[2]
        if r or w:
            threads += 1
    return {"run_seconds": run / 1e9, "wait_seconds": wait / 1e9, "timeslices": slices, "threads": threads}


def wait_per_run(usage):
    """Seconds waited for a core per second on one (0 when nothing ran)."""
    return usage["wait_seconds"] / usage["run_seconds"] if usage["run_seconds"] > 0 else 0.0
