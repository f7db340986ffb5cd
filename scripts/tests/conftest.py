"""pytest fixtures for the fixture tests: where the generated GGUFs are and where the real model is."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    """DIFFRUN_FIXTURE_DIR (filled by the ctest fixture fixtures_generate), or a fresh generation when unset."""
    env = os.environ.get("DIFFRUN_FIXTURE_DIR")
    out = Path(env) if env else tmp_path_factory.mktemp("fixtures")
    subprocess.run([sys.executable, str(REPO / "scripts/gen_fixtures.py"), "--out", str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    d = os.environ.get("DIFFRUN_MODELS")
    if not d:
        d = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "diffrun", "models")
    p = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.exists():
        pytest.fail(f"{p} is missing: run scripts/fetch_models")
    return p
