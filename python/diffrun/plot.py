"""Plots of an engine dump against a reference dump, as PNGs.

    python -m diffrun.plot ENGINE.h5 REFERENCE.h5 --out plots [--step 0] [--heatmap NAME ...]

writes
    rel_l2_by_layer_step<k>.png   relative L2 error against layer, one line per checkpoint kind
    heatmap_<name>_step<k>.png    |engine - reference| of one checkpoint over (token x channel)
The default heatmap is the checkpoint with the largest relative error in the step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from .dump import Dump, DumpFormatError, open as open_dump  # noqa: E402
from .metrics import dim_sizes, tensor_metrics  # noqa: E402


def layer_errors(engine: Dump, reference: Dump, step: int) -> "OrderedDict[str, dict[int, float]]":
    """kind -> layer -> rel_l2 for the per-layer checkpoints of a step, kinds in execution order."""
    out: "OrderedDict[str, dict[int, float]]" = OrderedDict()
    engine_names = set(engine.names(step))
    dims = dim_sizes(reference.meta)
    for name in reference.names(step):
        info = reference.info(name, step)
        if info.layer < 0 or name not in engine_names or engine.info(name, step).shape != info.shape:
            continue
        m = tensor_metrics(engine.get(name, step), reference.get(name, step), info.layout, dims)
        out.setdefault(name.rsplit("-", 1)[0], {})[info.layer] = m["rel_l2"]
    return out


def plot_layer_errors(errors: "OrderedDict[str, dict[int, float]]", title: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(11, 6.5), dpi=110)
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
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error  ||engine - reference|| / ||reference||")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=2, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def token_by_channel(values: np.ndarray, layout: str) -> tuple[np.ndarray, str, str]:
    """A 2-D (rows, channels) view: rows are tokens (T) or cache positions (S), the rest are channels."""
    dims = layout.split(",") if layout else []
    if values.ndim == 1:
        return values.reshape(1, -1), "-", dims[0] if dims else "channel"
    row = next((i for i, d in enumerate(dims) if d in ("T", "S")), 0) if len(dims) == values.ndim else 0
    moved = np.moveaxis(values, row, 0)
    rest = [d for i, d in enumerate(dims) if i != row] if len(dims) == values.ndim else ["channel"]
    return moved.reshape(moved.shape[0], -1), (dims[row] if dims else "row"), "·".join(rest)


def plot_heatmap(engine: Dump, reference: Dump, name: str, step: int, path: str) -> None:
    info = reference.info(name, step)
    a, b = engine.get(name, step).astype(np.float64), reference.get(name, step).astype(np.float64)
    if a.shape != b.shape:
        raise DumpFormatError(engine.path, f"shape {a.shape} differs from the reference's {b.shape}", name)
    diff, row_dim, col_dims = token_by_channel(np.abs(a - b), info.layout)
    fig, ax = plt.subplots(figsize=(11, max(3.0, min(9.0, 1.5 + 0.35 * diff.shape[0]))), dpi=110)
    positive = diff[np.isfinite(diff) & (diff > 0)]
    if positive.size:
        shown = np.where(np.isfinite(diff), np.maximum(diff, positive.min()), positive.max())
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma",
                       norm=LogNorm(vmin=positive.min(), vmax=positive.max()))
    else:
        im = ax.imshow(diff, aspect="auto", interpolation="nearest", cmap="magma")
    fig.colorbar(im, ax=ax, label="|engine - reference|")
    ax.set_xlabel(f"channel ({col_dims})")
    ax.set_ylabel(f"{row_dim}")
    ax.set_title(f"{name}, step {step}: |engine - reference| ({engine.meta.get('backend')}/{engine.meta.get('precision')}"
                 f" vs {reference.meta.get('backend')}/{reference.meta.get('precision')})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def worst_checkpoint(engine: Dump, reference: Dump, step: int) -> str:
    """The checkpoint of the step with the largest relative error (the first of equals)."""
    best, best_err = "", -1.0
    engine_names = set(engine.names(step))
    for name in reference.names(step):
        info = reference.info(name, step)
        if info.dtype.kind != "f" or name not in engine_names or engine.info(name, step).shape != info.shape:
            continue
        err = tensor_metrics(engine.get(name, step), reference.get(name, step))["rel_l2"]
        if err > best_err:
            best, best_err = name, err
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffrun.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="engine dump (side a)")
    p.add_argument("reference", help="reference dump (side b)")
    p.add_argument("--out", default="diffrun-plots", help="directory for the PNGs (default diffrun-plots)")
    p.add_argument("--step", type=int, default=0, help="step to plot (default 0, the prefill)")
    p.add_argument("--heatmap", action="append", default=[], metavar="NAME",
                   help="checkpoint for a |a-b| heatmap (repeatable; default: the worst of the step)")
    args = p.parse_args(argv)
    try:
        with open_dump(args.engine) as engine, open_dump(args.reference) as reference:
            if args.step not in reference.steps() or args.step not in engine.steps():
                raise DumpFormatError(args.reference, f"step {args.step} is not in both dumps")
            os.makedirs(args.out, exist_ok=True)
            written = []
            errors = layer_errors(engine, reference, args.step)
            if errors:
                path = os.path.join(args.out, f"rel_l2_by_layer_step{args.step}.png")
                title = (f"{os.path.basename(str(reference.meta.get('model_path', '')))}: relative error by layer, "
                         f"step {args.step} ({engine.meta.get('precision')} engine vs "
                         f"{reference.meta.get('precision')} reference)")
                plot_layer_errors(errors, title, path)
                written.append(path)
            for name in args.heatmap or [worst_checkpoint(engine, reference, args.step)]:
                path = os.path.join(args.out, f"heatmap_{name}_step{args.step}.png")
                plot_heatmap(engine, reference, name, args.step, path)
                written.append(path)
    except DumpFormatError as e:
        print(f"diffrun.plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
