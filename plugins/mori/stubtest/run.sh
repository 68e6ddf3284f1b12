#!/usr/bin/env bash
# run.sh: builds the mori shim with the stand-ins for MORI and libibverbs and
# runs its stand-in test (stubtest/shim_test.c). The stand-ins are NOT MORI:
# they prove the shim's own logic (handles, grouping, errors, the
# refusals), nothing about MORI-IO.
#
# usage: plugins/mori/stubtest/run.sh [--stub-lib OUT.so] OUTDIR INCLUDE...
#
#   OUTDIR    where the objects, libraries and the test binary go
#   INCLUDE   folders for -isystem: MORI's include/ (or stubtest/include,
#             the stand-in headers) and what MORI's headers need
#   --stub-lib F  also write the shim linked with the stand-ins as plugin F,
#             with the stand-in libmori_io.so and libibverbs.so.1 beside it
#
# Environment: CXX, CC, SAN (extra compile and link flags, e.g.
# "-fsanitize=thread"), CXXSTD (default c++20), REG_MODES (more
# KVHOST_MORI_REG modes to build the shim for and test with --reg-mode,
# e.g. "ibv auto-offset0"; the main build is "auto").
#
# Builds:
#   ibv/libibverbs.so.1   stubtest/ibverbs_stub.c
#   mori1/libmori_io.so   stubtest/mori_stub.cc: the library the shim is built against
#   mori2/libmori_io.so   the same code with one more constant: another build ID
#   shim_test             the shim (KVHOST_MORI_LIB_ID = mori1's build ID) and the test
# Runs shim_test against mori1 (every check), then against mori2
# (--expect-mismatch: loading must be refused, naming both build IDs).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
CXX="${CXX:-g++}"
CC="${CC:-gcc}"
SAN="${SAN:-}"
CXXSTD="${CXXSTD:-c++20}"

stub_lib=""
if [[ "${1:-}" == "--stub-lib" ]]; then
  stub_lib="${2:?--stub-lib needs a file name}"
  shift 2
fi
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [--stub-lib OUT.so] OUTDIR INCLUDE..." >&2
  exit 2
fi
out="$1"; shift
incs=()
for d in "$@"; do incs+=(-isystem "$d"); done
mkdir -p "$out/ibv" "$out/mori1" "$out/mori2"
out="$(cd "$out" && pwd)"
# shellcheck disable=SC2206
san=($SAN)

run() { printf '+'; printf ' %q' "$@"; printf '\n'; "$@"; }

build_id() {
  readelf -n "$1" | sed -n 's/^ *Build ID: *//p'
}

cxxflags=(-std="$CXXSTD" -O1 -g -fPIC -pthread -fno-omit-frame-pointer -Wall -Wextra -Werror
          -DMSGPACK_NO_BOOST -D__HIP_PLATFORM_AMD__ -I"$root/abi" -I"$root/plugins/common"
          "${incs[@]}" "${san[@]}")

echo "== stand-in libibverbs.so.1 (stubtest/ibverbs_stub.c; not libibverbs)"
run "$CC" -std=c11 -O1 -g -fPIC -Wall -Wextra -Werror "${san[@]}" -shared \
  -Wl,-soname,libibverbs.so.1 -o "$out/ibv/libibverbs.so.1" "$here/ibverbs_stub.c"
ln -sf libibverbs.so.1 "$out/ibv/libibverbs.so"

echo "== stand-in libmori_io.so (stubtest/mori_stub.cc; not MORI), twice"
run "$CXX" "${cxxflags[@]}" -c "$here/mori_stub.cc" -o "$out/mori_stub.o"
run "$CXX" "${san[@]}" -shared -pthread -Wl,-soname,libmori_io.so -Wl,--build-id=sha1 \
  -o "$out/mori1/libmori_io.so" "$out/mori_stub.o"
printf 'const char kvhost_mori_stub_other_build[] = "2";\n' > "$out/other.c"
run "$CC" -fPIC -c "$out/other.c" -o "$out/other.o"
run "$CXX" "${san[@]}" -shared -pthread -Wl,-soname,libmori_io.so -Wl,--build-id=sha1 \
  -o "$out/mori2/libmori_io.so" "$out/mori_stub.o" "$out/other.o"
id1="build-id:$(build_id "$out/mori1/libmori_io.so")"
id2="build-id:$(build_id "$out/mori2/libmori_io.so")"
if [[ "$id1" == "build-id:" || "$id1" == "$id2" ]]; then
  echo "run.sh: the two stand-in libraries need distinct build IDs, got '$id1' and '$id2'" >&2
  exit 1
fi

echo "== the shim, built against mori1 ($id1)"
run "$CXX" "${cxxflags[@]}" -fvisibility=hidden -DKVHOST_MORI_COMMIT='"stand-in"' \
  -DKVHOST_MORI_LIB_ID="\"$id1\"" -DKVHOST_MORI_REG='"auto"' \
  -c "$here/../mori_plugin.cc" -o "$out/mori_plugin.o"
run "$CC" -std=c11 -O1 -g -fPIC -pthread -Wall -Wextra -Werror "${san[@]}" -I"$root/abi" \
  -I"$root/plugins/common" -c "$root/plugins/common/kvp_util.c" -o "$out/kvp_util.o"
run "$CC" -std=c11 -O1 -g -pthread -Wall -Wextra -Werror -Wno-missing-field-initializers \
  "${san[@]}" -I"$root/abi" -c "$here/shim_test.c" -o "$out/shim_test.o"
run "$CXX" "${san[@]}" -pthread -o "$out/shim_test" "$out/shim_test.o" "$out/mori_plugin.o" \
  "$out/kvp_util.o" -L"$out/mori1" -lmori_io -L"$out/ibv" -libverbs

if [[ -n "$stub_lib" ]]; then
  dir="$(dirname "$stub_lib")"
  mkdir -p "$dir"
  run "$CXX" "${san[@]}" -shared -pthread -Wl,-rpath,'$ORIGIN' -o "$stub_lib" \
    "$out/mori_plugin.o" "$out/kvp_util.o" -L"$out/mori1" -lmori_io -L"$out/ibv" -libverbs
  cp "$out/mori1/libmori_io.so" "$out/ibv/libibverbs.so.1" "$dir/"
  echo "stub plugin: $stub_lib (with the stand-in libmori_io.so and libibverbs.so.1 beside it)"
fi

echo "== stand-in test against the library it was built with"
run env LD_LIBRARY_PATH="$out/mori1:$out/ibv" "$out/shim_test"
echo "== stand-in test against another libmori_io.so ($id2): loading must be refused"
run env LD_LIBRARY_PATH="$out/mori2:$out/ibv" SHIM_TEST_BUILT_ID="$id1" \
  SHIM_TEST_LOADED_ID="$id2" "$out/shim_test" --expect-mismatch

for mode in ${REG_MODES:-}; do
  echo "== the shim as built for a MORI whose registration mode is $mode"
  run "$CXX" "${cxxflags[@]}" -fvisibility=hidden -DKVHOST_MORI_COMMIT='"stand-in"' \
    -DKVHOST_MORI_LIB_ID="\"$id1\"" -DKVHOST_MORI_REG="\"$mode\"" \
    -c "$here/../mori_plugin.cc" -o "$out/mori_plugin_$mode.o"
  run "$CXX" "${san[@]}" -pthread -o "$out/shim_test_$mode" "$out/shim_test.o" \
    "$out/mori_plugin_$mode.o" "$out/kvp_util.o" -L"$out/mori1" -lmori_io -L"$out/ibv" -libverbs
  run env LD_LIBRARY_PATH="$out/mori1:$out/ibv" "$out/shim_test_$mode" --reg-mode "$mode"
done
