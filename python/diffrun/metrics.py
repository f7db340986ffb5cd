"""The metrics of diffrun's comparison library (diff/metrics.cpp) in numpy, on two dumps or two arrays.

    from diffrun import metrics
    m = metrics.tensor_metrics(engine_array, reference_array, layout="T,H,Dh", dims={"H": 9, "Dh": 64})
    rows = metrics.compare("run/engine.h5", "run/reference.h5")   # every common checkpoint, in order

Side a is the engine, side b the reference; everything is computed in float64. The keys are those of
the JSON report's "metrics" objects (diff/report_json.cpp), and the values agree with it to ~1e-12.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np

from . import schema
from .dump import Dump, open as open_dump

ElementTolerance = Callable[[str], "tuple[float, float]"]


def dim_sizes(meta: dict) -> dict[str, int]:
    """Sizes of the layout letters from a dump's root attributes."""
    return {letter: int(meta[k]) for letter, k in schema.DIMS.items() if k and k in meta}


def layout_coordinates(flat: int, shape: tuple[int, ...], layout: str, dims: dict[str, int]) -> dict[str, int]:
    """Row-major index to coordinates named by the layout letters; "X*Y" is split when the sizes fit."""
    index = list(np.unravel_index(flat, shape)) if shape else []
    parts = layout.split(",") if layout else []
    if len(parts) != len(shape):
        return {f"d{i}": int(v) for i, v in enumerate(index)}
    coords: dict[str, int] = {}
    for part, extent, idx in zip(parts, shape, index):
        factors = part.split("*")
        sizes = _factor_sizes(factors, extent, dims) if len(factors) > 1 else None
        if not sizes:
            coords[part] = int(idx)
            continue
        for f, v in zip(factors, np.unravel_index(int(idx), sizes)):
            coords[f] = int(v)
    return coords


def _factor_sizes(factors: list[str], extent: int, dims: dict[str, int]) -> list[int] | None:
    known = [dims.get(f, 0) for f in factors]
    unknown = [i for i, s in enumerate(known) if s <= 0]
    if len(unknown) > 1:
        return None
    product = math.prod(s for s in known if s > 0)
    if unknown:
        if product <= 0 or extent % product:
            return None
        known[unknown[0]] = extent // product
    elif product != extent:
        return None
    return known


def _named_dims(shape: tuple[int, ...], layout: str, dims: dict[str, int]) -> list[tuple[str, int]]:
    """The layout's letters with their extents, "X*Y" split where the sizes fit; [] when the layout
    does not name every stored dimension."""
    parts = layout.split(",") if layout else []
    if len(parts) != len(shape):
        return []
    out = []
    for part, extent in zip(parts, shape):
        factors = part.split("*")
        sizes = _factor_sizes(factors, extent, dims) if len(factors) > 1 else None
        out.extend(zip(factors, sizes) if sizes else [(part, extent)])
    return out


def _slice_worst(x: np.ndarray, y: np.ndarray, named: list[tuple[str, int]]) -> dict:
    """worst_row (T, else a leading S), worst_head (H/Hkv), worst_channel (the last dimension): the
    largest rel L2 over one index of that axis, as diff::compute_metrics defines them."""
    out = {"worst_row": None, "worst_head": None, "worst_channel": None}
    letters = [d for d, _ in named]
    if not named or math.prod(e for _, e in named) != x.size:
        return out
    row = letters.index(schema.ROW_DIM) if schema.ROW_DIM in letters else (0 if letters[0] == schema.CACHE_DIM else -1)
    head = next((i for i, d in enumerate(letters) if d in schema.HEAD_DIMS), -1)
    channel = len(named) - 1 if len(named) >= 2 and len(named) - 1 not in (row, head) else -1
    finite = np.isfinite(x) & np.isfinite(y)
    shape = tuple(e for _, e in named)
    d2 = np.where(finite, (x - y) ** 2, 0.0).reshape(shape)
    b2 = np.where(finite, y * y, 0.0).reshape(shape)
    for key, axis in (("worst_row", row), ("worst_head", head), ("worst_channel", channel)):
        if axis < 0:
            continue
        other = tuple(i for i in range(len(shape)) if i != axis)
        sd, sb = d2.sum(axis=other), b2.sum(axis=other)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(sb > 0, np.sqrt(sd) / np.sqrt(sb), np.where(sd > 0, math.inf, 0.0))
        j = int(np.argmax(rel))
        out[key] = {"dim": letters[axis], "index": j, "rel_l2": float(rel[j]) if finite.all() else math.nan}
    return out


def tensor_metrics(a: np.ndarray, b: np.ndarray, layout: str = "", dims: dict[str, int] | None = None,
                   atol: float = 0.0, rtol: float = 0.0) -> dict:
    """max_abs, mean_abs, rel_l2, nmse, cosine, sqnr_db, n_fail, fail_frac, NaN/Inf counts, worst element,
    min_atol and min_rtol, as diff::compute_metrics defines them."""
    shape = tuple(b.shape)
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    fx, fy = np.isfinite(x), np.isfinite(y)
    both = fx & fy
    same_nonfinite = ~both & ((np.isnan(x) & np.isnan(y)) | (np.isinf(x) & np.isinf(y) & (np.sign(x) == np.sign(y))))
    mismatch = ~both & ~same_nonfinite
    xf, yf = x[both], y[both]
    d = np.abs(xf - yf)
    sum_d2, sum_a2, sum_b2 = float(np.sum(d * d)), float(np.sum(xf * xf)), float(np.sum(yf * yf))
    sum_ab = float(np.sum(xf * yf))
    bound = atol + rtol * np.abs(yf)
    n_fail = int(np.count_nonzero(d > bound)) + int(np.count_nonzero(mismatch))
    n = x.size
    m: dict = {"n": n}
    m["max_abs"] = float(d.max()) if d.size else 0.0
    m["mean_abs"] = float(d.sum() / d.size) if d.size else 0.0
    if sum_b2 > 0:
        m["rel_l2"] = math.sqrt(sum_d2) / math.sqrt(sum_b2)
        m["nmse"] = sum_d2 / sum_b2
    else:
        m["rel_l2"] = m["nmse"] = math.inf if sum_d2 > 0 else 0.0
    if sum_a2 == 0 and sum_b2 == 0:
        m["cosine"] = 1.0
    elif sum_a2 == 0 or sum_b2 == 0:
        m["cosine"] = 0.0
    else:
        m["cosine"] = sum_ab / math.sqrt(sum_a2 * sum_b2)
    if sum_d2 == 0:
        m["sqnr_db"] = math.inf
    else:
        m["sqnr_db"] = 10.0 * math.log10(sum_b2 / sum_d2) if sum_b2 > 0 else -math.inf
    m["n_fail"] = n_fail
    m["fail_frac"] = n_fail / n if n else 0.0
    m["atol"], m["rtol"] = float(atol), float(rtol)
    m["nan_engine"], m["inf_engine"] = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    m["nan_reference"], m["inf_reference"] = int(np.isnan(y).sum()), int(np.isinf(y).sum())
    m["nonfinite_mismatch"] = int(mismatch.sum())
    m["min_atol"] = math.inf if mismatch.any() else m["max_abs"]
    over = d > atol
    if mismatch.any():
        m["min_rtol"] = math.inf
    elif over.any():
        yb = np.abs(yf[over])
        m["min_rtol"] = math.inf if (yb == 0).any() else float(np.max((d[over] - atol) / yb))
    else:
        m["min_rtol"] = 0.0
    # Worst element: largest |a-b| / (atol + rtol|b|) (or |a-b| where that is 0); non-finite mismatches
    # score inf; the first of equals wins.
    score = np.full(n, -1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        score[both] = np.where(bound > 0, d / np.where(bound > 0, bound, 1.0), d)
    score[mismatch] = math.inf
    if n and score.max() >= 0:
        flat = int(np.argmax(score))
        err = abs(x[flat] - y[flat]) if both[flat] else math.inf
        m["worst"] = {"flat": flat, "coords": layout_coordinates(flat, shape, layout, dims or {}),
                      "engine": float(x[flat]), "reference": float(y[flat]), "abs_err": float(err)}
    else:
        m["worst"] = None
    m.update(_slice_worst(x, y, _named_dims(shape, layout, dims or {})))
    if not (fx.all() and fy.all()):
        # Undefined over non-finite data (JSON null), never the finite pairs' 0 or 1.
        for key in ("max_abs", "mean_abs", "rel_l2", "nmse", "cosine", "sqnr_db", "min_atol", "min_rtol"):
            m[key] = math.nan
    return m


def _log_softmax(row: np.ndarray) -> np.ndarray | None:
    if not np.isfinite(row).all():
        return None
    mx = row.max()
    return row - (mx + math.log(float(np.sum(np.exp(row - mx)))))


def _top_k(row: np.ndarray, k: int) -> np.ndarray:
    idx = np.flatnonzero(np.isfinite(row))
    order = np.lexsort((idx, -row[idx]))  # value descending, then index ascending
    return idx[order[:k]]


def _argmax(row: np.ndarray) -> int:
    finite = np.isfinite(row)
    if not finite.any():
        return -1
    return int(np.argmax(np.where(finite, row, -np.inf)))


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict:
    """Logits [T, V]: top-1 agreement, top-5 overlap and KL(softmax(b) || softmax(a)) per token."""
    x = np.asarray(a, dtype=np.float64).reshape(a.shape[0], -1)
    y = np.asarray(b, dtype=np.float64).reshape(b.shape[0], -1)
    rows, vocab = y.shape
    k = min(5, vocab)
    am_a, am_b, overlap, kl = [], [], [], []
    for t in range(rows):
        am_a.append(_argmax(x[t]))
        am_b.append(_argmax(y[t]))
        overlap.append(len(set(_top_k(x[t], 5).tolist()) & set(_top_k(y[t], 5).tolist())) / k)
        la, lb = _log_softmax(x[t]), _log_softmax(y[t])
        kl.append(math.nan if la is None or lb is None else max(float(np.sum(np.exp(lb) * (lb - la))), 0.0))
    out = {"tokens": rows, "top1": float(np.mean([p == q for p, q in zip(am_a, am_b)])) if rows else 0.0,
           "top5_overlap": float(np.mean(overlap)) if rows else 0.0, "kl_mean": float(np.mean(kl)) if rows else 0.0,
           "kl_max": max(kl, default=0.0), "kl": kl, "argmax_engine": am_a, "argmax_reference": am_b}
    if any(math.isnan(k) for k in kl):
        out["top1"] = out["top5_overlap"] = out["kl_mean"] = out["kl_max"] = math.nan
    return out


def compare(engine: str | Dump, reference: str | Dump, element_tolerance: ElementTolerance | None = None
            ) -> list[dict]:
    """Metrics of every checkpoint present in both dumps with the same shape: step 0 first, then the
    reference's execution order. element_tolerance(name) -> (atol, rtol), default (0, 0)."""
    return list(iter_compare(engine, reference, element_tolerance))


def iter_compare(engine: str | Dump, reference: str | Dump, element_tolerance: ElementTolerance | None = None
                 ) -> Iterator[dict]:
    e = engine if isinstance(engine, Dump) else open_dump(engine)
    r = reference if isinstance(reference, Dump) else open_dump(reference)
    dims = dim_sizes(r.meta)
    for step in r.steps():
        if step not in e.steps():
            continue
        engine_names = set(e.names(step))
        for name in r.names(step):
            info = r.info(name, step)
            if name not in engine_names or info.dtype.kind != "f" or e.info(name, step).shape != info.shape:
                continue
            atol, rtol = element_tolerance(name) if element_tolerance else (0.0, 0.0)
            a, b = e.get(name, step), r.get(name, step)
            m = tensor_metrics(a, b, info.layout, dims, atol, rtol)
            m["logits"] = logit_metrics(a, b) if name == "result_output" and b.ndim == 2 else None
            yield {"step": step, "name": name, "layer": info.layer, "layout": info.layout, "metrics": m}
