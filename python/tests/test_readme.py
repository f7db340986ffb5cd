"""The README's "Debug your own engine" Python runs as printed, from another directory, and the dump it writes compares clean.

Its `my_engine` is played here by a replay of the reference's own checkpoints (per-head ones as [T, H*Dh], as
an engine holds them). Needs DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (ctest sets them).
"""

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import diffrun

REPO = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))


def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Debug your own engine", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class ReplayEngine:
    """Yields the reference's checkpoints of the step whose tokens it is given."""

    def __init__(self, path):
        self.ref = diffrun.open(path)
        self.step = 0

    def forward(self, ids):
        step, self.step = self.step, self.step + 1
        assert list(self.ref.get("tokens", step)) == list(ids)
        for name in self.ref.names(step):
            if name != "tokens":
                a = self.ref.get(name, step)
                yield name, (a.reshape(a.shape[0], -1) if a.ndim == 3 and name[0] in "QKV" else a)


def test_readme_loop_writes_a_dump_that_compares_clean(tmp_path, monkeypatch):
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f32", "--model",
                    str(FIXTURES / "tiny-qwen3-q8_0.gguf"), "--tokens", "1,2,3", "--steps", "2", "--out",
                    str(tmp_path / "ref.h5")], check=True, capture_output=True)
    monkeypatch.chdir(tmp_path)
    engine = ReplayEngine(tmp_path / "ref.h5")
    exec(compile(readme_snippet(), "README.md", "exec"), {"my_engine": engine})
    engine.ref.close()
    report = tmp_path / "r.json"
    r = subprocess.run([BIN, "compare", "mine.h5", "ref.h5", "--no-color", "--report-json", str(report)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(report.read_text())
    assert result["first_divergence"] is None
    compared = [c for c in result["checkpoints"] if c.get("metrics")]
    assert len(compared) > 40 and all(c["metrics"]["rel_l2"] == 0 for c in compared)
    with diffrun.open("mine.h5") as d:
        assert d.meta["backend"] == "mine" and len(d.info("Qcur-1", 1).shape) == 3
