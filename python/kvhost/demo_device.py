"""The engine demo's GPU: one thread per engine process, named "device"
(one CUDA stream's worth of ordering), that runs the work a real engine's
GPU does (the prefill's forward pass writing a request's KV, the decode's
check of every byte it received: numpy here) asynchronously to the
engine's scheduler loop, which submits a job and keeps polling, and acts
on the job's result (sends the KV, frees the pages) only once the device
reports it done: the ordering the engines' real code has (KV written
before it is sent, pages freed only after they were read).

Priority ("idle", the default): the thread asks the kernel for
SCHED_IDLE, the lowest priority an unprivileged thread gets (os.nice(19)
where that is refused). In a deployment that work runs on the GPU, not
on the host cores the sidecar's copies and the engine's scheduler thread
use; here it runs on the same cores, and on a machine with fewer cores
than processes a normal-priority stand-in preempts the sidecars' copy
threads thousands of times a run, which real GPU kernels do not.
"normal" keeps the engine's own priority, for comparison.

Linux applies sched_setscheduler(0, ...) and nice() to the calling
thread only, which is why the thread sets its own priority. numpy
releases the GIL inside its copy and compare loops (take, fancy-index
assignment, array_equal), so the low-priority thread holds the GIL only
for the few Python lines between them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback

PRIORITIES = ("idle", "normal")


class DeviceError(RuntimeError):
    """A job raised on the device; the message holds its traceback."""


class Job:
    """One submitted piece of GPU work. ``done`` turns True (on the device
    thread) once it ran; value() returns its result or raises what it
    raised."""

    __slots__ = ("phase", "fn", "args", "done", "result", "error", "_ev")

    def __init__(self, phase, fn, args):
        self.phase, self.fn, self.args = phase, fn, args
        self.done = False
        self.result = None
        self.error = None
        self._ev = threading.Event()

    def value(self):
        if not self.done:
            raise RuntimeError("device job %s: value() before it is done" % self.phase)
        if self.error is not None:
            raise DeviceError("device job %s failed:\n%s" % (self.phase, self.error))
        return self.result


class Device:
    """The device thread of one engine process. submit() queues a job
    (in order, like a stream); the loop polls Job.done, or blocks in
    wait()/idle() without spinning (a spinning loop would take the core
    the idle-priority thread needs).

    report(): per phase, the seconds the device ran jobs (wall, the
    device's "busy time") and their thread CPU seconds, the job count, and
    the scheduling policy the thread got."""

    def __init__(self, priority="idle", name="device", delay=0.0):
        """delay: seconds each job waits on the device before it runs (a
        slower GPU: work launched is not work done; tests prove with it
        that the loop waits for the device)."""
        if priority not in PRIORITIES:
            raise ValueError("device priority %r: want one of %s" % (priority, ", ".join(PRIORITIES)))
        self.priority = priority
        self.delay = float(delay)
        self.policy = None  # what the thread got: "SCHED_IDLE", "nice 19", "normal (nice N)"
        self.tid = None  # its kernel thread id
        self.busy, self.cpu, self.jobs = {}, {}, {}
        self._q = queue.SimpleQueue()
        self._completed = threading.Event()
        self._submitted = 0
        self._finished = 0  # written by the device thread only
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _lower_priority(self):
        if self.priority != "idle":
            return "normal (nice %d)" % os.getpriority(os.PRIO_PROCESS, 0)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:
            os.nice(19)
            return "nice %d" % os.getpriority(os.PRIO_PROCESS, 0)

    def _run(self, ready):
        self.tid = threading.get_native_id()
        try:
            # The kernel's name of the thread too, for perf and top -H.
            with open("/proc/self/task/%d/comm" % self.tid, "w") as f:
                f.write(self._thread.name[:15])
        except OSError:
            pass
        try:
            self.policy = self._lower_priority()
        finally:
            ready.set()
        while True:
            job = self._q.get()
            if job is None:
                return
            t, c = time.monotonic(), time.thread_time()
            if self.delay > 0:
                time.sleep(self.delay)
            try:
                job.result = job.fn(*job.args)
            except BaseException:
                job.error = traceback.format_exc()
            self.busy[job.phase] = self.busy.get(job.phase, 0.0) + time.monotonic() - t
            self.cpu[job.phase] = self.cpu.get(job.phase, 0.0) + time.thread_time() - c
            self.jobs[job.phase] = self.jobs.get(job.phase, 0) + 1
            job.done = True
            self._finished += 1
            job._ev.set()
            self._completed.set()

    def submit(self, phase, fn, *args):
        """Queues fn(*args) as device work of ``phase`` ("fill", "verify");
        returns its Job."""
        job = Job(phase, fn, args)
        self._submitted += 1
        self._q.put(job)
        return job

    def pending(self):
        """Jobs submitted and not yet done."""
        return self._submitted - self._finished

    def wait(self, jobs, ph=None, timeout=None):
        """Blocks until every job is done (the loop has nothing else to do:
        a synchronizing step); timed as ph's "wait_device"."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with _timed(ph, "wait_device"):
            for j in jobs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not j._ev.wait(left):
                    raise TimeoutError("device job %s not done within %s s" % (j.phase, timeout))
        return [j.value() for j in jobs]

    def idle(self, ph=None, seconds=0.001):
        """The loop's pause when a pass found nothing to do: up to
        ``seconds``, returning early when a device job completes (timed as
        "wait_device" while jobs are pending, else "idle")."""
        if self.pending():
            with _timed(ph, "wait_device"):
                self._completed.wait(seconds)
                self._completed.clear()
        else:
            with _timed(ph, "idle"):
                time.sleep(seconds)

    def report(self):
        out = {"priority": self.priority, "policy": self.policy, "jobs": dict(self.jobs)}
        out.update(self.busy)
        out.update({k + "_cpu": v for k, v in self.cpu.items()})
        return out

    def close(self):
        self._q.put(None)
        self._thread.join(10)


class _NoTimer:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _timed(ph, name):
    return ph.timed(name) if ph is not None else _NoTimer()
