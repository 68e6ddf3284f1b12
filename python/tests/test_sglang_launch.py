"""python -m kvhost.sglang.launch adds "kvhost" to SGLang's closed
transfer-backend enum and flag choices and resolves it to kvhost.sglang's
classes, in the launching process and in the processes SGLang spawns
(against a stand-in for the SGLang modules it patches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, PYROOT

STANDIN = os.path.join(HERE, "sglang_standin")


def launch(*argv, entry=("-m", "kvhost.sglang.launch")):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STANDIN, PYROOT]))
    env.pop("KVHOST_CONTROL", None)
    return subprocess.run([sys.executable, *entry, *argv], env=env, capture_output=True, text=True, timeout=120)


def test_launcher_registers_kvhost_backend():
    r = launch("--kvhost-control", "ipc:///tmp/x.sock", "--model-path", "m",
               "--disaggregation-transfer-backend", "kvhost")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parent"] == ["kvhost.sglang.conn.KVManager", "ipc:///tmp/x.sock"]
    assert out["child"] == ["kvhost.sglang.conn.KVManager", "ipc:///tmp/x.sock"]
    # The launcher's own flags do not reach SGLang.
    assert out["argv"] == ["--model-path", "m", "--disaggregation-transfer-backend", "kvhost"]


def test_launcher_leaves_other_backends_alone():
    r = launch("--disaggregation-transfer-backend", "fake")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parent"][0] == "sglang.srt.disaggregation.utils.FakeKVManager"
    assert out["child"][0] == "sglang.srt.disaggregation.utils.FakeKVManager"


def test_without_the_launcher_sglang_refuses_kvhost():
    """Proves the stand-in is closed like SGLang: the patch is what opens it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STANDIN, PYROOT]))
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--disaggregation-transfer-backend", "kvhost"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "invalid choice" in r.stderr


@pytest.mark.parametrize("flag", ["--kvhost-control=ipc:///tmp/y.sock"])
def test_flag_with_equals(flag):
    r = launch(flag, "--disaggregation-transfer-backend", "kvhost")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["child"][1] == "ipc:///tmp/y.sock"
