"""diffrun compare on dumps written by other engines (h5py): per-head layouts, stored dtypes, optional
attributes, coverage, and the llama.cpp / Hugging Face name maps. Each foreign dump is made from a real
reference run of a tiny fixture, rewritten the way that engine stores it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import h5py
import numpy as np
import pytest

import dump_h5

BIN = os.environ.get("DIFFRUN_BIN")
FIXTURES = os.environ.get("DIFFRUN_FIXTURE_DIR")


def run(*args, check_rc=None):
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True)
    if check_rc is not None:
        assert r.returncode == check_rc, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not BIN or not FIXTURES:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_foreign_dumps)")
    out = {}
    for arch in ("qwen2", "llama", "qwen3"):
        d = tmp_path_factory.mktemp(arch)
        # prefill of 5 tokens and 2 decode steps: S grows 5, 6, 7; the whole cache at every step, as the
        # foreign engines these dumps stand for record it
        run("--model", Path(FIXTURES) / f"tiny-{arch}-f32.gguf", "--tokens", "1,2,3,4,5", "--steps", "2",
            "--engine", "cpu", "--cache-rows", "all", "--out", d, "--no-color", check_rc=0)
        out[arch] = d
    return out


def rewrite(src: Path, dst: Path, fn):
    """Copies dump `src` to `dst`; fn(step, name, array, attrs) returns a list of (name, array, attrs)."""
    with h5py.File(src, "r") as a, h5py.File(dst, "w") as b:
        for k, v in a.attrs.items():
            b.attrs[k] = v
        for g in a:
            step = int(g.split("_")[1])
            grp = b.create_group(g)
            table = dump_h5.table(a[g])  # the step's attribute table (format version 2)
            rows = {}
            for name in a[g]:
                if name == dump_h5.TABLE:
                    continue
                ds = a[g][name]
                for new_name, arr, attrs in fn(step, name, ds[()], dict(table.get(name, {}))):
                    grp.create_dataset(new_name, data=arr)
                    if attrs:
                        rows[new_name] = attrs
            if rows:
                dump_h5.write_table(grp, rows)
    return dst


def bare(attrs):
    """A foreign writer's attributes: none of order / layer / native_dtype / layout."""
    return {}


def compare(engine, reference, *extra, rc):
    j = engine.parent / (engine.stem + "-report.json")
    r = run("compare", engine, reference, "--no-color", "--report-json", j, *extra)
    assert r.returncode == rc, r.stdout + r.stderr
    return r.stdout, (json.loads(j.read_text()) if j.exists() and rc != 2 else None)


def by_name(report, step=0):
    return {c["name"]: c for c in report["checkpoints"] if c["step"] == step}


def test_per_head_2d_and_no_attributes_compare_clean(runs, tmp_path):
    d = runs["qwen2"]

    def fn(step, name, arr, attrs):
        if name == "tokens":
            return [(name, arr, {})]
        if arr.ndim == 3 and name.split("-")[0] in ("Qcur", "Kcur", "Vcur", "Qrope", "Krope", "kqv_out"):
            arr = arr.reshape(arr.shape[0], -1)  # [T, H*Dh], as engines hold it
        return [(name, arr, bare(attrs))]

    eng = rewrite(d / "engine.h5", tmp_path / "e2d.h5", fn)
    out, rep = compare(eng, d / "reference.h5", "--require-coverage", "100", rc=0)
    assert rep["summary"]["fail"] == 0 and rep["coverage"]["percent"] == 100
    q = by_name(rep)["Qcur-0"]
    assert q["status"] == "pass" and q["shape_engine"] == q["shape_reference"] == [5, 8, 32]
    assert by_name(rep, 2)["kq_soft_max-1"]["shape_engine"] == [8, 1, 7]


def test_head_major_layout_is_permuted(runs, tmp_path):
    d = runs["qwen2"]

    def fn(step, name, arr, attrs):
        if name.startswith(("Qcur-", "Qrope-")):
            attrs = {**attrs, "layout": "H,T,Dh"}
            arr = np.ascontiguousarray(arr.transpose(1, 0, 2))
        if name.startswith("cache_k-"):
            attrs = {**attrs, "layout": "Hkv,Dh,S"}
            arr = np.ascontiguousarray(arr.transpose(1, 2, 0))
        return [(name, arr, attrs)]

    eng = rewrite(d / "engine.h5", tmp_path / "ehm.h5", fn)
    with h5py.File(eng) as f:
        assert f["step_0000/Qcur-0"].shape == (8, 5, 32)
    out, rep = compare(eng, d / "reference.h5", rc=0)
    assert by_name(rep)["Qcur-0"]["status"] == "pass"
    assert by_name(rep, 1)["cache_k-1"]["metrics"]["rel_l2"] < 1e-5


def test_really_wrong_shape_still_fails(runs, tmp_path):
    d = runs["qwen2"]

    def fn(step, name, arr, attrs):
        if name == "Qcur-0":
            arr = arr[:, :7, :]  # one head missing: a real element-count mismatch
        return [(name, arr, attrs)]

    eng = rewrite(d / "engine.h5", tmp_path / "ebad.h5", fn)
    out, rep = compare(eng, d / "reference.h5", rc=1)
    assert rep["first_divergence"]["name"] == "Qcur-0"
    assert by_name(rep)["Qcur-0"]["status"] == "shape_mismatch"

    def fn2(step, name, arr, attrs):
        if name == "Qcur-0":  # the same count, but its layout attribute names other letters
            attrs = {**attrs, "layout": "T,D"}
            arr = arr.reshape(arr.shape[0], -1)
        return [(name, arr, attrs)]

    eng = rewrite(d / "engine.h5", tmp_path / "ebad2.h5", fn2)
    out, rep = compare(eng, d / "reference.h5", rc=1)
    assert by_name(rep)["Qcur-0"]["status"] == "shape_mismatch"


def bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("dtype", ["f64", "f16", "bf16"])
def test_stored_dtypes_read_exactly(runs, tmp_path, dtype):
    d = runs["qwen2"]
    stored = {}

    def fn(step, name, arr, attrs):
        if name == "tokens":
            return [(name, arr.astype(np.int64), attrs)]  # numpy's default integers
        attrs = {k: v for k, v in attrs.items() if k != "native_dtype"}
        if dtype == "f64":
            out = arr.astype(np.float64)
            value = out
        elif dtype == "f16":
            out = arr.astype(np.float16)
            value = out.astype(np.float32)
        else:
            out = bf16_words(arr)
            value = bf16_values(out)
            attrs["dtype"] = "bf16"
        stored[(step, name)] = value
        return [(name, out, attrs)]

    eng = rewrite(d / "engine.h5", tmp_path / f"e_{dtype}.h5", fn)
    ls = run("ls", eng, "--step", "0", check_rc=0).stdout
    row = ls.split(" embd ")[1].splitlines()[0].split()
    assert row[-2:] == [{"f64": "float64", "f16": "float16", "bf16": "bfloat16"}[dtype], dtype], row
    tol = tmp_path / "loose.json"
    tol.write_text(json.dumps({"rules": [], "default": {"max_rel_l2": 1.0, "reason": "reading test"}}))
    out, rep = compare(eng, d / "reference.h5", "--tolerances", tol, rc=0)
    with h5py.File(d / "reference.h5") as r:
        for name in ("embd", "Qcur-1", "kq_soft_max-0", "result_output"):
            b = r[f"step_0000/{name}"][()].astype(np.float64)
            a = stored[(0, name)].astype(np.float64)
            want = np.linalg.norm(a - b) / np.linalg.norm(b)
            got = by_name(rep)[name]["metrics"]["rel_l2"]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-12), name
    if dtype != "f64":
        assert by_name(rep)["result_output"]["metrics"]["rel_l2"] > 1e-4  # the rounding is really there


def test_bf16_without_marker_is_a_clear_error(runs, tmp_path):
    d = runs["qwen2"]

    def fn(step, name, arr, attrs):
        return [(name, bf16_words(arr) if name == "embd" else arr, attrs)]

    eng = rewrite(d / "engine.h5", tmp_path / "e_u16.h5", fn)
    r = run("compare", eng, d / "reference.h5", "--no-color")
    assert r.returncode == 2 and "step_0000/embd" in r.stderr and 'dtype = "bf16"' in r.stderr, r.stderr


def test_same_precision_across_backends_takes_the_cross_preset(runs, tmp_path):
    """Two f32 dumps are judged bit for bit (f32_vs_f32) only when one backend wrote both; an f32 engine of another
    backend against an f32 reference (cuda against cpu: other summation orders) takes f32_vs_f32_cross."""
    d = runs["llama"]
    same = rewrite(d / "engine.h5", tmp_path / "same.h5", lambda s, n, a, t: [(n, a, t)])
    other = rewrite(d / "engine.h5", tmp_path / "other.h5", lambda s, n, a, t: [(n, a, t)])
    with h5py.File(other, "r+") as f:
        f.attrs["backend"] = np.bytes_("cuda")
    _, report = compare(same, d / "engine.h5", rc=0)
    assert report["tolerances"]["preset"] == "f32_vs_f32"
    _, report = compare(other, d / "engine.h5", rc=0)
    assert report["tolerances"]["preset"] == "f32_vs_f32_cross"
    # one f32 element moved by 1e-6 relative: a difference of summation order, inside the cross preset only
    def nudge(step, name, arr, attrs):
        if (step, name) == (0, "attn_out-0"):
            arr = arr.copy()
            arr.flat[0] *= np.float32(1 + 1e-6)
        return [(name, arr, attrs)]
    nudged = rewrite(d / "engine.h5", tmp_path / "nudged.h5", nudge)
    compare(nudged, d / "engine.h5", rc=1)
    with h5py.File(nudged, "r+") as f:
        f.attrs["backend"] = np.bytes_("cuda")
    compare(nudged, d / "engine.h5", rc=0)


def test_coverage_l_out_only(runs, tmp_path):
    d = runs["qwen2"]

    def fn(step, name, arr, attrs):
        keep = name == "tokens" or name.startswith(("l_out-", "result_"))
        return [(name, arr, attrs)] if keep else []

    eng = rewrite(d / "engine.h5", tmp_path / "lout.h5", fn)
    with h5py.File(d / "reference.h5") as r:
        n_ref = sum(1 for g in r for n in r[g] if n not in ("tokens", dump_h5.TABLE))
    n_kept = 3 * (2 + 2)  # l_out-0, l_out-1, result_norm, result_output per step
    out, rep = compare(eng, d / "reference.h5", rc=0)  # no requirement: passes, coverage stated
    pct = 100.0 * n_kept / n_ref
    assert f"coverage   {n_kept} of the reference's {n_ref} float checkpoints compared ({pct:.1f}%)" in out
    junit = tmp_path / "j.xml"
    out, rep = compare(eng, d / "reference.h5", "--require-coverage", "90", "--report-junit", junit, rc=1)
    assert rep["coverage"] == {"reference": n_ref, "compared": n_kept, "percent": pytest.approx(pct),
                               "required": 90.0, "met": False, "missing_kinds": rep["coverage"]["missing_kinds"],
                               "missing_steps": []}
    assert rep["exit_code"] == 1 and rep["first_divergence"] is None
    assert "attn_norm" in rep["coverage"]["missing_kinds"] and "l_out" not in rep["coverage"]["missing_kinds"]
    assert "RESULT: FAIL: coverage" in out and "missing: embd, attn_norm, Qcur" in out
    root = ET.parse(junit).getroot()
    case = root.find("./testsuite[@name='coverage']/testcase")
    assert case.find("failure") is not None and "attn_norm" in case.find("failure").get("message")
    compare(eng, d / "reference.h5", "--require-coverage", f"{pct - 0.1:.1f}", rc=0)


# --- llama.cpp ------------------------------------------------------------------------------------

def llamacpp_fn(arch, pad=16, perturb=None):
    """Rewrites a diffrun dump the way llama.cpp's eval callback records its graph (see fixtures/names)."""
    def fn(step, name, arr, attrs):
        base, _, layer = name.rpartition("-")
        if name == "tokens":
            return [(name, arr, {})]
        if not base:
            base, layer = name, None
        out = []

        def add(n, a):
            a = np.ascontiguousarray(a, dtype=np.float32)
            if perturb and perturb == (step, n):
                a = a.copy()
                a.flat[1] += 0.05 * (np.abs(a).max() + 1.0)  # position 1: inside every crop
            out.append((n, a, {}))

        T = arr.shape[0]
        if base in ("Qcur", "Kcur", "Vcur"):
            flat = arr.reshape(T, -1)
            add(f"{base}-{layer}", flat * 0.5 if arch != "llama" else flat)  # matmul (before the bias)
            add(f"{base}-{layer}#2", flat)                                   # bias added / reshape
            if arch == "qwen2":
                add(f"{base}-{layer}#3", arr)                                # reshape
        elif base in ("Qrope", "Krope"):
            src = "Qcur" if base == "Qrope" else "Kcur"
            k = {"qwen2": 4, "llama": 3, "qwen3": 3}[arch]
            add(f"{src}-{layer}#{k}", arr)
        elif base in ("Qnorm", "Knorm"):
            add(f"{base[0]}cur_normed-{layer}", arr)
        elif base == "embd":
            add("inp_embd", arr)
        elif base == "attn_norm":
            add(f"norm-{layer}", arr * 0.9)
            add(f"attn_norm-{layer}", arr)
        elif base == "ffn_norm":
            add(f"norm-{layer}#2", arr * 0.9)
            add(f"ffn_norm-{layer}", arr)
        elif base == "kq_soft_max":
            H, T, S = arr.shape
            add(f"kq-{layer}", np.log(arr + 1e-9))
            padded = np.zeros((H, T, pad), np.float32)
            padded[:, :, :S] = arr
            add(f"kq_soft_max-{layer}", padded)
        elif base == "result_norm":
            add("norm", arr * 0.9)
            add("node_65", arr * 3.0)
            add(name, arr)
        elif base == "kqv_out":
            add(f"kqv-{layer}", arr.transpose(1, 0, 2))
            add(f"kqv_out-{layer}", arr.reshape(T, -1))
        elif base in ("cache_k", "cache_v") and arch == "llama":
            # as llama.cpp's graph holds it (adapters/llamacpp): views of the whole padded cache
            S, Hkv, Dh = arr.shape
            cache = np.full((pad, Hkv, Dh), 7.0, np.float32)  # cells past S: stale, must be cut
            cache[:S] = arr
            if base == "cache_k":
                add(f"cache_k_l{layer} (view)", cache.reshape(pad, -1))
                add(f"cache_k_l{layer} (view)#2", cache)
            else:
                add(f"cache_v_l{layer} (view)", cache.transpose(2, 1, 0))  # [Dh, Hkv, kv_size]
                add(f"cache_v_l{layer} (reshaped)", cache.reshape(-1, 1))
        elif base in ("cache_k", "cache_v"):
            # the plain convention: whole cache tensors, shape reversed(ne), V bytes transposed
            S, Hkv, Dh = arr.shape
            cache = np.full((pad, Hkv * Dh), 7.0, np.float32)  # rows past S: stale, must be cut
            cache[:S] = arr.reshape(S, -1)
            if base == "cache_v":
                # ne = [Hkv*Dh, kv_size]: stored shape [kv_size, Hkv*Dh], bytes transposed
                cache = np.ascontiguousarray(cache.T).reshape(pad, Hkv * Dh)
            add(f"{base}_l{layer}", cache)
        else:
            add(name, arr)
        return out
    return fn


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_llamacpp_map_compares_clean(runs, tmp_path, arch):
    d = runs[arch]
    eng = rewrite(d / "engine.h5", tmp_path / "llamacpp.h5", llamacpp_fn(arch))
    with h5py.File(eng) as f:
        assert "Qcur-0#3" in f["step_0000"]
        assert ("cache_v_l1 (view)" if arch == "llama" else "cache_v_l1") in f["step_0001"]
    out, rep = compare(eng, d / "reference.h5", "--names", "llamacpp", "--require-coverage", "100", rc=0)
    assert rep["summary"]["fail"] == 0 and rep["summary"]["one_sided"] == 0
    for name in ("Qcur-0", "Qrope-0", "cache_v-1", "kq_soft_max-1"):
        assert by_name(rep, 2)[name]["metrics"]["rel_l2"] < 1e-5, name
    # without the map the names do not meet
    out, rep = compare(eng, d / "reference.h5", "--require-coverage", "100", rc=1)


@pytest.mark.parametrize("arch,step,name,expect", [
    ("llama", 2, "cache_v_l0 (view)", "cache_v-0"),  # [Dh, Hkv, kv_size] view
    ("llama", 1, "cache_k_l1 (view)", "cache_k-1"),
    ("qwen2", 0, "Qcur-1#3", "Qcur-1"),          # the pre-RoPE q (qwen2: the reshape)
    ("qwen2", 1, "Qcur-0#4", "Qrope-0"),         # the RoPE output
    ("qwen2", 2, "cache_v_l1", "cache_v-1"),     # transposed V cache
    ("qwen2", 1, "kq_soft_max-0", "kq_soft_max-0"),
])
def test_llamacpp_map_perturbed_fails_there(runs, tmp_path, arch, step, name, expect):
    d = runs[arch]
    eng = rewrite(d / "engine.h5", tmp_path / "llamacpp-bad.h5", llamacpp_fn(arch, perturb=(step, name)))
    out, rep = compare(eng, d / "reference.h5", "--names", "llamacpp", rc=1)
    fd = rep["first_divergence"]
    assert (fd["step"], fd["name"]) == (step, expect)


def test_llamacpp_perturbed_dropped_node_is_ignored(runs, tmp_path):
    d = runs["qwen2"]
    eng = rewrite(d / "engine.h5", tmp_path / "llamacpp-kq.h5", llamacpp_fn("qwen2", perturb=(0, "kq-0")))
    compare(eng, d / "reference.h5", "--names", "llamacpp", "--require-coverage", "100", rc=0)
    ls = run("ls", eng, "--names", "llamacpp", "--step", "0", check_rc=0).stdout
    assert "Qrope-0" in ls and "kq-0" not in ls


# --- Hugging Face ---------------------------------------------------------------------------------

HF = {"embd": "model.embed_tokens", "attn_norm": "model.layers.{}.input_layernorm",
      "Qcur": "model.layers.{}.self_attn.q_proj", "Kcur": "model.layers.{}.self_attn.k_proj",
      "Vcur": "model.layers.{}.self_attn.v_proj", "Qnorm": "model.layers.{}.self_attn.q_norm",
      "Knorm": "model.layers.{}.self_attn.k_norm", "attn_out": "model.layers.{}.self_attn.o_proj",
      "ffn_norm": "model.layers.{}.post_attention_layernorm", "ffn_gate": "model.layers.{}.mlp.gate_proj",
      "ffn_up": "model.layers.{}.mlp.up_proj", "ffn_out": "model.layers.{}.mlp.down_proj",
      "l_out": "model.layers.{}", "result_norm": "model.norm", "result_output": "lm_head"}


def hf_fn(step, name, arr, attrs):
    base, _, layer = name.rpartition("-")
    if not base:
        base, layer = name, ""
    if name == "tokens":
        return [(name, arr, {})]
    if base not in HF:
        return []
    a = arr.reshape(1, arr.shape[0], -1) if base in ("Qcur", "Kcur", "Vcur") else arr[None]
    out = [(HF[base].format(layer), a, {})]
    if base == "ffn_gate":
        out.append((f"model.layers.{layer}.mlp.act_fn", a * 0.3, {}))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_hf_map_compares_clean(runs, tmp_path, arch):
    d = runs[arch]
    eng = rewrite(d / "engine.h5", tmp_path / "hf.h5", hf_fn)
    out, rep = compare(eng, d / "reference.h5", "--names", "hf", rc=0)
    names = by_name(rep)
    assert names["Qcur-1"]["status"] == "pass" and names["l_out-1"]["status"] == "pass"
    assert rep["summary"]["one_sided"] > 0  # HF has no ffn_inp, kq_soft_max, caches...
    if arch == "qwen3":
        assert names["Qnorm-0"]["status"] == "pass"


# Mixtures of experts: transformers 5's module outputs (the router's logits and the experts' sum [T, D] without a
# batch dimension, the blocks' outputs with one), the repeats and duplicates a hook on every module records too.
@pytest.fixture(scope="module")
def moe_refs(tmp_path_factory):
    if not BIN or not FIXTURES:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_foreign_dumps)")
    out = {}
    for arch in ("qwen3moe", "qwen2moe", "mixtral"):
        ref = tmp_path_factory.mktemp(arch) / "reference.h5"
        run("dump", "--backend", "cpu", "--precision", "f64", "--model", Path(FIXTURES) / f"tiny-{arch}-f32.gguf",
            "--tokens", "1,2,3,4,5", "--steps", "2", "--out", ref, check_rc=0)
        out[arch] = ref
    return out


def hf_moe_fn(arch, perturb=None):
    """A reference dump of a mixture of experts rewritten as forward hooks on every module of transformers 5's
    Qwen3Moe/Qwen2Moe/MixtralForCausalLM record it."""
    def fn(step, name, arr, attrs):
        base, _, layer = name.rpartition("-")
        out = []

        def add(n, a):
            a = np.ascontiguousarray(a, dtype=np.float32)
            if perturb == (step, n):
                a = a.copy()
                a.flat[1] += 0.05 * (np.abs(a).max() + 1.0)
            out.append((n, a, {}))

        m = f"model.layers.{layer}.mlp"
        if base == "ffn_moe_logits":
            add(f"{m}.gate", arr)                                   # [T, E]: the router's first output
        elif base == "ffn_moe_out":
            add(f"{m}.experts", arr)                                # [T, D]
            if arch != "qwen2moe":
                add(m, arr[None])                                   # the block: the same sum, [1, T, D]
            add(f"{m}.experts.act_fn", np.ones((3, 5)))            # silu(gate) of one expert's routed rows
            add(f"{m}.experts.act_fn#2", np.ones((2, 5)))
        elif base == "ffn_shexp":
            add(f"{m}.shared_expert", arr)
            add(f"{m}.shared_expert.down_proj", arr)
            add(f"{m}.shared_expert.gate_proj", np.ones((arr.shape[0], 384)))
        elif base == "ffn_shexp_gate_inp":
            add(f"{m}.shared_expert_gate", arr[:, None])            # nn.Linear(D, 1): [T, 1]
        elif base == "ffn_out" and arch == "qwen2moe":
            add(m, arr[None])
        elif base in ("Qcur", "Kcur") and arch == "mixtral":
            add(HF[base].format(layer), arr.reshape(1, arr.shape[0], -1)[..., ::-1])  # rows in HF's order: dropped
        else:
            return hf_fn(step, name, arr, attrs)
        return out
    return fn


MOE_KINDS = {"qwen3moe": {"ffn_moe_logits", "ffn_moe_out", "Qcur", "Qnorm"},
             "qwen2moe": {"ffn_moe_logits", "ffn_moe_out", "ffn_shexp", "ffn_shexp_gate_inp", "ffn_out", "Qcur"},
             "mixtral": {"ffn_moe_logits", "ffn_moe_out", "Vcur"}}


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_hf_map_of_a_mixture_of_experts_compares_clean(moe_refs, tmp_path, arch):
    ref = moe_refs[arch]
    eng = rewrite(ref, tmp_path / "hf.h5", hf_moe_fn(arch))
    out, rep = compare(eng, ref, "--names", "hf", rc=0)
    compared = {c["base"] for c in rep["checkpoints"] if c.get("metrics")}
    assert MOE_KINDS[arch] | {"embd", "attn_norm", "ffn_norm", "l_out", "result_output"} <= compared, compared
    assert {"ffn_moe_topk", "ffn_moe_probs", "ffn_moe_gate"} <= set(rep["coverage"]["missing_kinds"])
    if arch == "mixtral":  # llama's q/k rows: permuted by the GGUF conversion, dropped
        assert not {"Qcur", "Kcur"} & compared
    ls = run("ls", eng, "--names", "hf", "--step", "1", check_rc=0).stdout
    names = [line.split()[1] for line in ls.splitlines() if re.match(r"\s+\d+\s", line)]
    assert "ffn_moe_out-1" in names and not [n for n in names if n.startswith(("model", "lm_head"))], ls


@pytest.mark.parametrize("arch,step,name,expect", [
    ("qwen2moe", 0, "model.layers.1.mlp.shared_expert_gate", "ffn_shexp_gate_inp-1"),  # [T, 1]
    ("qwen2moe", 0, "model.layers.0.mlp.experts", "ffn_moe_out-0"),
    ("qwen3moe", 2, "model.layers.1.mlp", "ffn_moe_out-1"),
    ("mixtral", 0, "model.layers.1.mlp.gate", "ffn_moe_logits-1"),
])
def test_hf_map_of_a_mixture_of_experts_perturbed_fails_there(moe_refs, tmp_path, arch, step, name, expect):
    eng = rewrite(moe_refs[arch], tmp_path / "hf-bad.h5", hf_moe_fn(arch, perturb=(step, name)))
    out, rep = compare(eng, moe_refs[arch], "--names", "hf", rc=1)
    fd = rep["first_divergence"]
    assert (fd["step"], fd["name"]) == (step, expect)


def test_name_map_errors_exit_2(runs, tmp_path):
    d = runs["qwen2"]
    r = run("compare", d / "engine.h5", d / "reference.h5", "--names", "nosuchmap")
    assert r.returncode == 2 and "neither a built-in name map (hf, llamacpp) nor a file" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"match": "x-{L}", "to": "Qcur-{L}", "drop": True}]}))
    r = run("compare", d / "engine.h5", d / "reference.h5", "--names", bad)
    assert r.returncode == 2 and "rule 1" in r.stderr and "exactly one of" in r.stderr
    bad.write_text("{\"rules\": [")
    r = run("compare", d / "engine.h5", d / "reference.h5", "--names", bad)
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"rules": [{"match": "l_out-{L}", "to": "ffn_out-{L}"}]}))
    r = run("compare", d / "engine.h5", d / "reference.h5", "--names", own)
    assert r.returncode == 2 and "two datasets are presented as 'ffn_out-0'" in r.stderr
