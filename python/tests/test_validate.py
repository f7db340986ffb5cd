"""diffrun.validate on a set of broken dumps: the problems it lists, and the same list as `diffrun validate --json`
(the C++ checks in dump/dump_validate.cpp) wherever the built diffrun has that command.

Needs DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (ctest sets them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from diffrun import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import dump_h5  # noqa: E402  (plain-h5py edits of the attribute table)

BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")
    out = tmp_path_factory.mktemp("validate") / "good.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f32", "--model",
                    str(FIXTURES / "tiny-llama-q8_0.gguf"), "--tokens", "1,5,9", "--steps", "2", "--out", str(out)],
                   check=True, capture_output=True)
    return out


def _replace(g, name, data, **attrs):
    """Replaces a dataset; its row of the step's attribute table stays, with `attrs` set on it."""
    if name in g:
        del g[name]
    g.create_dataset(name, data=data)
    for k, v in attrs.items():
        dump_h5.set_attr(g, name, k, v)


def break_root(f):
    del f.attrs["n_ff"]
    f.attrs["precision"] = dump_h5.fixed("fp32")
    f.attrs["backend"] = dump_h5.fixed("")
    f.attrs["format_version"] = np.int32(3)
    f.attrs["all_token_ids"] = np.array([9, 9, 9, 9, 9], np.int32)


def break_steps(f):
    del f["step_0001/tokens"]
    f.move("step_0002", "step_0003")
    f.attrs["argmax"] = np.array([1, 2, 3, 4, 5], np.int32)


def break_datasets(f):
    g = f["step_0000"]
    _replace(g, "attn_norm-0", np.zeros((3, 7), np.float32))                  # wrong shape
    q = g["Qcur-0"][()]
    _replace(g, "Qcur-0", q.reshape(3, -1))                                   # [T, H*Dh]: fine
    _replace(g, "Kcur-0", g["Kcur-0"][()].transpose(1, 0, 2).copy())          # permuted, layout says T,Hkv,Dh
    _replace(g, "Vcur-0", g["Vcur-0"][()], layout="T,H,Dh")                   # not a permutation
    dump_h5.set_attr(g, "ffn_up-1", "layer", 0)
    dump_h5.set_attr(g, "ffn_gate-1", "order", 3)
    dump_h5.set_attr(g, "ffn_out-1", "native_dtype", "q8")
    _replace(g, "l_out-0", np.zeros((3, 256), np.uint16))                     # bf16 bits without dtype
    _replace(g, "l_out-1", np.zeros((3, 256), np.int64))
    _replace(g, "embd", g["embd"][()], dtype="bf16")                          # dtype on float data
    _replace(g, "result_norm", g["result_norm"][()].astype(np.float16))       # fine
    _replace(g, "ffn_norm-0", g["ffn_norm-0"][()].astype(np.float64))         # fine
    g.create_dataset("my_engine.extra", data=np.zeros(3, np.float32))
    g.create_dataset("Qnorm-0", data=q)                                       # llama has no q norm
    g.create_dataset("Qcur-7", data=q)                                        # layer outside the model
    dump_h5.set_attr(g, "tokens", "layout", "S")


def no_config(f):
    del f.attrs["arch"]
    f.attrs["n_head_kv"] = np.int32(3)
    f.attrs["rms_eps"] = -1.0
    f.attrs["qk_norm"] = dump_h5.fixed("yes")


BREAKS = {"root": break_root, "steps": break_steps, "datasets": break_datasets, "no_config": no_config}


def broken(good: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / f"{how}.h5"
    shutil.copy(good, path)
    with h5py.File(path, "a") as f:
        BREAKS[how](f)
    return path


def problems(path) -> list[tuple[str, str]]:
    return [(p.where, p.what) for p in validate.validate(path).problems]


def test_a_diffrun_dump_is_valid(good):
    r = validate.validate(good)
    assert r.valid and r.n_steps == 3, r.problems


@pytest.mark.parametrize("how, expected", [
    ("root", [
        ("root attribute 'precision'", 'is "fp32", expected "f16", "bf16", "f32" or "f64"'),
        ("root attribute 'backend'", "is empty (name the engine that wrote the dump)"),
        ("root attribute 'n_ff'", "missing (an int32 scalar)"),
        ("root attribute 'format_version'", "is 3, this diffrun reads versions 1 to 2"),
        ("root attribute 'all_token_ids'", "does not start with token_ids"),
        ("/", "datasets are not checked against the vocabulary: the config attributes are incomplete"),
    ]),
    ("steps", [
        ("step_0001/tokens", "missing (every step records the ids it was fed, int32 [T])"),
        ("step_0002", "missing: steps are numbered from 0 without gaps (last step is 3)"),
        ("root attribute 'argmax'", "holds 5 ids for 3 steps (one per step)"),
    ]),
    ("datasets", [
        ("step_0000/attn_norm-0", "shape [3, 7] does not fit layout 'T,D' = [3, 256] (T = 3, S = 3)"),
        ("step_0000/Kcur-0", "same element count: a permuted array needs its layout attribute"),
        ("step_0000/Vcur-0", "layout 'T,H,Dh' is not a permutation of the vocabulary's 'T,Hkv,Dh'"),
        ("step_0000/ffn_up-1", "attribute 'layer' is 0 but the name says 1"),
        ("step_0000/ffn_gate-1", "attribute 'order' is 3 but the vocabulary puts it at"),
        ("step_0000/ffn_out-1", "attribute 'native_dtype' is \"q8\""),
        ("step_0000/l_out-0", "is uint16 without the attribute dtype = \"bf16\""),
        ("step_0000/l_out-1", "is an integer of 8 bytes; float checkpoints are"),
        ("step_0000/embd", "attribute 'dtype' = \"bf16\" on float data"),
        ("step_0000/my_engine.extra", "not a checkpoint name of the vocabulary"),
        ("step_0000/Qnorm-0", "does not exist for architecture llama without per-head q/k norms"),
        ("step_0000/Qcur-7", "layer 7 outside 0..1"),
        ("step_0000/tokens", "attribute 'layout' is \"S\", expected \"T\""),
    ]),
    ("no_config", [
        ("root attribute 'arch'",
         "missing (a string: \"llama\", \"qwen2\", \"qwen3\", \"gemma3\", \"qwen3moe\" or \"qwen2moe\")"),
        ("root attribute 'qk_norm'", "is a string, expected a boolean (h5py bool, or an integer 0/1)"),
        ("root attribute 'rms_eps'", "is -1.000000, expected a positive real"),
        ("root attribute 'n_head_kv'", "is 3, which does not divide n_head = 4"),
    ]),
])
def test_broken_dumps_list_each_problem(good, tmp_path, how, expected):
    found = problems(broken(good, tmp_path, how))
    for where, what in expected:
        assert any(w == where and what in t for w, t in found), (where, what, found)
    wheres = [w for w, _ in found]
    assert not any(w in ("step_0000/Qcur-0", "step_0000/result_norm", "step_0000/ffn_norm-0") for w in wheres)


def test_unreadable_files_raise(tmp_path):
    with pytest.raises(validate.DumpFormatError, match="nope.h5: no such file"):
        validate.validate(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(validate.DumpFormatError, match="text.h5: not an HDF5 file"):
        validate.validate(tmp_path / "text.h5")


def _cpp_has_validate() -> bool:
    if not BIN:
        return False
    text = subprocess.run([BIN, "--help"], capture_output=True, text=True).stdout
    return any(line.split()[:1] == ["validate"] for line in text.split("Subcommands:")[-1].splitlines())


@pytest.mark.parametrize("how", ["good", *BREAKS])
def test_python_and_cpp_agree(good, tmp_path, how):
    if not _cpp_has_validate():
        pytest.skip("this diffrun has no `validate` command yet")
    path = good if how == "good" else broken(good, tmp_path, how)
    r = subprocess.run([BIN, "validate", str(path), "--json"], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    cpp = [(p["where"], p["what"]) for p in json.loads(r.stdout)["problems"]]
    assert problems(path) == cpp
    py = subprocess.run([sys.executable, "-m", "diffrun.validate", str(path)], capture_output=True, text=True)
    assert py.returncode == r.returncode
