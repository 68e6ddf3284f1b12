#!/usr/bin/env bash
# Installs the Debian packages the test suite needs (C compiler, the Python
# peers' libraries for the interop tests, pytest and venv for python/tests).
# Does nothing when they are already present; needs root (or sudo) otherwise.
set -euo pipefail

need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
for mod in zmq msgpack numpy pytest; do
  if ! /usr/bin/python3 -c "import $mod" >/dev/null 2>&1; then
    need+=("python3-$mod")
  fi
done
# python3-venv: the Python package's install check (pip install ./python in
# a fresh virtual environment).
/usr/bin/python3 -c "import ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
# The mori stand-in test's headers (make mori-stub-test): its own script.
"$(dirname "$0")/../plugins/mori/stubtest/install-deps.sh"
[ ${#need[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
