"""docs/dump-format.md stays true: its Python fingerprint gives `diffrun inspect`'s value on every fixture model and on SmolLM2."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))


def models() -> list[Path]:
    out = sorted(FIXTURES.glob("*.gguf"))
    d = os.environ.get("DIFFRUN_MODELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "diffrun", "models")
    smollm2 = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return out + ([smollm2] if smollm2.exists() else [])


def test_doc_fingerprint_matches_diffrun_inspect():
    doc = (REPO / "docs/dump-format.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def gguf_fingerprint" in b]
    assert len(blocks) == 1, "the doc holds one gguf_fingerprint reference implementation"
    ns: dict = {}
    exec(blocks[0], ns)
    paths = models()
    if not paths:
        pytest.skip(f"no GGUF models in {FIXTURES}: run ctest -R fixtures_generate first")
    for p in paths:
        out = subprocess.run([DIFFRUN, "inspect", str(p)], capture_output=True, text=True, timeout=60).stdout
        want = re.search(r"fingerprint (\S+)", out).group(1)
        assert ns["gguf_fingerprint"](str(p)) == want, p
