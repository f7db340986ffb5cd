#!/usr/bin/env bash
# llama.cpp's own graph (the llama.cpp adapter) against diffrun's f64 reference on one tiny fixture: tiny-llama3rope-f32 (rope_freqs), tiny-mistral-f32 (sliding_window key not applied), or a mixture of experts (tiny-qwen3moe, tiny-mixtral, tiny-qwen2moe: every routing checkpoint, qwen2moe's shared expert).
#
#   tests/llamacpp_fixture.sh tiny-mistral-f32   (ctest: llamacpp_tiny-mistral-f32, label llamacpp)
#   tests/llamacpp_fixture.sh tiny-qwen3moe-f32 'tokens,embd,...'   compare only these checkpoints (compare --checkpoints):
#       llama.cpp leaves qwen3's attention output projection unnamed, so its graph has no attn_out
#
# Env: DIFFRUN_BIN, DIFFRUN_LLAMACPP_BIN (the adapter; empty when not built), DIFFRUN_FIXTURE_DIR,
# DIFFRUN_LLAMACPP_WORK (scratch folder, default build/llamacpp-test). A 12-token prompt and 3 decode
# steps (longer than tiny-mistral's window of 8); every checkpoint within f32_vs_f64, 100% coverage.
# Exit codes: 0 passed, 1 failed, 2 usage, 77 skipped (adapter not built, fixture missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

skip() { echo "llamacpp_fixture: skipped: $*"; echo "llamacpp_fixture: 0 passed, 0 failed, 1 skipped"; exit 77; }
fail() { echo "llamacpp_fixture: FAILED: $*"; echo "llamacpp_fixture: 0 passed, 1 failed"; exit 1; }

[[ $# == 1 || $# == 2 ]] || { echo "usage: $0 FIXTURE_STEM [CHECKPOINTS] (e.g. tiny-mistral-f32)" >&2; exit 2; }
filter=()
[[ $# == 2 ]] && filter=(--checkpoints "$2")
diffrun=${DIFFRUN_BIN:-build/cli/diffrun}
adapter=${DIFFRUN_LLAMACPP_BIN:-}
model=${DIFFRUN_FIXTURE_DIR:-build/fixtures}/$1.gguf
out=${DIFFRUN_LLAMACPP_WORK:-build/llamacpp-test}/$1

[[ -n $adapter && -x $adapter ]] || skip "the llama.cpp adapter is not built (scripts/setup --tests builds it; by hand: scripts/build_llamacpp.sh, then -DDIFFRUN_LLAMACPP_DIR=build/llama.cpp/install)"
[[ -f $model ]] || skip "$model is missing (scripts/gen_fixtures.py)"
mkdir -p "$out"

"$diffrun" dump -m "$model" --backend cpu --precision f64 --tokens 1,40,41,42,43,44,45,46,47,48,49,50 --steps 3 \
  -o "$out/reference.h5" >/dev/null 2>"$out/reference.log" || { cat "$out/reference.log"; fail "diffrun dump"; }
"$adapter" -m "$model" -r "$out/reference.h5" -o "$out/llamacpp.h5" --threads 2 >"$out/llamacpp.log" 2>&1 \
  || { tail -20 "$out/llamacpp.log"; fail "diffrun_llamacpp"; }
"$diffrun" compare "$out/llamacpp.h5" "$out/reference.h5" --names llamacpp \
  --tolerances fixtures/tolerances/f32_vs_f64.json --require-coverage 100 --no-color "${filter[@]}" >"$out/compare.txt" 2>&1 \
  || { cat "$out/compare.txt"; fail "diffrun compare --names llamacpp (expected 0: the same weights, f32 against f64)"; }
grep -E '^  (compared|coverage)' "$out/compare.txt" || true
echo "llamacpp_fixture: 1 passed, 0 failed"
