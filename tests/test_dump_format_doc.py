"""docs/dump-format.md stays true: its Python fingerprint gives `diffrun inspect`'s value on every fixture model and on SmolLM2, and its plain-h5py attribute-table reader reads a diffrun dump."""
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


def test_doc_table_reader_reads_a_diffrun_dump(tmp_path):
    """The doc's plain-h5py reader of the attribute table gives each dataset's attributes as diffrun wrote them."""
    import sys

    doc = (REPO / "docs/dump-format.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def dataset_attributes" in b]
    assert len(blocks) == 1, "the doc holds one dataset_attributes reference implementation"
    ns: dict = {}
    exec(blocks[0], ns)
    model = FIXTURES / "tiny-qwen2-f32.gguf"
    if not model.exists():
        pytest.skip(f"{model} missing: run ctest -R fixtures_generate first")
    out = tmp_path / "d.h5"
    r = subprocess.run([DIFFRUN, "dump", "--backend", "cpu", "--model", str(model), "--tokens", "1,2,3", "--steps", "2",
                        "--logits-rows", "2", "--cache-rows", "step", "--out", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    import h5py

    sys.path.insert(0, str(REPO / "python"))
    from diffrun import vocabulary

    with h5py.File(out, "r") as f:
        for step in range(3):
            attrs = ns["dataset_attributes"](f, step)
            names = [n for n in f[f"step_{step:04d}"] if n != "_attributes"]
            assert sorted(attrs) == sorted(names)
            for name, a in attrs.items():
                base, layer = vocabulary.parse_name(name)
                assert a["layer"] == layer and a["layout"] == vocabulary.find_kind(base).layout, name
                assert a["native_dtype"] == ("i32" if name == "tokens" else "f32"), name
                assert "dtype" not in a, name
            # the cut logits and the cache rows each decode step wrote say where their rows start
            assert attrs["result_output"].get("row_offset") == (1 if step == 0 else None)
            assert attrs["cache_k-0"].get("row_offset") == (None if step == 0 else 2 + step)
