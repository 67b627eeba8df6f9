"""vLLM plugin entry point: the only place that patches vLLM.

vLLM calls ``register()`` once in every process (front end, engine core,
workers) through ``entry.register``, the ``vllm.general_plugins`` entry point, which
imports this module only when a variable asks for something (``entry.ASKING``): an
installed statediff cannot stop a vLLM that did not ask for it.
It does nothing unless ``STATEDIFF_TRACE`` names a trace path (or exact
replay's ``STATEDIFF_SPLITS`` / ``STATEDIFF_EXACT_BLOCK`` is set, or
``STATEDIFF_LIVE_AUDIT`` names an incident file for a live audit under ``vllm serve``,
``statediff.audit.live``, or ``STATEDIFF_ENGINE_PATCHES=1`` asks for the engine patches alone), and
``STATEDIFF_DISABLE=1`` is a kill switch. Active, it first installs the
engine patches this platform needs for the engine to run at all
(``install_engine_patches``: today the CPU stand-ins of ``cpu.mamba_align``);
the trace records them (run field ``engine_patches``). vLLM is imported lazily, the
original methods are kept (``unregister()`` restores them), and an engine
version or runner statediff has not verified fails loudly instead of
silently capturing nothing (``STATEDIFF_ALLOW_UNVERIFIED=1`` tries anyway).

Which methods are wrapped is named in ``surface.py`` (``PatchPoint``);
``CAPTURE_HOOKS`` says what the capture (``v1.V1Capture``) does before and
after each. The process that records closes its trace at exit (``atexit``);
a program that dies on an uncaught exception first marks it incomplete with
the exception named (``sys.excepthook``, which runs before ``atexit``; with
a multi-process engine the front end leaves a note the engine's process
reads when it closes the trace).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statediff.errors import first_line
from . import metrics, surface
from .surface import UnsupportedEngine, check_version

__all__ = ["RecordingRefused", "UnsupportedEngine", "annotate_request", "check_version", "close", "fault_fired",
           "mark_stopped", "register", "reset", "unregister"]

_originals: list[tuple[Any, str, Any]] = []
_state: dict[str, Any] = {"capture": None, "recorder": None, "error": None, "metrics": None}
_adapter: list[surface.Adapter] = []  # the version row register() checked, for the run metadata
_hooked_exit: list[bool] = []  # the crash note is installed once per process


def _log(msg: str) -> None:
    print(f"statediff: {msg}", file=sys.stderr, flush=True)


def _patch(point: surface.PatchPoint, wrapper_factory: Callable[[Any], Any]) -> None:
    owner = point.target()
    orig = getattr(owner, point.name)
    _originals.append((owner, point.name, orig))
    setattr(owner, point.name, wrapper_factory(orig))


def installed(point: surface.PatchPoint) -> bool:
    """``point`` is wrapped in this process (an optional patch point may be missing in a vLLM version)."""
    target = _target_or_none(point)
    return target is not None and any(owner is target and name == point.name for owner, name, _ in _originals)


def _target_or_none(point: surface.PatchPoint) -> Any:
    try:
        return point.target()
    except ImportError:
        return None


def _around(before: Callable[[Any, dict], None] | None = None,
            after: Callable[[Any, dict, Any], None] | None = None, *, start: bool = False,
            skip: Callable[[dict], bool] | None = None) -> Callable[[Any], Any]:
    """A wrapper factory for ``_patch``: the original, with the capture's hooks around it.

    ``before(capture, args)`` runs before the original and ``after(capture, args, result)``
    after it, where ``args`` are the call's arguments by name (``self`` and defaults included),
    each only while this process records, and through ``_guard`` (a capture error stops
    recording, never the engine). ``start``: the call's ``self`` is the runner whose first
    step creates the capture (``_capture_for``). ``skip(args)`` true: a call the capture does not
    see (Model Runner V2's profiling and warm-up runs are ``execute_model(dummy_run=True)``).
    """

    def factory(orig: Any) -> Any:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def wrapper(*a: Any, **kw: Any) -> Any:
            bound = sig.bind(*a, **kw)
            bound.apply_defaults()
            args = bound.arguments
            if skip is not None and skip(args):
                return orig(*a, **kw)
            cap = _capture_for(args["self"]) if start else _state["capture"]
            if before is not None and cap is not None:
                _guard(lambda: before(cap, args))
            out = orig(*a, **kw)
            cap = _state["capture"]
            if after is not None and cap is not None:
                _guard(lambda: after(cap, args, out))
            return out
        return wrapper
    return factory


def _after_execute(cap: Any, args: dict, out: Any) -> None:
    if out is not None:  # the runner skipped sample_tokens: this is the step's output
        cap.after_step(out)


#: The capture's hooks on vLLM 0.32 (``surface`` names each method): (patch point, wrapper factory).
CAPTURE_HOOKS: tuple[tuple[surface.PatchPoint, Callable[[Any], Any]], ...] = (
    (surface.EXECUTE_MODEL, _around(lambda cap, a: cap.before_execute(a["scheduler_output"]), _after_execute,
                                    start=True)),
    (surface.SAMPLE_TOKENS, _around(after=lambda cap, a, out: cap.after_step(out))),
    # before: a planted KV fault edits the runner's host rows (before commit_block_table);
    # after: the hit's K/V are read through the device rows
    (surface.PREPARE_INPUTS, _around(lambda cap, a: cap.before_prepare_inputs(),
                                     lambda cap, a, out: cap.after_prepare_inputs())),
    (surface.PREPROCESS_MAMBA, _around(after=lambda cap, a, out: cap.after_preprocess_mamba(a["mamba_state_idx"]))),
    (surface.PROPOSE_DRAFT, _around(lambda cap, a: cap.before_propose(a),  # v1/spec.py
                                    lambda cap, a, out: cap.after_propose(out))),
    # inside the forward context, before the kernels: first chunks' GDN metadata (statediff audit)
    (surface.MODEL_FORWARD, _around(lambda cap, a: cap.before_forward())),
)


def _v2_hooks() -> tuple[tuple[surface.PatchPoint, Callable[[Any], Any]], ...]:
    """The capture's hooks on Model Runner V2 (``v2/surface.py`` names each method; ``v2/capture.py``)."""
    from .v2 import surface as v2

    return (
        (v2.EXECUTE_MODEL, _around(lambda cap, a: cap.before_execute(a["scheduler_output"]), _after_execute,
                                   start=True, skip=lambda a: bool(a.get("dummy_run")))),
        (v2.SAMPLE_TOKENS, _around(after=lambda cap, a, out: cap.after_step(out))),
        # before: a planted KV fault edits the slot's device row; after: the hit's K/V through the batch's tables
        (v2.PREPARE_ATTN, _around(lambda cap, a: cap.before_prepare_attn(a["input_batch"]),
                                  lambda cap, a, out: cap.after_prepare_attn(out))),
        (v2.PREPROCESS_STATE, _around(after=lambda cap, a, out: cap.after_preprocess_state())),
        (v2.PREPARE_ATTN_METADATA, _around(after=lambda cap, a, out: cap.after_attn_metadata(out))),
        (v2.INITIALIZE_KV_CACHE, _check_fault_after),
    ) + tuple((point, _around(lambda cap, a: cap.before_propose(a), lambda cap, a, out: cap.after_propose(out),
                              skip=lambda a: bool(a.get("dummy_run"))))
              for point in v2.SPECULATOR_PROPOSE)  # v2/spec.py; a class missing in this vLLM is skipped


def _register_v2() -> None:
    """Model Runner V2's hooks (``_v2_hooks``), where this vLLM has the runner; the capture is the runner's
    that runs (``_capture_for``)."""
    from .v2 import surface as v2

    try:
        v2.EXECUTE_MODEL.target()
    except (ImportError, AttributeError):
        return  # no Model Runner V2 in this vLLM
    for point, factory in _v2_hooks():
        try:
            present = hasattr(point.target(), point.name)
        except Exception:  # noqa: BLE001 - a speculator module this vLLM lacks or cannot import: its drafter unrecorded
            present = False
        if present:
            _patch(point, factory)


def register() -> None:
    """vLLM plugin hook: install the capture patches when STATEDIFF_TRACE is set."""
    if os.environ.get("STATEDIFF_DISABLE") == "1":
        return
    live = _live_config()  # STATEDIFF_LIVE_AUDIT: a bad value stops here, before the engine starts
    capture = bool(os.environ.get("STATEDIFF_TRACE") or os.environ.get("STATEDIFF_SPLITS")
                   or os.environ.get("STATEDIFF_EXACT_BLOCK") == "1" or live)
    if not (capture or os.environ.get(ENGINE_PATCHES_ENV) == "1"):
        return
    if _originals:
        return  # once per process
    check_trace_path(os.environ.get("STATEDIFF_TRACE"))
    _adapter[:] = [check_version()]
    install_engine_patches()
    if not capture:
        return  # STATEDIFF_ENGINE_PATCHES=1 alone: the stand-ins, no capture
    if live:  # statediff's counters on this server's /metrics (metrics.py), before the engine core starts
        _metrics_call(lambda: metrics.serve())
    if os.environ.get("STATEDIFF_TRACE"):
        _note_uncaught_exceptions()  # every process: the front end of a multi-process engine too
    for point, factory in CAPTURE_HOOKS:
        _patch(point, factory)
    try:  # the rows the drafter model receives inside the proposer (v1/proposer.py)
        _patch(surface.PROPOSER_FIRST_PASS, _around(after=lambda cap, a, out: cap.after_first_pass(a, out)))
    except (ImportError, AttributeError):
        pass  # no such proposer in this vLLM: the role is not recorded
    _patch(surface.INITIALIZE_KV_CACHE, _check_fault_after)  # refuse a fault that cannot act
    if os.environ.get("STATEDIFF_TRACE") or live:  # each KV-cache group's final hit (statediff audit)
        from .v1.group_hits import wrap_get_computed_blocks

        _patch(surface.GET_COMPUTED_BLOCKS, wrap_get_computed_blocks)
    if _fault_name() == "logits":  # the logits path is hooked only for the fault that edits it
        _patch(surface.SAMPLE, _around(lambda cap, a: cap.before_sample(a["logits"], a["spec_decode_metadata"])))
    _register_scheduler()
    _register_v2()  # statediff records whichever runner vLLM picks


def _live_config() -> bool:
    """Whether ``STATEDIFF_LIVE_AUDIT`` asks for a live audit (``statediff.audit.live``).

    A bad value (``LiveConfig.from_env``) is refused here, in every process, before the
    engine starts: one line ``statediff: error: ...`` on stderr, then exit status 2.
    """
    from statediff.audit.live import LiveConfig

    try:
        return LiveConfig.from_env() is not None
    except ValueError as e:
        print(f"statediff: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


#: Set to 1, the plugin installs its engine patches (``install_engine_patches``) without recording.
ENGINE_PATCHES_ENV = "STATEDIFF_ENGINE_PATCHES"
#: Comma-separated engine-bug fixes to install too (``--engine-fix``): ``gdn-ragged-drafts``.
ENGINE_FIX_ENV = "STATEDIFF_ENGINE_FIX"
#: The fixes ``ENGINE_FIX_ENV`` may name -> their module (``install`` / ``installed``).
ENGINE_FIXES = {"gdn-ragged-drafts": "statediff_hooks.vllm.cpu.gdn_ragged_fix"}


def install_engine_patches() -> list[dict]:
    """Install, in this process, the stand-ins an engine needs to run at all on this platform.

    Today: ``cpu.triton_interpreter`` (Model Runner V2 chosen on a CPU: vLLM's own Triton kernels
    in Triton's interpreter; the align stand-ins then step aside), ``cpu.mamba_align`` (vLLM's two Triton-only mamba align kernels, on a CPU
    without Triton, where vLLM has no CPU implementation of them), ``nvfp4_cpu`` (vLLM's
    NVFP4 emulation kernel registered for a CPU that lists no NVFP4 kernel) and, on vLLM without an
    override registry (0.30), ``kernel_overrides_v030.install_spec_dispatchers`` (vLLM's own
    CPU ports for the speculative-decoding warmup dispatchers 0.30 leaves on Triton). Idempotent.

    With ``STATEDIFF_ENGINE_FIX`` also the engine-bug fixes it names (``ENGINE_FIXES``).

    Returns:
        What is installed (run field ``engine_patches``: one object per patch).
    Raises:
        UnsupportedEngine: ``STATEDIFF_ENGINE_FIX`` names an unknown fix.
    """
    import importlib
    import importlib.util

    from .cpu import kernel_overrides_v030, triton_interpreter
    from .cpu import mamba_align as mamba_align_cpu
    from .cpu import nvfp4 as nvfp4_cpu

    # first: with Model Runner V2 on a CPU, vLLM's own Triton kernels run (the stand-ins then step aside)
    hint = triton_interpreter.missing_hint()
    if hint:  # vLLM's own refusal follows; this line says how to start the process instead
        _log(hint)
    out = triton_interpreter.install()
    out += mamba_align_cpu.install() + nvfp4_cpu.install()
    if importlib.util.find_spec("vllm.triton_utils.dispatcher") is None:  # vLLM 0.29/0.30: no registry
        out += kernel_overrides_v030.install_spec_dispatchers()
    for name in filter(None, os.environ.get(ENGINE_FIX_ENV, "").split(",")):
        if name not in ENGINE_FIXES:
            raise UnsupportedEngine(f"{ENGINE_FIX_ENV}: unknown engine fix {name!r} (known: {', '.join(ENGINE_FIXES)})")
        out += importlib.import_module(ENGINE_FIXES[name]).install()
    return out


def _engine_patches(runner: Any) -> list[dict]:
    """The installed engine patches this runner's configuration launches (run field ``engine_patches``)."""
    import importlib

    from .cpu import kernel_overrides_v030, triton_interpreter
    from .cpu import mamba_align as mamba_align_cpu
    from .cpu import nvfp4 as nvfp4_cpu

    fixes = [importlib.import_module(m).installed(runner) for m in ENGINE_FIXES.values()
             if m in sys.modules]  # only a fix this process installed has its module imported
    return (triton_interpreter.installed(runner) + mamba_align_cpu.installed(runner)
            + kernel_overrides_v030.spec_dispatchers_installed(runner)
            + nvfp4_cpu.installed(runner) + [p for f in fixes for p in f])


def check_trace_path(trace: str | None) -> None:
    """Refuse a ``STATEDIFF_TRACE`` whose directory is missing or not a directory, at register
    time (before the engine starts: the trace is opened only in the worker, much later).

    Raises:
        RecordingRefused: one line naming the variable and the directory.
    """
    if not trace:
        return
    parent = Path(trace).parent if str(Path(trace).parent) else Path(".")
    if not parent.is_dir():
        raise RecordingRefused(f"STATEDIFF_TRACE={trace}: directory {parent} does not exist (create it, or "
                               "point STATEDIFF_TRACE into an existing one)")


def _register_scheduler() -> None:
    """The scheduler's own block-drop answer (``v1.sched.wrap_init_note``), and exact replay's scheduler
    wrappers (``v1.sched``), when asked for."""
    from .v1.sched import exact_wanted, load_plan, wrap_init_exact, wrap_init_note, wrap_split

    _patch(surface.SCHEDULER_INIT, wrap_init_note)
    plan = load_plan()
    if plan:  # exact replay, split form: the cold run splits prefills where the hit run did
        _patch(surface.SCHEDULER_SPLIT, lambda orig: wrap_split(orig, plan))
    if exact_wanted():  # exact replay, one block per step: of the block size the engine runs with
        _patch(surface.SCHEDULER_INIT, wrap_init_exact)


def unregister() -> None:
    """Restore every patched attribute (tests; a process that stops recording)."""
    while _originals:
        owner, name, orig = _originals.pop()
        setattr(owner, name, orig)


class RecordingRefused(RuntimeError):
    """The recording asked for cannot mean what it says on this engine (message: one line)."""


def _fault_name() -> str | None:
    from ..recording.faults import parse_fault

    try:
        spec = parse_fault(os.environ.get("STATEDIFF_FAULT") or "")
    except ValueError:
        return None  # reported by RecorderConfig.from_env when recording starts
    return spec.name if spec is not None and (os.environ.get("STATEDIFF_TRACE") or
                                              os.environ.get("STATEDIFF_LIVE_AUDIT")) else None


def _check_fault_after(orig: Any) -> Any:
    # the layers' cache tensors exist right after initialize_kv_cache, at engine start, before any request
    @functools.wraps(orig)
    def initialize_kv_cache(self: Any, *a: Any, **kw: Any) -> Any:
        out = orig(self, *a, **kw)
        check_fault_at_start(self)
        return out
    return initialize_kv_cache


def check_fault_at_start(runner: Any) -> None:
    """Refuse, at engine start, a planted fault that cannot act on the engine as it runs.

    Raises:
        RecordingRefused: ``faults.fault_problem`` names a reason (e.g.
            ``ssm-bf16`` on an SSM state that is already bfloat16).
    """
    from ..recording.faults import fault_problem
    from ..recording.config import RecorderConfig
    from .effective import effective_config

    from .v2 import surface as v2

    config = RecorderConfig.from_env()
    if config is None or config.fault is None:
        return
    if v2.is_v2_runner(runner):
        from .v2.capture import UNSUPPORTED_FAULTS

        if config.fault.name in UNSUPPORTED_FAULTS:
            raise RecordingRefused(f"fault {config.fault.spec} cannot be planted on Model Runner V2: "
                                   f"{UNSUPPORTED_FAULTS[config.fault.name]} (VLLM_USE_V2_MODEL_RUNNER=0 plants it on V1)")
    problem = fault_problem(config.fault, effective_config(runner))
    if problem:
        raise RecordingRefused(problem)


def _capture_for(runner: Any) -> Any:
    """The capture bound to this process's runner, created at its first step."""
    cap = _state["capture"]
    if cap is not None or _state["error"]:
        return cap
    from ..recording.recorder import Recorder
    from ..recording.config import RecorderConfig
    from .v1.capture import V1Capture, run_metadata
    from .v2 import surface as v2

    config = RecorderConfig.from_env()
    if config is None:
        return None
    config, tp = _rank_config(config, runner)
    is_v2 = v2.is_v2_runner(runner)
    rec = Recorder(config, run_metadata(runner, _adapter[0] if _adapter else None, "v2" if is_v2 else "v1",
                                        v2.RUNNER_NAME if is_v2 else surface.RUNNER_NAME))
    if tp is not None:
        rec.set_run(tensor_parallel=tp)  # this rank, the world size, the shard layout (v1/tp.py)
        _scheduler_budget_of_rank(rec, runner)
    rec.set_run(engine_patches=_engine_patches(runner))  # what runs in place of the engine's own code
    # After the writer's own exit handler, so that it runs first (atexit is LIFO)
    # and finishes the trace file instead of leaving a partial one.
    atexit.register(close)
    if config.live is None:
        _stop_note(config.trace).unlink(missing_ok=True)  # a note left by an earlier program is not this one's
    _state["recorder"] = rec
    if is_v2:
        from .v2.capture import V2Capture

        _state["capture"] = cap = V2Capture(rec, runner)
    else:
        _state["capture"] = cap = V1Capture(rec, runner)
    if rec.live:  # this process's live-audit counters, for the front end's /metrics
        _state["metrics"] = _metrics_call(lambda: metrics.AuditMetrics(rec, (tp or {}).get("rank", 0)))
    return cap


def _metrics_call(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None after one line on stderr: metrics never stop the audit or the engine."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        _log(f"live-audit metrics off: {type(e).__name__}: {first_line(e)}")
        return None


def _rank_config(config: Any, runner: Any) -> tuple[Any, dict | None]:
    """``config`` for this worker's rank (rank r > 0 writes ``v1.tp.rank_trace_path``; a live audit's
    rank r > 0 appends its incidents to ``STEM.rankR.jsonl``) and its run field ``tensor_parallel``
    (None without tensor parallelism).

    Raises:
        UnsupportedEngine: pipeline parallelism, or tensor parallelism on a vLLM version whose
            shard layout statediff has not verified (``v1.tp.check_supported``).
    """
    import dataclasses

    import vllm

    from .v1 import tp as tp_v1

    pc = runner.parallel_config
    why = tp_v1.check_supported(getattr(vllm, "__version__", "?"), int(getattr(pc, "tensor_parallel_size", 1) or 1),
                                int(getattr(pc, "pipeline_parallel_size", 1) or 1))
    if why:
        raise UnsupportedEngine(why)
    rank, size = tp_v1.rank_of(runner)
    if size == 1:
        return config, None
    if config.live is not None:  # each rank audits its own shards: rank r > 0 appends to STEM.rankR.jsonl
        live = dataclasses.replace(config.live, incidents=tp_v1.rank_trace_path(config.live.incidents, rank, ".jsonl"))
        field = tp_v1.tensor_parallel_field(runner, live.incidents, ".jsonl")
        return dataclasses.replace(config, live=live), field
    config = dataclasses.replace(config, trace=tp_v1.rank_trace_path(config.trace, rank))
    return config, tp_v1.tensor_parallel_field(runner, config.trace)


def _scheduler_budget_of_rank(rec: Any, runner: Any) -> None:
    """Exact replay under tensor parallelism: the scheduler runs in the engine core, outside this
    worker, and ``v1.sched.one_block_per_step`` lowered its budget there to one block (``cache_config
    .block_size``); this worker's copy of the scheduler config still holds the old budget, so the run
    fields ``max_num_batched_tokens`` and ``effective.max_num_scheduled_tokens`` are set to that block."""
    from .v1.sched import exact_wanted

    if not exact_wanted():
        return
    block = int(runner.cache_config.block_size)
    eff = dict(rec.run_field("effective") or {})
    eff["max_num_scheduled_tokens"] = block
    rec.set_run(effective=eff, max_num_batched_tokens=block)


def _note_uncaught_exceptions() -> None:
    """Make a program that dies on an exception leave its trace incomplete, the exception named.

    ``sys.excepthook`` runs before the interpreter's exit handlers (``atexit``), so the
    note (run metadata ``stopped``, as ``mark_stopped``) is in place when ``close``
    finishes the trace. The previous hook still prints the traceback.
    """
    if _hooked_exit:
        return
    _hooked_exit.append(True)
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            note_uncaught(exc)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def note_uncaught(exc: BaseException) -> None:
    """Record that the program stopped on ``exc`` (run metadata ``stopped``, request unknown),
    unless the trace is closed or already says where it stopped.

    In the process that records, directly. In the front end of a multi-process engine
    (this process holds no recorder, and the engine's process is recording: the trace's
    parts directory exists), as a note next to the trace (``TRACE.stopped.json``) that
    the recording process's ``close`` reads: the front end's exception hook runs before
    its exit handlers shut the engine down.
    """
    error = f"{type(exc).__name__}: {first_line(exc)}" if str(exc) else type(exc).__name__
    stopped = {"request": None, "error": error, "where": "uncaught exception in the recorded program"}
    rec = _state["recorder"]
    if rec is not None:
        if not rec.closed and not rec.run_field("stopped"):
            rec.set_run(stopped=stopped)
        return
    trace = os.environ.get("STATEDIFF_TRACE")
    if trace and _recording_elsewhere(trace):
        try:
            _stop_note(trace).write_text(json.dumps(stopped), encoding="utf-8")
        except OSError:
            pass  # the trace then closes as complete, as before


def _stop_note(trace: str) -> Path:
    return Path(trace).with_name(Path(trace).name + ".stopped.json")


def _recording_elsewhere(trace: str) -> bool:
    """Another process is recording ``trace`` (its unfinished parts directory exists)."""
    from statediff.trace.writer import parts_dir

    return parts_dir(trace).is_dir()


def _read_stop_note(trace: str) -> dict | None:
    """The front end's note that the program died (``note_uncaught``), removed once read; None if none."""
    note = _stop_note(trace)
    try:
        stopped = json.loads(note.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    note.unlink(missing_ok=True)
    return stopped if isinstance(stopped, dict) else None


def _guard(fn: Any) -> Any:
    """Run a capture callback; a capture bug stops recording, never the engine.
    A live audit's time in it goes to ``statediff:audit_seconds`` (``metrics.AuditMetrics.spent``)."""
    t0 = time.perf_counter()
    try:
        fn()
    except UnsupportedEngine:
        raise
    except Exception as e:  # noqa: BLE001 - report once, keep serving
        if not _state["error"]:
            _state["error"] = f"{type(e).__name__}: {e}"
            _log(f"recording stopped: {_state['error']}")
            _state["capture"] = None
    finally:
        m = _state.get("metrics")
        if m is not None:
            try:
                m.spent(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - metrics never stop the audit
                _state["metrics"] = None
                _log(f"live-audit metrics off: {type(e).__name__}: {first_line(e)}")


def close() -> dict:
    """Finish this process's trace (merge segments into the file); idempotent.

    Returns the writer's stats, or {} when nothing was recorded.
    """
    rec = _state["recorder"]
    if rec is None or rec.closed:
        return {}
    cap = _state["capture"]
    if cap is not None:
        try:
            cap.close()
        except Exception:  # noqa: BLE001
            pass
    stopped = _read_stop_note(rec.config.trace) if getattr(rec.config, "live", None) is None else None
    if stopped is not None and not rec.run_field("stopped"):
        rec.set_run(stopped=stopped)  # the program died in its front end (note_uncaught)
    stats = rec.close()
    stats["error"] = _state["error"]
    return stats


def annotate_request(index: int, **fields: Any) -> None:
    """Add front-end facts (e.g. sampled-token logprobs) to a recorded request.

    Only meaningful when the engine runs in this process (the replay path).
    """
    rec = _state["recorder"]
    if rec is not None and not rec.closed and rec.has_request(index):
        rec.set_request(index, **fields)


def request_index(request_id: str) -> int | None:
    """The trace index of the front end's request ``request_id`` (``RequestOutput.request_id``; vLLM 0.32's
    engine id is it plus ``-`` and a random suffix, ``v1/engine/input_processor.py``
    ``assign_request_id``), or None when this process records nothing or never saw it.

    Only meaningful when the engine runs in this process (the replay path).
    """
    rec = _state["recorder"]
    if rec is None or rec.closed:
        return None
    if request_id in rec.index:
        return rec.index[request_id]
    prefix = f"{request_id}-"
    return next((i for rid, i in rec.index.items() if rid.startswith(prefix)), None)


def mark_stopped(request: int | None, error: str, **where: Any) -> None:
    """Record that the replay stopped early at request ``request`` (None: unknown; run metadata ``stopped``).

    ``close()`` then finishes the trace marked incomplete (root attribute
    ``complete`` false): a reader says where and why it stopped.
    """
    rec = _state["recorder"]
    if rec is not None and not rec.closed:
        rec.set_run(stopped={"request": request, "error": error, **where})


def fault_fired() -> bool:
    """Whether this process's recording planted its fault (run metadata ``fault`` set)."""
    rec = _state["recorder"]
    return rec is not None and bool(rec.run_field("fault"))


def reset() -> None:
    """Forget this process's capture (a new engine in the same process records anew)."""
    _state.update(capture=None, recorder=None, error=None, metrics=None)
