"""Mistral's sliding window on the llama architecture: tiny-mistral's llama.attention.sliding_window (8) is read
but not applied, as llama.cpp does; the reference's kq_soft_max against a numpy softmax over every earlier key."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import gguf
import h5py
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DIFFRUN = os.environ.get("DIFFRUN_BIN", str(REPO / "build/cli/diffrun"))
FIXTURE_DIR = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", str(REPO / "build/fixtures")))
FIXTURE = FIXTURE_DIR / "tiny-mistral-f32.gguf"
PROMPT = list(range(40, 52))  # 12 tokens: longer than the window
STEPS = 3
NOTE = "llama.attention.sliding_window = 8 is not applied"


def window_from_gguf(path: Path) -> int:
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"
    return int(r.fields["llama.attention.sliding_window"].contents())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    assert FIXTURE.exists(), f"{FIXTURE} is missing: run scripts/gen_fixtures.py --out {FIXTURE_DIR}"
    out = tmp_path_factory.mktemp("swa")
    p = subprocess.run([DIFFRUN, "-m", str(FIXTURE), "--tokens", ",".join(map(str, PROMPT)), "--steps", str(STEPS),
                        "--engine", "cpu", "--engine-precision", "f32", "--reference-precision", "f64",
                        "--checkpoints", "Qrope-*,cache_k-*,kq_soft_max-*", "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return out / "reference.h5", p.stderr


def numpy_probs(q: np.ndarray, keys: np.ndarray, pos0: int, window: int) -> np.ndarray:
    """q [T, H, Dh] at positions pos0.., keys [S, Hkv, Dh]; softmax(q·k / sqrt(Dh)) over the keys a causal query
    sees (the last `window` positions, query included, when window > 0), [H, T, S]."""
    T, H, Dh = q.shape
    S, Hkv, _ = keys.shape
    k = np.repeat(keys, H // Hkv, axis=1)  # [S, H, Dh]: query head h reads kv head h // (H / Hkv)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(Dh)
    pos = pos0 + np.arange(T)[:, None]
    s = np.arange(S)[None, :]
    masked = (s > pos) | ((pos - s >= window) if window > 0 else False)
    scores = np.where(masked[None], -np.inf, scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_the_fixture_has_the_key():
    assert window_from_gguf(FIXTURE) == 8


@pytest.mark.parametrize("step", range(STEPS + 1))
@pytest.mark.parametrize("layer", [0, 1])
def test_every_earlier_key_is_attended(run, step, layer):
    dump, _ = run
    window = window_from_gguf(FIXTURE)
    with h5py.File(dump) as f:
        assert list(f.attrs["token_ids"]) == PROMPT
        g = f[f"step_{step:04d}"]
        q = np.asarray(g[f"Qrope-{layer}"], dtype=np.float64)
        keys = np.asarray(g[f"cache_k-{layer}"], dtype=np.float64)
        probs = np.asarray(g[f"kq_soft_max-{layer}"], dtype=np.float64)
    T = q.shape[0]
    S = len(PROMPT) + step
    pos0 = 0 if step == 0 else S - 1
    assert keys.shape[0] == S and probs.shape == (q.shape[1], T, S)
    full = numpy_probs(q, keys, pos0, 0)
    np.testing.assert_allclose(probs, full, rtol=0, atol=1e-6)  # the dump stores f32: its rounding only
    # The last query row attends all S > window positions; a windowed softmax is far from what the reference did.
    assert np.count_nonzero(probs[:, -1, :], axis=-1).min() == S > window
    assert np.abs(probs - numpy_probs(q, keys, pos0, window)).max() > 1e-3


def test_the_run_says_what_is_not_applied(run):
    _, stderr = run
    assert NOTE in stderr, stderr
    p = subprocess.run([DIFFRUN, "inspect", str(FIXTURE)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert NOTE in p.stdout, p.stdout
