#!/usr/bin/env bash
# GPU checks of the CUDA engine, run on the GPU host from the repository root: configure and build,
# generate the fixtures (tiny set and the Qwen2.5-0.5B shape), ctest -L gpu, compute-sanitizer
# memcheck on `diffrun dump --backend cuda` and `diffrun generate --backend cuda` (tiny fixture),
# then the benchmark. Everything is teed to ${OUT:-build/gpu-logs}/<stage>.log.
#
#   scripts/gpu_check.sh [SMOLLM2_SLICE.gguf]
#
# The SmolLM2 slice (a 12-layer slice made by scripts/slice_gguf.py) can also be given as
# DIFFRUN_SMOLLM2_SLICE; without one, its checks are skipped. BUILD (default build) and JOBS
# (default 16) can be overridden; BENCH=0 skips the benchmark (for a run beside other work, whose
# timings would mean nothing). Exit status: 0 when every stage passed, 1 otherwise.
set -uo pipefail

BUILD=${BUILD:-build}
JOBS=${JOBS:-16}
LOGS=${OUT:-$BUILD/gpu-logs}
FIXTURES=$BUILD/fixtures
SLICE=${1:-${DIFFRUN_SMOLLM2_SLICE:-}}
QWEN05B=$FIXTURES/qwen2.5-0.5b-f16.gguf
TINY=$FIXTURES/tiny-qwen2-q4_k.gguf
mkdir -p "$LOGS"
failed=()
t_start=$(date +%s)

# stage NAME CMD...: runs CMD with its output teed to $LOGS/NAME.log; records a failure.
stage() {
  local name=$1
  shift
  local t0
  t0=$(date +%s)
  echo "=== [$name] $*"
  "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] exit $rc after $(($(date +%s) - t0)) s (total $(($(date +%s) - t_start)) s)"
  if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
  return "$rc"
}

# quiet_stage NAME CMD...: like stage, but only the last lines reach the terminal (the log keeps all).
quiet_stage() {
  local name=$1
  shift
  local t0
  t0=$(date +%s)
  echo "=== [$name] $*"
  "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$LOGS/$name.log"
  echo "=== [$name] exit $rc after $(($(date +%s) - t0)) s (total $(($(date +%s) - t_start)) s)"
  if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
  return "$rc"
}

stage device nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv

quiet_stage configure cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
  -DDIFFRUN_CUDA=ON || { echo "configure failed: see $LOGS/configure.log"; exit 1; }
quiet_stage build ninja -C "$BUILD" -j"$JOBS" \
  || { echo "build failed: see $LOGS/build.log"; exit 1; }

quiet_stage fixtures python3 scripts/gen_fixtures.py --out "$FIXTURES"
quiet_stage fixture_qwen05b python3 scripts/gen_fixtures.py --out "$FIXTURES" --shape qwen2.5-0.5b

export DIFFRUN_QWEN05B=""
[ -f "$QWEN05B" ] && export DIFFRUN_QWEN05B=$(realpath "$QWEN05B")
export DIFFRUN_SMOLLM2_SLICE=""
if [ -n "$SLICE" ]; then
  if [ -f "$SLICE" ]; then export DIFFRUN_SMOLLM2_SLICE=$(realpath "$SLICE"); else echo "no SmolLM2 slice at $SLICE"; fi
fi
echo "DIFFRUN_QWEN05B=${DIFFRUN_QWEN05B:-<unset>} DIFFRUN_SMOLLM2_SLICE=${DIFFRUN_SMOLLM2_SLICE:-<unset>}"

stage ctest_gpu ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 900 -V

if command -v compute-sanitizer > /dev/null || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  stage memcheck_dump "$SAN" --tool memcheck --error-exitcode 3 --leak-check full \
    "$BUILD/cli/diffrun" dump --backend cuda --precision f16 --model "$TINY" --tokens 1,2,3,4,5 --steps 3 \
    --out "$LOGS/memcheck_dump.h5"
  stage memcheck_generate "$SAN" --tool memcheck --error-exitcode 3 \
    "$BUILD/cli/diffrun" generate --backend cuda --precision f32 --model "$TINY" --tokens 1,2,3 -n 4
else
  echo "compute-sanitizer not found"
  failed+=("memcheck")
fi

BENCH_MODELS=()
if [ "${BENCH:-1}" = 0 ]; then
  echo "benchmark skipped (BENCH=0)"
else
[ -n "$DIFFRUN_QWEN05B" ] && BENCH_MODELS+=("$DIFFRUN_QWEN05B")
[ -n "$DIFFRUN_SMOLLM2_SLICE" ] && BENCH_MODELS+=("$DIFFRUN_SMOLLM2_SLICE")
if [ ${#BENCH_MODELS[@]} -gt 0 ]; then
  stage bench "$BUILD/bench/bench_cuda_engine" --precision f16 "${BENCH_MODELS[@]}"
else
  echo "no model to benchmark"
  failed+=("bench")
fi
fi

echo
echo "=== summary after $(($(date +%s) - t_start)) s; logs in $LOGS"
grep -hE "tests passed|tests failed|Failed|SKIPPED \]|worst rel L2|top-1|explained" "$LOGS/ctest_gpu.log" | sort -u | head -60
grep -hE "ERROR SUMMARY" "$LOGS"/memcheck_*.log 2>/dev/null
grep -hE "tok/s|roofline|bandwidth|^/|device " "$LOGS/bench.log" 2>/dev/null
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED stages: ${failed[*]}"
  exit 1
fi
echo "all stages passed"
