"""diffrun's CPU reference of the mixtures of experts against Hugging Face transformers, an implementation diffrun did
not write: tiny-qwen3moe, tiny-qwen2moe (its shared expert) and tiny-mixtral in F32, so both sides read the same
numbers and differ by rounding alone.

- Every checkpoint transformers' modules expose (diffrun.adapters.transformers) agrees with the f64 reference within
  MAX_REL_L2, the same experts are chosen for every token of every layer and step (ffn_moe_topk compared exactly),
  and each step's next token agrees. What the modules do not expose is named (UNEXPOSED) and must stay so.
- A reference with a routing fault injected diverges from transformers at its layer, step 0.
- The hf name map (fixtures/names/hf.json) reads forward hooks on every module of the three models: the MoE kinds
  it maps compare clean, and no module output is left unmapped.

Prints the worst rel_l2 per checkpoint kind and the expert agreement. Needs torch, transformers (5: experts as fused
3-D weights), gguf (run_torch_tests.py skips without them), DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import diffrun

BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))
TOKENS = "1,5,9,13,200,31,77,140,250,3,64,99"  # 12 prompt tokens, then 3 decode steps
STEPS = "3"
MODELS = ["tiny-qwen3moe-f32.gguf", "tiny-qwen2moe-f32.gguf", "tiny-mixtral-f32.gguf"]
# F32 weights on both sides: transformers in float32 against the f64 reference measured 1.3e-6 at worst (ffn_moe_out
# of tiny-qwen2moe), 6.3e-6 for ffn_shexp_gate_inp, one dot product per token whose terms cancel (a [T] vector of
# logits near 0); a wrong weight, layout or routing is orders of magnitude above either.
MAX_REL_L2 = 1e-5
MAX_REL_L2_OF = {"ffn_shexp_gate_inp": 5e-5}
# The kinds of the reference that transformers computes inside a module's forward (not a module's output): the
# router's softmax, each expert's gate/up/SwiGLU/down (computed per expert over the tokens routed to it), the shared
# expert's sigmoid gate and gated output; and the selected weights in the form the model does not use (transformers'
# router returns the renormalised weights of Qwen3-MoE and Mixtral, the weights as selected of Qwen2-MoE).
PER_EXPERT = {"ffn_moe_probs", "ffn_moe_gate", "ffn_moe_up", "ffn_moe_swiglu", "ffn_moe_down"}
UNEXPOSED = {"tiny-qwen3moe-f32.gguf": PER_EXPERT | {"ffn_moe_weights"},
             "tiny-mixtral-f32.gguf": PER_EXPERT | {"ffn_moe_weights"},
             "tiny-qwen2moe-f32.gguf": PER_EXPERT | {"ffn_shexp_gate", "ffn_shexp_out"}}


def need_env() -> None:
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")


def reference(model: str, out: Path, *extra: str, steps: str = STEPS) -> Path:
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(FIXTURES / model),
                    "--tokens", TOKENS, "--steps", steps, "--out", str(out), *extra], check=True, capture_output=True)
    return out


def compare(engine: Path, ref: Path, report: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    c = subprocess.run([BIN, "compare", str(engine), str(ref), "--no-color", "--report-json", str(report), *extra],
                       capture_output=True, text=True)
    assert c.returncode in (0, 1), c.stdout + c.stderr
    return c, json.loads(report.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model: the f64 reference dump and the transformers dump teacher-forced with its tokens."""
    need_env()
    out = {}
    for model in MODELS:
        d = tmp_path_factory.mktemp(model.split(".")[0])
        ref = reference(model, d / "ref.h5")
        r = subprocess.run([sys.executable, "-m", "diffrun.adapters.transformers", "--model", str(FIXTURES / model),
                            "--reference", str(ref), "--out", str(d / "hf.h5"), "--device", "cpu"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        out[model] = (ref, d / "hf.h5", r.stdout.strip())
    return out


def expert_agreement(ref: Path, hf: Path) -> tuple[int, int, int, set[int]]:
    """(slots with the same expert id, slots, tokens x layers with the same set of experts, experts ever chosen)."""
    same = total = same_sets = 0
    chosen: set[int] = set()
    with diffrun.open(ref) as r, diffrun.open(hf) as h:
        for step in r.steps():
            for name in r.names(step):
                if not name.startswith("ffn_moe_topk-"):
                    continue
                a, b = r.get(name, step).astype(np.int64), h.get(name, step).astype(np.int64)
                assert a.shape == b.shape, (name, step, a.shape, b.shape)
                same += int((a == b).sum())
                total += a.size
                same_sets += sum(set(x) == set(y) for x, y in zip(a.tolist(), b.tolist()))
                chosen.update(a.reshape(-1).tolist())
    return same, total, same_sets, chosen


@pytest.mark.parametrize("model", MODELS, ids=[m.split(".")[0] for m in MODELS])
def test_every_exposed_checkpoint_and_every_expert_choice_agrees(model, runs, tmp_path):
    ref, hf, adapter_out = runs[model]
    c, report = compare(hf, ref, tmp_path / "report.json")
    worst: dict[str, float] = defaultdict(float)
    for cp in report["checkpoints"]:
        value = (cp.get("metrics") or {}).get("rel_l2")
        if isinstance(value, (int, float)):
            worst[cp["base"]] = max(worst[cp["base"]], value)
    same, total, same_sets, chosen = expert_agreement(ref, hf)
    n_steps = len(report["tokens"])
    agree = sum(t["match"] for t in report["tokens"])
    cov = report["coverage"]
    print(f"\n{model}: {cov['compared']}/{cov['reference']} checkpoints compared; worst rel_l2 by kind:")
    print("  " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    print(f"  expert ids: {same}/{total} slots, {same_sets} token-layers with the same set; experts chosen "
          f"{sorted(chosen)}; next token: {agree}/{n_steps} steps")
    print("  " + adapter_out.replace("\n", "\n  "))
    assert c.returncode == 0, c.stdout
    assert set(cov["missing_kinds"]) == UNEXPOSED[model], cov["missing_kinds"]
    assert cov["missing_steps"] == []
    over = {k: v for k, v in worst.items() if v > MAX_REL_L2_OF.get(k, MAX_REL_L2)}
    assert not over, over
    assert {"ffn_moe_logits", "ffn_moe_topk", "ffn_moe_out", "result_output"} <= set(worst)
    # the same experts, in the same slots, everywhere; and a run that routes to more than a couple of them
    assert same == total > 0 and report["routing"]["flipped"] == 0 and report["routing"]["reordered"] == 0
    assert len(chosen) >= 3, chosen
    assert agree == n_steps == int(STEPS) + 1


# A fault in the reference's routing, and the first checkpoint transformers exposes at or after it.
FAULTS = [("tiny-qwen3moe-f32.gguf", "moe_weights_not_renormalised", "ffn_moe_weights_norm-0"),
          ("tiny-mixtral-f32.gguf", "moe_expert_gate_up_swapped", "ffn_moe_out-0"),  # ffn_moe_gate-0 unexposed
          ("tiny-qwen2moe-f32.gguf", "moe_shared_expert_gate_skipped", "ffn_out-0")]  # ffn_shexp_out-0 unexposed


@pytest.mark.parametrize("model, fault, first", FAULTS, ids=[f[1] for f in FAULTS])
def test_a_routing_fault_in_the_reference_diverges_from_transformers(model, fault, first, runs, tmp_path):
    _, hf, _ = runs[model]
    bad = reference(model, tmp_path / "bad.h5", "--inject", fault, steps="0")
    c, report = compare(hf, bad, tmp_path / "report.json")
    fd = report["first_divergence"]
    assert c.returncode == 1 and fd is not None, c.stdout
    assert (fd["step"], fd["name"]) == (0, first), c.stdout


def test_expert_ids_off_by_one_in_the_reference_are_flips_against_transformers(runs, tmp_path):
    """Every token of layer 0 routed to other experts than transformers chose (ffn_moe_topk compared)."""
    model = "tiny-qwen3moe-f32.gguf"
    _, hf, _ = runs[model]
    bad = reference(model, tmp_path / "bad.h5", "--inject", "moe_expert_id_off_by_one", steps="0")
    c, report = compare(hf, bad, tmp_path / "report.json")
    layer0 = [x for x in report["routing"]["layers"] if (x["step"], x["layer"]) == (0, 0)]
    assert c.returncode == 1 and report["first_divergence"]["layer"] == 0, c.stdout
    assert layer0 and layer0[0]["flipped"] == layer0[0]["tokens"] == len(TOKENS.split(",")), layer0


# What the hf map makes of forward hooks on every module: the MoE kinds it must find, per architecture.
MAPPED = {"tiny-qwen3moe-f32.gguf": {"ffn_moe_logits", "ffn_moe_out", "Qcur", "Qnorm"},
          "tiny-mixtral-f32.gguf": {"ffn_moe_logits", "ffn_moe_out"},
          "tiny-qwen2moe-f32.gguf": {"ffn_moe_logits", "ffn_moe_out", "ffn_shexp", "ffn_shexp_gate_inp", "ffn_out",
                                     "Qcur"}}


@pytest.mark.parametrize("model", MODELS, ids=[m.split(".")[0] for m in MODELS])
def test_forward_hooks_on_every_module_compare_through_names_hf(model, runs, tmp_path):
    import diffrun.torch as dtorch
    from diffrun.adapters.transformers import feed, load_model

    ref, _, _ = runs[model]
    raw, report = tmp_path / "raw.h5", tmp_path / "report.json"
    hf = load_model(FIXTURES / model, "float32", "cpu")
    with diffrun.open(ref) as r, diffrun.writer.open(raw, backend="transformers", precision="f32", like=r) as w, \
            dtorch.record(hf, w):
        feed(hf, r, w)
    with diffrun.open(raw) as d:
        recorded = set(d.names(0))
    assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.experts"} <= recorded
    c, rep = compare(raw, ref, report, "--names", "hf")
    assert c.returncode == 0, c.stdout + c.stderr
    compared = {cp["base"] for cp in rep["checkpoints"] if cp.get("metrics")}
    worst = {k: max(cp["metrics"]["rel_l2"] for cp in rep["checkpoints"] if cp["base"] == k and cp.get("metrics"))
             for k in sorted(MAPPED[model] - {"Qcur", "Qnorm"})}
    print(f"\n{model}, hooks on every module through --names hf: {rep['coverage']['compared']}/"
          f"{rep['coverage']['reference']} checkpoints compared; " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert MAPPED[model] | {"embd", "attn_norm", "ffn_norm", "l_out", "result_output"} <= compared, sorted(compared)
    # every module output is mapped or dropped by a rule: none is left under its own name
    ls = subprocess.run([BIN, "ls", str(raw), "--names", "hf", "--step", "0"], capture_output=True, text=True)
    assert ls.returncode == 0, ls.stderr
    names = [line.split()[1] for line in ls.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert names and not [n for n in names if n.startswith(("model", "lm_head"))], ls.stdout
