"""diffrun.adapters.transformers against diffrun's f64 CPU reference: every checkpoint within the f32_vs_f64 tolerances.

Tiny llama/qwen2/qwen3/gemma3 fixtures, SmolLM2 (a slice of its first 12 layers: DIFFRUN_SMOLLM2_SLICE, or cut
here from the fetched model with scripts/slice_gguf.py) and Gemma 3 270M (scripts/fetch_models gemma3, or
DIFFRUN_GEMMA3). Gemma 3 also runs in float64 (compared under the f32_vs_f64 rules: transformers computes its
norms, RoPE tables and softmax in float32 whatever the dtype), and every Gemma 3 checkpoint must agree to
1e-5 relative L2. The tiny gemma3's window (8) is shorter than its run (9 positions). Prints the worst
rel_l2 per checkpoint kind.
Needs torch, transformers, gguf (run_torch_tests.py skips without them), DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import diffrun

REPO = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))
# SmolLM2's layers in the run: a 12-layer slice by default (it fits what travels to a GPU host); 0, the whole model.
SMOL_LAYERS = int(os.environ.get("DIFFRUN_SMOLLM2_LAYERS", "12"))


def models_dir() -> Path:
    return Path(os.environ.get("DIFFRUN_MODELS") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffrun" / "models")


def gemma3_270m() -> Path | None:
    path = Path(os.environ.get("DIFFRUN_GEMMA3") or models_dir() / "gemma-3-270m-q4_k_m.gguf")
    return path if path.exists() else None


def smollm2_slice(tmp_path_factory) -> Path | None:
    given = os.environ.get("DIFFRUN_SMOLLM2_SLICE")
    if given:
        return Path(given)
    full = models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not full.exists():
        return None
    if SMOL_LAYERS == 0:
        return full
    out = tmp_path_factory.mktemp("smol") / f"SmolLM2-135M-Instruct.Q4_1.{SMOL_LAYERS}l.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts/slice_gguf.py"), str(full), str(out), "--layers",
                    str(SMOL_LAYERS)], check=True, capture_output=True)
    return out


TINY = ["--tokens", "1,5,9,13,200,31"]
CASES = [("tiny-llama-q8_0.gguf", TINY, "float32"),
         ("tiny-qwen2-q8_0.gguf", TINY, "float32"),
         ("tiny-qwen3-q8_0.gguf", TINY, "float32"),
         ("tiny-gemma3-f32.gguf", TINY, "float32"),
         ("tiny-gemma3-q8_0.gguf", TINY, "float64"),
         ("SmolLM2", ["--prompt", "The capital of France is"], "float32"),
         ("Gemma3-270M", ["--chat", "--prompt", "What is the capital of France?"], "float64")]
GEMMA3_MAX_REL_L2 = 1e-5


@pytest.mark.parametrize("model, prompt, dtype", CASES, ids=[c[0].split(".")[0] + "-" + c[2] for c in CASES])
def test_every_checkpoint_within_f32_vs_f64(model, prompt, dtype, tmp_path, tmp_path_factory):
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")
    if model == "SmolLM2":
        path = smollm2_slice(tmp_path_factory)
    elif model == "Gemma3-270M":
        path = gemma3_270m()
    else:
        path = FIXTURES / model
    if path is None:
        pytest.skip(f"{model} is not fetched (scripts/fetch_models) and its DIFFRUN_ variable is unset")
    ref, out, report = tmp_path / "ref.h5", tmp_path / "hf.h5", tmp_path / "report.json"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(path), *prompt,
                    "--steps", "3", "--out", str(ref)], check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-m", "diffrun.adapters.transformers", "--model", str(path), "--reference",
                        str(ref), "--out", str(out), "--dtype", dtype], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = ["--tolerances", str(REPO / "fixtures/tolerances/f32_vs_f64.json")] if dtype == "float64" else []
    c = subprocess.run([BIN, "compare", str(out), str(ref), "--no-color", "--report-json", str(report), *rules],
                       capture_output=True, text=True)
    result = json.loads(report.read_text())
    worst: dict[str, float] = defaultdict(float)
    for cp in result["checkpoints"]:
        value = (cp.get("metrics") or {}).get("rel_l2")
        if isinstance(value, (int, float)):
            worst[cp["base"]] = max(worst[cp["base"]], value)
    with diffrun.open(ref) as d:
        n_float = sum(1 for s in d.steps() for n in d.names(s) if n != "tokens")
    compared = sum(1 for cp in result["checkpoints"] if cp["name"] != "tokens" and cp.get("metrics"))
    print(f"\n{path.name} ({dtype}): {compared}/{n_float} checkpoints compared; worst rel_l2 by kind:")
    print("  " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    print("  " + r.stdout.strip().replace("\n", "\n  "))
    assert c.returncode == 0, c.stdout
    assert compared == n_float
    if "gemma" in path.name.lower():
        assert max(worst.values()) <= GEMMA3_MAX_REL_L2, {k: v for k, v in worst.items() if v > GEMMA3_MAX_REL_L2}


@pytest.mark.parametrize("model", ["tiny-llama-q8_0.gguf", "tiny-qwen2-q8_0.gguf"])
def test_hugging_face_directory(model, tmp_path):
    """The adapter on a Hugging Face directory (config.json and safetensors, no GGUF): the model transformers loads
    from the GGUF, saved with save_pretrained, compares clean against the f64 reference of that GGUF; for llama the
    directory holds transformers' half-split q/k rows, put back in the GGUF's order from the reference's rope_type."""
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")
    from diffrun.adapters.transformers import load_model

    path = FIXTURES / model
    hf_dir = tmp_path / "hf"
    loaded = load_model(path, "float32")  # from the GGUF: marked as quantized, which save_pretrained refuses
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(str(hf_dir))
    assert (hf_dir / "config.json").exists() and not list(hf_dir.glob("*.gguf"))
    ref, out, report = tmp_path / "ref.h5", tmp_path / "hf.h5", tmp_path / "report.json"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(path), *TINY,
                    "--steps", "2", "--out", str(ref)], check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-m", "diffrun.adapters.transformers", "--model", str(hf_dir), "--reference",
                        str(ref), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    c = subprocess.run([BIN, "compare", str(out), str(ref), "--no-color", "--report-json", str(report),
                        "--require-coverage", "100"], capture_output=True, text=True)
    assert c.returncode == 0, c.stdout + c.stderr
    print(f"\n{model} as a Hugging Face directory: " + c.stdout.strip().splitlines()[-1])


def _has_names_option() -> bool:
    r = subprocess.run([BIN, "compare", "--help"], capture_output=True, text=True)
    return "--names" in r.stdout


def test_generic_hooks_compare_through_names_hf(tmp_path):
    """diffrun.torch.record on every module of a transformers model, names as given, read by --names hf."""
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")
    if not _has_names_option():
        pytest.skip("this diffrun has no `compare --names` yet")
    import torch

    import diffrun.torch as dtorch
    from diffrun.adapters.transformers import feed, load_model

    path = FIXTURES / "tiny-qwen2-q8_0.gguf"
    ref, out, report = tmp_path / "ref.h5", tmp_path / "raw.h5", tmp_path / "report.json"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(path), "--tokens",
                    "1,5,9,13", "--steps", "2", "--out", str(ref)], check=True, capture_output=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, "float32", device)
    with diffrun.open(ref) as r, diffrun.writer.open(out, backend="transformers", precision="f32", like=r) as w, \
            dtorch.record(model, w):
        feed(model, r, w, device)
    with diffrun.open(out) as d:
        assert "model.layers.1.self_attn.q_proj" in d.names(0) and "lm_head" in d.names(2)
    c = subprocess.run([BIN, "compare", str(out), str(ref), "--names", "hf", "--no-color", "--report-json",
                        str(report)], capture_output=True, text=True)
    assert c.returncode == 0, c.stdout + c.stderr
    compared = {cp["name"] for cp in json.loads(report.read_text())["checkpoints"] if cp.get("metrics")}
    assert {"embd", "Qcur-0", "attn_out-1", "ffn_up-1", "l_out-1", "result_output"} <= compared, sorted(compared)
