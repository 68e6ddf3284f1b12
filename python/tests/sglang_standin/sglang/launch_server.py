"""Stand-in for SGLang's launch_server: parses the flags, resolves the
transfer backend here and in a spawned process (SGLang's schedulers)."""
import json
import multiprocessing as mp
import sys

from sglang.srt.server_args import prepare_server_args


if __name__ == "__main__":
    args = prepare_server_args(sys.argv[1:])
    from sglang.srt.disaggregation.prefill import child, resolve

    parent = resolve(args.disaggregation_transfer_backend)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(args.disaggregation_transfer_backend, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    print(json.dumps({"parent": parent, "child": list(got), "argv": sys.argv[1:]}))
