"""``statediff_hooks.vllm.entry`` without an engine: which variables ask for statediff, that a
process where none does imports nothing of statediff, and that ``entry.ASKING`` and
``plugin.register`` agree on every ``STATEDIFF_*`` variable the code reads. With vLLM:
tests/hooks/vllm/test_vllm_entry.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from statediff_hooks.vllm import entry, plugin

REPO = Path(__file__).resolve().parents[3]


def clean_env(**env: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STATEDIFF_")} | env


@pytest.mark.parametrize("env,names", [
    ({}, []),
    ({"STATEDIFF_TRACE": "/tmp/t.h5"}, ["STATEDIFF_TRACE"]),
    ({"STATEDIFF_TRACE": ""}, []),  # empty is unset
    ({"STATEDIFF_EXACT_BLOCK": "0", "STATEDIFF_ENGINE_PATCHES": "0"}, []),  # switches ask with 1 only
    ({"STATEDIFF_EXACT_BLOCK": "1", "STATEDIFF_SPLITS": "{}"}, ["STATEDIFF_SPLITS", "STATEDIFF_EXACT_BLOCK"]),
    ({"STATEDIFF_LIVE_AUDIT_PROMPTS": "0"}, ["STATEDIFF_LIVE_AUDIT_PROMPTS"]),  # refused by plugin.register
    ({"STATEDIFF_FAULT": "ssm-bf16", "STATEDIFF_ENGINE_FIX": "gdn-ragged-drafts", "STATEDIFF_KV": "none"}, []),
    ({"STATEDIFF_TRACE": "/tmp/t.h5", "STATEDIFF_DISABLE": "1"}, []),  # the kill switch
])
def test_which_variables_ask_for_statediff(env, names):
    assert entry.asked(env) == names


def test_a_process_that_asks_for_nothing_imports_nothing_of_statediff():
    code = ("import sys\nfrom statediff_hooks.vllm import entry\nentry.register()\n"
            "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('statediff', 'statediff_hooks')))")
    env = clean_env(STATEDIFF_FAULT="ssm-bf16", STATEDIFF_ENGINE_FIX="gdn-ragged-drafts", STATEDIFF_KEEP="all")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert json.loads(r.stdout.replace("'", '"')) == ["statediff_hooks", "statediff_hooks.vllm",
                                                     "statediff_hooks.vllm.entry"]


def variables_in_the_code() -> list[str]:
    """Every ``STATEDIFF_*`` variable name written in statediff/ and hooks/."""
    names = set()
    for path in [*(REPO / "statediff").rglob("*.py"), *(REPO / "hooks").rglob("*.py")]:
        names |= set(re.findall(r"\bSTATEDIFF_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    return sorted(names - {"STATEDIFF_DISABLE"})


@pytest.mark.parametrize("name", variables_in_the_code())
def test_the_entry_point_passes_on_exactly_the_variables_plugin_register_acts_on(name, monkeypatch, tmp_path):
    """A variable ``plugin.register`` acts on but ``entry.ASKING`` leaves out would be ignored in
    every vLLM process; one in ``ASKING`` that it ignores would import statediff for nothing."""
    for key in [k for k in os.environ if k.startswith("STATEDIFF_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # STATEDIFF_TRACE=1 / STATEDIFF_LIVE_AUDIT=1: a file here
    monkeypatch.setenv(name, "1")
    acted = []
    monkeypatch.setattr(plugin, "_originals", [])
    monkeypatch.setattr(plugin, "check_version", lambda: acted.append("check_version"))
    monkeypatch.setattr(plugin, "install_engine_patches", lambda: [])
    monkeypatch.setattr(plugin, "_note_uncaught_exceptions", lambda: None)
    monkeypatch.setattr(plugin, "_patch", lambda point, factory: None)
    monkeypatch.setattr(plugin, "_register_scheduler", lambda: None)
    try:
        plugin.register()
    except SystemExit as e:  # a refused value: acting too
        acted.append(f"exit {e.code}")
    assert bool(acted) == bool(entry.asked({name: "1"})), acted
