"""kvhost.schedstat: per-thread run and runqueue wait of a process, the
numbers make demo-engine prints for each kvhost serve sidecar."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvhost import schedstat


def write_proc(root, pid, files):
    """A fake proc tree: process pid with one task per entry of files
    (tid -> schedstat content; None leaves the task without the file)."""
    for tid, content in files.items():
        d = root / str(pid) / "task" / str(tid)
        d.mkdir(parents=True)
        if content is not None:
            (d / "schedstat").write_text(content)
    return str(root)


@pytest.mark.parametrize("text,want", [
    ("845423 12 1\n", (845423, 12, 1)),
    ("0 0 0", (0, 0, 0)),
])
def test_parse(text, want):
    assert schedstat.parse(text) == want


@pytest.mark.parametrize("text", ["1 2\n", "1 2 3 4\n", "1 -2 3\n", "1  2 3\n", "a b c\n", "", "1 2 3\n\n",
                                  "+1 2 3", "18446744073709551615 0 0\n", "1 ２ 3"])
def test_parse_refuses(text):
    with pytest.raises(ValueError):
        schedstat.parse(text)


def test_snapshot_synthetic(tmp_path):
    root = write_proc(tmp_path, 42, {42: "1000000000 500000000 10\n", 43: "2000 3000 4\n"})
    (tmp_path / "42" / "task" / "notatid").mkdir()
    assert schedstat.snapshot(42, root) == {42: (10**9, 5 * 10**8, 10), 43: (2000, 3000, 4)}


def test_snapshot_skips_a_thread_being_reaped(tmp_path):
    """A thread being reaped reads empty: it is left out, not an error
    that drops the snapshot."""
    root = write_proc(tmp_path, 5, {5: "1 1 1\n", 6: ""})
    assert schedstat.snapshot(5, root) == {5: (1, 1, 1)}


def test_snapshot_while_threads_end():
    """Threads of this process that end while it is read never fail it."""
    import threading
    import time
    stop = time.monotonic() + 1.0
    reads = 0
    while time.monotonic() < stop:
        ts = [threading.Thread(target=lambda: None) for _ in range(4)]
        for t in ts:
            t.start()
        schedstat.snapshot()
        reads += 1
        for t in ts:
            t.join()
    assert reads > 0


def test_snapshot_unavailable(tmp_path):
    # A kernel without CONFIG_SCHED_INFO: the task is there, its file not.
    root = write_proc(tmp_path, 7, {7: None})
    with pytest.raises(schedstat.Unavailable):
        schedstat.snapshot(7, root)


def test_snapshot_no_process(tmp_path):
    with pytest.raises(FileNotFoundError):
        schedstat.snapshot(99, str(tmp_path))


@pytest.mark.parametrize("content", ["1 2\n", "x y z\n", "1" * 300 + " 2 3\n"])
def test_snapshot_malformed(tmp_path, content):
    root = write_proc(tmp_path, 5, {5: "1 1 1\n", 6: content})
    with pytest.raises(ValueError) as e:
        schedstat.snapshot(5, root)
    assert os.path.join("task", "6", "schedstat") in str(e.value)


def test_delta():
    s = 10**9
    before = {1: (1 * s, s // 10, 5), 2: (2 * s, 0, 1), 3: (9 * s, 9 * s, 9), 4: (5 * s, 5 * s, 50)}
    after = {
        1: (s + s // 2, 4 * s // 10, 8),  # ran 0.5 s, waited 0.3 s
        2: (2 * s, 0, 1),  # idle
        5: (s // 4, s // 20, 2),  # new: from zero
        4: (s // 100, s // 50, 1),  # a new thread with an old id: from zero
    }  # 3 ended: lost
    u = schedstat.delta(before, after)
    assert u["run_seconds"] == pytest.approx(0.5 + 0.25 + 0.01)
    assert u["wait_seconds"] == pytest.approx(0.3 + 0.05 + 0.02)
    assert u["timeslices"] == 3 + 2 + 1 and u["threads"] == 3, u
    assert schedstat.wait_per_run(u) == pytest.approx(0.37 / 0.76)
    assert schedstat.wait_per_run({"run_seconds": 0.0, "wait_seconds": 1.0}) == 0.0


def test_self_spinning_thread():
    """This very process: a thread spinning must show its run time grow
    (no bound on how long that takes on a loaded machine, short of the
    test's own timeout)."""
    stop = threading.Event()
    tid = []

    def spin():
        tid.append(threading.get_native_id())
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, daemon=True)
    before = schedstat.snapshot()
    t.start()
    try:
        while not tid:
            time.sleep(0.001)
        deadline = time.monotonic() + 120
        while True:
            after = schedstat.snapshot()
            u = schedstat.delta(before, after)
            if after.get(tid[0], (0, 0, 0))[0] >= 50_000_000:
                break
            assert time.monotonic() < deadline, ("thread %d never ran 50 ms" % tid[0], after.get(tid[0]))
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    # The thread started after the first snapshot: it counts from zero.
    assert tid[0] not in before
    assert u["run_seconds"] >= 0.05 and u["wait_seconds"] >= 0 and u["threads"] >= 1, u
