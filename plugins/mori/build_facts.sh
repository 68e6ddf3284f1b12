#!/usr/bin/env bash
# build_facts.sh: what `make plugin-mori` records in the shim about the MORI
# it builds against (see "Build facts" in mori_plugin.cc):
#
#   line 1  KVHOST_MORI_COMMIT  MORI_COMMIT if set; else the commit of the
#           MORI_SRC git checkout; else the wheel's version (mori/_version.py,
#           "1.2.3.devN+gHASH" names the commit)
#   line 2  KVHOST_MORI_REG     MORI_REG if set; else from MORI_SRC's history:
#           ibv (before 09ad89c4), auto-offset0 (09ad89c4 up to 0d05a4d2),
#           auto (0d05a4d2 on); a wheel of a release tag v1.2.0 to v1.2.2:
#           ibv; else unknown
#   line 3  KVHOST_MORI_LIB_ID  build-id:HEX of LIBDIR/libmori_io.so, or
#           size:BYTES when it has no build ID
#
# usage: plugins/mori/build_facts.sh LIBDIR   (environment: MORI_SRC,
#        MORI_PREFIX, MORI_COMMIT, MORI_REG)
# Exits 2 naming what to set when the commit cannot be found.
set -euo pipefail
lib="${1:?usage: $0 LIBDIR}/libmori_io.so"
[[ -f "$lib" ]] || { echo "build_facts.sh: $lib not found" >&2; exit 2; }

src_git=""
if [[ -n "${MORI_SRC:-}" ]] && git -C "$MORI_SRC" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  src_git="$MORI_SRC"
fi
wheel_version=""
if [[ -n "${MORI_PREFIX:-}" && -f "$MORI_PREFIX/_version.py" ]]; then
  wheel_version=$(sed -n "s/^__version__ *= *['\"]\\([^'\"]*\\)['\"].*/\\1/p" "$MORI_PREFIX/_version.py" | head -1)
fi

commit="${MORI_COMMIT:-}"
if [[ -z "$commit" && -n "$src_git" ]]; then
  commit=$(git -C "$src_git" describe --tags --always --abbrev=10 2>/dev/null || git -C "$src_git" rev-parse --short=10 HEAD)
fi
[[ -z "$commit" ]] && commit="$wheel_version"
if [[ -z "$commit" ]]; then
  echo "build_facts.sh: cannot tell which MORI commit $lib was built from: set MORI_SRC to the MORI git checkout it was built from, or MORI_COMMIT=<commit or tag>" >&2
  exit 2
fi
case "$commit" in *[!A-Za-z0-9._+-]*)
  echo "build_facts.sh: MORI_COMMIT=$commit: use letters, digits and . _ + - only" >&2; exit 2 ;;
esac

reg="${MORI_REG:-}"
if [[ -z "$reg" && -n "$src_git" ]]; then
  if ! git -C "$src_git" cat-file -e 09ad89c4^{commit} 2>/dev/null; then
    reg=unknown  # a shallow or foreign history
  elif git -C "$src_git" merge-base --is-ancestor 0d05a4d2 HEAD 2>/dev/null; then
    reg=auto
  elif git -C "$src_git" merge-base --is-ancestor 09ad89c4 HEAD 2>/dev/null; then
    reg=auto-offset0
  else
    reg=ibv
  fi
fi
if [[ -z "$reg" ]]; then
  case "$wheel_version" in 1.2.0|1.2.1|1.2.2) reg=ibv ;; *) reg=unknown ;; esac
fi
case "$reg" in ibv|auto-offset0|auto|unknown) ;; *)
  echo "build_facts.sh: MORI_REG=$reg: want ibv, auto-offset0, auto or unknown" >&2; exit 2 ;;
esac

id=$(readelf -n "$lib" 2>/dev/null | sed -n 's/^ *Build ID: *//p' | head -1)
if [[ -n "$id" ]]; then
  id="build-id:$id"
else
  id="size:$(stat -L -c %s "$lib")"
fi
printf '%s\n%s\n%s\n' "$commit" "$reg" "$id"
