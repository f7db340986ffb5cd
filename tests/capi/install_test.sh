#!/usr/bin/env bash
# Installs the C API to a temporary prefix as the README says (what `scripts/setup --install PREFIX` runs), then
# builds the consumers the README shows: a C program with find_package(diffrun) (run from its build tree and
# installed), one with pkg-config, and a cargo crate whose build.rs asks pkg-config. Each runs without
# LD_LIBRARY_PATH, against the installed library, writes a dump that diffrun validate accepts and reads it back
# with the C API's reader.
# Usage: install_test.sh BUILD_DIR DIFFRUN_BIN. Exit 77 (skip) without pkg-config or a C compiler, and when cargo
# is missing (after the C consumers passed).
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
fail() { echo "install_test: FAILED: $*"; exit 1; }

cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/diffrun/dump_writer.h lib/cmake/diffrun/diffrunConfig.cmake lib/cmake/diffrun/diffrunConfigVersion.cmake \
         lib/cmake/diffrun/diffrunTargets.cmake lib/pkgconfig/diffrun-dump-writer.pc; do
  [[ -f $prefix/$f ]] || fail "$f not installed"
done
ls "$prefix"/lib/libdiffrun-dump-writer.so* >/dev/null

# Runs a consumer with no LD_LIBRARY_PATH, after checking that the dynamic loader finds the installed library.
run_consumer() {
  local exe=$1 out=$2 found
  found=$(env -u LD_LIBRARY_PATH ldd "$exe" | awk '/libdiffrun-dump-writer/ {print $3}')
  [[ $found == "$prefix"/lib/* ]] || fail "$exe: the loader finds libdiffrun-dump-writer at '${found:-nothing}', not under the prefix"
  env -u LD_LIBRARY_PATH "$exe" "$out"
  "$diffrun" validate "$out" >/dev/null || fail "diffrun validate $out"
}

# find_package(diffrun): from the build tree (CMake's build RPATH) and installed (CMAKE_INSTALL_RPATH_USE_LINK_PATH).
cmake -S "$here/consumer" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$tmp/app" -DCMAKE_C_FLAGS="${san[*]:-}" -DCMAKE_EXE_LINKER_FLAGS="${san[*]:-}" >/dev/null
cmake --build "$tmp/cmake-build" >/dev/null
run_consumer "$tmp/cmake-build/consumer" "$tmp/cmake.h5"
cmake --install "$tmp/cmake-build" >/dev/null
run_consumer "$tmp/app/bin/consumer" "$tmp/cmake-installed.h5"

# pkg-config: its Libs carry the rpath, nothing else is added.
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
"$cc" ${san[@]+"${san[@]}"} "$here/consumer/consumer.c" $(pkg-config --cflags --libs diffrun-dump-writer) -o "$tmp/pc-consumer"
run_consumer "$tmp/pc-consumer" "$tmp/pkgconfig.h5"

# Only the C API is exported.
if nm -D --defined-only "$prefix"/lib/libdiffrun-dump-writer.so | awk '{print $3}' | grep -v '^diffrun_dump_' | grep -q .; then
  echo "install_test: FAILED: symbols other than diffrun_dump_* exported:"
  nm -D --defined-only "$prefix"/lib/libdiffrun-dump-writer.so | grep -v ' diffrun_dump_' | head
  exit 1
fi

# cargo: the crate's build.rs runs pkg-config (no crates, offline), copied out of the source tree (cargo writes
# Cargo.lock beside Cargo.toml).
if [[ -n ${DIFFRUN_SANITIZE_FLAGS:-} ]]; then
  # As in test_capi: a Rust program does not link the ASan runtime the sanitizer build's library needs.
  echo "install_test: passed (find_package and pkg-config consumers; the cargo crate is not built in a sanitizer build)"
  exit 0
fi
if ! command -v cargo >/dev/null || ! cargo --version >/dev/null 2>&1; then
  echo "install_test: SKIPPED the cargo crate: cargo not found (the find_package and pkg-config consumers passed)"
  exit 77
fi
cp -r "$here/consumer/rust" "$tmp/crate"
CARGO_TARGET_DIR=$tmp/cargo-target cargo build --offline --quiet --manifest-path "$tmp/crate/Cargo.toml" \
  || fail "cargo build of the crate"
run_consumer "$tmp/cargo-target/debug/diffrun-consumer" "$tmp/cargo.h5"
echo "install_test: passed (find_package, installed find_package, pkg-config and cargo consumers ran without LD_LIBRARY_PATH)"
