"""Runs the torch-labelled pytest files, or exits 77 (ctest's SKIP_RETURN_CODE) with the reason when torch,
transformers or gguf is missing.

    python3 python/tests/run_torch_tests.py [FILE.py ...] [pytest args]

Without a FILE, test_torch.py and test_transformers_adapter.py (ctest's test_python_torch).
"""

import importlib.util
import sys
from pathlib import Path

missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
if missing:
    print(f"skipped: the torch tests need {', '.join(missing)} (not installed here)")
    sys.exit(77)

import pytest  # noqa: E402

HERE = Path(__file__).resolve().parent
files = [a for a in sys.argv[1:] if a.endswith(".py")]
args = [a for a in sys.argv[1:] if not a.endswith(".py")]
if not files:
    files = [str(HERE / "test_torch.py"), str(HERE / "test_transformers_adapter.py")]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-s", *files, *args]))
