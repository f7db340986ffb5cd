#!/usr/bin/env bash
# The CUDA example engine end to end (ctest example_cuda_engine, label gpu): against diffrun's f64 CPU reference on a
# tiny F16 llama, the clean engine (decode steps recorded inside its CUDA graph) passes every checkpoint it records at
# every step, and so does the same recording through immediate device puts (bit for bit, where h5py is there); with
# --bug rope-pos the first divergence is Qrope-0 at step 1. Then --bench prints the recording's cost. Exit 0 passed, 1 failed (with the evidence), 77 skipped (no CUDA device).
#   test_cuda_engine.sh ENGINE DIFFRUN MODEL.gguf
set -u
engine=$1 diffrun=$2 model=$3
py=${PYTHON:-python3}
steps=6
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() {
  echo "FAIL: $*"
  exit 1
}

"$engine" --probe
probe=$?
if ((probe == 77)); then
  echo "SKIP: no CUDA device (cudaGetDeviceCount found none): example_cuda_engine needs a GPU"
  exit 77
fi
((probe == 0)) || fail "cuda_engine --probe exited $probe"
[[ -f $model ]] || fail "$model missing (ctest -R fixtures_generate writes it)"

echo "== reference: $diffrun dump --backend cpu --precision f64 --model $model --steps $steps"
"$diffrun" dump --backend cpu --precision f64 --model "$model" --tokens 1,5,9,13,200,31,7 --steps $steps \
  --out "$tmp/ref.h5" >"$tmp/ref.log" 2>&1 || { cat "$tmp/ref.log"; fail "the reference dump failed"; }

# run_engine NAME [--bug B]: the engine's dump NAME.h5, validated.
run_engine() {
  local name=$1
  shift
  echo "== engine: cuda_engine --out $name.h5 $*"
  "$engine" --model "$model" --reference "$tmp/ref.h5" --out "$tmp/$name.h5" "$@" >"$tmp/$name.log" 2>&1 ||
    { cat "$tmp/$name.log"; fail "cuda_engine $* exited $?"; }
  cat "$tmp/$name.log"
  "$diffrun" validate "$tmp/$name.h5" >"$tmp/$name.validate" 2>&1 ||
    { cat "$tmp/$name.validate"; fail "diffrun validate $name.h5"; }
}

# compare NAME: exit status of diffrun compare NAME.h5 ref.h5, report in NAME.json, text in NAME.compare.
compare() {
  "$diffrun" compare "$tmp/$1.h5" "$tmp/ref.h5" --no-color --report-json "$tmp/$1.json" >"$tmp/$1.compare" 2>&1
}

run_engine clean
compare clean
rc=$?
((rc == 0)) || { cat "$tmp/clean.compare"; fail "compare of the clean engine exited $rc (want 0)"; }
# Every step, the graph-recorded ones (1..) included, holds the 3 + 15 per layer checkpoints the engine records.
"$py" - "$tmp/clean.json" $steps <<'EOF' || { cat "$tmp/clean.compare"; fail "the clean engine's checkpoints"; }
import collections, json, sys
report, steps = json.load(open(sys.argv[1])), int(sys.argv[2])
n_layer = report["model"]["n_layer"]
per_step = collections.Counter(c["step"] for c in report["checkpoints"] if c["status"] == "pass")
bad = [c for c in report["checkpoints"] if c["status"] not in ("pass", "only_reference")]
want = 3 + 15 * n_layer
print(f"clean: {report['summary']}; passing checkpoints per step {dict(sorted(per_step.items()))} (want {want})")
assert not bad, f"not passing: {[(c['step'], c['name'], c['status']) for c in bad][:10]}"
assert sorted(per_step) == list(range(steps + 1)), f"steps compared {sorted(per_step)}, want 0..{steps}"
assert all(n == want for n in per_step.values()), f"want {want} passing checkpoints in every step"
assert report["engine"]["backend"] == "cuda_engine" and report["engine"]["precision"] == "f16"
EOF

# The same recording through immediate device puts (one copy node each inside the graph): it passes, and where
# h5py is there, every checkpoint equals the deferred puts' bit for bit.
run_engine immediate --immediate
compare immediate
rc=$?
((rc == 0)) || { cat "$tmp/immediate.compare"; fail "compare of the engine with --immediate exited $rc (want 0)"; }
"$py" - "$tmp/clean.h5" "$tmp/immediate.h5" <<'EOF' || fail "immediate and deferred device puts recorded different values"
import sys
try:
    import h5py, numpy as np
except ImportError:
    print("immediate: h5py missing, the bit-for-bit check against the deferred puts skipped")
    sys.exit(0)
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
names, bnames = [], []
a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
b.visititems(lambda n, o: bnames.append(n) if isinstance(o, h5py.Dataset) else None)
assert sorted(names) == sorted(bnames), f"datasets differ: {sorted(set(names) ^ set(bnames))[:10]}"
def same(x, y):
    x, y = np.asarray(x[()]), np.asarray(y[()])
    if x.dtype.kind in "fiu":  # bit for bit
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return np.array_equal(x, y)
diff = [n for n in names if not same(a[n], b[n])]
assert not diff, f"values differ in {diff[:10]}"
print(f"immediate: {len(names)} datasets equal to the deferred puts' bit for bit")
EOF

run_engine bug --bug rope-pos
compare bug
rc=$?
((rc == 1)) || { cat "$tmp/bug.compare"; fail "compare of --bug rope-pos exited $rc (want 1)"; }
"$py" - "$tmp/bug.json" <<'EOF' || { cat "$tmp/bug.compare"; fail "the seeded bug's first divergence"; }
import json, sys
first = json.load(open(sys.argv[1]))["first_divergence"]
print(f"bug: first divergence {first and (first['name'], first['step'], first['verdict']['kind'])}")
assert first is not None and (first["name"], first["step"]) == ("Qrope-0", 1), "want Qrope-0 at step 1"
EOF

echo "== bench: cuda_engine --bench 5"
"$engine" --model "$model" --reference "$tmp/ref.h5" --out "$tmp/bench.h5" --bench 5 || fail "cuda_engine --bench"
echo "PASS"
