#!/usr/bin/env bash
# Gemma 3 270M on the GPU host: greedy generation with the CPU reference (f64) and the CUDA engine (f32,
# f16) on the chat prompt and a plain one, the main job with both pairs (f32 vs f64, f16 vs f32-f16store),
# and the transformers adapter (float64 and float32) against the f64 reference on every checkpoint.
# Each stage's output goes to ${OUT:-build/gpu-logs}/gemma3/<stage>.log (generated text: <stage>.txt).
#
#   scripts/gpu_gemma3.sh MODEL.gguf [DIFFRUN_BIN]
#
# Needs a CUDA build of diffrun (default build/cli/diffrun), and torch, transformers and gguf for the
# adapter stages (PYTHONPATH holding python/). Exit status: 0 when every stage passed, 1 otherwise.
set -uo pipefail

MODEL=${1:?usage: scripts/gpu_gemma3.sh MODEL.gguf [DIFFRUN_BIN]}
BIN=${2:-build/cli/diffrun}
LOGS=${OUT:-build/gpu-logs}/gemma3
WORK=$(mktemp -d)
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$LOGS"
failed=()

# stage NAME CMD...: CMD's stdout to NAME.txt, its stderr to NAME.log; prints the ends of both.
stage() {
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== [$name] ${*//$MODEL/MODEL}"
  "$@" > "$LOGS/$name.txt" 2> "$LOGS/$name.log"
  local rc=$?
  tail -n "${TAIL:-4}" "$LOGS/$name.log"
  tail -c 1500 "$LOGS/$name.txt"
  echo
  echo "=== [$name] exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
  return "$rc"
}

CHAT=(--chat --prompt "What is the capital of France?")
PLAIN=(--prompt "The capital of France is")

# 1. Greedy generation: the engine's tokens against the reference's.
for p in chat plain; do
  if [ $p = chat ]; then args=("${CHAT[@]}"); else args=("${PLAIN[@]}"); fi
  stage "gen-$p-cpu-f64" "$BIN" generate -m "$MODEL" --backend cpu --precision f64 "${args[@]}" -n 32
  for prec in f32 f16; do
    stage "gen-$p-cuda-$prec" "$BIN" generate -m "$MODEL" --backend cuda --precision $prec "${args[@]}" -n 32
    if cmp -s "$LOGS/gen-$p-cpu-f64.txt" "$LOGS/gen-$p-cuda-$prec.txt"; then
      echo "gen-$p: cuda $prec text identical to the cpu f64 reference's"
    else
      echo "gen-$p: cuda $prec text differs from the cpu f64 reference's"
    fi
  done
done

# 2. The main job, both pairs, every checkpoint of every step.
TAIL=40 stage job-chat "$BIN" -m "$MODEL" "${CHAT[@]}" --steps 8 --engine cuda -o "$WORK/job-chat" --no-color
TAIL=40 stage job-plain "$BIN" -m "$MODEL" "${PLAIN[@]}" --steps 8 --engine cuda -o "$WORK/job-plain" --no-color

# 3. transformers against the f64 reference: worst rel_l2 per kind over every checkpoint and step.
worst() {
  python3 - "$1" <<'EOF'
import json, sys
from collections import defaultdict
worst = defaultdict(float)
try:
    cps = json.load(open(sys.argv[1]))["checkpoints"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no comparison to read ({e})")
for cp in cps:
    v = (cp.get("metrics") or {}).get("rel_l2")
    if isinstance(v, (int, float)):
        worst[cp["base"]] = max(worst[cp["base"]], v)
n = sum(1 for cp in cps if cp["name"] != "tokens" and cp.get("metrics"))
if not worst:
    sys.exit("no checkpoint compared")
kind = max(worst, key=worst.get)
print(f"{n} checkpoints compared; worst rel_l2 {worst[kind]:.2e} ({kind})")
print(", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
EOF
}
stage hf-ref "$BIN" dump --backend cpu --precision f64 -m "$MODEL" "${CHAT[@]}" --steps 3 --out "$WORK/ref.h5"
for dtype in float64 float32; do
  stage "hf-$dtype" python3 -m diffrun.adapters.transformers --model "$MODEL" --reference "$WORK/ref.h5" \
    --out "$WORK/hf-$dtype.h5" --dtype $dtype
  rules=()
  if [ $dtype = float64 ]; then rules=(--tolerances "$REPO/fixtures/tolerances/f32_vs_f64.json"); fi
  stage "hf-$dtype-compare" "$BIN" compare "$WORK/hf-$dtype.h5" "$WORK/ref.h5" --no-color --summary \
    --report-json "$LOGS/hf-$dtype-report.json" "${rules[@]}"
  worst "$LOGS/hf-$dtype-report.json" | tee "$LOGS/hf-$dtype-worst.txt"
done

rm -rf "$WORK"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all Gemma 3 stages passed"
