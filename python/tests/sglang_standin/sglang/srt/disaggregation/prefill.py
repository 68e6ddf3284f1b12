"""Stand-in for a scheduler module that imports get_kv_class by name."""
import os

from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class


def resolve(name):
    cls = get_kv_class(TransferBackend(name), KVClassType.MANAGER)
    return "%s.%s" % (cls.__module__, cls.__qualname__), os.environ.get("KVHOST_CONTROL")


def child(name, q):
    """A scheduler process's entry point (SGLang's run_scheduler_process
    lives in a module, not in launch_server's __main__)."""
    q.put(resolve(name))
