#!/usr/bin/env bash
# check_compile.sh: proves that plugins/mori/mori_plugin.cc compiles cleanly
# (-Wall -Wextra -Werror) against the headers of a MORI-IO release, on a
# machine that cannot build or run MORI (no ROCm, no AMD GPU, no RDMA NIC).
#
# It only compiles; it fetches nothing and builds no part of MORI. Linking
# needs libmori_io.so, which needs ROCm to build: use `make plugin-mori` on a
# machine with MORI installed.
#
# usage: plugins/mori/check_compile.sh [--stub-test] [--stub-lib OUT.so] MORI_INCLUDE [DEP_INCLUDE...]
#
#   MORI_INCLUDE  the folder holding mori/io/io.hpp (MORI's include/ folder)
#   DEP_INCLUDE   folders holding the headers MORI's public IO headers include
#                 and that are not in the compiler's default path:
#                 msgpack.hpp (msgpack-c, C++ API), spdlog/spdlog.h,
#                 hip/hip_runtime_api.h + hip/hip_version.h + hip/amd_detail/
#                 (ROCm's include/), infiniband/verbs.h (libibverbs-dev)
#   --stub-test   also link the shim with stubtest/mori_stub.cc (a memcpy
#                 stand-in for the 11 IOEngine functions the shim calls, NOT
#                 MORI) and run stubtest/shim_test.c, which drives every ABI
#                 entry and verifies the bytes moved
#   --stub-lib F  also write the shim linked with the stand-in as plugin F
#                 (e.g. /tmp/stubplug/libkvhost_mori.so) so the Go conformance
#                 suite can drive the shim's logic
#
# Environment: CXX (default g++), CC (default gcc).
# Exit status 0 when everything asked for passed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
CXX="${CXX:-g++}"
CC="${CC:-gcc}"

stub_test=0
stub_lib=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --stub-test) stub_test=1; shift ;;
    --stub-lib) stub_lib="${2:?--stub-lib needs a file name}"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "check_compile.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [--stub-test] [--stub-lib OUT.so] MORI_INCLUDE [DEP_INCLUDE...]" >&2
  exit 2
fi
mori_inc="$1"; shift
if [[ ! -f "$mori_inc/mori/io/io.hpp" ]]; then
  echo "check_compile.sh: $mori_inc/mori/io/io.hpp not found (give MORI's include/ folder)" >&2
  exit 2
fi

incs=(-isystem "$mori_inc")
for d in "$@"; do
  [[ -d "$d" ]] || { echo "check_compile.sh: $d is not a folder" >&2; exit 2; }
  incs+=(-isystem "$d")
done

# Say which dependency is missing before the compiler does, in plain words.
missing=0
for h in msgpack.hpp spdlog/spdlog.h hip/hip_runtime_api.h hip/hip_version.h infiniband/verbs.h; do
  if ! printf '#include <%s>\n' "$h" | "$CXX" -std=c++20 -D__HIP_PLATFORM_AMD__ -DMSGPACK_NO_BOOST \
      "${incs[@]}" -x c++ -E - >/dev/null 2>&1; then
    echo "check_compile.sh: <$h> (or a header it includes) not found in the folders given or the default path" >&2
    missing=1
  fi
done
[[ $missing -eq 0 ]] || exit 2

# -std=c++20: MORI's rdma.hpp has a constexpr operator== calling std::equal,
# which is constexpr only from C++20 (hipcc's clang accepts it in C++17 mode,
# g++ does not). MORI's headers are -isystem so that -Werror applies to the
# shim, not to warnings inside MORI and HIP.
flags=(-std=c++20 -O2 -g -fPIC -pthread -fvisibility=hidden -Wall -Wextra -Werror
       -DMSGPACK_NO_BOOST -D__HIP_PLATFORM_AMD__ -I"$root/abi" -I"$root/plugins/common" "${incs[@]}")

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

run() { printf '+'; printf ' %q' "$@"; printf '\n'; "$@"; }

echo "== syntax check"
run "$CXX" "${flags[@]}" -fsyntax-only "$here/mori_plugin.cc"
echo "== object compile"
run "$CXX" "${flags[@]}" -c "$here/mori_plugin.cc" -o "$tmp/mori_plugin.o"
echo "== MORI symbols the object needs from libmori_io.so"
nm -uC "$tmp/mori_plugin.o" | grep 'mori::' | sed 's/(.*//' | sort -u
echo "compile check: OK ($("$CXX" --version | head -1))"

if [[ $stub_test -eq 1 || -n "$stub_lib" ]]; then
  echo "== stub build (stubtest/mori_stub.cc stands in for libmori_io; it is not MORI)"
  run "$CC" -std=c11 -O2 -g -fPIC -pthread -Wall -Wextra -Werror -I"$root/abi" \
    -I"$root/plugins/common" -c "$root/plugins/common/kvp_util.c" -o "$tmp/kvp_util.o"
  run "$CXX" "${flags[@]}" -c "$here/stubtest/mori_stub.cc" -o "$tmp/mori_stub.o"
  if [[ -n "$stub_lib" ]]; then
    mkdir -p "$(dirname "$stub_lib")"
    run "$CXX" -shared -pthread -o "$stub_lib" "$tmp/mori_plugin.o" "$tmp/mori_stub.o" "$tmp/kvp_util.o"
    echo "stub plugin: $stub_lib"
  fi
  if [[ $stub_test -eq 1 ]]; then
    run "$CC" -std=c11 -O1 -g -pthread -Wall -Wextra -Werror -Wno-missing-field-initializers -I"$root/abi" \
      -c "$here/stubtest/shim_test.c" -o "$tmp/shim_test.o"
    run "$CXX" -pthread -o "$tmp/shim_test" "$tmp/shim_test.o" "$tmp/mori_plugin.o" \
      "$tmp/mori_stub.o" "$tmp/kvp_util.o"
    echo "== stub test"
    run "$tmp/shim_test"
  fi
fi
