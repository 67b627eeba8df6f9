"""The `engine` marker is found statically, so `pytest -m "not engine"` runs where torch is not installed."""

from __future__ import annotations

from pathlib import Path

from engine_marks import function_needs_engine, needs_engine

TESTS = Path(__file__).resolve().parent


def test_modules_that_import_torch_directly_or_through_hooks_need_the_engine(tmp_path):
    assert needs_engine(TESTS / "trace" / "test_digest.py")  # import torch
    assert needs_engine(TESTS / "hooks" / "test_transformers_adapter.py")  # in a try at module level
    assert needs_engine(TESTS / "vllm_driver.py")
    assert not needs_engine(TESTS / "cli" / "test_cli.py")
    assert not needs_engine(TESTS / "hooks" / "test_ablate.py")  # statediff_hooks.drivers.ablate is torch-free
    helper = tmp_path / "test_x.py"
    helper.write_text("from statediff_hooks.recorder import Recorder\n")  # recorder imports torch
    assert needs_engine(helper)


def test_a_function_or_fixture_that_imports_the_engine_side_needs_it(tmp_path):
    assert function_needs_engine(TESTS / "hooks" / "vllm" / "test_vllm_spec.py", "test_row_rule_and_acceptance_arithmetic")
    mod = tmp_path / "test_y.py"
    mod.write_text("def fixture(monkeypatch):\n"
                   "    monkeypatch.setattr('statediff_hooks.recorder.Recorder', None)\n"
                   "def test_light():\n"
                   "    from statediff.trace import open_trace\n")
    assert function_needs_engine(mod, "fixture")
    assert not function_needs_engine(mod, "test_light")
