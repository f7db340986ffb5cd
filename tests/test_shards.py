"""Sharded dumps (docs/dump-format.md, "Shards"): a CPU reference dump of a tiny fixture split into N rank dumps the
Megatron way (scripts/shard_dump.py) merges back and compares clean against the whole dump; a seeded shard bug is
found at its checkpoint with the rank and slice named; broken rank sets are refused (exit 2) with the reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = os.environ.get("DIFFRUN_BIN")
FIXTURES = os.environ.get("DIFFRUN_FIXTURE_DIR")
ROOT = Path(__file__).resolve().parent.parent
SHARD = ROOT / "scripts" / "shard_dump.py"


def run(*args):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True)


def shard(ref, out, *args):
    subprocess.run([sys.executable, SHARD, ref, out, *map(str, args)], check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    if not BIN or not FIXTURES:
        pytest.skip("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR are set by ctest (test_shards)")
    d = tmp_path_factory.mktemp("ref")
    # tiny-llama: H = 4, Hkv = 2 (so at N = 4 each KV head is copied to two ranks), F = 512; prefill and 2 decodes
    r = run("dump", "--backend", "cpu", "--precision", "f64", "--model", Path(FIXTURES) / "tiny-llama-f32.gguf",
            "--tokens", "1,5,9,13", "--steps", "2", "--out", d / "ref.h5")
    assert r.returncode == 0, r.stderr
    return d / "ref.h5"


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_dumps_merge_back_to_the_whole_dump(ref, tmp_path, ranks):
    out = shard(ref, tmp_path / "tp", "--ranks", ranks)
    for f in sorted(out.iterdir()):
        r = run("validate", f)
        assert r.returncode == 0, r.stdout + r.stderr
    r = run("compare", out, ref, "--report-json", tmp_path / "r.json", "--summary")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    compared = [c for c in report["checkpoints"] if c["metrics"]]
    assert len(compared) > 100
    # the merge gives the whole dump back bit for bit (partials cut exactly, slices placed at their offsets)
    assert all(c["metrics"]["max_abs"] == 0 for c in compared)
    # the files listed one by one are the same set
    files = sorted(out.iterdir())
    assert run("compare", *files, ref, "--summary").returncode == 0


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_corrupted_shard_names_its_rank_and_slice(ref, tmp_path, ranks):
    # rank 1's first local query head scaled: at N = 2 rank 1 holds heads 2..3, at N = 4 head 1
    out = shard(ref, tmp_path / "bad", "--ranks", ranks, "--corrupt", "Qcur-1:1")
    r = run("compare", out, ref, "--report-json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    heads = 4 // ranks
    lo, hi = heads, 2 * heads - 1
    assert "FIRST DIVERGENCE  Qcur-1  (step 0, layer 1)" in r.stdout
    assert f"ranks     rank 1 (H {lo}..{hi})" in r.stdout, r.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["first_divergence"]
    failed = next(c for c in report["checkpoints"] if c["name"] == "Qcur-1" and c["step"] == 0)
    assert first["name"] == "Qcur-1" and first["step"] == 0
    assert failed["ranks"]["split"] == "H" and failed["ranks"]["blamed"] == [1]
    share = failed["ranks"]["ranks"][1]
    assert (share["from"], share["to"], share["failed"]) == (lo, hi + 1, True)


def test_a_replica_that_differs_names_its_rank(ref, tmp_path):
    out = shard(ref, tmp_path / "rep", "--ranks", 2, "--corrupt", "l_out-0:1")
    r = run("compare", out, ref)
    assert r.returncode == 1
    assert "FIRST DIVERGENCE  l_out-0  (step 0, layer 0)" in r.stdout
    assert "rank 1" in r.stdout and "its copy differs" in r.stdout, r.stdout


@pytest.mark.parametrize("ranks, corrupt, name", [
    (2, "l_out-0:0", "l_out-0"),      # rank 0's copy of a replicated checkpoint
    (4, "cache_k-0:0", "cache_k-0"),  # rank 0's copy of KV head 0, which rank 1 holds too
])
def test_a_wrong_copy_on_rank_0_names_rank_0_alone(ref, tmp_path, ranks, corrupt, name):
    """Each rank is judged on its own copy, not on the one the merge presents: the rank whose copy is wrong is named,
    the lowest rank included, and the rank holding the right copy is not; the verdict is local (rule replicas)."""
    out = shard(ref, tmp_path / "rep", "--ranks", ranks, "--corrupt", corrupt)
    r = run("compare", out, ref, "--report-json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["first_divergence"]
    failed = next(c for c in report["checkpoints"] if c["name"] == name and c["step"] == 0)
    assert (first["name"], first["step"]) == (name, 0), r.stdout
    assert failed["ranks"]["blamed"] == [0], r.stdout
    assert [s["rank"] for s in failed["ranks"]["ranks"] if s["copy_differs"]] == [0], r.stdout
    assert first["verdict"]["kind"] == "local" and first["verdict"]["rule"] == "replicas", r.stdout


def test_a_wrong_partial_sum_says_it_cannot_name_a_rank(ref, tmp_path):
    out = shard(ref, tmp_path / "part", "--ranks", 2, "--corrupt", "attn_out-1:1")
    r = run("compare", out, ref)
    assert r.returncode == 1
    assert "FIRST DIVERGENCE  attn_out-1  (step 0, layer 1)" in r.stdout
    assert "partial sums of 2 ranks" in r.stdout


def test_broken_rank_sets_are_refused(ref, tmp_path):
    two = shard(ref, tmp_path / "two", "--ranks", 2)
    four = shard(ref, tmp_path / "four", "--ranks", 4)
    gap = shard(ref, tmp_path / "gap", "--ranks", 4, "--drop-rank", 2)
    cases = {
        "rank 2 missing": [gap, ref],
        "rank dumps of different world sizes": [two / "rank0.h5", four / "rank1.h5", ref],
        "are both rank 0": [two / "rank0.h5", two / "rank0.h5", ref],
        "give all of them, or their directory": [two / "rank1.h5", ref],
        "not a rank dump": [ref, two / "rank1.h5", ref],
    }
    for message, args in cases.items():
        r = run("compare", *args)
        assert r.returncode == 2, (message, r.stdout, r.stderr)
        assert message in r.stderr, (message, r.stderr)


def _edit(path, fn):
    import h5py
    with h5py.File(path, "r+") as f:
        fn(f)


def _root(key, value):
    import numpy as np
    return lambda f: f.attrs.modify(key, np.int64(value))


def _row(name, column, value):
    """Sets one column of the first step's attribute-table row of checkpoint `name`."""
    def fn(f):
        step = sorted(k for k in f.keys() if k.startswith("step_"))[0]
        table = f[step]["_attributes"]
        rows = table[()]
        for i, r in enumerate(rows):
            if bytes(r["name"]).decode() == name:
                rows[i][column] = value
        table[...] = rows
    return fn


@pytest.mark.parametrize("broken", [
    ("world_size 0", _root("world_size", 0)),
    ("rank past world_size", _root("rank", 3)),
    ("world_size missing", lambda f: f.attrs.__delitem__("world_size")),
    ("split not a layout letter", _row("Qcur-0", "split", b"X")),
    ("slice past the dimension", _row("Qcur-0", "shard_offset", 3)),
    ("partial not 0 or 1", _row("attn_out-0", "partial", 2)),
    ("split and partial together", _row("Qcur-0", "partial", 1)),
], ids=lambda b: b[0])
def test_both_validators_read_rank_dumps_alike(ref, tmp_path, broken):
    """diffrun validate and the Python package's validator accept the rank dumps and give the same problems,
    word for word, for each broken shard attribute."""
    from diffrun.validate import validate
    out = shard(ref, tmp_path / "tp", "--ranks", 2)
    rank1 = out / "rank1.h5"
    assert validate(rank1).valid
    _edit(rank1, broken[1])
    r = run("validate", rank1, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    cpp = [(p["where"], p["what"]) for p in json.loads(r.stdout)["problems"]]
    py = [(p.where, p.what) for p in validate(rank1).problems]
    assert cpp and sorted(cpp) == sorted(py)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_python_reader_reads_a_rank_directory_as_the_whole_dump(ref, tmp_path, ranks):
    """diffrun.open(DIR) merges the rank dumps (at N = 4 each KV head is a copy on two ranks): every checkpoint of
    every step equals the unsharded dump's, shape and values."""
    import numpy as np
    import diffrun
    out = shard(ref, tmp_path / "tp", "--ranks", ranks)
    with diffrun.open(out) as merged, diffrun.open(ref) as whole:
        assert merged.world_size == ranks and merged.steps() == whole.steps()
        for step in whole.steps():
            assert sorted(merged.names(step)) == sorted(whole.names(step))
            for name in whole.names(step):
                a, b = merged.get(name, step), whole.get(name, step)
                assert merged.info(name, step).shape == whole.info(name, step).shape == b.shape, name
                assert a.shape == b.shape and np.array_equal(a, b), (step, name)


def test_the_python_reader_refuses_a_broken_rank_set(ref, tmp_path):
    import diffrun
    out = shard(ref, tmp_path / "tp", "--ranks", 4, "--drop-rank", 2)
    with pytest.raises(diffrun.DumpFormatError, match="rank 2 of world_size 4 missing"):
        diffrun.open(out)
    with pytest.raises(diffrun.DumpFormatError, match="not a rank dump"):
        diffrun.open_ranks([ref, out / "rank0.h5"])


def test_validate_checks_a_rank_directory_and_its_set(ref, tmp_path):
    """diffrun validate DIR: each rank dump, then the set as compare merges it (exit 1 for a broken set)."""
    out = shard(ref, tmp_path / "tp", "--ranks", 2)
    r = run("validate", out)
    assert r.returncode == 0 and "2 dumps that compare reads as one" in r.stdout, r.stdout + r.stderr
    gap = shard(ref, tmp_path / "gap", "--ranks", 4, "--drop-rank", 2)
    r = run("validate", gap)
    assert r.returncode == 1 and "rank set:" in r.stdout and "rank 2 missing" in r.stdout, r.stdout + r.stderr
    r = run("validate", out, "--json")
    assert r.returncode == 2 and "takes one dump" in r.stderr, r.stdout + r.stderr


def test_a_tensor_parallel_engine_against_one_gpu_takes_the_cross_preset(ref, tmp_path):
    """TP invariance (DESIGN.md, "Tensor parallelism"): rank dumps whose ranks carry the tensor_parallel fact, compared
    against a dump of the same backend and precision without it, are judged by <p>_vs_<p>_cross (the summation orders
    differ), not by the bit-exact <p>_vs_<p>; without the fact on either side, <p>_vs_<p>."""
    import h5py
    import numpy as np
    whole = tmp_path / "f32.h5"
    r = run("dump", "--backend", "cpu", "--precision", "f32", "--model", Path(FIXTURES) / "tiny-llama-f32.gguf",
            "--tokens", "1,5,9,13", "--steps", "2", "--out", whole)
    assert r.returncode == 0, r.stderr
    ranks = shard(whole, tmp_path / "tp", "--ranks", "2")

    def preset(engine, reference):
        report = tmp_path / "report.json"
        c = run("compare", engine, reference, "--no-color", "--report-json", report)
        assert c.returncode in (0, 1), c.stderr
        return json.loads(report.read_text())["tolerances"]["preset"]

    assert preset(ranks, whole) == "f32_vs_f32"
    for p in sorted(ranks.iterdir()):
        with h5py.File(p, "r+") as f:
            f.attrs["tensor_parallel"] = np.bytes_("2 ranks")  # fixed-length, as the format stores strings
    assert preset(ranks, whole) == "f32_vs_f32_cross"
