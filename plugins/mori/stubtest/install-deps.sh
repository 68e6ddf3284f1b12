#!/usr/bin/env bash
# install-deps.sh: installs the Debian packages the mori stand-in test
# (make mori-stub-test) compiles with: the msgpack-c C++ API and the
# libibverbs headers (the stand-ins replace the libraries). Does nothing
# when the headers are there; needs root (or sudo) otherwise.
set -euo pipefail
CXX="${CXX:-g++}"
need=()
has() { printf '#include <%s>\n' "$1" | "$CXX" -std=c++20 -DMSGPACK_NO_BOOST -E -x c++ - >/dev/null 2>&1; }
has msgpack.hpp || need+=(libmsgpack-cxx-dev)
has infiniband/verbs.h || need+=(libibverbs-dev)
command -v readelf >/dev/null || need+=(binutils)
[ ${#need[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "mori stand-in test: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
