"""Dump volume: the cache rows of each step, the last logits and token rows (row_offset), --compress; read back by plain h5py, the Python reader, compare and both validators."""
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
STEPS = 3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from diffrun import dump as dump_reader  # noqa: E402
from diffrun import validate as py_validate  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DIFFRUN, *args], capture_output=True, text=True, timeout=120)


def dump(out: Path, *extra: str) -> Path:
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr
    return out


def valid(path: Path) -> None:
    r = run("validate", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    res = py_validate.validate(path)
    assert res.valid, res.problems


def compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return run("compare", str(a), str(b))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    d = tmp_path_factory.mktemp("dumprows")
    return {
        "default": dump(d / "default.h5", "--cache-rows", "step"),
        # every row of everything: what dumps held before row cuts
        "all": dump(d / "all.h5", "--cache-rows", "all", "--logits-rows", "0"),
    }


def test_cache_holds_the_rows_each_step_wrote(dumps):
    default, full = dumps["default"], dumps["all"]
    with h5py.File(default, "r") as f, h5py.File(full, "r") as g:
        assert f["step_0000/cache_k-0"].shape[0] == 12 and "row_offset" not in dump_h5.attrs(f, 0, "cache_k-0")
        for step in range(1, STEPS + 1):
            for name in ("cache_k-1", "cache_v-0"):
                ds = f[f"step_{step:04d}/{name}"]
                assert ds.shape[0] == 1 and dump_h5.attrs(f, step, name)["row_offset"] == 11 + step
                whole = g[f"step_{step:04d}/{name}"][()]
                assert whole.shape[0] == 12 + step
                np.testing.assert_array_equal(ds[()], whole[-1:])
    assert default.stat().st_size < full.stat().st_size
    valid(default)
    valid(full)


def test_the_cache_keeps_every_row_unless_over_the_limit(dumps, tmp_path: Path):
    out = dump(tmp_path / "auto.h5")
    with h5py.File(out, "r") as f:
        assert f["step_0002/cache_k-0"].shape[0] == 14 and "row_offset" not in dump_h5.attrs(f, 2, "cache_k-0")
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(tmp_path / "x.h5"),
            "--max-dump-size", "0")
    est = float(re.search(r"each dump will take about ([0-9.]+) kB", r.stderr).group(1)) * 1e3
    small = tmp_path / "small.h5"
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(small),
            "--max-dump-size", str(int(est - 1000)))
    assert r.returncode == 0 and "cache_k/cache_v keep the rows each step wrote" in r.stderr, r.stderr
    assert "kq_soft_max keeps" not in r.stderr, r.stderr  # the cache's rows were enough
    with h5py.File(small, "r") as f:
        assert f["step_0002/cache_k-0"].shape[0] == 1
    assert small.stat().st_size <= est - 1000


def test_readers_put_the_cache_back_together(dumps):
    default, full = dumps["default"], dumps["all"]
    with dump_reader.open(default) as a, dump_reader.open(full) as b:
        for step in a.steps():
            for name in a.names(step):
                if name == "result_output":
                    continue
                ia = a.info(name, step)
                assert ia.shape == b.info(name, step).shape and ia.row_offset == 0, (name, step)
                np.testing.assert_array_equal(a.get(name, step), b.get(name, step))
    # C++: compare both ways, and show presents [S, Hkv, Dh].
    for x, y in ((default, full), (full, default)):
        r = compare(x, y)
        assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    r = run("show", str(default), "cache_v-1", "--step", "3")
    assert r.returncode == 0 and "shape [15, 2, 64]" in r.stdout.splitlines()[0], r.stdout + r.stderr


def test_a_cache_missing_earlier_rows_compares_the_rows_it_holds(dumps, tmp_path: Path):
    default, full = dumps["default"], dumps["all"]
    partial = tmp_path / "partial.h5"
    shutil.copy(default, partial)
    with h5py.File(partial, "r+") as f:
        del f["step_0001/cache_k-0"]  # step 2's cache_k-0 cannot be put back together
    with dump_reader.open(partial) as p:
        info = p.info("cache_k-0", 2)
        assert info.row_offset == 13 and info.shape[0] == 1
        assert p.info("cache_k-0", 3).row_offset == 14
    r = compare(partial, full)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    # The rows it holds are compared: a wrong value there is found.
    with h5py.File(partial, "r+") as f:
        ds = f["step_0002/cache_k-0"]
        x = ds[()]
        x[0, 1, 5] += 0.5
        ds[...] = x
    r = compare(partial, full)
    assert r.returncode == 1 and "cache_k-0" in r.stdout, r.stdout


def test_a_wrong_cache_row_in_an_earlier_step_shows_in_every_later_step(dumps, tmp_path: Path):
    default, full = dumps["default"], dumps["all"]
    bad = tmp_path / "bad.h5"
    shutil.copy(default, bad)
    with h5py.File(bad, "r+") as f:
        ds = f["step_0000/cache_v-1"]
        x = ds[()]
        x[3, 0, 0] += 0.5
        ds[...] = x
    r = run("compare", str(bad), str(full), "--report-json", str(tmp_path / "r.json"))
    assert r.returncode == 1, r.stdout
    import json

    results = json.loads((tmp_path / "r.json").read_text())
    failing = {(c["step"], c["name"]) for c in results["checkpoints"] if c["status"] == "fail"}
    assert {(s, "cache_v-1") for s in range(STEPS + 1)} <= failing, failing


def test_logits_rows(dumps, tmp_path: Path):
    full = dumps["all"]
    out = dump(tmp_path / "logits.h5", "--logits-rows", "4")
    with h5py.File(out, "r") as f, h5py.File(full, "r") as g:
        ds = f["step_0000/result_output"]
        assert ds.shape[0] == 4 and dump_h5.attrs(f, 0, "result_output")["row_offset"] == 8
        np.testing.assert_array_equal(ds[()], g["step_0000/result_output"][()][8:])
        assert "row_offset" not in dump_h5.attrs(f, 1, "result_output")
    with dump_reader.open(out) as d:
        assert d.info("result_output", 0).row_offset == 8 and d.get("result_output", 0).shape[0] == 4
    valid(out)
    for x, y in ((out, full), (full, out)):
        r = compare(x, y)
        assert r.returncode == 0 and "RESULT: PASS" in r.stdout and "4/4 steps agree" in r.stdout, r.stdout + r.stderr
    # The default keeps 64 rows: a 12-token prefill keeps them all.
    with h5py.File(dumps["default"], "r") as f:
        assert f["step_0000/result_output"].shape[0] == 12


def test_token_rows(dumps, tmp_path: Path):
    full = dumps["all"]
    out = dump(tmp_path / "tokens.h5", "--token-rows", "5")
    with h5py.File(out, "r") as f, h5py.File(full, "r") as g:
        for name, rd in (("attn_norm-0", 0), ("Qcur-1", 0), ("ffn_up-0", 0), ("kq_soft_max-1", 1), ("result_output", 0)):
            ds = f[f"step_0000/{name}"]
            assert ds.shape[rd] == 5 and dump_h5.attrs(f, 0, name)["row_offset"] == 7, name
            want = g[f"step_0000/{name}"][()]
            np.testing.assert_array_equal(ds[()], want[7:] if rd == 0 else want[:, 7:])
        assert f["step_0000/cache_k-0"].shape[0] == 12  # the cache keeps every row
        assert f["step_0000/tokens"].shape[0] == 12
    valid(out)
    r = compare(out, full)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr


def test_token_rows_auto_keeps_the_limit(dumps, tmp_path: Path):
    full = dumps["default"]
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(tmp_path / "x.h5"),
            "--max-dump-size", "0")
    est = re.search(r"each dump will take about ([0-9.]+) kB", r.stderr)
    assert est, r.stderr
    limit = int(float(est.group(1)) * 1e3 * 0.4)  # the cache rows of each step and one kq_soft_max row are not enough
    out = tmp_path / "auto.h5"
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(out),
            "--max-dump-size", str(limit))
    assert r.returncode == 0, r.stderr
    assert "cache_k/cache_v keep the rows each step wrote" in r.stderr, r.stderr
    m = re.search(r"every per-token checkpoint keeps its last (\d+) rows", r.stderr)
    assert m, r.stderr
    rows = int(m.group(1))
    assert 1 <= rows < 12
    assert out.stat().st_size <= limit
    with h5py.File(out, "r") as f:
        assert f["step_0000/ffn_gate-0"].shape[0] == rows
    valid(out)
    r = compare(out, full)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr


def test_compress(dumps, tmp_path: Path):
    plain = dumps["all"]  # every row, as the compressed dumps below (under the size limit)
    out = dump(tmp_path / "z.h5", "--compress", "6")
    dflt = dump(tmp_path / "z4.h5", "--compress")
    with h5py.File(out, "r") as f, h5py.File(plain, "r") as g, h5py.File(dflt, "r") as h:
        ds = f["step_0000/ffn_up-0"]  # 12 x 128 values
        assert ds.compression == "gzip" and ds.compression_opts == 6 and ds.shuffle and ds.chunks
        assert h["step_0000/ffn_up-0"].compression_opts == 4
        assert f["step_0000/tokens"].compression is None
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
        for n in names:  # plain h5py reads every dataset, equal to the uncompressed dump
            np.testing.assert_array_equal(f[n][()], g[n][()])
    valid(out)
    r = compare(out, plain)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--out", str(tmp_path / "bad.h5"), "--compress", "10")
    assert r.returncode == 2 and "--compress" in r.stderr, r.stderr


def test_the_main_job_without_a_dump_says_what_it_compares(tmp_path: Path):
    # --dump none keeps the same cuts (the report is the one a written run gives) and says they bound what is
    # compared, not a file's size.
    r = run("dump", "--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--out", str(tmp_path / "x.h5"),
            "--max-dump-size", "0")
    limit = int(float(re.search(r"each dump will take about ([0-9.]+) kB", r.stderr).group(1)) * 1e3 * 0.4)
    for mode in ("none", "full"):
        out = tmp_path / mode
        r = run("--model", str(MODEL), "--tokens", TOKENS, "--steps", str(STEPS), "--engine", "cpu", "--dump", mode,
                "--max-dump-size", str(limit), "--out", str(out))
        assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
        assert re.search(r"every per-token checkpoint keeps its last \d+ rows", r.stderr), r.stderr
        if mode == "none":
            assert "no dump is written (--dump none); each side's checkpoints take about" in r.stderr, r.stderr
            assert "each dump will take" not in r.stderr, r.stderr
            assert not list(out.glob("*.h5")), list(out.iterdir())
        else:
            assert "each dump will take about" in r.stderr, r.stderr
