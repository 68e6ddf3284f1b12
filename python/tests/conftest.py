"""Fixtures: live ``kvhost serve`` sidecars (bin/kvhost of this checkout,
fake plugin) and the paths of the repository.

``KVHOST_TEST_BACKEND`` (default ``fake``; CI keeps it) runs the sidecars
on another plugin: ``nixl`` (lib/kvhost/libkvhost_nixl.so from ``make
plugin-nixl``, NIXL's environment set) moves the same bytes over a real
NIXL agent pair (UCX on loopback).

A missing bin/kvhost is a failure, not a skip: build it with ``make all``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
KVHOST = os.environ.get("KVHOST_BIN") or os.path.join(REPO, "bin", "kvhost")
BACKEND = os.environ.get("KVHOST_TEST_BACKEND") or "fake"

if PYROOT not in sys.path:
    sys.path.insert(0, PYROOT)


def kvhost_bin() -> str:
    if not os.access(KVHOST, os.X_OK):
        pytest.fail("%s is missing: run `make all` first (the Python tests drive the real sidecar)" % KVHOST)
    return KVHOST


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Sidecar:
    """One ``kvhost serve --backend $KVHOST_TEST_BACKEND`` (fake) process on an ipc:// socket in a
    temporary folder; its stderr goes to a log file shown on failure."""

    def __init__(self, tmpdir: str, name: str = "sidecar", extra: Optional[List[str]] = None):
        self.dir = tmpdir
        self.name = name
        self.sock = os.path.join(tmpdir, name + ".sock")
        self.endpoint = "ipc://" + self.sock
        self.log_path = os.path.join(tmpdir, name + ".log")
        self.extra = list(extra or [])
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    def start(self, wait: float = 30.0) -> "Sidecar":
        args = [kvhost_bin(), "--backend", BACKEND, "serve", "--control", self.endpoint] + self.extra
        self._log = open(self.log_path, "ab")
        env = dict(os.environ)
        env.pop("KVHOST_CONTROL", None)
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.starts += 1
        deadline = time.monotonic() + wait
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError("kvhost serve exited with %s:\n%s" % (self.proc.returncode, self.log()))
            if time.monotonic() > deadline:
                raise RuntimeError("kvhost serve did not create %s within %.0f s:\n%s" % (self.sock, wait, self.log()))
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: the sidecar dies without a word."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        # A killed sidecar leaves its socket file behind.
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode if self.proc else 0
        try:
            self._log.close()
        except Exception:
            pass
        return rc

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-8000:].decode(errors="replace")
        except FileNotFoundError:
            return ""


@pytest.fixture
def tmpdir_short():
    # ipc:// paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="kvh-")
    yield d
    for f in os.listdir(d):
        try:
            os.unlink(os.path.join(d, f))
        except OSError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass


@pytest.fixture
def sidecar_factory(tmpdir_short, request):
    made: List[Sidecar] = []

    def make(name: str = "sidecar", extra: Optional[List[str]] = None, start: bool = True) -> Sidecar:
        s = Sidecar(tmpdir_short, name, extra)
        made.append(s)
        return s.start() if start else s

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for s in made:
        s.stop()
        if failed:
            sys.stderr.write("---- %s log ----\n%s\n" % (s.name, s.log()))


@pytest.fixture(scope="session")
def standin_cudart(tmp_path_factory):
    """host/serve/engmem's stand-in libcudart (CUDA's IPC entry points over
    POSIX shared memory; CI has no GPU), built with gcc; no gcc fails."""
    import shutil

    src = os.path.join(REPO, "host", "serve", "engmem", "testdata", "cudart_standin.c")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is needed to build the stand-in libcudart")
    out = str(tmp_path_factory.mktemp("cudart") / "libcudart_standin.so")
    subprocess.run([gcc, "-std=c11", "-O1", "-fPIC", "-shared", "-pthread", "-o", out, src], check=True)
    return out


@pytest.fixture
def sidecar(sidecar_factory):
    return sidecar_factory()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
