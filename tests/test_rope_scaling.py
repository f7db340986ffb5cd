"""Llama 3 RoPE scaling: the reference's Qrope/Krope on tiny-llama3rope against a numpy RoPE with the gguf package's factors, and bad rope_freqs refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import h5py
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from fixturegen import models  # noqa: E402

DIFFRUN = os.environ.get("DIFFRUN_BIN", str(REPO / "build/cli/diffrun"))
FIXTURE_DIR = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", str(REPO / "build/fixtures")))
FIXTURE = FIXTURE_DIR / "tiny-llama3rope-f32.gguf"


def rope_factors(path: Path) -> np.ndarray:
    r = gguf.GGUFReader(str(path))
    (t,) = [t for t in r.tensors if t.name == "rope_freqs.weight"]
    return np.asarray(t.data, dtype=np.float64).reshape(-1)


def numpy_rope_norm(x: np.ndarray, pos0: int, theta: float, factors: np.ndarray | None) -> np.ndarray:
    """x [T, H, Dh]; llama's NORM pairing (2i, 2i+1), angle pos · theta^(-2i/Dh) / factor_i (ggml_rope_ext)."""
    T, _, Dh = x.shape
    i = np.arange(Dh // 2)
    freq = theta ** (-2.0 * i / Dh)
    if factors is not None:
        freq = freq / factors
    angle = (pos0 + np.arange(T))[:, None, None] * freq[None, None, :]  # [T, 1, Dh/2]
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    assert FIXTURE.exists(), f"{FIXTURE} is missing: run scripts/gen_fixtures.py --out {FIXTURE_DIR}"
    out = tmp_path_factory.mktemp("rope")
    p = subprocess.run([DIFFRUN, "-m", str(FIXTURE), "--prompt", "hello world, the rope is scaled", "--steps", "2",
                        "--engine", "cpu", "--engine-precision", "f32", "--reference-precision", "f64",
                        "--checkpoints", "Qcur-*,Kcur-*,Qrope-*,Krope-*", "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return out / "reference.h5"


def test_factors_are_llama3s():
    f = rope_factors(FIXTURE)
    assert f.shape == (32,)
    assert f.min() == 1.0 and f.max() == 8.0 and np.any((f > 1) & (f < 8)), f


@pytest.mark.parametrize("step", [0, 1, 2])
@pytest.mark.parametrize("layer", [0, 1])
def test_reference_rope_matches_numpy(dump, step, layer):
    factors = rope_factors(FIXTURE)
    theta = models.TINY["tiny-llama"].rope_theta
    with h5py.File(dump) as f:
        n_prompt = len(f.attrs["token_ids"])
        g = f[f"step_{step:04d}"]
        pos0 = 0 if step == 0 else n_prompt + step - 1
        for before, after in ((f"Qcur-{layer}", f"Qrope-{layer}"), (f"Kcur-{layer}", f"Krope-{layer}")):
            x, y = np.asarray(g[before], dtype=np.float64), np.asarray(g[after], dtype=np.float64)
            assert x.ndim == 3 and x.shape == y.shape
            expected = numpy_rope_norm(x, pos0, theta, factors)
            assert rel_l2(y, expected) < 1e-6, (before, step)  # the dump stores f32: its rounding only
            # The factors matter: the unscaled rotation is far from what the reference did.
            assert rel_l2(y, numpy_rope_norm(x, pos0, theta, None)) > 1e-3, (before, step)


def write_variant(path: Path, factors: np.ndarray | None, scaling: dict | None = None) -> None:
    """tiny-llama f32 with the given rope_freqs.weight and llama.rope.scaling.* keys."""
    shape = models.TINY["tiny-llama"]
    extra = {} if factors is None else {"rope_freqs.weight": factors}
    models.write_model(shape, "f32", path, 1234, extra_tensors=extra)
    if scaling:  # rewrite with the keys: GGUFWriter takes them before the tensors, so copy through a writer
        r = gguf.GGUFReader(str(path))
        tmp = path.with_suffix(".tmp.gguf")
        w = gguf.GGUFWriter(str(tmp), "llama")
        for name, fld in r.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vtype = fld.types[0]
            sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, fld.contents(), vtype, sub_type=sub)
        for k, v in scaling.items():
            if isinstance(v, str):
                w.add_string(k, v)
            else:
                w.add_float32(k, v)
        for t in r.tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                         raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)


@pytest.mark.parametrize("case,factors,scaling,message", [
    ("short", np.ones(31, np.float32), None, "'rope_freqs.weight' has 31 elements"),
    ("nan", np.array([1.0] * 5 + [np.nan] + [1.0] * 26, np.float32), None, "element 5 is nan"),
    ("zero", np.array([1.0] * 31 + [0.0], np.float32), None, "element 31 is 0"),
    ("yarn", None, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "'yarn' is not supported"),
    ("negative", None, {"llama.rope.scaling.factor": -2.0}, "llama.rope.scaling.factor = -2"),
])
def test_bad_scaling_is_refused(tmp_path, case, factors, scaling, message):
    path = tmp_path / f"bad-{case}.gguf"
    write_variant(path, factors, scaling)
    p = subprocess.run([DIFFRUN, "inspect", str(path)], capture_output=True, text=True)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and str(path) in p.stderr, p.stderr


def test_linear_factor_folds_into_the_factors(tmp_path):
    path = tmp_path / "linear.gguf"
    write_variant(path, rope_factors(FIXTURE), {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    p = subprocess.run([DIFFRUN, "inspect", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "with freq factors 2..16" in p.stdout, p.stdout
