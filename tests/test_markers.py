"""The ``engine`` marker is declared (tests/conftest.py), so ``pytest -m "not engine"`` runs without torch.

A module that imports an engine package when it loads must declare the
marker at module level: collecting the suite with the engine packages made
unimportable (``STATEDIFF_TEST_BLOCK_ENGINE=1``, as in a light install)
then imports no such module and reports no error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import declares_engine

TESTS = Path(__file__).resolve().parent


def test_collection_without_the_engine_packages_has_no_errors():
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not engine", str(TESTS)], capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, STATEDIFF_TEST_BLOCK_ENGINE="1"), cwd=TESTS.parent)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert not re.search(r"^ERROR |^_+ ERROR collecting|\d+ errors? in ", out, re.MULTILINE), out[-3000:]
    assert re.search(r"engine: \d+ test modules not collected \(torch is not installed\): .*test_summary\.py", out)
    assert "tests/trace/test_guard.py::test_the_child_maps_what_the_process_itself_would" in out


def test_a_module_level_declaration_is_what_counts(tmp_path):
    cases = {
        "pytestmark = pytest.mark.engine\n": True,
        "pytestmark = [pytest.mark.engine, pytest.mark.vllm]  # why\n": True,
        "pytestmark = pytest.mark.vllm\n": False,
        "def f():\n    pytestmark = pytest.mark.engine\n": False,  # not at module level
        "import torch\n": False,  # an import is not a declaration: test_collection_... catches it
    }
    for n, (text, declared) in enumerate(cases.items()):
        path = tmp_path / f"test_{n}.py"
        path.write_text("import pytest\n" + text)
        assert declares_engine(path) is declared, text
    assert declares_engine(TESTS / "trace" / "test_summary.py")
    assert not declares_engine(TESTS / "trace" / "test_guard.py")
