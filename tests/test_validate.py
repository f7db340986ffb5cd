"""`diffrun validate`: diffrun's own dumps pass, a hand-written h5py dump passes, and each class of problem is named, all in one run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

import dump_h5

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))
MODEL = FIXTURES / "tiny-llama-f32.gguf"
QWEN3 = FIXTURES / "tiny-qwen3-f32.gguf"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DIFFRUN, *args], capture_output=True, text=True, timeout=120)


def validate(path: Path) -> tuple[int, list[str]]:
    r = run("validate", str(path))
    return r.returncode, (r.stdout + r.stderr).splitlines()


def assert_problems(lines: list[str], expected: list[str], counted: bool = True):
    """Every expected problem is among validate's lines; with `counted`, the last line counts exactly those."""
    for e in expected:
        assert any(e in line for line in lines), (e, lines)
    if counted:
        assert lines[-1].endswith(f"{len(expected)} problems"), lines


@pytest.fixture(scope="module")
def ref_dump(tmp_path_factory) -> Path:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    out = tmp_path_factory.mktemp("validate") / "ref.h5"
    r = run("dump", "--backend", "cpu", "--model", str(MODEL), "--tokens", "1,17,42", "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def copy(src: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copy(src, dst)
    return dst


def test_diffrun_dumps_are_valid(ref_dump: Path, tmp_path: Path):
    rc, lines = validate(ref_dump)
    assert rc == 0, lines
    assert lines[-1].endswith("valid diffrun dump (3 steps, 120 datasets)"), lines
    if QWEN3.exists():  # Qnorm/Knorm, qk_norm = true
        out = tmp_path / "qwen3.h5"
        assert run("dump", "--backend", "cpu", "--precision", "f64", "--model", str(QWEN3), "--tokens", "3,4",
                   "--steps", "1", "--out", str(out)).returncode == 0
        rc, lines = validate(out)
        assert rc == 0, lines


def test_unreadable_files_exit_2(tmp_path: Path):
    rc, lines = validate(tmp_path / "missing.h5")
    assert rc == 2 and "no such file" in lines[-1]
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not an hdf5 file at all" * 10)
    rc, lines = validate(junk)
    assert rc == 2 and "not an HDF5 file" in lines[-1]


def test_bare_dump_lists_every_missing_attribute_at_once(tmp_path: Path):
    bare = tmp_path / "bare.h5"
    with h5py.File(bare, "w") as f:
        f.create_group("step_0000")
    rc, lines = validate(bare)
    assert rc == 1
    required = ["format", "format_version", "backend", "precision", "model_path", "model_fingerprint", "arch",
                "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "n_ctx", "rope_theta",
                "rope_type", "rms_eps", "tied_output", "qkv_bias", "qk_norm", "prompt", "token_ids", "created_utc",
                "diffrun_version"]
    for name in required:
        assert any(f"root attribute '{name}': missing" in line for line in lines), (name, lines)
    assert any("step_0000/tokens: missing" in line for line in lines)
    assert lines[-1].endswith(f"{len(required) + 2} problems"), lines[-1]


def test_each_class_of_root_problem_is_named(ref_dump: Path, tmp_path: Path):
    bad = copy(ref_dump, tmp_path, "bad_root.h5")
    with h5py.File(bad, "r+") as f:
        f.attrs["rope_type"] = np.int32(0)            # mistyped root attribute
        f.attrs["arch"] = dump_h5.fixed("mistral")     # bad enum string
        f.attrs["tied_output"] = dump_h5.fixed("true")  # boolean stored as a string
        del f.attrs["model_fingerprint"]               # missing
        f.attrs["n_head"] = np.float64(4.0)            # integer stored as a real
        f.attrs["format_version"] = np.int32(7)        # unknown version
    rc, lines = validate(bad)
    assert rc == 1, lines
    expected = [
        "root attribute 'rope_type': is an integer, expected a string",
        "root attribute 'arch': is \"mistral\", expected \"llama\", \"qwen2\", \"qwen3\", \"gemma3\", \"qwen3moe\" or \"qwen2moe\"",
        "root attribute 'tied_output': is a string, expected a boolean",
        "root attribute 'model_fingerprint': missing",
        "root attribute 'n_head': is a float, expected an int32 scalar",
        "root attribute 'format_version': is 7, this diffrun reads versions 1 to 2",
        "/: datasets are not checked against the vocabulary",
    ]
    assert_problems(lines, expected)


def test_each_class_of_dataset_problem_is_named(ref_dump: Path, tmp_path: Path):
    bad = copy(ref_dump, tmp_path, "bad_datasets.h5")
    with h5py.File(bad, "r+") as f:
        s0 = f["step_0000"]
        s0["foo_bar"] = np.zeros(3, np.float32)        # unknown name
        dump_h5.set_attr(s0, "Kcur-1", "order", 99)           # order contradicts the vocabulary
        dump_h5.set_attr(s0, "Vcur-1", "layer", 0)            # layer contradicts the name
        dump_h5.set_attr(s0, "ffn_up-0", "native_dtype", "fp8")  # bad enum string on a dataset
        dump_h5.set_attr(s0, "ffn_gate-0", "layout", "T,D")   # layout not a permutation of the vocabulary's
        dump_h5.set_attr(f["step_0001"], "gone-0", "order", 3)  # a table row naming no dataset
        data = s0["ffn_out-0"][...]
        del s0["ffn_out-0"]
        s0["ffn_out-0"] = data.astype(np.int32)        # float checkpoint stored as integers
        f.move("step_0002", "step_0003")               # steps not contiguous
        f.attrs["argmax"] = np.array([1, 2], np.int32)  # one per step
    rc, lines = validate(bad)
    assert rc == 1, lines
    expected = [
        "step_0000/foo_bar: not a checkpoint name of the vocabulary",
        "step_0000/Kcur-1: attribute 'order' is 99 but the vocabulary puts it at 22",
        "step_0000/Vcur-1: attribute 'layer' is 0 but the name says 1",
        "step_0000/ffn_up-0: attribute 'native_dtype' is \"fp8\"",
        "step_0000/ffn_gate-0: layout 'T,D' is not a permutation of the vocabulary's 'T,F'",
        "step_0000/ffn_out-0: is an integer of 4 bytes",
        "step_0001/_attributes: names 'gone-0', which the step does not hold",
        "step_0002: missing: steps are numbered from 0 without gaps",
        "root attribute 'argmax': holds 2 ids for 3 steps",
        "root attribute 'all_token_ids': holds 5 ids; 3 decode steps after a prompt of 3 need at least 6",
    ]
    assert_problems(lines, expected)


def test_variable_length_strings_and_damaged_tables_are_named(ref_dump: Path, tmp_path: Path):
    """Version 2 stores no variable-length string: one is reported without being read; a table of the
    wrong form is named."""
    bad = copy(ref_dump, tmp_path, "vlen.h5")
    vlen = h5py.string_dtype("utf-8")
    with h5py.File(bad, "r+") as f:
        del f.attrs["prompt"]
        f.attrs.create("prompt", "1,17,42", dtype=vlen)
        f.attrs.create("device", "a fact", dtype=vlen)
        g = f["step_0001"]
        t = g["_attributes"][()]
        del g["_attributes"]
        g.create_dataset("_attributes", data=np.array([(n.decode(),) for n in t["name"]],
                                                      dtype=[("name", vlen)]))
        del f["step_0002/_attributes"]
        f["step_0002/_attributes"] = np.zeros((2, 2), np.int32)
    rc, lines = validate(bad)
    assert rc == 1, lines
    expected = [
        "root attribute 'prompt': is a variable-length string; format version 2 stores fixed-length strings",
        "root attribute 'device': is a variable-length string; format version 2 stores fixed-length strings",
        "step_0001/_attributes: column 'name' is a variable-length string",
        "step_0002/_attributes: is not a compound dataset",
    ]
    assert_problems(lines, expected)
    r = run("ls", str(bad))
    assert r.returncode == 2 and "root attribute 'prompt' is a variable-length string" in r.stderr, r.stderr


def test_version_1_dumps_stay_valid_and_compare_alike(ref_dump: Path, tmp_path: Path, monkeypatch):
    """The old form (format_version 1: per-dataset attributes, variable-length strings) is read only
    with DIFFRUN_READ_V1=1 (HDF5 1.10 can crash on a damaged one's strings); then it is valid, and
    compares against the version-2 dump it was made from exactly as that dump against itself."""
    old = copy(ref_dump, tmp_path, "v1.h5")
    dump_h5.to_version_1(old)
    for args in (["validate", str(old)], ["compare", str(old), str(ref_dump)], ["ls", str(old)]):
        r = run(*args)
        assert r.returncode == 2 and "set DIFFRUN_READ_V1=1 to read a version-1 dump" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    monkeypatch.setenv("DIFFRUN_READ_V1", "1")
    rc, lines = validate(old)
    assert rc == 0, lines
    assert lines[-1].endswith("valid diffrun dump (3 steps, 120 datasets)"), lines
    with h5py.File(old, "r+") as f:
        f["step_0000/Kcur-1"].attrs["order"] = np.int32(99)
    rc, lines = validate(old)
    assert rc == 1 and any("step_0000/Kcur-1: attribute 'order' is 99" in line for line in lines), lines
    with h5py.File(old, "r+") as f:
        f["step_0000/Kcur-1"].attrs["order"] = np.int32(22)
    same = run("compare", str(ref_dump), str(ref_dump), "--no-color")
    mixed = run("compare", str(old), str(ref_dump), "--no-color")
    assert same.returncode == mixed.returncode == 0, mixed.stdout + mixed.stderr
    strip = lambda out: [line.replace(str(old), "X").replace(str(ref_dump), "X") for line in out.splitlines()]
    assert strip(mixed.stdout) == strip(same.stdout)


def test_shape_problems_are_checked_against_the_config(ref_dump: Path, tmp_path: Path):
    bad = copy(ref_dump, tmp_path, "shapes.h5")
    with h5py.File(bad, "r+") as f:
        s0, s1, s2 = f["step_0000"], f["step_0001"], f["step_0002"]
        del s0["Qcur-0"]
        s0["Qcur-0"] = np.zeros((3, 7), np.float32)          # wrong element count
        q = s1["Qrope-1"][...]
        del s1["Qrope-1"]
        s1["Qrope-1"] = np.ascontiguousarray(q.reshape(1, 64, 4))  # same count, dims swapped, no layout
        s1["Qnorm-0"] = np.zeros((1, 4, 64), np.float32)      # a qwen3 name in a llama dump
        del s1["cache_k-0"]
        s1["cache_k-0"] = np.zeros((3, 2, 64), np.float32)    # S is 4 after step 1
        ids = s2["tokens"][...]
        del s2["tokens"]
        s2["tokens"] = np.array([ids[0], 5], np.int32)        # a decode step feeds one id
    rc, lines = validate(bad)
    assert rc == 1
    expected = [
        "step_0000/Qcur-0: shape [3, 7] does not fit layout 'T,H,Dh' = [3, 4, 64] (T = 3, S = 3)",
        "step_0001/Qrope-1: shape [1, 64, 4] does not fit layout 'T,H,Dh' = [1, 4, 64] (T = 1, S = 4); same element count",
        "step_0001/Qnorm-0: checkpoint 'Qnorm-0' does not exist for architecture llama",
        "step_0001/cache_k-0: shape [3, 2, 64] does not fit layout 'S,Hkv,Dh' = [4, 2, 64]",
        "step_0002/tokens: holds 2 ids; a decode step feeds one",
        "step_0002/embd: shape [1, 256] does not fit layout 'T,D' = [2, 256] (T = 2, S = 6)",
    ]
    assert_problems(lines, expected, counted=False)


def test_tolerated_forms_are_valid(ref_dump: Path, tmp_path: Path):
    """Optional dataset attributes absent, [T, H*Dh], permuted layouts, float16/float64/bf16 storage."""
    ok = copy(ref_dump, tmp_path, "tolerated.h5")
    with h5py.File(ok, "r+") as f:
        s0 = f["step_0000"]
        for name in ("embd", "attn_norm-0"):
            for a in ("order", "layer", "layout", "native_dtype"):
                dump_h5.set_attr(s0, name, a, None)
        q = s0["Qcur-0"][...]
        del s0["Qcur-0"]
        s0["Qcur-0"] = q.reshape(q.shape[0], -1)                      # [T, H*Dh]
        k = s0["Krope-1"][...]
        del s0["Krope-1"]
        s0["Krope-1"] = np.ascontiguousarray(k.transpose(1, 0, 2))    # [Hkv, T, Dh]
        dump_h5.set_attr(s0, "Krope-1", "layout", "Hkv,T,Dh")
        x = s0["ffn_out-0"][...]
        del s0["ffn_out-0"]
        s0["ffn_out-0"] = x.astype(np.float16)
        y = s0["ffn_out-1"][...]
        del s0["ffn_out-1"]
        s0["ffn_out-1"] = y.astype(np.float64)
        z = s0["l_out-1"][...]
        del s0["l_out-1"]
        s0["l_out-1"] = (z.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits (truncated)
        dump_h5.set_attr(s0, "l_out-1", "dtype", "bf16")
        f.attrs["device"] = dump_h5.fixed("a backend fact")
    rc, lines = validate(ok)
    assert rc == 0, lines
    with h5py.File(ok, "r+") as f:
        dump_h5.set_attr(f["step_0000"], "l_out-1", "dtype", None)
    rc, lines = validate(ok)
    assert rc == 1 and any("l_out-1: is uint16 without the attribute dtype" in line for line in lines), lines


def test_skeleton_and_a_dump_written_by_hand_with_h5py(ref_dump: Path, tmp_path: Path):
    r = run("validate", "--skeleton", str(MODEL), "--json")
    assert r.returncode == 0, r.stderr
    sk = json.loads(r.stdout)
    attrs = {a["name"]: a for a in sk["root_attributes"]}
    assert attrs["n_layer"]["value"] == 2 and attrs["arch"]["value"] == "llama"
    text = run("validate", "--skeleton", str(MODEL)).stdout
    assert "Qcur-0" in text and "[T, 4, 64]" in text and "[S, 2, 64]" in text

    # Only h5py and numpy, from the skeleton: the tokens of the reference, random checkpoints.
    with h5py.File(ref_dump, "r") as ref:
        prompt_ids = ref.attrs["token_ids"]
        all_ids = ref.attrs["all_token_ids"]
    hand = tmp_path / "hand.h5"
    rng = np.random.default_rng(0)
    with h5py.File(hand, "w") as f:
        for a in sk["root_attributes"]:
            v = a["value"]
            if a["type"] == "int32":
                f.attrs[a["name"]] = np.int32(v)
            elif a["type"] == "float64":
                f.attrs[a["name"]] = float(v)
            elif a["type"] == "bool":
                f.attrs[a["name"]] = np.bool_(v)
            elif a["type"] == "string" and v is not None:
                f.attrs[a["name"]] = np.bytes_(v.encode())  # fixed-length strings (numpy bytes)
        f.attrs.update({"backend": np.bytes_(b"h5py-by-hand"), "precision": np.bytes_(b"f32"),
                        "prompt": np.bytes_(b"1,17,42"), "token_ids": np.asarray(prompt_ids, np.int32),
                        "created_utc": np.bytes_(b"2026-11-23T05:00:00Z"), "diffrun_version": np.bytes_(b"hand"),
                        "all_token_ids": np.asarray(all_ids, np.int32)})
        n_kv = 0
        for step in range(3):
            ids = prompt_ids if step == 0 else all_ids[len(prompt_ids) + step - 1: len(prompt_ids) + step]
            T = len(ids)
            n_kv += T
            g = f.create_group(f"step_{step:04d}")
            rows = []
            for d in sk["datasets"]:
                shape = [T if s == "T" else n_kv if s == "S" else s for s in d["shape"]]
                if d["name"] == "tokens":
                    g.create_dataset("tokens", data=np.asarray(ids, np.int32))
                else:
                    g.create_dataset(d["name"], data=rng.standard_normal(shape).astype(np.float32))
                rows.append((d["name"], d["order"], d["layer"], d["layout"], "i32" if d["name"] == "tokens" else "f32"))
            # the step's attribute table: a numpy structured array (only the columns used)
            g["_attributes"] = np.array(rows, dtype=[("name", "S32"), ("order", "<i4"), ("layer", "<i4"),
                                                     ("layout", "S16"), ("native_dtype", "S4")])
    rc, lines = validate(hand)
    assert rc == 0, lines
    # diffrun's C++ reader reads it: compare runs (random data diverges: exit 1, not 2)
    r = run("compare", str(hand), str(ref_dump), "--tolerances", "fixtures/tolerances/f32_vs_f64.json")
    assert r.returncode == 1, r.stdout + r.stderr


def test_cuda_dump_is_valid(tmp_path: Path):
    """The CUDA engine's dump (f16) passes too; skipped where diffrun has no CUDA engine or no device."""
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    out = tmp_path / "cuda.h5"
    r = run("dump", "--backend", "cuda", "--precision", "f16", "--model", str(MODEL), "--tokens", "1,17,42",
            "--steps", "2", "--out", str(out))
    if r.returncode == 2 and ("without the CUDA engine" in r.stderr or "CUDA device" in r.stderr):
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    rc, lines = validate(out)
    assert rc == 0, lines


def test_foreign_names_are_problems_without_a_name_map(ref_dump: Path, tmp_path: Path):
    """llama.cpp's and Hugging Face's names (as tests/test_foreign_dumps.py writes them) pass with --names only."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_foreign_dumps import hf_fn, llamacpp_fn, rewrite

    lcpp = rewrite(ref_dump, tmp_path / "llamacpp.h5", llamacpp_fn("llama"))
    rc, lines = validate(lcpp)
    assert rc == 1 and any("step_0000/Qcur-0#3: not a checkpoint name of the vocabulary" in l for l in lines), lines
    r = run("validate", str(lcpp), "--names", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("validate", str(lcpp), "--names", "hf")  # the wrong map leaves llama.cpp's names unknown
    assert r.returncode == 1 and "nor of the name map" in r.stdout, r.stdout

    hf = rewrite(ref_dump, tmp_path / "hf.h5", hf_fn)
    rc, lines = validate(hf)
    assert rc == 1 and any("model.layers.0.self_attn.q_proj: not a checkpoint name" in l for l in lines), lines
    r = run("validate", str(hf), "--names", "hf")
    assert r.returncode == 0, r.stdout + r.stderr

    # a map that renames into the wrong shape: the mapped dataset is checked as compare reads it
    with h5py.File(hf, "r+") as f:
        for g in f.values():
            for n in list(g):
                if n not in ("tokens", "model.layers.0.mlp.up_proj"):
                    del g[n]
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"rules": [{"match": "model.layers.{L}.mlp.up_proj", "to": "attn_norm-{L}"}]}))
    r = run("validate", str(hf), "--names", str(own))
    assert r.returncode == 1, r.stdout
    assert "step_0001/model.layers.0.mlp.up_proj (mapped to attn_norm-0): shape [1, 1, 512] does not fit layout " \
           "'T,D' = [1, 256]" in r.stdout, r.stdout


def _validate_json(path: Path) -> tuple[dict, dict]:
    """`diffrun validate --json` and `python -m diffrun.validate --json` on one dump."""
    import sys
    cpp = run("validate", str(path), "--json")
    assert cpp.returncode in (0, 1), cpp.stderr
    py = subprocess.run([sys.executable, "-m", "diffrun.validate", str(path), "--json"], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "python")))
    assert py.returncode == cpp.returncode, py.stderr
    return json.loads(cpp.stdout), json.loads(py.stdout)


def test_layout_ambiguity_without_layout_attribute(tmp_path: Path):
    """Tiny llama has H = 4: a prompt of 4 tokens gives kq_soft_max [H, T, S] = [4, 4, 4] and Qcur [T, H, Dh] with
    T == H. Without a layout attribute, kq_soft_max's probabilities tell [H,T,S] from [T,H,S] (causal, summing to 1
    along S): stored transposed it is a problem; Qcur's dims cannot be told apart: a warning, the dump still valid.
    The Python validator says the same (its parity)."""
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    good = tmp_path / "t4.h5"
    r = run("dump", "--backend", "cpu", "--model", str(MODEL), "--tokens", "1,17,42,5", "--steps", "1", "--out", str(good))
    assert r.returncode == 0, r.stderr
    # The vocabulary's order, unlabelled: the data confirms it, no problem and no warning for kq_soft_max.
    plain = copy(good, tmp_path, "plain.h5")
    with h5py.File(plain, "a") as f:
        dump_h5.set_attr(f["step_0000"], "kq_soft_max-0", "layout", None)
        dump_h5.set_attr(f["step_0000"], "Qcur-0", "layout", None)
        dump_h5.set_attr(f["step_0000"], "Qrope-0", "layout", None)
    rc, lines = validate(plain)
    assert rc == 0, lines
    assert not any("kq_soft_max" in line for line in lines), lines
    warned = [line for line in lines if "warning:" in line]
    assert len(warned) == 1 and "step_0000/Qcur-0: warning: dims T and H are both 4 ([T,H,Dh] and [H,T,Dh] store " \
        "the same shape): ambiguous without a layout attribute (and 1 more dataset of this step)" in warned[0], lines
    cpp, py = _validate_json(plain)
    assert cpp["valid"] and cpp["warnings"] == py["warnings"] and len(cpp["warnings"]) == 1, (cpp, py)
    # Stored [T, H, S] without saying so: the probabilities read right only with T and H swapped.
    swapped = copy(good, tmp_path, "swapped.h5")
    with h5py.File(swapped, "a") as f:
        g = f["step_0000"]
        p = g["kq_soft_max-0"][()]
        del g["kq_soft_max-0"]
        g.create_dataset("kq_soft_max-0", data=np.ascontiguousarray(p.transpose(1, 0, 2)))
        dump_h5.set_attr(g, "kq_soft_max-0", "layout", None)
    rc, lines = validate(swapped)
    assert_problems(lines, ["step_0000/kq_soft_max-0: the layout looks like [T,H,S], not [H,T,S]: label it with the "
                            "layout attribute"], counted=False)
    assert rc == 1 and lines[-1].endswith(": 1 problem"), lines
    cpp, py = _validate_json(swapped)
    assert cpp["problems"] == py["problems"] and not cpp["valid"], (cpp, py)
    # The same data labelled: no problem, no warning.
    with h5py.File(swapped, "a") as f:
        dump_h5.set_attr(f["step_0000"], "kq_soft_max-0", "layout", "T,H,S")
    rc, lines = validate(swapped)
    assert rc == 0 and not any("warning" in line for line in lines), lines
