"""`pip install ./python` in a fresh virtual environment (system site
packages: Debian's pyzmq and msgpack) gives a package whose adapters import
without SGLang, vLLM or torch, and needs no network."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from conftest import PYROOT


def test_pip_install_in_fresh_venv():
    with tempfile.TemporaryDirectory(prefix="kvh-venv-") as d:
        venv = os.path.join(d, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        r = subprocess.run([py, "-m", "pip", "install", "-q", PYROOT], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        mods = ["kvhost", "kvhost.client", "kvhost.shm", "kvhost.sglang", "kvhost.sglang.launch"]
        if os.path.exists(os.path.join(PYROOT, "kvhost", "vllm.py")) or os.path.isdir(os.path.join(PYROOT, "kvhost", "vllm")):
            mods.append("kvhost.vllm")
        code = ("import sys\n"
                "for m in %r: __import__(m)\n"
                "import kvhost\n"
                "assert kvhost.__file__.startswith(%r), kvhost.__file__\n"
                "for m in ('sglang', 'vllm', 'torch'): assert m not in sys.modules, m\n") % (mods, venv)
        r = subprocess.run([py, "-c", code], env=env, cwd=d, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert os.path.exists(os.path.join(venv, "bin", "kvhost-sglang"))
