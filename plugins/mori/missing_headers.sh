#!/usr/bin/env bash
# missing_headers.sh: names every header family that MORI's public IO
# headers (mori/io/io.hpp) include and that the compiler cannot find, in
# plain words, instead of the compiler's first "No such file" error.
#
# usage: plugins/mori/missing_headers.sh CXX [FLAGS...]
#   CXX FLAGS  the compiler and the flags the shim is compiled with (the
#              -isystem folders above all)
# Prints one line per missing family to stderr and exits 1, or exits 0.
#
# How: the preprocessor lists every header io.hpp pulls in, taking the ones
# it cannot find as generated (-M -MG); those without a folder are missing.
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 CXX [FLAGS...]" >&2; exit 2; }

deps=$(printf '#include <mori/io/io.hpp>\n' | "$@" -M -MG -x c++ - 2>/dev/null) || {
  echo "missing_headers.sh: the preprocessor failed on mori/io/io.hpp:" >&2
  printf '#include <mori/io/io.hpp>\n' | "$@" -M -MG -x c++ - >/dev/null || true
  exit 1
}
missing=$(printf '%s\n' "$deps" | tr ' \\' '\n\n' | grep -v -e '^$' -e ':$' -e '^/' | sort -u || true)
[[ -z "$missing" ]] && exit 0

rocm_dir="${ROCM_PATH:-/opt/rocm}"
rocm="ROCM_PATH=$rocm_dir"
if [[ ! -d "$rocm_dir" ]]; then
  rocm="there is no $rocm_dir; ROCm 7.14 and later have no /opt/rocm: set ROCM_PATH to where ROCm is"
fi
declare -A seen=()
while read -r h; do
  case "$h" in
    msgpack*) fam="msgpack-c C++ API: MORI's 3rdparty/msgpack-c/include (MORI_SRC or the wheel's _jit-sources/3rdparty), or libmsgpack-cxx-dev" ;;
    spdlog/*|fmt/*) fam="spdlog: MORI's 3rdparty/spdlog/include (MORI_SRC or the wheel's _jit-sources/3rdparty), or libspdlog-dev" ;;
    hip/*) fam="HIP: ROCm's include/ ($rocm)" ;;
    hsa/*) fam="HSA runtime: ROCm's include/ ($rocm)" ;;
    hsakmt/*|hsakmt*.h) fam="hsakmt: ROCm's include/hsakmt/ ($rocm); MORI v1.2.0's SDMA headers include it" ;;
    infiniband/*|rdma/*) fam="libibverbs: libibverbs-dev (rdma-core)" ;;
    mori/*) fam="MORI itself: MORI's include/ folder is incomplete" ;;
    *) fam="other" ;;
  esac
  seen["$fam"]+=" <$h>"
done <<< "$missing"
for fam in "${!seen[@]}"; do
  echo "missing${seen[$fam]}: $fam" >&2
done
exit 1
