#!/usr/bin/env bash
# Fetches llama.cpp (pinned in vendor/llama.cpp/SOURCE), builds libllama CPU-only into build/llama.cpp and installs it under build/llama.cpp/install.
#
#   scripts/build_llamacpp.sh            idempotent: each step is skipped when its result is in place
#   scripts/build_llamacpp.sh --source   only the download and unpacking (for the tokenizer suite test,
#                                        test_tokenizer_llamacpp, which reads models/ggml-vocab-*)
#
# Steps: pip download of the pinned llama-cpp-python sdist (sha256-checked) into build/llama.cpp-dl,
# its vendor/llama.cpp unpacked into build/llama.cpp-src, CMake (Release, -DGGML_CUDA=OFF, -DGGML_NATIVE=OFF,
# -DLLAMA_CURL=OFF, no tests/tools/examples/server/common) into build/llama.cpp, build of the one target the
# adapter links (llama, with ggml-base and ggml-cpu: 78 build steps) with nice and $DIFFRUN_JOBS jobs
# (default 2), install into build/llama.cpp/install (lib/, include/, lib/cmake/llama). Then the adapter
# (adapters/llamacpp) can be built, and the ctest label llamacpp runs instead of skipping.
# `scripts/setup --tests` runs it (the test command builds the adapter and runs the llamacpp tests).
#
# GGML_NATIVE=OFF: the CPU backend is built for a fixed x86-64 level (SSE4.2, AVX, AVX2, FMA, F16C, BMI2)
# rather than -march=native, so the objects do not depend on the build host and a compiler cache can be
# shared between machines. With ccache on the PATH the compiles go through it (CCACHE_BASEDIR is the
# repository, so another clone of it hits the same entries; the cache lives in ~/.cache/ccache).
# Measured on a 2-core machine (2 jobs, another build running beside it): 210 s from a fresh clone with an
# empty cache (sdist download 6 s, unpacking 2 s), 28 s with the cache filled by an earlier build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "build_llamacpp: $*"; }
source_only=0
case ${1:-} in
  --source) source_only=1 ;;
  "") ;;
  *) echo "usage: scripts/build_llamacpp.sh [--source]" >&2; exit 2 ;;
esac
pin() { sed -n "s/^$1=//p" vendor/llama.cpp/SOURCE; }

package=$(pin package); version=$(pin version); file=$(pin file); sha256=$(pin sha256)
dl=build/llama.cpp-dl
src=build/llama.cpp-src
bin=build/llama.cpp
prefix=$PWD/$bin/install
jobs=${DIFFRUN_JOBS:-2}
python=${PYTHON:-python3}

mkdir -p "$dl"
if [[ ! -f $dl/$file ]] || ! echo "$sha256  $dl/$file" | sha256sum -c --quiet - 2>/dev/null; then
  say "downloading $package==$version (sdist)"
  rm -f "$dl/$file"
  "$python" -m pip download --quiet --no-binary :all: --no-deps -d "$dl" "$package==$version"
  [[ -f $dl/$file ]] || { echo "build_llamacpp: pip did not produce $dl/$file" >&2; exit 1; }
  if ! echo "$sha256  $dl/$file" | sha256sum -c --quiet -; then
    echo "build_llamacpp: $dl/$file: sha256 mismatch (expected $sha256)" >&2
    exit 1
  fi
fi

if [[ ! -f $src/.unpacked || $(cat "$src/.unpacked") != "$sha256" ]]; then
  say "unpacking llama.cpp into $src"
  rm -rf "$src" "$bin"
  mkdir -p "$src"
  tar -xzf "$dl/$file" -C "$src" --strip-components=3 "${file%.tar.gz}/vendor/llama.cpp"
  echo "$sha256" > "$src/.unpacked"
fi
((source_only)) && { say "source in $src"; exit 0; }

# Configured on every run (a quick no-op when nothing changed), so a changed option here takes effect.
say "configuring $bin (CPU only)"
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
fi
# RPATH $ORIGIN: the installed libllama finds its libggml* beside it.
cmake -S "$src" -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_RPATH='$ORIGIN' -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF "${launcher[@]}" >"$bin.configure.log" 2>&1 \
  || { cat "$bin.configure.log" >&2; exit 1; }

say "building libllama ($jobs jobs)"
nice -n 10 cmake --build "$bin" --target llama -j "$jobs"
cmake --install "$bin" >/dev/null
say "done: $prefix"
