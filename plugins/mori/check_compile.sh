#!/usr/bin/env bash
# check_compile.sh: proves that plugins/mori/mori_plugin.cc compiles cleanly
# (-Wall -Wextra -Werror) against the headers of MORI-IO releases, on a
# machine that cannot build or run MORI (no ROCm, no AMD GPU, no RDMA NIC).
#
# It only compiles; it builds no part of MORI. Linking needs libmori_io.so,
# which needs ROCm to build: use `make plugin-mori` on a machine with MORI
# installed.
#
# usage: plugins/mori/check_compile.sh [--stub-test] [--stub-lib OUT.so] MORI_INCLUDE [DEP_INCLUDE...]
#        plugins/mori/check_compile.sh --mori-git DIR [--refs "REF..."] [DEP_INCLUDE...]
#
#   MORI_INCLUDE  the folder holding mori/io/io.hpp (MORI's include/ folder)
#   DEP_INCLUDE   folders holding the headers MORI's public IO headers include
#                 and that are not in the compiler's default path: msgpack-c
#                 (C++ API), spdlog, HIP, HSA and hsakmt (ROCm's include/),
#                 libibverbs; every family missing is named before compiling
#   --mori-git D  compile against the include/ folder of each of REFS in the
#                 MORI git repository D (read with git archive, nothing is
#                 built), naming the commit each ref resolves to
#   --refs "R.."  the refs to check (default: $KNOWN_REFS below: the
#                 releases since WaitAll and the main commit last checked)
#   --stub-test   also build the shim with the stand-ins (stubtest/: a memcpy
#                 libmori_io.so and a libibverbs.so.1 that are NOT MORI or
#                 libibverbs) against these headers and run the stand-in
#                 test (stubtest/run.sh), which `make mori-stub-test` runs
#                 against the stand-in headers
#   --stub-lib F  also write the shim linked with the stand-ins as plugin F
#                 (e.g. /tmp/stubplug/libkvhost_mori.so, the stand-in
#                 libraries beside it) so the Go conformance suite can drive
#                 the shim's logic; runs the stand-in test too
#
# Environment: CXX (default g++), CC (default gcc), ROCM_PATH (named when
# HIP, HSA or hsakmt headers are missing).
# Exit status 0 when everything asked for passed.
set -euo pipefail

KNOWN_REFS="v1.2.0 v1.2.1 v1.2.2 624002c897a30928ec04c14fc167bf2b8a93f6ce"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
CXX="${CXX:-g++}"
CC="${CC:-gcc}"

stub_test=0
stub_lib=""
mori_git=""
refs="$KNOWN_REFS"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --stub-test) stub_test=1; shift ;;
    --stub-lib) stub_lib="${2:?--stub-lib needs a file name}"; shift 2 ;;
    --mori-git) mori_git="${2:?--mori-git needs a folder}"; shift 2 ;;
    --refs) refs="${2:?--refs needs a list}"; shift 2 ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "check_compile.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

run() { printf '+'; printf ' %q' "$@"; printf '\n'; "$@"; }

# compile_one LABEL MORI_INCLUDE DEP_INCLUDE...: the compile proof for one
# set of MORI headers.
compile_one() {
  local label="$1" mori_inc="$2"; shift 2
  if [[ ! -f "$mori_inc/mori/io/io.hpp" ]]; then
    echo "check_compile.sh: $mori_inc/mori/io/io.hpp not found (give MORI's include/ folder)" >&2
    return 2
  fi
  local incs=(-isystem "$mori_inc") d
  for d in "$@"; do
    [[ -d "$d" ]] || { echo "check_compile.sh: $d is not a folder" >&2; return 2; }
    incs+=(-isystem "$d")
  done
  # -std=c++20: MORI's rdma.hpp has a constexpr operator== calling
  # std::equal, which is constexpr only from C++20 (hipcc's clang accepts it
  # in C++17 mode, g++ does not). MORI's headers are -isystem so that
  # -Werror applies to the shim, not to warnings inside MORI and HIP. The
  # build facts are placeholders: a compile check links no libmori_io.so.
  local flags=(-std=c++20 -O2 -g -fPIC -pthread -fvisibility=hidden -Wall -Wextra -Werror
               -DMSGPACK_NO_BOOST -D__HIP_PLATFORM_AMD__ -I"$root/abi" -I"$root/plugins/common"
               "${incs[@]}")
  echo "== $label: header families MORI's IO headers need"
  if ! "$here/missing_headers.sh" "$CXX" "${flags[@]}"; then
    echo "check_compile.sh: $label: headers missing (above); give their folders as DEP_INCLUDE" >&2
    return 2
  fi
  local facts=(-DKVHOST_MORI_COMMIT="\"$label\"" -DKVHOST_MORI_LIB_ID='"none"'
               -DKVHOST_MORI_REG='"unknown"')
  # Each step checks its status: set -e does not apply inside a function
  # called as an if condition (the --mori-git loop).
  echo "== $label: object compile"
  rm -f "$tmp/mori_plugin.o"
  run "$CXX" "${flags[@]}" "${facts[@]}" -c "$here/mori_plugin.cc" -o "$tmp/mori_plugin.o" || {
    echo "compile check $label: FAILED" >&2; return 1; }
  echo "== $label: MORI symbols the object needs from libmori_io.so"
  local syms
  syms=$(nm -uC "$tmp/mori_plugin.o" | grep 'mori::' | sed 's/(.*//' | sort -u) || return 1
  printf '%s\n' "$syms"
  echo "compile check $label: OK ($("$CXX" --version | head -1))"
}

if [[ -n "$mori_git" ]]; then
  git -C "$mori_git" rev-parse --git-dir >/dev/null || {
    echo "check_compile.sh: $mori_git is not a git repository" >&2; exit 2; }
  results=()
  rc=0
  for ref in $refs; do
    commit=$(git -C "$mori_git" rev-parse --verify -q "$ref^{commit}") || {
      echo "check_compile.sh: $ref is not a commit in $mori_git" >&2; exit 2; }
    name="$(git -C "$mori_git" describe --tags --always --abbrev=10 "$commit")"
    mkdir -p "$tmp/$commit"
    git -C "$mori_git" archive "$commit" include | tar -x -C "$tmp/$commit"
    echo "== $ref is $commit ($name)"
    if compile_one "$name" "$tmp/$commit/include" "$@"; then
      results+=("OK     $ref = $commit ($name)")
    else
      results+=("FAILED $ref = $commit ($name)")
      rc=1
    fi
  done
  echo "== summary"
  printf '%s\n' "${results[@]}"
  exit $rc
fi

if [[ $# -lt 1 ]]; then
  echo "usage: $0 [--stub-test] [--stub-lib OUT.so] MORI_INCLUDE [DEP_INCLUDE...]" >&2
  echo "       $0 --mori-git DIR [--refs \"REF...\"] [DEP_INCLUDE...]" >&2
  exit 2
fi
compile_one "$(basename "$(dirname "$1")")" "$@"

if [[ $stub_test -eq 1 || -n "$stub_lib" ]]; then
  echo "== stand-in build and test against these headers (stubtest/; not MORI)"
  args=()
  [[ -n "$stub_lib" ]] && args+=(--stub-lib "$stub_lib")
  # run.sh always runs the test (seconds), --stub-lib alone included.
  CXX="$CXX" CC="$CC" "$here/stubtest/run.sh" "${args[@]}" "$tmp/stub" "$@"
fi
