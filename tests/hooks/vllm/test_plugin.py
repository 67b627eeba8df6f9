"""``statediff_hooks.vllm.plugin`` without an engine: the one before/after wrapper factory, and a
program that dies on an uncaught exception (its trace marked incomplete, the exception named)."""

from __future__ import annotations

import sys
from types import SimpleNamespace as NS

import pytest

from statediff_hooks.vllm import plugin
from statediff_hooks.vllm.surface import PatchPoint


class Runner:
    """Stands in for vLLM's runner: one method with a keyword-only argument."""

    def step(self, scheduler_output, extra=0, *, flag=False):
        return ("out", scheduler_output, extra, flag)


POINT = PatchPoint(__name__, "Runner", "step")


class Capture:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def before(self, args):
        self.calls.append(("before", {k: v for k, v in args.items() if k != "self"}))
        if self.fail:
            raise RuntimeError("capture bug")

    def after(self, args, out):
        self.calls.append(("after", out))


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(plugin, "_state", {"capture": None, "recorder": None, "error": None})
    plugin._patch(POINT, plugin._around(lambda cap, a: cap.before(a), lambda cap, a, out: cap.after(a, out)))
    yield
    plugin.unregister()
    assert Runner.step.__name__ == "step" and not hasattr(Runner.step, "__wrapped__")


def test_hooks_run_around_the_original_with_bound_arguments(patched):
    assert Runner().step("so") == ("out", "so", 0, False)  # not recording: the original alone
    cap = plugin._state["capture"] = Capture()
    assert Runner().step("so2", 3, flag=True) == ("out", "so2", 3, True)
    assert cap.calls == [("before", {"scheduler_output": "so2", "extra": 3, "flag": True}),
                         ("after", ("out", "so2", 3, True))]


def test_a_capture_error_stops_recording_never_the_engine(patched, capsys):
    cap = plugin._state["capture"] = Capture(fail=True)
    assert Runner().step("so") == ("out", "so", 0, False)
    assert plugin._state["error"] == "RuntimeError: capture bug" and plugin._state["capture"] is None
    assert cap.calls == [("before", {"scheduler_output": "so", "extra": 0, "flag": False})]  # no after
    assert capsys.readouterr().err == "statediff: recording stopped: RuntimeError: capture bug\n"


class Recorder:
    def __init__(self) -> None:
        self.closed, self.run = False, {}

    def run_field(self, key):
        return self.run.get(key)

    def set_run(self, **fields):
        self.run.update(fields)


def test_an_uncaught_exception_marks_the_trace_stopped_before_exit(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(plugin, "_state", {"capture": None, "recorder": rec, "error": None})
    monkeypatch.setattr(plugin, "_hooked_exit", [])
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[1]))
    plugin._note_uncaught_exceptions()
    plugin._note_uncaught_exceptions()  # once per process
    err = ValueError("boom\nsecond line")
    sys.excepthook(ValueError, err, None)
    assert seen == [err]  # the program's own hook (the traceback) still runs
    assert rec.run["stopped"] == {"request": None, "error": "ValueError: boom",
                                  "where": "uncaught exception in the recorded program"}
    plugin.note_uncaught(KeyboardInterrupt())  # already stopped: the first reason stays
    assert rec.run["stopped"]["error"] == "ValueError: boom"
    rec.run.clear()
    rec.closed = True  # the replay closed it itself (mark_stopped + close): nothing more
    plugin.note_uncaught(KeyboardInterrupt())
    assert rec.run == {}


class ClosingRecorder(Recorder):
    def __init__(self, trace: str) -> None:
        super().__init__()
        self.config = NS(trace=trace)

    def close(self):
        self.closed = True
        return {"tensors": 0}


def test_the_front_end_of_a_multi_process_engine_leaves_a_note_the_engine_reads(monkeypatch, tmp_path):
    trace = tmp_path / "run.h5"
    monkeypatch.setenv("STATEDIFF_TRACE", str(trace))
    monkeypatch.setattr(plugin, "_state", {"capture": None, "recorder": None, "error": None})
    plugin.note_uncaught(ValueError("boom"))  # no engine recording this trace: nothing to note
    assert not (tmp_path / "run.h5.stopped.json").exists()
    (tmp_path / "run.h5.parts").mkdir()  # the engine's process is recording it
    plugin.note_uncaught(ValueError("boom"))
    assert (tmp_path / "run.h5.stopped.json").is_file()
    # ... and in the engine's process, close() marks the trace before finishing it
    rec = ClosingRecorder(str(trace))
    monkeypatch.setattr(plugin, "_state", {"capture": None, "recorder": rec, "error": None})
    assert plugin.close() == {"tensors": 0, "error": None}
    assert rec.run["stopped"] == {"request": None, "error": "ValueError: boom",
                                  "where": "uncaught exception in the recorded program"}
    assert not (tmp_path / "run.h5.stopped.json").exists()


@pytest.mark.parametrize("env,patches,capture", [
    ({"STATEDIFF_ENGINE_PATCHES": "1"}, True, False),  # the stand-ins alone: a plain engine that must run
    ({"STATEDIFF_TRACE": "t.h5"}, True, True),  # recording: stand-ins first, then the capture
    ({"STATEDIFF_ENGINE_PATCHES": "1", "STATEDIFF_DISABLE": "1"}, False, False),  # the kill switch wins
    ({}, False, False),  # not asked for: the plugin stays out of the engine
])
def test_register_installs_the_engine_patches_wherever_the_plugin_is_active(monkeypatch, env, patches, capture):
    for key in [k for k in __import__("os").environ if k.startswith("STATEDIFF_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(plugin, "_originals", [])
    monkeypatch.setattr(plugin, "check_version", lambda: "0.32.0")
    monkeypatch.setattr(plugin, "install_engine_patches", lambda: calls.append("patches"))
    monkeypatch.setattr(plugin, "_note_uncaught_exceptions", lambda: None)
    monkeypatch.setattr(plugin, "_patch", lambda point, factory: calls.append(point.name))
    monkeypatch.setattr(plugin, "_register_scheduler", lambda: None)
    plugin.register()
    assert ("patches" in calls) == patches
    assert ("execute_model" in calls) == capture
    assert ("set_inputs_first_pass" in calls) == capture  # the proposer's input rows (v1/proposer.py)
    if patches:
        assert calls[0] == "patches"


def test_a_trace_into_a_missing_directory_is_refused_at_register_time(tmp_path, monkeypatch):
    """Issue 19: refused before the engine starts, not by a worker traceback ~40 s later."""
    trace = tmp_path / "missing" / "run.h5"
    monkeypatch.setenv("STATEDIFF_TRACE", str(trace))
    monkeypatch.delenv("STATEDIFF_DISABLE", raising=False)
    monkeypatch.setattr(plugin, "_originals", [])
    monkeypatch.setattr(plugin, "check_version", lambda: pytest.fail("the version check ran first"))
    with pytest.raises(plugin.RecordingRefused) as e:
        plugin.register()
    assert str(e.value) == (f"STATEDIFF_TRACE={trace}: directory {trace.parent} does not exist (create it, or "
                            "point STATEDIFF_TRACE into an existing one)")
    plugin.check_trace_path(str(tmp_path / "run.h5"))  # an existing directory passes


@pytest.mark.vllm  # the fix is built from vLLM's own source
def test_the_engine_fix_is_installed_only_when_named(monkeypatch):
    from statediff_hooks.vllm.cpu import gdn_ragged_fix
    from statediff_hooks.vllm.cpu import mamba_align as mamba_align_cpu
    from statediff_hooks.vllm.cpu import nvfp4 as nvfp4_cpu

    monkeypatch.setattr(mamba_align_cpu, "install", lambda: [])
    monkeypatch.setattr(nvfp4_cpu, "install", lambda: [])
    monkeypatch.delenv(plugin.ENGINE_FIX_ENV, raising=False)
    try:
        assert plugin.install_engine_patches() == [] and gdn_ragged_fix.installed() == []
        monkeypatch.setenv(plugin.ENGINE_FIX_ENV, "gdn-ragged-drafts")
        assert [p["name"] for p in plugin.install_engine_patches()] == ["gdn-ragged-drafts"]
        monkeypatch.setenv(plugin.ENGINE_FIX_ENV, "gdn-ragged")
        with pytest.raises(plugin.UnsupportedEngine, match=r"^STATEDIFF_ENGINE_FIX: unknown engine fix 'gdn-ragged' "
                                                            r"\(known: gdn-ragged-drafts\)$"):
            plugin.install_engine_patches()
    finally:
        gdn_ragged_fix.uninstall()


@pytest.mark.engine  # imports vllm (the patch point's owner class)
def test_installed_says_whether_an_optional_patch_point_is_wrapped(monkeypatch):
    from statediff_hooks.vllm import surface

    point = surface.PROPOSER_FIRST_PASS
    monkeypatch.setattr(plugin, "_originals", [])
    assert not plugin.installed(point)
    owner = point.target()
    monkeypatch.setattr(plugin, "_originals", [(owner, point.name, getattr(owner, point.name))])
    assert plugin.installed(point)
    missing = surface.PatchPoint("vllm.v1.spec_decode.no_such_module", "X", "set_inputs_first_pass")
    assert not plugin.installed(missing)
