"""Runs the torch-labelled pytest files, or exits 77 (ctest's SKIP_RETURN_CODE) with the reason when torch,
transformers or gguf is missing.

    python3 python/tests/run_torch_tests.py [pytest args]
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
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-s", str(HERE / "test_torch.py"),
                      str(HERE / "test_transformers_adapter.py"), *sys.argv[1:]]))
