#!/usr/bin/env bash
# End-to-end test of the llama.cpp adapter: SmolLM2 through llama.cpp against diffrun's f64 reference, names mapped, f32_vs_f64 tolerances.
#
#   adapters/llamacpp/e2e_test.sh [f32]  (ctest: llamacpp_smollm2_f32, label llamacpp)
#   adapters/llamacpp/e2e_test.sh q41    (ctest: llamacpp_smollm2_q41, label llamacpp)
#
# Env: DIFFRUN_BIN (diffrun), DIFFRUN_LLAMACPP_BIN (the adapter; empty when not built), PYTHON,
# DIFFRUN_LLAMACPP_WORK (scratch folder, default build/llamacpp-test), DIFFRUN_MODELS (model cache).
# The weights are identical on both sides (scripts/gguf_to_f32.py dequantizes the Q4_1 model with
# the gguf package), so every mapped checkpoint must be within the f32_vs_f64 preset: exit 0 from
# diffrun compare, and every float checkpoint of the reference compared.
# q41: the stock Q4_1 model on both sides. llama.cpp quantizes each activation row to Q8_1 before
# a Q4_1 matmul, so the comparison must diverge (exit 1) first at Qcur-0, the first matmul, with
# the verdict local, and cover every checkpoint (adapters/llamacpp/README.md has the figures).
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

mode=${1:-f32}
mkdir -p "$work"
case $mode in
  f32)
    model=$work/SmolLM2-135M-Instruct.F32.gguf
    if [[ ! -f $model || $model -ot $q41 || $model -ot scripts/gguf_to_f32.py ]]; then
      "$python" scripts/gguf_to_f32.py "$q41" "$model" || fail "gguf_to_f32.py"
    fi ;;
  q41) model=$q41 ;;
  *) echo "usage: $0 [f32|q41]" >&2; exit 2 ;;
esac
out=$work/$mode
mkdir -p "$out"

"$diffrun" dump -m "$model" --backend cpu --precision f64 --prompt "The capital of France is" --steps 3 \
  -o "$out/reference.h5" >/dev/null 2>"$out/reference.log" || { cat "$out/reference.log"; fail "diffrun dump"; }
"$adapter" -m "$model" -r "$out/reference.h5" -o "$out/llamacpp.h5" --threads 2 \
  || fail "diffrun_llamacpp"

set +e
"$diffrun" compare "$out/llamacpp.h5" "$out/reference.h5" --names llamacpp \
  --tolerances fixtures/tolerances/f32_vs_f64.json --require-coverage 100 --no-color \
  --report-json "$out/compare.json"
rc=$?
set -e
if [[ $mode == f32 ]]; then
  [[ $rc == 0 ]] || fail "diffrun compare --names llamacpp exited $rc (expected 0: identical weights, f32 against f64)"
else
  [[ $rc == 1 ]] || fail "diffrun compare --names llamacpp exited $rc (expected 1: Q8_1 activations in llama.cpp's Q4_1 matmuls)"
  "$python" - "$out/compare.json" <<'PY' || fail "expected a local first divergence at Qcur-0 and 100% coverage"
import json, sys
r = json.load(open(sys.argv[1]))
fd = r["first_divergence"]
print(f"llamacpp_e2e: first divergence {fd['name']} (step {fd['step']}), verdict {fd['verdict']['kind']}; "
      f"coverage {r['coverage']['percent']}%")
ok = fd["name"] == "Qcur-0" and fd["step"] == 0 and fd["verdict"]["kind"] == "local"
sys.exit(0 if ok and r["coverage"]["percent"] == 100.0 else 1)
PY
fi
echo "llamacpp_e2e: 1 passed, 0 failed"
