"""The tensor-parallel example engine end to end at N = 2 and 4: clean, its rank dumps compare within tolerance; each
seeded shard bug is the first divergence, at its checkpoint and step, with its rank named.

Needs DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (ctest sets them), the `gguf` package and the diffrun package.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

HERE = Path(__file__).resolve().parent
BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))
MODEL = FIXTURES / "tiny-llama-f32.gguf"  # H = 4, Hkv = 2 (at N = 4 each KV head is on two ranks), F = 512, V = 1459


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not BIN or not MODEL.exists():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (with tiny-llama-f32.gguf) must be set: run through ctest")
    out = tmp_path_factory.mktemp("tp_numpy_engine") / "ref.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(MODEL),
                    "--tokens", "1,5,9,13,200,31", "--steps", "2", "--out", str(out)], check=True, capture_output=True)
    return out


def run_engine(reference, out, world, *args):
    cmd = [sys.executable, str(HERE / "tp_numpy_engine.py"), "--model", str(MODEL), "--reference", str(reference),
           "--out", str(out), "--world-size", str(world), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/")  # any directory: the package is installed


def compare(ranks, reference, tmp_path):
    report = tmp_path / "report.json"
    r = subprocess.run([BIN, "compare", str(ranks), str(reference), "--no-color", "--report-json", str(report)],
                       capture_output=True, text=True)
    return r.returncode, json.loads(report.read_text()), r.stdout


def shard_attributes(path, name, step=0):
    """The split / shard_offset / partial columns of one dataset's row of a step's attribute table."""
    with h5py.File(path, "r") as f:
        row = next(r for r in f[f"step_{step:04d}/_attributes"][()] if r["name"] == name.encode())
    absent = -(2 ** 31)
    out = {"split": row["split"].decode()} if row["split"] else {}
    out.update({k: int(row[k]) for k in ("shard_offset", "partial") if int(row[k]) != absent})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_clean_ranks_are_within_tolerance(reference, tmp_path, world):
    r = run_engine(reference, tmp_path / "tp", world)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == [f"rank{i}.h5" for i in range(world)]
    v = subprocess.run([BIN, "validate", str(tmp_path / "tp")], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    rc, report, text = compare(tmp_path / "tp", reference, tmp_path)
    assert rc == 0, text
    assert report.get("first_divergence") is None
    assert len([c for c in report["checkpoints"] if c["metrics"]]) > 100


def test_each_rank_records_what_it_holds(reference, tmp_path):
    """Rank 3 of 4 in the Megatron layout: query head 3, a copy of KV head 1 (3·2/4 floored), FFN channels 384..,
    the vocabulary from ceil(1459/4)·3 = 1095; partial sums before each all-reduce; replicated values after."""
    assert run_engine(reference, tmp_path / "tp", 4).returncode == 0
    rank3 = tmp_path / "tp" / "rank3.h5"
    with h5py.File(rank3, "r") as f:
        assert (int(f.attrs["rank"]), int(f.attrs["world_size"])) == (3, 4)
    expected = {
        "Qcur-0": {"split": "H", "shard_offset": 3}, "kq_soft_max-1": {"split": "H", "shard_offset": 3},
        "Kcur-0": {"split": "Hkv", "shard_offset": 1}, "cache_v-1": {"split": "Hkv", "shard_offset": 1},
        "ffn_up-0": {"split": "F", "shard_offset": 384}, "ffn_swiglu-1": {"split": "F", "shard_offset": 384},
        "attn_out-0": {"partial": 1}, "ffn_out-1": {"partial": 1},
        "result_output": {"split": "V", "shard_offset": 1095},
        "embd": {}, "attn_norm-0": {}, "ffn_inp-0": {}, "l_out-1": {}, "result_norm": {},
    }
    assert {name: shard_attributes(rank3, name) for name in expected} == expected


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bug, name, step", [
    ("wq_wrong_shard", "Qcur-0", 0),
    ("attn_allreduce_skipped", "ffn_inp-0", 0),  # attn_out's partials are right; the residual is the first sum
    ("rope_position_offset", "Qrope-0", 1),      # the prefill's positions are right
    ("kv_stale_row", "cache_k-0", 1),
])
def test_seeded_shard_bug_names_its_rank(reference, tmp_path, world, bug, name, step):
    check_bug(reference, tmp_path, world, bug, 1, name, step)


@pytest.mark.parametrize("bug, name, step", [
    ("attn_allreduce_skipped", "ffn_inp-0", 0),  # rank 0's copy of a replicated value is the wrong one
    ("kv_stale_row", "cache_k-0", 1),            # rank 0's copy of KV head 0, which rank 1 also holds
])
def test_a_wrong_copy_on_rank_0_blames_rank_0(reference, tmp_path, bug, name, step):
    check_bug(reference, tmp_path, 4, bug, 0, name, step)


def check_bug(reference, tmp_path, world, bug, rank, name, step):
    r = run_engine(reference, tmp_path / "tp", world, "--bug", bug, "--bug-rank", rank)
    assert r.returncode == 0, r.stderr
    rc, report, text = compare(tmp_path / "tp", reference, tmp_path)
    assert rc == 1, text
    first = report["first_divergence"]
    assert (first["name"], first["step"]) == (name, step), text
    assert first["verdict"]["kind"] == "local", text
    failing = next(c for c in report["checkpoints"] if (c["name"], c["step"]) == (name, step))
    assert failing["ranks"]["blamed"] == [rank], text
    assert f"ranks     rank {rank}" in text, text


@pytest.mark.parametrize("args, message", [
    (["--world-size", "3"], "must both be multiples of the world size 3"),
    (["--world-size", "2", "--bug", "kv_stale_row", "--bug-rank", "2"], "--bug-rank 2 is not a rank of world size 2"),
])
def test_bad_input_exits_2(reference, tmp_path, args, message):
    cmd = [sys.executable, str(HERE / "tp_numpy_engine.py"), "--model", str(MODEL), "--reference", str(reference),
           "--out", str(tmp_path / "tp"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "tp").exists()


def test_a_directory_holding_other_dumps_is_refused(reference, tmp_path):
    assert run_engine(reference, tmp_path / "tp", 4).returncode == 0
    r = run_engine(reference, tmp_path / "tp", 2)
    assert r.returncode == 2 and "holds other dumps (rank2.h5, rank3.h5)" in r.stderr, r.stderr
