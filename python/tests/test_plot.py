"""diffrun.plot: PNGs from a pair of dumps (error by layer, |a-b| heatmap) and its command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from diffrun import plot

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    binary = os.environ.get("DIFFRUN_BIN")
    fixtures = os.environ.get("DIFFRUN_FIXTURE_DIR")
    if not binary or not fixtures:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_plot)")
    out = tmp_path_factory.mktemp("plot")
    subprocess.run([binary, "--model", str(Path(fixtures) / "tiny-llama-q8_0.gguf"), "--tokens", "1,2,3,4,5,6",
                    "--steps", "1", "--engine", "cpu", "--out", str(out), "--no-color"], check=True,
                   capture_output=True)
    return out / "engine.h5", out / "reference.h5"


def _image(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(path)


def test_plots_written_and_not_blank(pair, tmp_path):
    engine, reference = pair
    assert plot.main([str(engine), str(reference), "--out", str(tmp_path), "--heatmap", "kq_soft_max-1",
                      "--heatmap", "l_out-0"]) == 0
    layers = _image(tmp_path / "rel_l2_by_layer_step0.png")
    assert layers.shape[0] > 300 and layers.shape[1] > 600
    for name in ("kq_soft_max-1", "l_out-0"):
        img = _image(tmp_path / f"heatmap_{name}_step0.png")
        assert img[..., :3].std() > 0.05  # a picture, not a blank canvas


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


def test_bad_dump_exits_2(tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_text("not hdf5")
    assert plot.main([str(bogus), str(bogus), "--out", str(tmp_path)]) == 2
