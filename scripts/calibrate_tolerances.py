#!/usr/bin/env python3
"""Tolerance calibration: run `diffrun` (engine vs reference, teacher-forced) on several models and
print the worst value of each bounded metric per checkpoint kind, with the model, step and layer
where it occurred, as the evidence for a preset in fixtures/tolerances/.

    scripts/calibrate_tolerances.py --diffrun build/cli/diffrun --engine-precision f16 \\
        --reference-precision f32 --steps 16 --out DIR MODEL.gguf [MODEL.gguf ...]

Each model runs once (`diffrun --report-json`; its exit status 1, a divergence under the preset
in use, is expected while calibrating). The summary goes to stdout and DIR/summary.json.
"""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

# metric key in the report -> (bound name, worse is larger)
METRICS = {"rel_l2": ("max_rel_l2", True), "max_abs": ("max_abs", True), "cosine": ("min_cosine", False)}
LOGIT_METRICS = {"top1": ("min_top1", False), "kl_max": ("max_kl", True)}


def number(v):
    return float(v) if not isinstance(v, str) else float(v.replace("inf", "Infinity"))


def run_model(args, model: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    cmd = [args.diffrun, "--model", str(model), "--engine", "cuda", "--engine-precision", args.engine_precision,
           "--reference-precision", args.reference_precision, "--steps", str(args.steps), "--tokens", args.tokens,
           "--out", str(out), "--report-json", str(report), "--no-color"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 1) or not report.exists():
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(report.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diffrun", required=True)
    ap.add_argument("--engine-precision", default="f16")
    ap.add_argument("--reference-precision", default="f32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens", default="1,17,42,7,99,3,120", help="prompt token ids (ids below the smallest vocab)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("models", nargs="+", type=Path)
    args = ap.parse_args()

    worst = {}  # (base, metric) -> (value, where)
    tokens = {}
    for model in args.models:
        rep = run_model(args, model, args.out / model.stem)
        for c in rep["checkpoints"]:
            m = c.get("metrics")
            if not m:
                continue
            where = f"{model.stem} step {c['step']}" + (f" layer {c['layer']}" if c["layer"] >= 0 else "")
            values = {k: number(m[k]) for k in METRICS}
            if m.get("logits"):
                values.update({k: number(m["logits"][k]) for k in LOGIT_METRICS})
            for k, v in values.items():
                larger = {**METRICS, **LOGIT_METRICS}[k][1]
                key = (c["base"], k)
                old = worst.get(key)
                if old is None or math.isnan(v) or (v > old[0] if larger else v < old[0]):
                    worst[key] = (v, where)
        decode = [t for t in rep["tokens"] if t["step"] > 0]
        tokens[model.stem] = {"agree": sum(1 for t in decode if t["match"]), "total": len(decode)}

    summary = {"engine_precision": args.engine_precision, "reference_precision": args.reference_precision,
               "steps": args.steps, "models": [str(m) for m in args.models], "top1": tokens,
               "worst": {f"{b}:{k}": {"value": v, "where": w} for (b, k), (v, w) in sorted(worst.items())}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{args.engine_precision} engine vs {args.reference_precision} reference, {args.steps} steps")
    for (b, k), (v, w) in sorted(worst.items()):
        print(f"  {b:14s} {k:8s} {v:.3e}  ({w})")
    for name, t in tokens.items():
        print(f"  top-1 {name}: {t['agree']}/{t['total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
