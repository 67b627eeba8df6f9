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
    assert re.search(r"engine: \d+ test modules not imported \(torch is not installed\): .*test_summary\.py", out)
    assert "tests/trace/test_guard.py::test_the_child_maps_what_the_process_itself_would" in out


def test_a_module_level_declaration_is_what_counts(tmp_path):
    cases = {
        "pytestmark = pytest.mark.engine\n": True,
        "pytestmark = [pytest.mark.engine, pytest.mark.vllm]  # why\n": True,
        "pytestmark = pytest.mark.vllm\n": True,  # the vllm marker implies engine
        "def f():\n    pytestmark = pytest.mark.engine\n": False,  # not at module level
        "import torch\n": False,  # an import is not a declaration: test_collection_... catches it
    }
    for n, (text, declared) in enumerate(cases.items()):
        path = tmp_path / f"test_{n}.py"
        path.write_text("import pytest\n" + text)
        assert declares_engine(path) is declared, text
    assert declares_engine(TESTS / "trace" / "test_summary.py")
    assert not declares_engine(TESTS / "trace" / "test_guard.py")


def _blocked(*args: str, allow_skip: bool = False) -> subprocess.CompletedProcess:
    """pytest ARGS with the engine packages blocked, as on a laptop without torch."""
    env = dict(os.environ, STATEDIFF_TEST_BLOCK_ENGINE="1")
    env.pop("STATEDIFF_ALLOW_SKIP", None)
    if allow_skip:
        env["STATEDIFF_ALLOW_SKIP"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=TESTS.parent)


def test_selected_engine_tests_fail_without_torch_unless_skips_are_allowed():
    """The rule (STATEDIFF_ALLOW_SKIP): an engine test that was selected never skips silently where torch
    is missing. A module declaring the marker (not imported) and an engine-marked test in a module that
    is imported, each: an error naming what to do; skipped with the reason under STATEDIFF_ALLOW_SKIP=1;
    deselected by -m "not engine" (the laptop's run)."""
    targets = ("tests/hooks/vllm/test_retention.py",
               "tests/hooks/vllm/test_versions.py::test_the_override_survives_install_capture_and_picks_the_nearest_adapter")
    p = _blocked(*targets)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert re.search(r"^2 errors in ", out.splitlines()[-1]), out[-3000:]
    assert ("test_retention.py (not imported) needs torch (the engine), which is not installed: install it "
            "(scripts/setup.sh), deselect the engine tests with -m 'not engine', or set STATEDIFF_ALLOW_SKIP=1") in out
    assert "this test needs torch (the engine), which is not installed: install it" in out
    assert "engine: 1 test modules not imported (torch is not installed): test_retention.py" in out
    p = _blocked(*targets, allow_skip=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and re.search(r"^2 skipped in ", out.splitlines()[-1]), out[-3000:]
    assert "test_retention.py (not imported) needs torch (the engine), which is not installed (STATEDIFF_ALLOW_SKIP=1)" in out
    p = _blocked("-m", "not engine", *targets)
    out = p.stdout + p.stderr
    assert p.returncode == 5 and re.search(r"^2 deselected in ", out.splitlines()[-1]), out[-3000:]
