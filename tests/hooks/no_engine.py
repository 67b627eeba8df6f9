"""The `no_engine` fixture: `record` checked up to the point where it would start vLLM."""

from __future__ import annotations

import pytest

from statediff.errors import StatediffError


@pytest.fixture
def no_engine(monkeypatch):
    """Replace the replay (the only way `record` starts vLLM) by one that keeps its arguments."""
    calls = []

    def fake_replay(turns, kw, **rest):
        calls.append({"turns": turns, "kw": kw, **rest})
        raise StatediffError("engine would start here")

    monkeypatch.setattr("statediff_hooks.vllm.replay.replay", fake_replay)
    return calls
