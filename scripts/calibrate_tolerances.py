#!/usr/bin/env python3
"""Tolerance calibration: run `diffrun` (engine vs reference, teacher-forced) on several models and
prompts and print the worst value of each bounded metric per checkpoint kind (and per kind at layer 0),
with the model, prompt, step and layer where it occurred, as the evidence for a preset in
fixtures/tolerances/.

    scripts/calibrate_tolerances.py --diffrun build/cli/diffrun --engine-precision f16 \\
        --reference-precision f32-f16store --steps 16 --out DIR MODEL.gguf [MODEL.gguf ...]

Each model runs once per prompt (`diffrun --report-json`; its exit status 1, a divergence under the
preset in use, is expected while calibrating, and counted: on a clean engine it is a false alarm).
--engine-precision default runs diffrun's default pairs (on a GPU both: f32 vs f64 and f16 vs
f32-f16store). The summary goes to stdout and DIR/summary.json.

    --prompts FILE       one prompt per line (run with --chat; a line "@N" is N ids 1..N of filler
                         text instead), else the ids of --tokens
    --emit-preset PATH   write a preset: per kind, max_rel_l2 = --factor x the worst rel_l2 measured
                         (2 significant digits, rounded up), a rule for layer 0 ("attn_norm-0") before
                         the rule of the kind ("attn_norm-*") unless --single-rule, the KL bound of the
                         logits; --axis-bounds adds max_row_rel_l2 and max_head_rel_l2 from the worst row
                         and head, --fail-frac-below X max_fail_frac (atol 0, rtol 0) where the share of
                         differing elements never passed X
    --keep-dumps         keep each run's dumps (by default deleted once the run is summarised)
    --reuse              read an earlier run's reports and kept dumps in --out instead of running
    --merge S.json ...   fold earlier runs' worst values in (--merge-pair logic|precision: that pair's)
    --sensitivity        per kind, the smallest scale error 1+eps of one token row, and of one head of
                         it (per-head kinds), that the preset in use catches at that checkpoint: the
                         engine's tensor in the dump scaled, rel_l2, cosine, worst row and head
                         recomputed against the reference and checked against the rule's bounds (worst
                         over layers and steps;
                         max_fail_frac is left out: an unrounded scale error says nothing of f16 flips);
                         for the default pairs also "default/": per checkpoint the better pair
    --sensitivity-steps N  only the first N steps of each dump

The isolation replay of a pair against an emulated storage reference (engine-isolated.h5, always run
there) is compared with its reference too and kept as the pair "local/" (--merge-pair local emits the
`_local` preset from it).
"""
import argparse
import fnmatch
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

# metric key in the report -> (bound name, worse is larger)
METRICS = {"rel_l2": ("max_rel_l2", True), "max_abs": ("max_abs", True), "cosine": ("min_cosine", False)}
# the worst token (or cache) row's and the worst head's rel L2 (report keys worst_row, worst_head)
AXIS_METRICS = {"row_rel_l2": ("max_row_rel_l2", True), "head_rel_l2": ("max_head_rel_l2", True),
                "fail_frac": ("max_fail_frac", True)}
LOGIT_METRICS = {"top1": ("min_top1", False), "kl_max": ("max_kl", True)}
PRESETS = Path(__file__).resolve().parent.parent / "fixtures" / "tolerances"
PER_HEAD = {"Qcur", "Kcur", "Vcur", "Qnorm", "Knorm", "Qrope", "Krope", "kqv_out", "cache_k", "cache_v"}
# Kinds that normalize another kind's rows (Gemma 3's and Qwen3's per-head q/k RMSNorm, Gemma 3's norms of the
# attention and FFN outputs): a normalization carries its input's relative error through, row by row, so its bounds
# are never tighter than its input's. Without this, a kind measured on fewer models than its input (these norms exist
# in qwen3 and gemma3 only) gets a bound its own input's accepted error exceeds (Gemma 3 270M, H100, f16 pair:
# Qnorm-0 2.63e-5 against 2e-5, carried in from Qcur-0's 1.87e-5 within Qcur-0's 2.5e-4; the same model on the CPU
# pair, a 503-token prompt: ffn_post_norm-1's token row 319 at 6.99e-5 against the default's 5.56e-5, carried in
# from ffn_out-1 within ffn_out-*'s 2.5e-4).
NORMALIZES = {"Qnorm": "Qcur", "Knorm": "Kcur", "attn_post_norm": "attn_out", "ffn_post_norm": "ffn_out"}
# Rule keys this script does not measure; when a preset is regenerated they are carried over, rule by
# rule (same "match"), from the file being replaced.
CARRIED_KEYS = ("rel_l2_per_position",)
BOUND_KEYS = ("max_rel_l2", "max_row_rel_l2", "max_head_rel_l2")


def floor_normalized(rules, default=None):
    """Raises each NORMALIZES kind's bounds to its input's rule of the same layer pattern (in place). Where the kind
    has no rule of that pattern and would fall to the preset's `default`, a rule with the default's bounds is added
    after its input's and raised the same way; none is added where the default is already no tighter."""
    by_match = {r["match"]: r for r in rules}
    added = set()  # matches of the rules added here
    if default is not None:
        normalizer = {src: kind for kind, src in NORMALIZES.items()}
        for i in range(len(rules) - 1, -1, -1):  # backwards, so that an insertion moves no rule still to visit
            kind, _, layer = rules[i]["match"].partition("-")
            match = f"{normalizer.get(kind)}-{layer}"
            if kind in normalizer and layer and match not in by_match:
                by_match[match] = {"match": match, **{k: default[k] for k in BOUND_KEYS if k in default}, "reason": ""}
                rules.insert(i + 1, by_match[match])
                added.add(match)
    raised_any = set()
    for r in rules:
        kind, _, layer = r["match"].partition("-")
        src = by_match.get(f"{NORMALIZES[kind]}-{layer}") if kind in NORMALIZES and layer else None
        if not src:
            continue
        # max_rel_l2 always; a row or head bound only where the rule has one (absent is unchecked)
        raised = [k for k in BOUND_KEYS if k in src and (k == "max_rel_l2" or k in r) and src[k] > r.get(k, 0)]
        if not raised:
            continue
        raised_any.add(r["match"])
        for k in raised:
            r[k] = src[k]
        note = f"raised to {src['match']}'s bounds: an RMSNorm carries its input's relative error through"
        if r["match"] in added:
            r["reason"] = f"no rule of its own: the default's bounds, {note}"
        elif note not in r.get("reason", ""):
            r["reason"] = r.get("reason", "") + "; " + note
    # An added rule that nothing raised is the default again.
    rules[:] = [r for r in rules if r["match"] not in added or r["match"] in raised_any]


def carry_over(rules, path: Path):
    """Copies CARRIED_KEYS from the preset at `path` (when it exists) into the rules of the same match."""
    if not path.exists():
        return
    old = {r.get("match"): r for r in json.loads(path.read_text()).get("rules", [])}
    for r in rules:
        for k in CARRIED_KEYS:
            if k in old.get(r["match"], {}):
                r[k] = old[r["match"]][k]


def number(v):
    if v is None:
        return float("nan")
    return float(v) if not isinstance(v, str) else float(v.replace("inf", "Infinity"))


def run_model(args, model: Path, out: Path, prompt) -> tuple:
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    if args.reuse and report.exists():  # an earlier run's reports (and kept dumps), e.g. for --sensitivity
        rep = json.loads(report.read_text())
        pairs = [(p["title"], p["report"]) for p in rep["pairs"]] if "pairs" in rep else [("", rep)]
        for title, prep in list(pairs):
            if prep.get("isolated_path") and (Path(prep["isolated_path"]).parent / "local.json").exists():
                pairs.append(("local: " + (title.split(": ", 1)[-1] if title else "isolation replay"),
                              json.loads((Path(prep["isolated_path"]).parent / "local.json").read_text())))
        return rep.get("exit_code", 0), pairs
    cmd = [args.diffrun, "--model", str(model), "--engine", args.engine, "--steps", str(args.steps),
           "--out", str(out), "--report-json", str(report), "--no-color"]
    if args.engine_precision != "default":
        cmd += ["--engine-precision", args.engine_precision, "--reference-precision", args.reference_precision]
    if args.tolerances:
        cmd += ["--tolerances", args.tolerances]
    if prompt is None:
        cmd += ["--tokens", args.tokens]
    elif prompt.startswith("@"):
        cmd += ["--tokens", ",".join(str(1 + i % 200) for i in range(int(prompt[1:])))]
    else:
        cmd += ["--prompt", prompt, "--chat"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 1) or not report.exists():
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rep = json.loads(report.read_text())
    # One pair: the report itself; the default GPU run: {"pairs": [{"title", "exit_code", "report"}]}.
    pairs = [(p["title"], p["report"]) for p in rep["pairs"]] if "pairs" in rep else [("", rep)]
    # The isolation replay (always run against an emulated f16 storage reference): its own comparison
    # gives every local metric (row and head included); its failures are already in the pair's report.
    for title, prep in list(pairs):
        iso = prep.get("isolated_path")
        if not iso:
            continue
        local = Path(iso).parent / "local.json"
        c = subprocess.run([args.diffrun, "compare", iso, prep["reference"]["path"], "--report-json", str(local),
                            "--summary"], capture_output=True, text=True)
        if c.returncode not in (0, 1) or not local.exists():
            sys.exit(f"compare {iso}: exit {c.returncode}\n{c.stdout[-2000:]}\n{c.stderr[-2000:]}")
        pairs.append(("local: " + (title.split(": ", 1)[-1] if title else "isolation replay"), json.loads(local.read_text())))
    return r.returncode, pairs


def first_divergence(rep):
    f = rep.get("first_divergence")
    if not f:
        return None
    v = f["verdict"]
    return f"{f['name']} step {f['step']} ({v['kind']}{' precision' if v.get('precision') else ''})"


class Preset:
    def __init__(self, path):
        d = json.loads(Path(path).read_text())
        self.rules, self.default = d["rules"], d["default"]

    def rule(self, name):
        for r in self.rules:
            if fnmatch.fnmatchcase(name, r["match"]):
                return r
        return self.default


def sensitivity(eng_path: Path, ref_path: Path, preset: Preset, worst: dict, pair: str = "", run: str = "",
                each: dict = None, steps: int = None):
    """Smallest eps (one row, one head of a row) caught per kind; keeps the largest over checkpoints
    in `worst`, and each checkpoint's per pair in `each[(run, step, name, what)][pair]`."""
    import h5py
    import numpy as np

    grid = np.array([1e-4 * 1.25 ** i for i in range(60)])  # eps from 1e-4 to ~5

    def per_axis(x, axis):  # sums over every axis but `axis`
        return x.sum(axis=tuple(i for i in range(x.ndim) if i != axis))

    def caught(a, b, sl, rule, axes):
        # a' = a with a[sl] scaled by 1+eps: closed forms of |a'-b|^2 and <a',b>, |a'|^2 in eps, for the
        # tensor and for each token (or cache) row and head (axes: {"max_row_rel_l2": axis, ...}), over
        # the whole grid at once; the smallest eps that fails a bound of the rule.
        d = a - b
        nb2, nd2, na2, ab = float((b * b).sum()), float((d * d).sum()), float((a * a).sum()), float((a * b).sum())
        a_s, d_s, b_s = a[sl], d[sl], b[sl]
        da, aa, ba = float((d_s * a_s).sum()), float((a_s * a_s).sum()), float((b_s * a_s).sum())
        if nb2 <= 0:
            return math.inf
        fails = np.zeros(len(grid), dtype=bool)
        if "max_rel_l2" in rule:
            fails |= np.sqrt(np.maximum(nd2 + 2 * grid * da + grid * grid * aa, 0.0) / nb2) > rule["max_rel_l2"]
        if "min_cosine" in rule:
            nap2 = na2 + (2 * grid + grid * grid) * aa
            fails |= (ab + grid * ba) / np.sqrt(np.maximum(nap2 * nb2, 1e-300)) < rule["min_cosine"]
        for bound, axis in axes.items():
            if bound not in rule or axis is None:
                continue
            da_m, aa_m = np.zeros_like(a), np.zeros_like(a)
            da_m[sl], aa_m[sl] = d_s * a_s, a_s * a_s
            d2, b2 = per_axis(d * d, axis), np.maximum(per_axis(b * b, axis), 1e-300)
            dax, aax = per_axis(da_m, axis), per_axis(aa_m, axis)
            rel = np.sqrt(np.maximum(d2[None, :] + 2 * grid[:, None] * dax[None, :] + (grid * grid)[:, None] * aax[None, :], 0.0)
                          / b2[None, :])
            fails |= rel.max(axis=1) > rule[bound]
        hit = np.flatnonzero(fails)
        return float(grid[hit[0]]) if hit.size else math.inf

    with h5py.File(eng_path, "r") as fe, h5py.File(ref_path, "r") as fr:
        for step in sorted(k for k in fr.keys() if k.startswith("step_"))[:steps]:
            if step not in fe:
                continue
            for name, ds in fr[step].items():
                if name not in fe[step] or ds.dtype.kind != "f":
                    continue
                b = ds[()].astype(np.float64)
                a = fe[step][name][()].astype(np.float64)
                if a.shape != b.shape or b.ndim < 2:
                    continue
                base = name.rsplit("-", 1)[0] if name[-1].isdigit() and "-" in name else name
                rule = preset.rule(name)
                if base == "kq_soft_max":  # [H, T, S]: the last token's row of head 0, and of every head
                    row, head = (slice(None), -1), (0, -1)
                    axes = {"max_row_rel_l2": 1, "max_head_rel_l2": 0}
                else:  # [T, ...] (cache: [S, ...]): the last token's row, and head 0 of it
                    row, head = (-1,), (-1, 0)
                    axes = {"max_row_rel_l2": 0, "max_head_rel_l2": 1 if a.ndim == 3 else None}
                results = {"row": caught(a, b, row, rule, axes)}
                if base in PER_HEAD or base == "kq_soft_max":
                    results["head"] = caught(a, b, head, rule, axes)
                for what, eps in results.items():
                    if each is not None:
                        each.setdefault((run, step, name, what), {})[pair] = eps
                    key = (f"{pair}{base}", what)
                    if key not in worst or eps > worst[key][0]:
                        worst[key] = (eps, f"{run or eng_path.parent.name} {step} {name}")


def emit_preset(args, worst, path: Path):
    def up(v):  # factor x v, 2 significant digits, rounded up
        x = v * args.factor
        if x <= 0 or not math.isfinite(x):
            return x
        e = math.floor(math.log10(x)) - 1
        return math.ceil(x / 10 ** e) * 10 ** e

    kinds, rules = [], []
    for (b, k) in worst:
        if k == "rel_l2" and not b.endswith("@0") and b not in kinds:
            kinds.append(b)
    where = args.where or f"{len(args.models)} model(s), {max(1, len(args.prompt_list))} prompt(s), {args.steps} steps"
    for b in kinds:
        layer0_rules = not args.single_rule and (f"{b}@0", "rel_l2") in worst
        for layer0 in ([True, False] if layer0_rules else [False]):
            key = (f"{b}@0" if layer0 else b, "rel_l2")
            v, w = worst[key]
            rule = {"match": f"{b}-0" if layer0 else (b if b in ("embd", "result_norm", "result_output") else f"{b}-*"),
                    "max_rel_l2": float(f"{max(up(v), args.floor):.2g}")}
            for metric, bound in (("row_rel_l2", "max_row_rel_l2"), ("head_rel_l2", "max_head_rel_l2")):
                if args.axis_bounds and (key[0], metric) in worst and math.isfinite(worst[(key[0], metric)][0]):
                    rule[bound] = float(f"{max(up(worst[(key[0], metric)][0]), args.floor):.2g}")
            # Where nearly every element is bit-equal (a tensor stored in f16: one-ulp flips are rare), the
            # share that differ catches a small systematic change that its rel_l2 cannot tell from a flip.
            ff = worst.get((key[0], "fail_frac"), (math.nan,))[0]
            if args.fail_frac_below and 0 < ff <= args.fail_frac_below:
                rule["atol"], rule["rtol"], rule["max_fail_frac"] = 0, 0, float(f"{min(up(ff), 1.0):.2g}")
            if b == "result_output" and (b, "kl_max") in worst:
                rule["max_kl"] = float(f"{max(up(worst[(b, 'kl_max')][0]), 1e-9):.2g}")
            if b == "kq_soft_max" and (b, "cosine") in worst:
                # 1 - cosine grows as rel_l2 squared (about rel_l2^2 / 2): the factor applies squared, so the
                # cosine bound is no tighter than the rel_l2 bound beside it.
                rule["min_cosine"] = float(f"{1 - max(up(up(1 - worst[(b, 'cosine')][0])), 1e-9):.10g}")
            rule["reason"] = f"{args.factor:g}x the worst measured {'at layer 0 ' if layer0 else ''}({where}): {v:.2e} ({w})"
            rules.append(rule)
    default = max(r["max_rel_l2"] for r in rules)
    floor_normalized(rules, {"max_rel_l2": default})
    carry_over(rules, path)
    preset = {"preset": path.stem, "description": args.description or f"calibrated by scripts/calibrate_tolerances.py ({where})",
              "rules": rules, "default": {"max_rel_l2": default, "reason": "a kind not measured: the loosest bound above"}}
    # The longest context the bounds hold for unscaled: --calibrated-positions, else the replaced file's.
    cal_positions = args.calibrated_positions
    if cal_positions is None and path.exists():
        cal_positions = json.loads(path.read_text()).get("calibrated_positions")
    # The reduction lengths the bounds hold for unscaled (diff/tolerances.hpp): the replaced file's.
    cal_reduction = json.loads(path.read_text()).get("calibrated_reduction") if path.exists() else None
    lines = ["{", f'  "preset": {json.dumps(preset["preset"])},', f'  "description": {json.dumps(preset["description"])},',
             *([f'  "calibrated_positions": {int(cal_positions)},'] if cal_positions else []),
             *([f'  "calibrated_reduction": {json.dumps(cal_reduction)},'] if cal_reduction else []),
             '  "rules": [', ",\n".join("    " + json.dumps(r) for r in rules), "  ],",
             f'  "default": {json.dumps(preset["default"])}', "}"]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(rules)} rules)")


def stop(*_):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diffrun", required=True)
    ap.add_argument("--engine", default="cuda", help="engine side: cuda or cpu")
    ap.add_argument("--engine-precision", default="f16", help="f16, f32, a cpu spec, or 'default' (diffrun's own pairs)")
    ap.add_argument("--reference-precision", default="f32-f16store")
    ap.add_argument("--tolerances", help="tolerance file to use instead of the pair's preset")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens", default="1,17,42,7,99,3,120", help="prompt token ids (ids below the smallest vocab)")
    ap.add_argument("--prompts", type=Path, help="one prompt per line, run with --chat ('@N': N filler ids)")
    ap.add_argument("--emit-preset", type=Path)
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument("--calibrated-positions", type=int, default=None,
                    help="the longest context (prompt + steps) calibrated on; beyond it the comparison scales the rel L2 "
                         "bounds by sqrt(positions / this) (default: the replaced preset's value)")
    ap.add_argument("--floor", type=float, default=1e-6, help="smallest max_rel_l2 an emitted rule gets")
    ap.add_argument("--single-rule", action="store_true", help="--emit-preset: one rule per kind, no layer-0 rule")
    ap.add_argument("--axis-bounds", action="store_true",
                    help="--emit-preset: also max_row_rel_l2 and max_head_rel_l2, --factor x the worst row's and head's")
    ap.add_argument("--fail-frac-below", type=float, default=0.0,
                    help="--emit-preset: for a kind whose share of differing elements (atol 0, rtol 0) never passed "
                         "this, also max_fail_frac = --factor x its worst")
    ap.add_argument("--description", default="")
    ap.add_argument("--where", default="", help="what the emitted reasons say was measured")
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--sensitivity-steps", type=int, help="--sensitivity over the first N steps only (default all)")
    ap.add_argument("--keep-dumps", action="store_true", help="keep each run's HDF5 dumps (deleted once read)")
    ap.add_argument("--reuse", action="store_true",
                    help="read the reports an earlier run left in --out instead of running (with --keep-dumps dumps: "
                         "--sensitivity under the presets as they are now)")
    ap.add_argument("--merge", type=Path, nargs="*", help="summary.json files of earlier runs to fold into the worst values")
    ap.add_argument("--merge-pair", default="",
                    help="with --merge: take that pair's values (logic, precision, or local: the precision pair's isolation replay)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("models", nargs="*", type=Path)
    args = ap.parse_args()
    if not args.models and not args.merge:
        ap.error("give models to run, or --merge summaries")
    args.prompt_list = [l.rstrip("\n") for l in args.prompts.read_text().splitlines() if l.strip()] if args.prompts else []

    worst = {}  # (base or base@0, metric) -> (value, where)
    sens = {}  # (base, "row"|"head") -> (eps, where)
    each = {}  # (run, step, name, "row"|"head") -> {pair prefix: eps}
    tokens, alarms, runs = {}, [], 0
    # A SIGTERM (timeout) ends the runs early; what was measured so far is still summarised.
    signal.signal(signal.SIGTERM, stop)
    interrupted = False
    try:
        for model in args.models:
            for i, prompt in enumerate(args.prompt_list or [None]):
                out = args.out / (model.stem + (f"-p{i:03d}" if prompt is not None else ""))
                code, pairs = run_model(args, model, out, prompt)
                runs += 1
                print(f"  run {runs}: {out.name} exit {code}", flush=True)
                for title, rep in pairs:
                    if rep["summary"]["diverged"] and not title.startswith("local"):  # local: in its pair's report
                        alarms.append(f"{model.stem} prompt {i} {title}: {first_divergence(rep)}")
                        print(f"  divergence: {alarms[-1]}", flush=True)
                    for c in rep["checkpoints"]:
                        m = c.get("metrics")
                        if not m:
                            continue
                        where = f"{model.stem}{f' p{i}' if prompt is not None else ''} step {c['step']}" + (
                            f" layer {c['layer']}" if c["layer"] >= 0 else "")
                        prefix = f"{title.split(':')[0]}/" if title else ""  # the default pairs: logic/, precision/
                        values = {k: number(m[k]) for k in METRICS}
                        if m.get("atol") == 0 and m.get("rtol") == 0:  # the share of elements not bit-equal
                            values["fail_frac"] = number(m["fail_frac"])
                        for k, axis in (("row_rel_l2", "worst_row"), ("head_rel_l2", "worst_head")):
                            if m.get(axis):
                                values[k] = number(m[axis]["rel_l2"])
                        if m.get("logits"):
                            values.update({k: number(m["logits"][k]) for k in LOGIT_METRICS})
                        for k, v in values.items():
                            larger = {**METRICS, **AXIS_METRICS, **LOGIT_METRICS}[k][1]
                            for key in [(prefix + c["base"], k)] + ([(prefix + c["base"] + "@0", k)] if c["layer"] == 0 else []):
                                old = worst.get(key)
                                if old is None or math.isnan(v) or (v > old[0] if larger else v < old[0]):
                                    worst[key] = (v, where)
                    decode = [t for t in rep["tokens"] if t["step"] > 0]
                    tk = tokens.setdefault(f"{model.stem} {title}".strip(), {"agree": 0, "total": 0})
                    tk["agree"] += sum(1 for t in decode if t["match"])
                    tk["total"] += len(decode)
                    if args.sensitivity:
                        name = rep["tolerances"]["preset"] + ("_local" if title.startswith("local") else "")
                        preset = Preset(args.tolerances) if args.tolerances else Preset(PRESETS / f"{name}.json")
                        sensitivity(Path(rep["engine"]["path"]), Path(rep["reference"]["path"]), preset, sens,
                                    f"{title.split(':')[0]}/" if title else "", out.name, each, args.sensitivity_steps)
                if not args.keep_dumps:  # a 30-layer model on a long prompt writes gigabytes per run
                    for h5 in out.rglob("*.h5"):
                        h5.unlink()
    except KeyboardInterrupt:
        interrupted = True
        print(f"  interrupted after {runs} runs: summarising those", flush=True)

    # The default run fails when any of its pairs does (the precision pair on its local errors too):
    # its sensitivity per kind is the best of the pairs'.
    for (run, step, name, what), by_pair in each.items():
        if len(by_pair) < 2:
            continue
        base = name.rsplit("-", 1)[0] if name[-1].isdigit() and "-" in name else name
        eps = min(by_pair.values())
        key = ("default/" + base, what)
        if key not in sens or eps > sens[key][0]:
            sens[key] = (eps, f"{run} {step} {name}")
    for path in args.merge or []:  # earlier runs' worst values, of --merge-pair's pair when they ran both
        want = f"{args.merge_pair}/" if args.merge_pair else ""
        for key, e in json.loads(path.read_text())["worst"].items():
            bk, k = key.rsplit(":", 1)
            if ("/" in bk and not (want and bk.startswith(want))) or ("/" not in bk and want == "local/"):
                continue  # the other pair's (a one-pair run's values are that pair's, never local errors)
            bk = bk[len(want):] if want and bk.startswith(want) else bk
            v, larger, old = number(e["value"]), {**METRICS, **AXIS_METRICS, **LOGIT_METRICS}[k][1], worst.get((bk, k))
            if old is None or (v > old[0] if larger else v < old[0]):
                worst[(bk, k)] = (v, f"{e['where']} ({path.stem})")
    summary = {"engine": args.engine, "engine_precision": args.engine_precision,
               "reference_precision": args.reference_precision, "steps": args.steps,
               "models": [str(m) for m in args.models], "prompts": len(args.prompt_list), "runs": runs,
               "interrupted": interrupted,
               "false_alarms": alarms, "top1": tokens,
               "worst": {f"{b}:{k}": {"value": v, "where": w} for (b, k), (v, w) in sorted(worst.items())},
               "sensitivity": {f"{b}:{k}": {"eps": v, "where": w} for (b, k), (v, w) in sorted(sens.items())}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    pairs = ("diffrun's default pairs" if args.engine_precision == "default" else
             f"{args.engine_precision} engine vs {args.reference_precision} reference")
    print(f"{args.engine}: {pairs}, {args.steps} steps, {runs} runs")
    for (b, k), (v, w) in sorted(worst.items()):
        print(f"  {b:16s} {k:8s} {v:.3e}  ({w})")
    for name, t in tokens.items():
        print(f"  top-1 {name}: {t['agree']}/{t['total']}")
    print(f"  divergences (false alarms on a clean engine): {len(alarms)} of {runs} runs")
    for a in alarms[:20]:
        print(f"    {a}")
    if sens:
        print("  sensitivity: smallest 1+eps caught at the checkpoint (worst over layers and steps)")
        for (b, k), (v, w) in sorted(sens.items()):
            print(f"    {b:14s} {k:4s} eps {v:.3g}  ({w})")
    if args.emit_preset:
        emit_preset(args, worst, args.emit_preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
