"""Dump size guard: the printed estimate against the written file, --max-dump-size, --softmax-rows (row_offset) through compare, validate, h5py and the Python reader."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import dump_h5

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))
MODEL = FIXTURES / "tiny-llama-f32.gguf"
TOKENS = "1,17,42,5,9,33,7,2,11,28,3,14"  # 12 prompt tokens
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from diffrun import dump as dump_reader  # noqa: E402
from diffrun import validate as py_validate  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DIFFRUN, *args], capture_output=True, text=True, timeout=120)


def dump(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", "2", "--out", str(out), *extra)


def estimate(stderr: str) -> float:
    m = re.search(r"each dump will take about ([0-9.]+) (B|kB|MB|GB|TB)", stderr)
    assert m, stderr
    return float(m.group(1)) * UNITS[m.group(2)]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, float]:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    out = tmp_path_factory.mktemp("dumpsize") / "full.h5"
    r = dump(out)
    assert r.returncode == 0, r.stderr
    return out, estimate(r.stderr)


def test_printed_estimate_matches_the_written_dump(full):
    path, est = full
    real = path.stat().st_size
    assert abs(est - real) / real < 0.03, (est, real)


def test_max_dump_size_refuses_before_running(full, tmp_path: Path):
    _, est = full
    out = tmp_path / "refused.h5"
    r = dump(out, "--max-dump-size", "10kB")
    assert r.returncode == 2, r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert "over --max-dump-size 10.0 kB" in msg and "--checkpoints" in msg and "--max-dump-size" in msg, msg
    assert "step 0" not in r.stderr  # nothing ran
    assert not out.exists() and not list(tmp_path.glob("refused.h5*tmp-*"))
    # The top-level job checks before running too.
    r = run("--model", str(MODEL), "--tokens", TOKENS, "--steps", "2", "--out", str(tmp_path / "job"),
            "--max-dump-size", "10kB")
    assert r.returncode == 2 and "over --max-dump-size" in r.stderr, r.stderr
    assert not (tmp_path / "job" / "reference.h5").exists()
    # A filter brings it under; 0 lifts the limit.
    assert dump(tmp_path / "filtered.h5", "--max-dump-size", "200kB", "--checkpoints", "result_*").returncode == 0
    assert dump(tmp_path / "unlimited.h5", "--max-dump-size", "0").returncode == 0
    r = dump(tmp_path / "bad.h5", "--max-dump-size", "lots")
    assert r.returncode == 2 and "size 'lots'" in r.stderr, r.stderr


def test_softmax_rows_auto_keeps_the_limit_and_compares(full, tmp_path: Path):
    path, est = full
    # Just under the full size: kq_soft_max keeps as many of its last rows as fit.
    limit = int(est - 2000)
    out = tmp_path / "rows.h5"
    r = dump(out, "--max-dump-size", str(limit), "--cache-rows", "all")  # else the cache's rows are cut first
    assert r.returncode == 0, r.stderr
    m = re.search(r"kq_soft_max keeps its last (\d+) rows", r.stderr)
    assert m, r.stderr
    rows = int(m.group(1))
    assert 1 <= rows < 12
    assert out.stat().st_size <= limit
    with h5py.File(out, "r") as f:  # plain h5py
        ds = f["step_0000/kq_soft_max-0"]
        assert ds.shape[1] == rows and dump_h5.attrs(f, 0, "kq_soft_max-0")["row_offset"] == 12 - rows
        with h5py.File(path, "r") as g:
            np.testing.assert_array_equal(ds[()], g["step_0000/kq_soft_max-0"][()][:, 12 - rows:, :])
        assert "row_offset" not in dump_h5.attrs(f, 1, "kq_soft_max-0")  # one-token decode steps keep their row
    info = dump_reader.open(out).info("kq_soft_max-0", 0)
    assert info.row_offset == 12 - rows and info.shape[1] == rows
    assert run("validate", str(out)).returncode == 0
    assert py_validate.validate(out).valid
    # Against the full dump, compare checks the rows both hold, either way round.
    for a, b in ((out, path), (path, out)):
        r = run("compare", str(a), str(b))
        assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    # A wrong value in those rows is found.
    bad = tmp_path / "bad.h5"
    shutil.copy(out, bad)
    with h5py.File(bad, "r+") as f:
        ds = f["step_0000/kq_soft_max-1"]
        x = ds[()]
        x[0, -1, 0] += 0.25
        ds[...] = x
    r = run("compare", str(bad), str(path))
    assert r.returncode == 1 and "kq_soft_max-1" in r.stdout, r.stdout


def test_explicit_softmax_rows_and_bad_row_offset(full, tmp_path: Path):
    out = tmp_path / "three.h5"
    assert dump(out, "--softmax-rows", "3").returncode == 0
    with h5py.File(out, "r") as f:
        assert f["step_0000/kq_soft_max-0"].shape[1] == 3
    bad = tmp_path / "offset.h5"
    shutil.copy(out, bad)
    with h5py.File(bad, "r+") as f:
        dump_h5.set_attr(f["step_0000"], "kq_soft_max-0", "row_offset", 12)
        dump_h5.set_attr(f["step_0000"], "tokens", "row_offset", 0)
    r = run("validate", str(bad))
    assert r.returncode == 1, r.stdout
    assert "row_offset' is 12, outside" in r.stdout and "only for checkpoints with token or cache rows" in r.stdout, r.stdout
    res = py_validate.validate(bad)
    text = "\n".join(str(p) for p in res.problems)
    assert "outside the step's 12 token rows" in text and "only for checkpoints with token or cache rows" in text, text
