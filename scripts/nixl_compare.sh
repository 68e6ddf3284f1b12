#!/bin/bash
# kvhost over real NIXL against the reference connectors' path
# (scripts/nixl_reference_bench.py) and raw memcpy, alternated in one run so
# that every variant sees the same machine: for each round, style (sglang
# push, vllm pull), request size (64 and 1024 tokens: 8 and 128 MiB) and
# process layout (1, 2), one run of each variant. Appends one JSON line per
# run to OUT; scripts/nixl_reference_bench.py --table OUT prints the medians
# and ratios. A measurement tool (plugins/nixl/README.md, "Against the
# reference path"); CI does not run it.
#
# usage: . /work/nixl-env.sh; nice -n -10 scripts/nixl_compare.sh ROUNDS OUT.jsonl
# env:   KVHOST_BEFORE=DIR  also run DIR/bin/kvhost (with its DIR/lib/kvhost
#                           plugins) as variant "before"
#        KVHOST_DEMO_FLAGS  extra flags for every kvhost run (default none)
#        SIZES="64 1024" PROCS="1 2" STYLES="sglang vllm"
#        REF_WARMUP=N       the reference's untimed first requests (default 0:
#                           every request timed, as kvhost demo's rate counts
#                           every request, the first peer connection included)
set -u
rounds=$1; out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
py=/usr/bin/python3
ref=$here/scripts/nixl_reference_bench.py
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-FATAL} UCX_WARN_UNUSED_ENV_VARS=n
shape=(--layers 32 --kv-heads 8 --head-dim 128 --page-size 16)

demo() { # BIN STYLE TOKENS PROCS REQS
  local inproc=(); [ "$4" = 1 ] && inproc=(--in-process)
  # shellcheck disable=SC2086
  "$1" --backend nixl demo "${inproc[@]}" --mem-kinds dram --style "$2" --prefill-tp 1 --decode-tp 1 \
    "${shape[@]}" --chunk-pages 0 --concurrency 1 --requests "$5" --min-tokens "$3" --max-tokens "$3" \
    ${KVHOST_DEMO_FLAGS:-} --json 2>/dev/null |
    $py -c 'import json,sys; d=json.load(sys.stdin); assert d["ok"]==d["requests"]
print(json.dumps({"xfer_gb_per_s":d["transfer_gb_per_s"],"memcpy_gb_per_s":d["memcpy_gb_per_s"],"requests":d["requests"],"xfer_p50_us":d["xfer_p50_us"]}))'
}

for r in $(seq 1 "$rounds"); do
  for style in ${STYLES:-sglang vllm}; do
    for tokens in ${SIZES:-64 1024}; do
      for procs in ${PROCS:-1 2}; do
        reqs=40; [ "$tokens" -ge 1024 ] && reqs=12
        variants="kvhost reference"
        [ "$style" = sglang ] && variants="$variants reference-prepped"
        [ -n "${KVHOST_BEFORE:-}" ] && variants="before $variants"
        for v in $variants; do
          case $v in
          kvhost) j=$(demo "$here/bin/kvhost" "$style" "$tokens" "$procs" "$reqs") ;;
          before) j=$(demo "$KVHOST_BEFORE/bin/kvhost" "$style" "$tokens" "$procs" "$reqs") ;;
          reference*)
            path=merged; [ "$v" = reference-prepped ] && path=prepped
            j=$($py "$ref" --style "$style" --sglang-path $path --tokens "$tokens" --procs "$procs" \
              --requests "$reqs" --warmup "${REF_WARMUP:-0}" "${shape[@]}" --json 2>/dev/null) ;;
          esac
          [ -n "$j" ] || j='{"error":true}'
          echo "{\"round\":$r,\"style\":\"$style\",\"tokens\":$tokens,\"procs\":$procs,\"variant\":\"$v\",\"run\":$j}" >>"$out"
        done
      done
    done
  done
done
