"""``statediff_hooks.vllm.replay``'s stages one by one, without starting an engine: the plan, the
environment the engine's processes read, the capture installed for it, the trace finished."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from statediff.errors import StatediffError
from statediff.replay.conversation import Turn
from statediff_hooks.recording.keep import KeepSpec
from statediff_hooks.recording.config import RecorderConfig
from statediff_hooks.vllm import plugin, replay
from statediff_hooks.vllm.replay import ReplayPlan, ReplaySpec, engine_environment, finish_trace, install_capture

TURNS = [Turn(line=1, id="a", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4})]
# run field conversation_digest, by its rule (recording/fields.py): sha256 of the replayed prompts'
# token ids as JSON, here [[1, 2, 3]]; pinned, so a change of the rule shows
PROMPTS_DIGEST = "4f6f1e9b8e7389cd920695e1f62808765b07297631ff05574a6dc0e577c1a736"
assert hashlib.sha256(b"[[1, 2, 3]]").hexdigest() == PROMPTS_DIGEST


def plan(trace="t.h5", splits=None, **spec) -> ReplayPlan:
    s = ReplaySpec(trace=trace, mode="cold", **spec)
    cfg = replay._recorder_config(TURNS, [[1, 2, 3]], s, splits or {})
    return ReplayPlan(TURNS, [[1, 2, 3]], {"model": "m"}, s, splits or {}, cfg)


def test_the_recorder_config_carries_the_replay_s_run_metadata():
    p = plan(exact=True, keep=KeepSpec("all"), run_extra={"conversation": "c.jsonl"})
    assert p.recorder == RecorderConfig(
        trace="t.h5", mode="cold", replay="exact", kv="all", fault=None, overwrite=False, activations=False,
        keep=KeepSpec("all"),
        run_extra={"conversation_digest": PROMPTS_DIGEST, "sampling": {"max_tokens": 4},
                   "num_requests": 1, "exact_form": "block", "split_plan": None, "logprobs_k": 5,
                   "conversation": "c.jsonl"})
    assert plan().recorder.keep == KeepSpec() and plan().recorder.replay == "default"


def test_the_engine_environment():
    env = engine_environment(plan(fault="kv-stale:layer=3", exact=True))
    assert env["STATEDIFF_TRACE"] == "t.h5" and env["STATEDIFF_MODE"] == "cold"
    assert env["STATEDIFF_FAULT"] == "kv-stale:layer=3" and env["STATEDIFF_EXACT_BLOCK"] == "1"
    assert RecorderConfig.from_env(env).fault.spec == "kv-stale:layer=3"
    split = engine_environment(plan(splits={1: [32, 64]}, exact_split=True))
    assert json.loads(split["STATEDIFF_SPLITS"]) == {"1": [32, 64]} and "STATEDIFF_EXACT_BLOCK" not in split
    assert env["STATEDIFF_ENGINE_PATCHES"] == "1"  # the stand-ins an engine needs (cpu/mamba_align.py)
    # without a trace only the scheduling and the engine patches survive: nothing is captured, no fault planted
    assert engine_environment(plan(trace=None, splits={1: [32]}, fault="conv-zero")) == {
        "STATEDIFF_SPLITS": '{"1": [32]}', "STATEDIFF_ENGINE_PATCHES": "1"}
    assert engine_environment(plan(trace=None)) == {"STATEDIFF_ENGINE_PATCHES": "1"}
    assert "STATEDIFF_ENGINE_FIX" not in env  # an engine fix only when asked for (--engine-fix)
    assert engine_environment(plan(engine_fixes=("gdn-ragged-drafts",)))["STATEDIFF_ENGINE_FIX"] == "gdn-ragged-drafts"
    assert engine_environment(plan(trace=None, engine_fixes=("gdn-ragged-drafts",))) == {
        "STATEDIFF_ENGINE_PATCHES": "1", "STATEDIFF_ENGINE_FIX": "gdn-ragged-drafts"}


def test_install_capture_replaces_what_an_earlier_replay_left(monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # this process's own STATEDIFF_* stay for later tests
    calls = []
    monkeypatch.setattr(plugin, "register", lambda: calls.append("register"))
    monkeypatch.setattr(plugin, "unregister", lambda: calls.append("unregister"))
    monkeypatch.setattr(plugin, "reset", lambda: calls.append("reset"))
    monkeypatch.setenv("STATEDIFF_FAULT", "conv-zero")
    monkeypatch.setenv("STATEDIFF_DEBUG", "1")
    install_capture({"STATEDIFF_TRACE": "x.h5"})
    assert calls == ["unregister", "reset", "register"]
    assert (os.environ["STATEDIFF_TRACE"], os.environ["STATEDIFF_DEBUG"]) == ("x.h5", "1")
    assert "STATEDIFF_FAULT" not in os.environ
    calls.clear()
    install_capture({})  # a plain replay: the plugin stays out
    assert calls == ["unregister", "reset"] and "STATEDIFF_TRACE" not in os.environ


@pytest.mark.parametrize("fired,stats,message", [
    (False, {"tensors": 3, "error": None}, "--fault conv-zero never fired (no request resumed from a prefix-cache "
                                           "hit deep enough, or no such layer or request): t.h5 holds a fault-free run"),
    (True, {"tensors": 3, "error": "OSError: disk full"}, "recording failed: OSError: disk full"),
])
def test_finish_trace_refuses_a_fault_that_never_fired_and_a_failed_recording(monkeypatch, fired, stats, message):
    monkeypatch.setattr(plugin, "fault_fired", lambda: fired)
    monkeypatch.setattr(plugin, "close", lambda: dict(stats))
    with pytest.raises(StatediffError) as e:
        finish_trace(plan(fault="conv-zero"))
    assert str(e.value) == message


def test_finish_trace_returns_the_writer_s_stats(monkeypatch):
    monkeypatch.setattr(plugin, "fault_fired", lambda: False)
    monkeypatch.setattr(plugin, "close", lambda: {"tensors": 3, "error": None})
    assert finish_trace(plan()) == {"tensors": 3, "error": None}
    assert finish_trace(plan(trace=None, fault="conv-zero")) == {"tensors": 3, "error": None}  # nothing recorded


@pytest.mark.vllm
@pytest.mark.parametrize("spec,message", [
    ({"mode": "warm"}, "--mode must be 'hit' or 'cold', not 'warm'"),
    ({"exact": True, "exact_split": True}, "choose one exact replay form: --exact or --exact-split"),
    ({"logprobs": 30}, "--logprobs 30 exceeds the engine's max_logprobs 20 (pass --engine-arg max_logprobs=30)"),
    ({"exact_split": True}, "--exact-split in cold mode needs --split-like HIT.h5 (the hit run's trace)"),
    ({"split_like": "h.h5", "mode": "hit"}, "--split-like is for the cold run of --exact-split"),
])
def test_plan_replay_refuses_before_any_engine(tmp_path, spec, message):
    spec = {"trace": str(tmp_path / "t.h5"), "mode": "cold"} | spec
    with pytest.raises(StatediffError) as e:
        replay.plan_replay(TURNS, {"model": "m"}, ReplaySpec(**spec))
    assert str(e.value) == message


@pytest.mark.vllm
def test_plan_replay_needs_no_tokenizer_for_token_id_prompts(tmp_path):
    p = replay.plan_replay(TURNS, {"model": str(tmp_path / "no-model")}, ReplaySpec(trace=None, mode="hit"))
    assert p.prompts == [[1, 2, 3]] and p.splits == {} and p.kw == {"model": str(tmp_path / "no-model")}
