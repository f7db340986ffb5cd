"""diffrun.plot: PNGs from a pair of dumps (error by op and by layer, |a-b| heatmap) and its command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/setup installs it)")
import matplotlib.image as mpimg  # noqa: E402

from diffrun import plot  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKENS = "1,17,42,7,99,3,120,5,63"


def _run(out: Path, model: str, *extra: str) -> tuple[Path, Path]:
    binary = os.environ.get("DIFFRUN_BIN")
    fixtures = os.environ.get("DIFFRUN_FIXTURE_DIR")
    if not binary or not fixtures:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_diff_python)")
    r = subprocess.run([binary, "--model", str(Path(fixtures) / model), "--tokens", TOKENS, "--steps", "1",
                        "--engine", "cpu", "--out", str(out), "--no-color", *extra], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return out / "engine.h5", out / "reference.h5"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plot"), "tiny-llama-q8_0.gguf")


@pytest.fixture(scope="module")
def fault(tmp_path_factory):
    """RoPE base 10000 on a model of base 1e6: the first divergence is Qrope-0 at step 0."""
    d = tmp_path_factory.mktemp("fault")
    engine, reference = _run(d / "out", "tiny-qwen2-f32.gguf", "--inject", "rope_theta_10000",
                             "--report-json", str(d / "r.json"))
    report = json.loads((d / "r.json").read_text())
    assert (report["first_divergence"]["name"], report["first_divergence"]["step"]) == ("Qrope-0", 0)
    return engine, reference, d / "r.json"


def _image(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(path)


def test_plots_written_and_not_blank(pair, tmp_path):
    engine, reference = pair
    assert plot.main([str(engine), str(reference), "--out", str(tmp_path), "--heatmap", "kq_soft_max-1",
                      "--heatmap", "l_out-0"]) == 0
    for name in ("errors_by_op_step0.png", "rel_l2_by_layer_step0.png"):
        img = _image(tmp_path / name)
        assert img.shape[0] > 600 and img.shape[1] > 1200, img.shape
    for name in ("kq_soft_max-1", "l_out-0"):
        img = _image(tmp_path / f"heatmap_{name}_step0.png")
        assert img[..., :3].std() > 0.05  # a picture, not a blank canvas


def test_default_heatmap_is_the_first_divergence(fault, tmp_path):
    engine, reference, report = fault
    # diffrun compare is run for the verdict ($DIFFRUN_BIN) ...
    r = subprocess.run([sys.executable, "-m", "diffrun.plot", str(engine), str(reference), "--out", str(tmp_path / "a")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "python")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "a" / f) for f in
                                ("errors_by_op_step0.png", "rel_l2_by_layer_step0.png", "heatmap_Qrope-0_step0.png")]
    # ... or its JSON report is given; the points are diffrun's (status, bound), the first divergence marked.
    assert plot.main([str(engine), str(reference), "--out", str(tmp_path / "b"), "--report", str(report)]) == 0
    assert (tmp_path / "b" / "heatmap_Qrope-0_step0.png").exists()
    with plot.open_dump(engine) as e, plot.open_dump(reference) as ref:
        points = plot.step_points(e, ref, 0, json.loads(report.read_text()))
    names = [p.name for p in points]
    first = names.index("Qrope-0")
    assert all(p.status == "pass" for p in points[:first]) and points[first].failed
    assert points[first].bound and points[first].rel_l2 > 100 * points[first].bound
    heat = _image(tmp_path / "b" / "heatmap_Qrope-0_step0.png")
    assert heat[..., :3].std() > 0.05


def test_without_diffrun_the_largest_jump_is_shown(fault, tmp_path, monkeypatch, capsys):
    engine, reference, _ = fault
    monkeypatch.setattr(plot, "find_diffrun", lambda explicit=None: None)
    assert plot.main([str(engine), str(reference), "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "the heatmap shows the largest jump, not the first divergence" in captured.err
    assert (tmp_path / "heatmap_Qrope-0_step0.png").exists(), captured.out
    with plot.open_dump(engine) as e, plot.open_dump(reference) as ref:
        points = plot.step_points(e, ref, 0)
        assert plot.largest_jump(points).name == "Qrope-0"
        assert not any(p.status for p in points)  # no tolerances here


def test_diffrun_found_in_the_current_checkout(tmp_path, monkeypatch):
    """The README runs `python3 -m diffrun.plot` from the checkout, with the package installed elsewhere and diffrun
    not on PATH: build/cli/diffrun under the current directory is the comparison's executable."""
    built = tmp_path / "build" / "cli" / "diffrun"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    monkeypatch.delenv("DIFFRUN_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert plot.find_diffrun() == str(built)
    built.chmod(0o644)  # not executable: not taken
    assert plot.find_diffrun() != str(built)


def test_run_directory_with_two_pairs(fault, pair, tmp_path):
    run = tmp_path / "run"
    for sub, (engine, reference) in (("logic", fault[:2]), ("precision", pair)):
        (run / sub).mkdir(parents=True)
        (run / sub / "engine.h5").symlink_to(engine)
        (run / sub / "reference.h5").symlink_to(reference)
    assert plot.main([str(run), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "logic" / "heatmap_Qrope-0_step0.png").exists()
    assert (tmp_path / "plots" / "precision" / "errors_by_op_step0.png").exists()
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2


def test_layer_errors_and_default_heatmap(pair, tmp_path):
    import diffrun

    engine, reference = pair
    with diffrun.open(engine) as e, diffrun.open(reference) as r:
        errors = plot.layer_errors(e, r, 0)
        assert list(errors)[0] == "attn_norm" and set(errors["l_out"]) == {0, 1}
        assert all(0 <= v < 1e-4 for layers in errors.values() for v in layers.values())
        worst = plot.worst_checkpoint(e, r, 0)
    assert worst
    r = subprocess.run([sys.executable, "-m", "diffrun.plot", str(engine), str(reference), "--out",
                        str(tmp_path), "--step", "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO / "python")})
    assert r.returncode == 0, r.stderr
    assert any(line.startswith(str(tmp_path / "heatmap_")) for line in r.stdout.splitlines())


def test_token_by_channel_layouts():
    v = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    m, rows, cols = plot.token_by_channel(v, "T,H,Dh")
    assert m.shape == (2, 12) and rows == "T" and cols == "H·Dh"
    m, rows, cols = plot.token_by_channel(v, "H,T,S")
    assert m.shape == (3, 8) and rows == "T" and cols == "H·S"
    assert (m[1] == np.concatenate([v[0, 1], v[1, 1]])).all()


def test_bad_input_exits_2(tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_text("not hdf5")
    assert plot.main([str(bogus), str(bogus), "--out", str(tmp_path)]) == 2
    assert plot.main([str(bogus), str(bogus), "--out", str(tmp_path), "--report", str(bogus)]) == 2
    assert plot.main([str(bogus), str(bogus), "--out", str(tmp_path), "--diffrun", str(bogus)]) == 2


def test_sweep_report_plots(tmp_path):
    """A `diffrun sweep --report-json` report (the format cli/sweep.cpp writes): the KL histogram and KL by step."""
    report = {"sweep_version": 1, "model": "m.gguf", "pair": "cpu/f32 engine vs cpu/f64 reference", "complete": False,
              "summary": {"kl_mean": 2e-6, "kl_median": 1e-7, "kl_p99": 3e-5, "kl_max": 4e-5},
              "prompts": [{"id": f"p{i}", "max_kl": 4e-5 / (i + 1),
                           "tokens": [{"step": s, "kl": (0.0 if s == 0 else 1e-7 * (s + i)), "bad": s == 3 and i == 0}
                                      for s in range(5)]} for i in range(7)]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "plots"
    assert plot.main([str(path), "--out", str(out)]) == 0
    for name in ("sweep_kl_distribution.png", "sweep_kl_by_position.png"):
        png = out / name
        assert png.stat().st_size > 5000, name
        pixels = mpimg.imread(png)
        assert pixels.std() > 0.01, f"{name} is blank"
    # A dump-pair invocation still refuses a JSON that is not a sweep report.
    other = tmp_path / "x.json"
    other.write_text("{}")
    assert plot.main([str(other)]) == 2
