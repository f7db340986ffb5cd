#!/usr/bin/env bash
# Installs the C API to a temporary prefix, builds a one-file consumer with find_package(diffrun) and one with pkg-config; each writes a dump that diffrun validate accepts.
# Usage: install_test.sh BUILD_DIR DIFFRUN_BIN. Exit 77 (skip) without pkg-config or a C compiler.
set -euo pipefail
build=$1
diffrun=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cc=${CC:-cc}
# A sanitizer build's library needs its runtime in the consumers too (tests/capi.cmake sets this).
read -r -a san <<<"${DIFFRUN_SANITIZE_FLAGS:-}"
if ! command -v pkg-config >/dev/null || ! command -v "$cc" >/dev/null; then
  echo "install_test: SKIPPED (needs pkg-config and a C compiler)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/diffrun/dump_writer.h lib/cmake/diffrun/diffrunConfig.cmake lib/cmake/diffrun/diffrunConfigVersion.cmake \
         lib/cmake/diffrun/diffrunTargets.cmake lib/pkgconfig/diffrun-dump-writer.pc; do
  [[ -f $prefix/$f ]] || { echo "install_test: FAILED: $f not installed"; exit 1; }
done
ls "$prefix"/lib/libdiffrun-dump-writer.so* >/dev/null

# find_package(diffrun)
cmake -S "$here/consumer" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_C_FLAGS="${san[*]:-}" -DCMAKE_EXE_LINKER_FLAGS="${san[*]:-}" >/dev/null
cmake --build "$tmp/cmake-build" >/dev/null
"$tmp/cmake-build/consumer" "$tmp/cmake.h5"
"$diffrun" validate "$tmp/cmake.h5"

# pkg-config
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
libdir=$(pkg-config --variable=libdir diffrun-dump-writer)
# shellcheck disable=SC2046
"$cc" ${san[@]+"${san[@]}"} "$here/consumer/consumer.c" $(pkg-config --cflags --libs diffrun-dump-writer) -Wl,-rpath,"$libdir" -o "$tmp/pc-consumer"
"$tmp/pc-consumer" "$tmp/pkgconfig.h5"
"$diffrun" validate "$tmp/pkgconfig.h5"

# Only the C API is exported.
if nm -D --defined-only "$prefix"/lib/libdiffrun-dump-writer.so | awk '{print $3}' | grep -v '^diffrun_dump_' | grep -q .; then
  echo "install_test: FAILED: symbols other than diffrun_dump_* exported:"
  nm -D --defined-only "$prefix"/lib/libdiffrun-dump-writer.so | grep -v ' diffrun_dump_' | head
  exit 1
fi
echo "install_test: passed (find_package and pkg-config consumers wrote valid dumps)"
