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


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_demo_engine_every_byte(style):
    out = run_demo("--styles", style, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads(out.stdout)
    assert s["style"] == style and s["ok"] == 24 and s["failed"] == 0 and not s["failures"], s
    assert s["bytes_verified"] > 0 and s["gb_per_s"] > 0


@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_demo_engine_fails_on_one_wrong_byte(style):
    out = run_demo("--styles", style, "--corrupt", "req-1-0005")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout
    assert "request req-1-0005: decode rank 0: page 0" in out.stdout and "byte 0: got" in out.stdout, out.stdout
    assert "23 ok, 1 failed" in out.stdout, out.stdout
