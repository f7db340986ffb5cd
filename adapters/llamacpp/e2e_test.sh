#!/usr/bin/env bash
# End-to-end test of the llama.cpp adapter: F32 SmolLM2 through llama.cpp against diffrun's f64 reference, names mapped, f32_vs_f64 tolerances.
#
#   adapters/llamacpp/e2e_test.sh        (ctest: llamacpp_smollm2_f32, label llamacpp)
#
# Env: DIFFRUN_BIN (diffrun), DIFFRUN_LLAMACPP_BIN (the adapter; empty when not built), PYTHON,
# DIFFRUN_LLAMACPP_WORK (scratch folder, default build/llamacpp-test), DIFFRUN_MODELS (model cache).
# The weights are identical on both sides (scripts/gguf_to_f32.py dequantizes the Q4_1 model with
# the gguf package), so every mapped checkpoint must be within the f32_vs_f64 preset: exit 0 from
# diffrun compare, and every float checkpoint of the reference compared.
# Exit codes: 0 passed, 1 failed, 77 skipped (llama.cpp or the adapter not built, model missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

skip() { echo "llamacpp_e2e: skipped: $*"; echo "llamacpp_e2e: 0 passed, 0 failed, 1 skipped"; exit 77; }
fail() { echo "llamacpp_e2e: FAILED: $*"; echo "llamacpp_e2e: 0 passed, 1 failed"; exit 1; }

diffrun=${DIFFRUN_BIN:-build/cli/diffrun}
adapter=${DIFFRUN_LLAMACPP_BIN:-}
python=${PYTHON:-python3}
work=${DIFFRUN_LLAMACPP_WORK:-build/llamacpp-test}
models=${DIFFRUN_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/diffrun/models}
q41=$models/SmolLM2-135M-Instruct.Q4_1.gguf

[[ -d build/llama.cpp/install ]] || skip "llama.cpp is not built (scripts/build_llamacpp.sh builds it into build/llama.cpp)"
[[ -n $adapter && -x $adapter ]] || skip "the adapter is not built (configure with -DDIFFRUN_LLAMACPP_DIR=build/llama.cpp/install)"
[[ -f $q41 ]] || skip "$q41 is missing (scripts/fetch_models)"

mkdir -p "$work"
f32=$work/SmolLM2-135M-Instruct.F32.gguf
if [[ ! -f $f32 || $f32 -ot $q41 || $f32 -ot scripts/gguf_to_f32.py ]]; then
  "$python" scripts/gguf_to_f32.py "$q41" "$f32" || fail "gguf_to_f32.py"
fi

"$diffrun" dump -m "$f32" --backend cpu --precision f64 --prompt "The capital of France is" --steps 3 \
  -o "$work/reference.h5" >/dev/null 2>"$work/reference.log" || { cat "$work/reference.log"; fail "diffrun dump"; }
"$adapter" -m "$f32" -r "$work/reference.h5" -o "$work/llamacpp.h5" --threads 2 \
  || fail "diffrun_llamacpp"

set +e
"$diffrun" compare "$work/llamacpp.h5" "$work/reference.h5" --names llamacpp \
  --tolerances fixtures/tolerances/f32_vs_f64.json --require-coverage 100 --no-color \
  --report-json "$work/compare.json"
rc=$?
set -e
[[ $rc == 0 ]] || fail "diffrun compare --names llamacpp exited $rc (expected 0: identical weights, f32 against f64)"
echo "llamacpp_e2e: 1 passed, 0 failed"
