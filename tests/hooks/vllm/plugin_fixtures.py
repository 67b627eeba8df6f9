"""Fixtures shared by the tests that call ``plugin.register`` without an engine."""

from __future__ import annotations

import pytest

from statediff_hooks.vllm import plugin


@pytest.fixture
def no_patching(monkeypatch):
    """plugin.register without touching vLLM: the patch points it would wrap are listed instead."""
    patched: list = []
    monkeypatch.setattr(plugin, "_patch", lambda point, factory: patched.append(point))
    monkeypatch.setattr(plugin, "_register_scheduler", lambda: None)
    monkeypatch.setattr(plugin, "_originals", [])
    monkeypatch.setattr(plugin, "_adapter", [])
    monkeypatch.setattr(plugin, "_note_uncaught_exceptions", lambda: None)
    return patched  # what register sets in os.environ: undone by conftest's _environment_restored
