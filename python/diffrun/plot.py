"""Plots of an engine dump against a reference dump, as PNGs.

    python -m diffrun.plot ENGINE.h5 REFERENCE.h5 [--out plots] [--step N] [--heatmap NAME ...] [--report R.json]
    python -m diffrun.plot RUN_DIR ...          (a diffrun run's --out: engine.h5 and reference.h5, or logic/ and
                                                 precision/ of a GPU run, each plotted into its own folder)
    python -m diffrun.plot SWEEP.json [--out plots]   (`diffrun sweep --report-json`: the corpus's KL)

writes, for the step of the first divergence (--step chooses another):
    errors_by_op_step<k>.png      relative L2 error of every checkpoint of the step in execution order (layer
                                  after layer), failures in red, their bounds as grey dashes; below, the
                                  first divergence's layer op by op, so a jump inside one layer shows
    rel_l2_by_layer_step<k>.png   relative L2 error against layer, one line per checkpoint kind
    heatmap_<name>_step<k>.png    |engine - reference| of one checkpoint over (token x channel), log colours
For a sweep report instead:
    sweep_kl_distribution.png     the KL(reference || engine) of every generated token, as a histogram on a log
                                  axis (exact zeros counted apart), with its mean, median, p99 and max
    sweep_kl_by_position.png      KL against the step for the worst prompts (by max KL), bad tokens marked x
The default heatmap is the first divergence. It, each checkpoint's status and its rel_l2 bound come from
diffrun's own comparison: the JSON report of --report (diffrun --report-json), else `diffrun compare` is run
(--diffrun PATH, $DIFFRUN_BIN, `diffrun` on PATH, or build/cli/diffrun in the current directory or in the
checkout this module is in). Without either, the
errors are computed here and the heatmap shows the largest jump of the error along the execution order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from . import schema  # noqa: E402
from .dump import Dump, DumpFormatError, open as open_dump  # noqa: E402
from .schema import attr  # noqa: E402
from .metrics import dim_sizes, tensor_metrics  # noqa: E402

PASS_COLOR, FAIL_COLOR, BOUND_COLOR = "#1f77b4", "#d62728", "#7f7f7f"


@dataclass
class Point:
    """One checkpoint of a step: its error and, from diffrun's report, its status and rel_l2 bound."""

    name: str
    base: str
    layer: int
    rel_l2: float  # nan where undefined (NaN/Inf in the data)
    status: str = ""  # pass, fail, shape_mismatch; "" without a report
    bound: float | None = None  # the rule's max_rel_l2

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "shape_mismatch")


# --- diffrun's comparison -------------------------------------------------------------------------

def find_diffrun(explicit: str | None = None) -> str | None:
    """The diffrun executable: explicit (an error when it is not one), $DIFFRUN_BIN, on PATH, or build/cli/diffrun
    in the current directory (the README's commands run from the checkout, where the installed package is not) or
    in the checkout this module is in."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise DumpFormatError(explicit, "--diffrun: not an executable")
        return explicit
    built = Path("build") / "cli" / "diffrun"
    checkouts = (Path.cwd() / built, Path(__file__).resolve().parents[2] / built)
    for candidate in (os.environ.get("DIFFRUN_BIN"), shutil.which("diffrun"), *map(str, checkouts)):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def pair_report(report: dict, engine_path: str) -> dict:
    """A single comparison's report; of a two-pair run's ({"pairs": ...}), the pair of this engine dump."""
    if "pairs" not in report:
        return report
    pairs = [p["report"] for p in report["pairs"]]
    for r in pairs:
        if os.path.abspath(r.get("engine", {}).get("path", "")) == os.path.abspath(engine_path):
            return r
    return next((r for r in pairs if r.get("first_divergence")), pairs[0])


def run_compare(binary: str, engine_path: str, reference_path: str) -> dict:
    """diffrun compare's JSON report of the pair. Raises RuntimeError with its message when it cannot compare."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        r = subprocess.run([binary, "compare", engine_path, reference_path, "--summary", "--no-color",
                            "--report-json", out], capture_output=True, text=True)
        if r.returncode not in (0, 1) or not os.path.exists(out):
            raise RuntimeError((r.stderr or r.stdout).strip() or f"{binary} compare exited {r.returncode}")
        with open(out) as f:
            return json.load(f)


def first_divergence(report: dict | None) -> tuple[str, int] | None:
    first = (report or {}).get("first_divergence")
    return (first["name"], int(first["step"])) if first else None


# --- the errors of a step -------------------------------------------------------------------------

def step_points(engine: Dump, reference: Dump, step: int, report: dict | None = None) -> list[Point]:
    """Every float checkpoint of the step both dumps hold, in execution order."""
    if report is not None:
        points = []
        for c in report["checkpoints"]:
            if c["step"] != step or c["status"] not in ("pass", "fail", "shape_mismatch"):
                continue
            rel = (c.get("metrics") or {}).get("rel_l2")
            bound = next((k["limit"] for k in c.get("checks", []) if k["bound"] == "max_rel_l2"), None)
            points.append(Point(c["name"], c["base"], c["layer"], math.nan if rel is None else float(rel),
                                c["status"], bound))
        return points
    points = []
    engine_names = set(engine.names(step))
    dims = dim_sizes(reference.meta)
    for name in reference.names(step):
        info = reference.info(name, step)
        if info.dtype.kind != "f" or name not in engine_names or engine.info(name, step).shape != info.shape:
            continue
        m = tensor_metrics(engine.get(name, step), reference.get(name, step), info.layout, dims)
        points.append(Point(name, name.rsplit("-", 1)[0] if info.layer >= 0 else name, info.layer, m["rel_l2"]))
    return points


def layer_errors(engine: Dump, reference: Dump, step: int,
                 points: list[Point] | None = None) -> "OrderedDict[str, dict[int, float]]":
    """kind -> layer -> rel_l2 for the per-layer checkpoints of a step, kinds in execution order."""
    out: "OrderedDict[str, dict[int, float]]" = OrderedDict()
    for p in points if points is not None else step_points(engine, reference, step):
        if p.layer >= 0:
            out.setdefault(p.base, {})[p.layer] = p.rel_l2
    return out


def largest_jump(points: list[Point]) -> Point | None:
    """Without diffrun's verdict: the checkpoint whose rel_l2 most exceeds every error before it in the step."""
    best, best_ratio, before = None, 1.0, 0.0
    for p in points:
        if not math.isfinite(p.rel_l2):
            return p  # NaN/Inf: where the data stops being finite
        if p.rel_l2 > 0:
            ratio = p.rel_l2 / before if before > 0 else (math.inf if p.rel_l2 > 1e-3 else 1.0)
            if ratio > best_ratio:
                best, best_ratio = p, ratio
            before = max(before, p.rel_l2)
    return best


# --- plots ----------------------------------------------------------------------------------------

def _positive_floor(values: list[float]) -> float:
    positive = [v for v in values if 0 < v < math.inf]
    return min(positive) if positive else 1e-12


def _plot_points(ax, points: list[Point], xs: list[int], floor: float) -> None:
    """rel_l2 on a log axis: exact zeros drawn at the floor (hollow), NaN/Inf as a red x at the top."""
    ys = [p.rel_l2 for p in points]
    finite = [y for y in ys if math.isfinite(y)]
    top = max(finite) if finite else 1.0
    ax.plot(xs, [max(y, floor) if math.isfinite(y) else np.nan for y in ys], color="#9ab", linewidth=0.8, zorder=1)
    colors = [FAIL_COLOR if p.failed else PASS_COLOR for p in points]
    shown = [(x, y, c) for x, y, c in zip(xs, ys, colors) if math.isfinite(y) and y > 0]
    if shown:
        ax.scatter([s[0] for s in shown], [s[1] for s in shown], c=[s[2] for s in shown], s=12, zorder=3)
    zeros = [x for x, y in zip(xs, ys) if y == 0]
    if zeros:
        ax.scatter(zeros, [floor] * len(zeros), facecolors="none", edgecolors=PASS_COLOR, s=14, zorder=3,
                   label="exact (0)")
    bad = [x for x, y in zip(xs, ys) if not math.isfinite(y)]
    if bad:
        ax.scatter(bad, [top * 2] * len(bad), marker="x", color=FAIL_COLOR, s=30, zorder=4, label="NaN/Inf")
    bounds = [(x, p.bound) for x, p in zip(xs, points) if p.bound]
    if bounds:
        ax.scatter([b[0] for b in bounds], [b[1] for b in bounds], marker="_", color=BOUND_COLOR, s=40, zorder=2,
                   label="bound (max_rel_l2)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", which="major", alpha=0.3)


def plot_errors_by_op(points: list[Point], marked: Point | None, mark_label: str, title: str, path: str) -> None:
    """The step's checkpoints in execution order, and below them the marked checkpoint's layer op by op."""
    fig, (ax, zoom) = plt.subplots(2, 1, figsize=(13, 8.5), dpi=110, gridspec_kw={"height_ratios": [3, 2]})
    floor = _positive_floor([p.rel_l2 for p in points] + [p.bound or 0 for p in points]) / 3
    xs = list(range(len(points)))
    # Alternate shading per layer, ticks at layer starts.
    starts = [(i, p.layer) for i, p in enumerate(points) if p.layer >= 0 and (i == 0 or points[i - 1].layer != p.layer)]
    n_layers = len(starts)
    every = max(1, math.ceil(n_layers / 16))
    for k, (i, layer) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else next(
            (j for j in range(i, len(points)) if points[j].layer < 0), len(points))
        if k % 2 == 0:
            ax.axvspan(i - 0.5, end - 0.5, color="#000", alpha=0.04, linewidth=0)
    ticks = [(i, f"L{layer}") for k, (i, layer) in enumerate(starts) if k % every == 0]
    ax.set_xticks([t[0] for t in ticks])
    ax.set_xticklabels([t[1] for t in ticks], fontsize=8, rotation=0)
    _plot_points(ax, points, xs, floor)
    ax.set_xlim(-1, len(points))
    outside = [p.name for p in points if p.layer < 0]
    ax.set_xlabel("checkpoints in execution order (Ln: the first of layer n" +
                  (f"; outside layers: {', '.join(outside)}" if outside else "") + ")")
    ax.set_ylabel("relative L2 error")
    ax.set_title(title, fontsize=11)
    if marked is not None:
        mi = next(i for i, p in enumerate(points) if p.name == marked.name)
        ax.axvline(mi, color=FAIL_COLOR, linestyle="--", linewidth=1)
        y = marked.rel_l2 if math.isfinite(marked.rel_l2) and marked.rel_l2 > 0 else floor
        ax.annotate(f"{mark_label}: {marked.name}\nrel_l2 {marked.rel_l2:.3g}", xy=(mi, y), xytext=(0.1, 0.3),
                    textcoords="axes fraction", fontsize=9, color=FAIL_COLOR,
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": FAIL_COLOR, "alpha": 0.9},
                    arrowprops={"arrowstyle": "->", "color": FAIL_COLOR})
    handles, labels = ax.get_legend_handles_labels()
    handles += [plt.Line2D([], [], marker="o", linestyle="", color=PASS_COLOR),
                plt.Line2D([], [], marker="o", linestyle="", color=FAIL_COLOR)]
    labels += ["within tolerance", "outside tolerance"]
    if any(p.status for p in points):
        ax.legend(handles, labels, fontsize=8, loc="lower right", framealpha=0.9)

    # The zoom: the marked checkpoint's layer (else the one with the largest error), with the two
    # checkpoints before it, one labelled tick per op.
    focus = marked if marked is not None else max(points, key=lambda p: p.rel_l2 if math.isfinite(p.rel_l2) else math.inf)
    fi = next(i for i, p in enumerate(points) if p.name == focus.name)
    if focus.layer >= 0:
        members = [i for i, p in enumerate(points) if p.layer == focus.layer]
        lo, hi = max(0, members[0] - 2), min(len(points), members[-1] + 2)
    else:
        lo, hi = max(0, fi - 12), min(len(points), fi + 3)
    sub = points[lo:hi]
    _plot_points(zoom, sub, list(range(len(sub))), floor)
    zoom.set_xticks(range(len(sub)))
    zoom.set_xticklabels([p.name for p in sub], rotation=40, ha="right", fontsize=8)
    for label, p in zip(zoom.get_xticklabels(), sub):
        if p.name == focus.name:
            label.set_color(FAIL_COLOR)
            label.set_fontweight("bold")
    zoom.axvline(fi - lo, color=FAIL_COLOR, linestyle="--", linewidth=1)
    where = f"layer {focus.layer}" if focus.layer >= 0 else "the last checkpoints"
    zoom.set_title(f"{where}, op by op ({mark_label if marked is not None else 'largest error'}: {focus.name})",
                   fontsize=10)
    zoom.set_ylabel("relative L2 error")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_layer_errors(errors: "OrderedDict[str, dict[int, float]]", title: str, path: str,
                      marked: tuple[str, int] | None = None) -> None:
    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=110)
    cmap = plt.get_cmap("tab20")
    floor = None
    for i, (kind, layers) in enumerate(errors.items()):
        xs = sorted(layers)
        ys = [layers[x] for x in xs]
        positive = [y for y in ys if 0 < y < math.inf]
        if positive:
            floor = min(positive) if floor is None else min(floor, min(positive))
        ax.plot(xs, ys, marker="os^D"[i % 4], markersize=3, linewidth=1.3, linestyle=("-", "--", "-.", ":")[i % 4],
                color=cmap(i % 20), label=kind)
    if floor is not None:
        ax.set_yscale("log")
    if marked is not None:
        name, layer = marked
        ax.axvline(layer, color=FAIL_COLOR, linestyle="--", linewidth=1)
        ax.text(layer, 1.0, f" {name}", transform=ax.get_xaxis_transform(), color=FAIL_COLOR, fontsize=9,
                va="bottom", ha="left")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error  ||engine - reference|| / ||reference||")
    ax.set_title(title, fontsize=11, pad=16 if marked is not None else 6)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(ncol=1, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def token_by_channel(values: np.ndarray, layout: str) -> tuple[np.ndarray, str, str]:
    """A 2-D (rows, channels) view: rows are tokens (T) or cache positions (S), the rest are channels."""
    dims = layout.split(",") if layout else []
    if values.ndim == 1:
        return values.reshape(1, -1), "-", dims[0] if dims else "channel"
    row = next((i for i, d in enumerate(dims) if d in schema.STEP_DIMS), 0) if len(dims) == values.ndim else 0
    moved = np.moveaxis(values, row, 0)
    rest = [d for i, d in enumerate(dims) if i != row] if len(dims) == values.ndim else ["channel"]
    return moved.reshape(moved.shape[0], -1), (dims[row] if dims else "row"), "·".join(rest)


MAX_COLUMNS = 2048  # wider checkpoints (logits, FFN) are shown as the max over blocks of columns


def plot_heatmap(engine: Dump, reference: Dump, name: str, step: int, path: str, note: str = "") -> None:
    info = reference.info(name, step)
    a, b = engine.get(name, step).astype(np.float64), reference.get(name, step).astype(np.float64)
    if a.shape != b.shape:
        raise DumpFormatError(engine.path, f"shape {a.shape} differs from the reference's {b.shape}", name)
    diff, row_dim, col_dims = token_by_channel(np.abs(a - b), info.layout)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on either side: as bad as it gets
    n_cols, block = diff.shape[1], 1
    if n_cols > MAX_COLUMNS:
        block = math.ceil(n_cols / MAX_COLUMNS)
        padded = np.pad(diff, ((0, 0), (0, block * math.ceil(n_cols / block) - n_cols)))
        diff = padded.reshape(diff.shape[0], -1, block).max(axis=2)
    fig, ax = plt.subplots(figsize=(13, max(3.5, min(9.0, 2.0 + 0.3 * diff.shape[0]))), dpi=110)
    positive = diff[np.isfinite(diff) & (diff > 0)]
    # Exact elements (|a-b| = 0, masked) pale green; NaN / Inf (over the top) cyan.
    cmap = plt.get_cmap("magma").with_extremes(bad="#c8e6c9", over="#00e5ff")
    shown = np.ma.masked_where(diff == 0, diff)
    # x in the checkpoint's own column indices, also when blocks of columns are pooled.
    extent = (-0.5, block * diff.shape[1] - 0.5, diff.shape[0] - 0.5, -0.5)
    if positive.size:
        lo, hi = positive.min(), positive.max()
        norm = LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, extent=extent)
    else:
        im = ax.imshow(np.ma.masked_all(diff.shape), aspect="auto", interpolation="nearest", cmap=cmap, extent=extent)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    bar = fig.colorbar(im, ax=ax, extend="max" if np.isinf(diff).any() else "neither")
    bar.set_label("|engine - reference| (log)" + ("; cyan: NaN/Inf" if np.isinf(diff).any() else ""))
    # Head boundaries on the channel axis of per-head checkpoints.
    rest = col_dims.split("·")
    if len(rest) == 2 and block == 1:
        letters = info.layout.split(",")
        n_heads, width = a.shape[letters.index(rest[0])], a.shape[letters.index(rest[1])]
        step_h = max(1, math.ceil(n_heads / 24))
        ax.set_xticks([h * width - 0.5 for h in range(0, n_heads, step_h)])
        ax.set_xticklabels([f"{rest[0]}{h}" for h in range(0, n_heads, step_h)], fontsize=8, ha="left")
        for h in range(1, n_heads):
            ax.axvline(h * width - 0.5, color="white", linewidth=0.4, alpha=0.6)
        ax.set_xlabel(f"columns ({col_dims}): {n_heads} {rest[0]} blocks of {width} {rest[1]}")
    else:
        ax.set_xlabel(f"columns ({col_dims})" + (f", max over blocks of {block} columns" if block > 1 else ""))
    ax.set_ylabel(f"{row_dim} (row)")
    pale = "pale green: exact" if (diff == 0).any() else ""
    ax.set_title(f"{name}, step {step}{(' - ' + note) if note else ''}: |engine - reference|"
                 f" ({engine.meta.get(attr.backend)}/{engine.meta.get(attr.precision)} vs"
                 f" {reference.meta.get(attr.backend)}/{reference.meta.get(attr.precision)})"
                 + (f"\n{pale}" if pale else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def worst_checkpoint(engine: Dump, reference: Dump, step: int) -> str:
    """The checkpoint of the step with the largest relative error (the first of equals)."""
    points = step_points(engine, reference, step)
    return max(points, key=lambda p: p.rel_l2 if not math.isnan(p.rel_l2) else math.inf).name if points else ""


# --- command line ---------------------------------------------------------------------------------

def run_pairs(path: str) -> list[tuple[str, str, str]]:
    """(label, engine, reference) of a run directory: DIR itself, else DIR/logic and DIR/precision."""
    pairs = []
    for label, d in (("", path), ("logic", os.path.join(path, "logic")), ("precision", os.path.join(path, "precision"))):
        e, r = os.path.join(d, "engine.h5"), os.path.join(d, "reference.h5")
        if os.path.isfile(e) and os.path.isfile(r):
            pairs.append((label, e, r))
            if not label:
                break
    if not pairs:
        raise DumpFormatError(path, "a directory without engine.h5 and reference.h5 (nor logic/ or precision/ "
                                    "holding them)")
    return pairs


def plot_pair(engine_path: str, reference_path: str, out: str, step: int | None, heatmaps: list[str],
              report: dict | None) -> list[str]:
    written = []
    with open_dump(engine_path) as engine, open_dump(reference_path) as reference:
        first = first_divergence(report)
        if step is None:
            step = first[1] if first else 0
        if step not in reference.steps() or step not in engine.steps():
            raise DumpFormatError(reference_path, f"step {step} is not in both dumps")
        os.makedirs(out, exist_ok=True)
        points = step_points(engine, reference, step, report)
        if not points:
            raise DumpFormatError(reference_path, f"step {step}: no float checkpoint both dumps hold")
        marked, label = None, ""
        if first and first[1] == step:
            marked, label = next((p for p in points if p.name == first[0]), None), "first divergence"
        elif report is not None:
            marked, label = next((p for p in points if p.failed), None), "first failure of the step"
        else:
            marked, label = largest_jump(points), "largest jump"
        model = os.path.basename(str(reference.meta.get(attr.model_path, "")))
        pair = (f"{engine.meta.get(attr.backend)}/{engine.meta.get(attr.precision)} engine vs "
                f"{reference.meta.get(attr.backend)}/{reference.meta.get(attr.precision)} reference")
        path = os.path.join(out, f"errors_by_op_step{step}.png")
        plot_errors_by_op(points, marked, label, f"{model}: relative error of each checkpoint, step {step} ({pair})",
                          path)
        written.append(path)
        errors = layer_errors(engine, reference, step, points)
        if errors:
            path = os.path.join(out, f"rel_l2_by_layer_step{step}.png")
            plot_layer_errors(errors, f"{model}: relative error by layer, step {step} ({pair})", path,
                              (marked.name, marked.layer) if marked is not None and marked.layer >= 0 else None)
            written.append(path)
        if heatmaps:
            chosen = [(name, "") for name in heatmaps]
        elif marked is not None:
            chosen = [(marked.name, label)]
        else:
            chosen = [(worst_checkpoint(engine, reference, step), "largest error")]
        for name, note in chosen:
            path = os.path.join(out, f"heatmap_{name}_step{step}.png")
            plot_heatmap(engine, reference, name, step, path, note)
            written.append(path)
    return written


def is_sweep_report(path: str) -> dict | None:
    """The JSON of `diffrun sweep --report-json` at path, or None for anything else."""
    if not path.endswith(".json") or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpFormatError(path, f"not a JSON report: {e}") from None
    return report if isinstance(report, dict) and "sweep_version" in report else None


def plot_sweep(report: dict, out: str, worst: int = 5) -> list[str]:
    """The sweep's KL distribution and, for its worst prompts, KL against the step (see the module's doc)."""
    os.makedirs(out, exist_ok=True)
    prompts = report.get("prompts", [])
    kls = [t["kl"] for p in prompts for t in p["tokens"] if t["kl"] is not None]
    s = report.get("summary", {})
    title = f"{os.path.basename(report.get('model', ''))}: {report.get('pair', '')}"
    if not report.get("complete", True):
        title += " (INCOMPLETE sweep)"
    written = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    positive = [k for k in kls if k > 0]
    zeros = len(kls) - len(positive)
    if positive:
        lo, hi = min(positive), max(positive)
        bins = np.logspace(math.log10(lo), math.log10(hi) + 1e-9, 40) if hi > lo else 10
        ax.hist(positive, bins=bins, color=PASS_COLOR)
        ax.set_xscale("log")
        for key, style in (("kl_mean", "-"), ("kl_median", "--"), ("kl_p99", ":"), ("kl_max", "-.")):
            v = s.get(key)
            if v and v > 0:
                ax.axvline(v, color=BOUND_COLOR, linestyle=style, label=f"{key[3:]} {v:.3g}")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "every token's KL is 0", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("KL(reference || engine), nats, per generated token")
    ax.set_ylabel("tokens")
    ax.set_title(f"{title}\n{len(kls)} tokens of {len(prompts)} prompts; {zeros} exactly 0 (not shown)", fontsize=9)
    path = os.path.join(out, "sweep_kl_distribution.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    order = sorted(prompts, key=lambda p: -(p.get("max_kl") or 0))[:worst]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    floor = min(positive) / 10 if positive else 1e-20
    for p in order:
        steps = [t["step"] for t in p["tokens"]]
        vals = [max(t["kl"] if t["kl"] is not None else float("nan"), floor) for t in p["tokens"]]
        (line,) = ax.plot(steps, vals, marker=".", label=p["id"])
        bad = [(st, v) for st, v, t in zip(steps, vals, p["tokens"]) if t["bad"]]
        if bad:
            ax.scatter([b[0] for b in bad], [b[1] for b in bad], color="black", marker="x", zorder=3, s=30)
    ax.set_yscale("log")
    ax.set_xlabel("step (0: the prefill's last token)")
    ax.set_ylabel("KL, nats")
    ax.set_title(f"{title}\nthe {len(order)} worst prompts by max KL; x: outside the result_output rule", fontsize=9)
    if order:
        ax.legend(fontsize=7)
    path = os.path.join(out, "sweep_kl_by_position.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffrun.plot", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", help="engine dump (side a), a diffrun run's --out directory, or a sweep's JSON report")
    p.add_argument("reference", nargs="?", help="reference dump (side b); absent with a run directory")
    p.add_argument("--out", default="diffrun-plots", help="directory for the PNGs (default diffrun-plots)")
    p.add_argument("--step", type=int, default=None,
                   help="step to plot (default: the first divergence's, else 0, the prefill)")
    p.add_argument("--heatmap", action="append", default=[], metavar="NAME",
                   help="checkpoint for a |a-b| heatmap (repeatable; default: the first divergence)")
    p.add_argument("--report", metavar="JSON", help="diffrun's JSON report of the pair (--report-json)")
    p.add_argument("--diffrun", metavar="PATH", help="the diffrun executable that compares when no --report is given")
    args = p.parse_args(argv)
    try:
        sweep = is_sweep_report(args.engine) if args.reference is None else None
        if sweep is not None:
            for path in plot_sweep(sweep, args.out):
                print(path)
            return 0
        if args.reference is None:
            if not os.path.isdir(args.engine):
                raise DumpFormatError(args.engine, "give the reference dump too, or a run's --out directory")
            pairs = run_pairs(args.engine)
        else:
            pairs = [("", args.engine, args.reference)]
        given = None
        if args.report:
            try:
                with open(args.report) as f:
                    given = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise DumpFormatError(args.report, f"not a diffrun JSON report: {e}") from None
        binary = None if given is not None else find_diffrun(args.diffrun)
        if given is None and binary is None:
            print("diffrun.plot: no diffrun executable (--diffrun, $DIFFRUN_BIN, PATH) and no --report: errors computed "
                  "here, without tolerances; the heatmap shows the largest jump, not the first divergence",
                  file=sys.stderr)
        written = []
        for label, engine_path, reference_path in pairs:
            report = None
            if given is not None:
                report = pair_report(given, engine_path)
            elif binary is not None:
                try:
                    report = run_compare(binary, engine_path, reference_path)
                except RuntimeError as e:
                    print(f"diffrun.plot: {binary} compare could not compare ({e}); errors computed here",
                          file=sys.stderr)
            out = os.path.join(args.out, label) if label else args.out
            written += plot_pair(engine_path, reference_path, out, args.step, args.heatmap, report)
    except DumpFormatError as e:
        print(f"diffrun.plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
