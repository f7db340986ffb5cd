"""diffrun.metrics: hand-worked values, and agreement with the C++ library's JSON report on the same dumps."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from diffrun import metrics

# KL of two nearly equal distributions is a sum of cancelling terms: near 0 it agrees to ~1e-14 absolute.
KL_ABS = 1e-13


def test_hand_worked_values():
    m = metrics.tensor_metrics(np.array([3.0, 5.0], np.float32), np.array([3.0, 4.0], np.float32))
    assert m["max_abs"] == 1.0 and m["mean_abs"] == 0.5
    assert m["rel_l2"] == pytest.approx(0.2, rel=1e-15)
    assert m["nmse"] == pytest.approx(0.04, rel=1e-15)
    assert m["cosine"] == pytest.approx(29.0 / (math.sqrt(34.0) * 5.0), rel=1e-15)
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(25.0), rel=1e-15)
    assert m["worst"]["flat"] == 1


def test_tolerance_fraction_and_worst_coordinates():
    b = np.array([1.0, 10.0, 100.0], np.float32)
    m = metrics.tensor_metrics(b + np.float32(0.25), b, atol=0.0, rtol=0.05)
    assert m["n_fail"] == 1 and m["fail_frac"] == pytest.approx(1 / 3)
    assert m["min_atol"] == 0.25 and m["min_rtol"] == 0.25 and m["worst"]["flat"] == 0
    ref = np.ones((2, 3, 4), np.float32)
    eng = ref.copy()
    eng[1, 2, 3] = 2.0
    assert metrics.tensor_metrics(eng, ref, "T,H,Dh")["worst"]["coords"] == {"T": 1, "H": 2, "Dh": 3}
    flat = metrics.tensor_metrics(eng.reshape(2, 12), ref.reshape(2, 12), "T,H*Dh", {"H": 3, "Dh": 4})
    assert flat["worst"]["coords"] == {"T": 1, "H": 2, "Dh": 3}


def test_worst_row_head_and_channel():
    ref = np.ones((4, 3, 2), np.float32)
    eng = ref.copy()
    eng[2, 1, :] = 1.5  # head 1 of token 2
    m = metrics.tensor_metrics(eng, ref, "T,H,Dh")
    assert m["worst_row"]["dim"] == "T" and m["worst_row"]["index"] == 2
    assert m["worst_row"]["rel_l2"] == pytest.approx(math.sqrt(0.5 / 6), rel=1e-12)
    assert m["worst_head"] == {"dim": "H", "index": 1, "rel_l2": pytest.approx(math.sqrt(0.5 / 8), rel=1e-12)}
    assert m["worst_channel"]["dim"] == "Dh"
    cache = metrics.tensor_metrics(eng.reshape(4, 6), ref.reshape(4, 6), "S,Hkv*Dh", {"Hkv": 3, "Dh": 2})
    assert cache["worst_row"]["dim"] == "S" and cache["worst_head"]["dim"] == "Hkv"
    assert metrics.tensor_metrics(eng.ravel(), ref.ravel())["worst_row"] is None


def test_non_finite():
    m = metrics.tensor_metrics(np.array([1.0, np.nan, 3.0], np.float32), np.array([1.0, 2.0, 3.0], np.float32))
    assert m["nonfinite_mismatch"] == 1 and m["n_fail"] == 1 and m["nan_engine"] == 1
    assert m["worst"]["flat"] == 1
    # Undefined over non-finite data, as in the C++ report (null there).
    assert all(math.isnan(m[k]) for k in ("rel_l2", "cosine", "max_abs", "min_atol", "sqnr_db"))
    same = metrics.tensor_metrics(np.array([np.nan, np.inf], np.float32), np.array([np.nan, np.inf], np.float32))
    assert same["nonfinite_mismatch"] == 0 and same["worst"] is None and math.isnan(same["rel_l2"])


def test_logits():
    b = np.array([[5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]], np.float32)
    a = np.array([[5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 5, 4]], np.float32)
    lm = metrics.logit_metrics(a, b)
    assert lm["argmax_engine"] == [0, 4] and lm["argmax_reference"] == [0, 5]
    assert lm["top1"] == 0.5 and lm["top5_overlap"] == 1.0 and lm["kl"][0] == 0.0
    pb = np.exp(b[1].astype(np.float64)) / np.exp(b[1].astype(np.float64)).sum()
    pa = np.exp(a[1].astype(np.float64)) / np.exp(a[1].astype(np.float64)).sum()
    assert lm["kl"][1] == pytest.approx(float(np.sum(pb * np.log(pb / pa))), rel=1e-12)


def _number(v):
    if v is None:  # the C++ report writes an undefined metric as null
        return math.nan
    return float(v) if isinstance(v, str) else v


def _close(x, y, what, abs_tol=1e-15):
    x, y = _number(x), _number(y)
    if isinstance(x, float) and isinstance(y, float) and not (math.isfinite(x) and math.isfinite(y)):
        assert (math.isnan(x) and math.isnan(y)) or x == y, what
        return
    # ~1e-9 relative; near zero the summation order decides the last bits (abs_tol).
    assert abs(x - y) <= 1e-9 * max(abs(x), abs(y)) + abs_tol, f"{what}: {x!r} vs {y!r}"


@pytest.fixture(scope="module")
def report_pair(tmp_path_factory):
    """A real f32-vs-f64 run on a tiny fixture, an engine dump edited with h5py (a NaN, a local bug),
    and the C++ JSON report of that pair under element tolerances."""
    binary = os.environ.get("DIFFRUN_BIN")
    fixtures = os.environ.get("DIFFRUN_FIXTURE_DIR")
    if not binary or not fixtures:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_metrics_py)")
    model = Path(fixtures) / "tiny-qwen2-q4_k.gguf"
    out = tmp_path_factory.mktemp("pair")
    subprocess.run([binary, "--model", str(model), "--tokens", "1,2,3,4,5", "--steps", "2", "--engine", "cpu",
                    "--out", str(out), "--no-color"], check=True, capture_output=True)
    with h5py.File(out / "engine.h5", "r+") as f:
        q = f["step_0000/Qcur-0"]
        v = q[()]
        v.flat[7] = np.nan
        q[...] = v
        up = f["step_0001/ffn_up-1"]
        up[...] = up[()] * np.float32(1.01)
    tol = out / "tol.json"
    tol.write_text(json.dumps({"rules": [{"match": "result_output", "atol": 1e-6, "rtol": 1e-4, "max_fail_frac": 1, "reason": "logits"}],
                               "default": {"atol": 1e-7, "rtol": 1e-6, "max_rel_l2": 1e-5, "reason": "t"}}))
    report = out / "report.json"
    r = subprocess.run([binary, "compare", str(out / "engine.h5"), str(out / "reference.h5"), "--tolerances",
                        str(tol), "--report-json", str(report), "--no-color"], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    return out, json.loads(report.read_text())


def test_agrees_with_the_cpp_report(report_pair):
    out, report = report_pair
    by_key = {(c["step"], c["name"]): c for c in report["checkpoints"] if c["metrics"] is not None}
    tolerances = {name: (c["metrics"]["atol"], c["metrics"]["rtol"]) for (_, name), c in by_key.items()}
    rows = metrics.compare(str(out / "engine.h5"), str(out / "reference.h5"), lambda n: tolerances[n])
    assert len(rows) == len(by_key) > 0
    checked = 0
    for row in rows:
        cpp = by_key[(row["step"], row["name"])]["metrics"]
        py = row["metrics"]
        for key, value in py.items():
            if key == "worst":
                assert (value is None) == (cpp["worst"] is None)
                if value is not None:
                    assert value["flat"] == cpp["worst"]["flat"] and value["coords"] == cpp["worst"]["coords"]
                    for k in ("engine", "reference", "abs_err"):
                        _close(value[k], cpp["worst"][k], f"{row['name']} worst.{k}")
            elif key in ("worst_row", "worst_head", "worst_channel"):
                assert (value is None) == (cpp[key] is None), (row["name"], key)
                if value is not None:
                    assert (value["dim"], value["index"]) == (cpp[key]["dim"], cpp[key]["index"]), (row["name"], key)
                    _close(value["rel_l2"], cpp[key]["rel_l2"], f"{row['name']} {key}")
            elif key == "logits":
                assert (value is None) == (cpp["logits"] is None), row["name"]
                if value is not None:
                    for k, v in value.items():
                        if isinstance(v, list):
                            assert len(v) == len(cpp["logits"][k])
                            for i, (x, y) in enumerate(zip(v, cpp["logits"][k])):
                                _close(x, y, f"{row['name']} logits.{k}[{i}]", KL_ABS)
                        else:
                            _close(v, cpp["logits"][k], f"{row['name']} logits.{k}", KL_ABS)
            else:
                _close(value, cpp[key], f"step {row['step']} {row['name']} {key}")
            checked += 1
    assert checked > 100
    # The edits are where the report says they are.
    first = report["first_divergence"]
    assert (first["step"], first["name"]) == (0, "Qcur-0")
    assert by_key[(0, "Qcur-0")]["metrics"]["nonfinite_mismatch"] == 1
    assert by_key[(0, "Qcur-0")]["metrics"]["rel_l2"] is None
    assert report["first_nonfinite"]["name"] == "Qcur-0"
    assert by_key[(1, "ffn_up-1")]["metrics"]["rel_l2"] == pytest.approx(0.01, rel=1e-3)
