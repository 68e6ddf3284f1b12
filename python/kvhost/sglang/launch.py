"""Starts SGLang's server with ``kvhost`` as a disaggregation transfer backend.

SGLang picks its connector classes from a closed enum
(TransferBackend in SGLang's python/sglang/srt/disaggregation/utils.py,
resolved by get_kv_class there) and its ``--disaggregation-transfer-backend``
flag accepts only the enum's values. This launcher

1. adds a member ``KVHOST = "kvhost"`` to TransferBackend, wraps
   get_kv_class so that member resolves to :mod:`kvhost.sglang`'s classes,
   replaces get_kv_class in every SGLang module that already imported it,
   and adds ``kvhost`` to the flag's choices (:func:`install`);
2. runs ``sglang.launch_server`` as ``__main__`` with the remaining argv.

The patch is installed when this module is imported, so SGLang's scheduler
processes, which multiprocessing starts with "spawn" (they import the
parent's main module, this one, before anything else), have it too.

Usage::

    python -m kvhost.sglang.launch [--kvhost-control ipc:///run/kvhost.sock]
        [--kvhost-variant nixl|mori] --model-path ... \
        --disaggregation-mode prefill --disaggregation-transfer-backend kvhost ...

(``kvhost-sglang`` is the same as a console script.) The ``--kvhost-*``
flags are taken out of argv and passed to every process as
``KVHOST_CONTROL`` / ``KVHOST_SGLANG_VARIANT`` / ``KVHOST_HOST``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

BACKEND = "kvhost"
_FLAGS = {"--kvhost-control": "KVHOST_CONTROL", "--kvhost-variant": "KVHOST_SGLANG_VARIANT",
          "--kvhost-host": "KVHOST_HOST"}


def _extend_enum(enum_cls, name: str, value: str):
    """Adds a member to an existing Enum class (Python's Enum has no API
    for it; this sets the same tables EnumType fills at class creation)."""
    try:
        return enum_cls(value)
    except ValueError:
        pass
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    try:
        member.__objclass__ = enum_cls
    except AttributeError:
        pass
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def kv_class(class_type):
    """kvhost.sglang's class for one of SGLang's KVClassType members (or
    their values: kvargs, manager, sender, receiver, bootstrap_server):
    what get_kv_class answers for the kvhost backend once installed."""
    from kvhost import sglang as ks

    kind = getattr(class_type, "value", class_type)
    return {
        "kvargs": ks.KVArgs,
        "manager": ks.KVManager,
        "sender": ks.KVSender,
        "receiver": ks.KVReceiver,
        "bootstrap_server": ks.KVBootstrapServer,
    }.get(kind)


def install() -> bool:
    """Registers the kvhost backend with SGLang, if SGLang is importable.
    Idempotent. Returns True when SGLang was patched."""
    try:
        import sglang.srt.disaggregation.utils as du  # type: ignore
    except ImportError:
        return False
    member = _extend_enum(du.TransferBackend, "KVHOST", BACKEND)
    orig = du.get_kv_class
    if getattr(orig, "_kvhost", False):
        return True

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend is member or getattr(transfer_backend, "value", transfer_backend) == BACKEND:
            return kv_class(class_type)
        return orig(transfer_backend, class_type)

    get_kv_class._kvhost = True  # type: ignore[attr-defined]
    get_kv_class.__wrapped__ = orig  # type: ignore[attr-defined]
    du.get_kv_class = get_kv_class
    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, "get_kv_class", None) is orig:
            try:
                setattr(mod, "get_kv_class", get_kv_class)
            except Exception:
                pass
    _add_choice()
    return True


def _add_choice() -> None:
    """Adds ``kvhost`` to the list of choices SGLang's server_args gives
    ``--disaggregation-transfer-backend`` (a module-level list in the
    releases that have one)."""
    try:
        import sglang.srt.server_args as sa  # type: ignore
    except Exception:
        return
    for name in dir(sa):
        if "TRANSFER_BACKEND" in name.upper() and "CHOICE" in name.upper():
            choices = getattr(sa, name)
            if isinstance(choices, list) and BACKEND not in choices:
                choices.append(BACKEND)


def take_flags(argv: List[str]) -> List[str]:
    """Removes ``--kvhost-*`` flags from argv into the environment."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key, _, val = a.partition("=")
        if key in _FLAGS:
            if not _:
                if i + 1 >= len(argv):
                    raise SystemExit("%s needs a value" % key)
                i += 1
                val = argv[i]
            os.environ[_FLAGS[key]] = val
        else:
            out.append(a)
        i += 1
    return out


def main(argv: Optional[List[str]] = None) -> None:
    args = take_flags(list(sys.argv[1:] if argv is None else argv))
    if not install():
        raise SystemExit("kvhost.sglang.launch: SGLang is not importable here (pip install sglang)")
    sys.argv = ["sglang.launch_server"] + args
    # alter_sys=False keeps this module as __main__, so the processes SGLang
    # spawns import it (and install the patch) before anything else.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


install()  # also in spawned children, which import this module first

if __name__ == "__main__":
    main()
