"""The numpy example engine end to end: clean it compares within tolerance; each seeded bug is the first divergence.

Needs DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (ctest sets them), the `gguf` package and the diffrun package.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))
MODEL = FIXTURES / "tiny-llama-q8_0.gguf"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not BIN or not MODEL.exists():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (with tiny-llama-q8_0.gguf) must be set: run through ctest")
    out = tmp_path_factory.mktemp("numpy_engine") / "ref.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(MODEL),
                    "--tokens", "1,5,9,13,200,31", "--steps", "2", "--out", str(out)], check=True, capture_output=True)
    return out


def run_engine(reference, out, bug=None, isolated=None):
    cmd = [sys.executable, str(HERE / "numpy_engine.py"), "--model", str(MODEL), "--reference", str(reference),
           "--out", str(out)] + (["--bug", bug] if bug else []) + (["--isolated", str(isolated)] if isolated else [])
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/")  # any directory: the package is installed


def compare(engine, reference, tmp_path, isolated=None):
    report = tmp_path / "report.json"
    r = subprocess.run([BIN, "compare", str(engine), str(reference), "--no-color", "--report-json", str(report)]
                       + (["--isolated", str(isolated)] if isolated else []), capture_output=True, text=True)
    return r.returncode, json.loads(report.read_text()), r.stdout


def test_clean_engine_is_within_tolerance(reference, tmp_path):
    r = run_engine(reference, tmp_path / "mine.h5")
    assert r.returncode == 0, r.stderr
    rc, report, text = compare(tmp_path / "mine.h5", reference, tmp_path)
    assert rc == 0, text
    assert report.get("first_divergence") is None
    assert "numpy/f32" in text


@pytest.mark.parametrize("bug, name, step", [
    ("rope_neox", "Qrope-0", 0),
    ("gqa_modulo", "kq_soft_max-0", 0),
    ("cache_unread", "kq_soft_max-0", 1),
])
def test_seeded_bug_is_the_first_divergence(reference, tmp_path, bug, name, step):
    r = run_engine(reference, tmp_path / "bug.h5", bug)
    assert r.returncode == 0, r.stderr
    rc, report, text = compare(tmp_path / "bug.h5", reference, tmp_path)
    assert rc == 1, text
    first = report["first_divergence"]
    assert (first["name"], first["step"]) == (name, step), text
    assert first["verdict"]["kind"] == "local"


@pytest.mark.parametrize("bug", [None, "gqa_modulo", "cache_unread"])
def test_isolation_replay_of_an_outside_engine(reference, tmp_path, bug):
    """The replay an outside engine writes (each op on the reference's inputs) gives every checkpoint its local error:
    clean, every local error passes; with a bug, only the ops that read the wrong KV head or cache rows fail alone."""
    mine, iso = tmp_path / "mine.h5", tmp_path / "iso.h5"
    r = run_engine(reference, mine, bug, isolated=iso)
    assert r.returncode == 0, r.stderr
    rc, report, text = compare(mine, reference, tmp_path, isolated=iso)
    assert report["isolated_path"] == str(iso)
    local = {(cp["name"], cp["step"]): cp["local"]["status"] for cp in report["checkpoints"] if cp.get("local")}
    assert len(local) > 100, text
    failing = {name.rsplit("-", 1)[0] for (name, _), status in local.items() if status != "pass"}
    if bug is None:
        assert rc == 0 and not failing, text
        return
    assert rc == 1, text
    first = report["first_divergence"]
    assert first["name"] == "kq_soft_max-0" and first["verdict"]["kind"] == "local", text
    assert local[(first["name"], first["step"])] != "pass", text
    assert failing <= {"kq_soft_max", "kqv_out"}, failing  # the ops whose code has the bug; nothing downstream


def test_wrong_model_and_bad_reference_exit_2(reference, tmp_path):
    other = FIXTURES / "tiny-llama-f32.gguf"
    r = subprocess.run([sys.executable, str(HERE / "numpy_engine.py"), "--model", str(other), "--reference",
                        str(reference), "--out", str(tmp_path / "x.h5")], capture_output=True, text=True)
    assert r.returncode == 2 and "fingerprints differ" in r.stderr
    bad = tmp_path / "bad.h5"
    bad.write_text("not a dump")
    r = run_engine(bad, tmp_path / "x.h5")
    assert r.returncode == 2 and "bad.h5" in r.stderr
    assert not (tmp_path / "x.h5").exists()
