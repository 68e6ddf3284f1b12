"""A PEP 517 build backend for the kvhost package, standard library only.

Why not setuptools: pip builds a pyproject.toml package in an isolated
environment and installs the backend named in ``requires`` there from the
package index, so ``pip install ./python`` on a machine without network
access (or with only Debian's python3-setuptools, which the isolated
environment does not see) fails before building anything. kvhost is pure
Python, so its wheel is a zip of the package plus three metadata files; this
backend writes exactly that and needs nothing to be downloaded.

Implements build_wheel, build_sdist and build_editable (PEP 517, PEP 660);
metadata comes from pyproject.toml's [project] table.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import zipfile

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover: Python < 3.11
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kvhost"


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = f.read()
    if tomllib is not None:
        return tomllib.loads(data.decode())["project"]
    return _mini_toml_project(data.decode())


def _mini_toml_project(text: str) -> dict:  # pragma: no cover: Python < 3.11 only
    """Just enough TOML for our own [project] table (strings, string lists)."""
    import ast

    out, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section in ("project", "project.scripts") and "=" in line and not line.startswith("#"):
            k, v = (s.strip() for s in line.split("=", 1))
            try:
                val = ast.literal_eval(v)
            except Exception:
                continue
            if section == "project":
                out[k] = val
            else:
                out.setdefault("scripts", {})[k.strip('"')] = val
    return out


def _metadata(p: dict) -> str:
    lines = ["Metadata-Version: 2.1", "Name: %s" % p["name"], "Version: %s" % p["version"]]
    if p.get("description"):
        lines.append("Summary: %s" % p["description"])
    if p.get("requires-python"):
        lines.append("Requires-Python: %s" % p["requires-python"])
    for d in p.get("dependencies", []):
        lines.append("Requires-Dist: %s" % d)
    for extra, deps in (p.get("optional-dependencies") or {}).items():
        lines.append("Provides-Extra: %s" % extra)
        for d in deps:
            lines.append('Requires-Dist: %s; extra == "%s"' % (d, extra))
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _entry_points(p: dict) -> str:
    scripts = p.get("scripts") or {}
    if not scripts:
        return ""
    return "[console_scripts]\n" + "".join("%s = %s\n" % kv for kv in scripts.items())


def _package_files():
    base = os.path.join(ROOT, PACKAGE)
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py") or f == "py.typed":
                full = os.path.join(d, f)
                yield full, os.path.relpath(full, ROOT)


class _Wheel:
    def __init__(self, path: str):
        self.zf = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, arcname: str, data: bytes) -> None:
        zi = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(zi, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))

    def close(self, dist_info: str) -> None:
        rec = dist_info + "/RECORD"
        self.record.append(rec + ",,")
        zi = zipfile.ZipInfo(rec, date_time=(1980, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        self.zf.writestr(zi, "\n".join(self.record) + "\n")
        self.zf.close()


def _build(wheel_directory: str, editable: bool) -> str:
    p = _project()
    name, version = p["name"], p["version"]
    dist_info = "%s-%s.dist-info" % (name, version)
    fname = "%s-%s-py3-none-any.whl" % (name, version)
    w = _Wheel(os.path.join(wheel_directory, fname))
    if editable:
        w.add("__editable__.%s.pth" % name, (ROOT + "\n").encode())
    else:
        for full, arc in _package_files():
            with open(full, "rb") as f:
                w.add(arc, f.read())
    w.add(dist_info + "/METADATA", _metadata(p).encode())
    w.add(dist_info + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: kvhost_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    ep = _entry_points(p)
    if ep:
        w.add(dist_info + "/entry_points.txt", ep.encode())
    w.close(dist_info)
    return fname


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, editable=False)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, editable=True)


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = "%s-%s" % (p["name"], p["version"])
    fname = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, fname), "w:gz") as tf:
        files = [os.path.join(ROOT, x) for x in ("pyproject.toml", "README.md")]
        files += [os.path.join(ROOT, "build_backend", "kvhost_build.py")]
        files += [full for full, _ in _package_files()]
        for full in files:
            if os.path.exists(full):
                tf.add(full, arcname=os.path.join(base, os.path.relpath(full, ROOT)))
        info = tarfile.TarInfo(os.path.join(base, "PKG-INFO"))
        data = _metadata(p).encode()
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return fname
