"""vLLM plugin entry point: the only place that patches vLLM.

Declared in pyproject.toml under ``vllm.general_plugins``; vLLM calls
``register()`` once in every process (front end, engine core, workers).
It does nothing unless ``STATEDIFF_TRACE`` names a trace path, and
``STATEDIFF_DISABLE=1`` is a kill switch. vLLM is imported lazily, the
original methods are kept (``unregister()`` restores them), and an engine
version or runner statediff has not verified fails loudly instead of
silently capturing nothing (``STATEDIFF_ALLOW_UNVERIFIED=1`` tries anyway).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
from typing import Any

_originals: list[tuple[Any, str, Any]] = []
_state: dict[str, Any] = {"capture": None, "recorder": None, "error": None}


class UnsupportedEngine(RuntimeError):
    """The installed vLLM version or model runner has no statediff adapter."""


def _log(msg: str) -> None:
    print(f"statediff: {msg}", file=sys.stderr, flush=True)


def check_version() -> str:
    """Installed vLLM version, if an adapter verifies it.

    Raises:
        UnsupportedEngine: unknown version (unless STATEDIFF_ALLOW_UNVERIFIED=1).
    """
    import vllm

    from .v1 import VERIFIED_VERSIONS

    version = getattr(vllm, "__version__", "unknown")
    base = version.split("+")[0]
    if base not in VERIFIED_VERSIONS and os.environ.get("STATEDIFF_ALLOW_UNVERIFIED") != "1":
        raise UnsupportedEngine(
            f"vLLM {version} is not verified by statediff (verified: "
            f"{', '.join(VERIFIED_VERSIONS)}); set STATEDIFF_ALLOW_UNVERIFIED=1 to try the "
            "V1-runner adapter anyway"
        )
    return version


def _patch(owner: Any, name: str, wrapper_factory: Any) -> None:
    orig = getattr(owner, name)
    _originals.append((owner, name, orig))
    setattr(owner, name, wrapper_factory(orig))


def register() -> None:
    """vLLM plugin hook: install the capture patches when STATEDIFF_TRACE is set."""
    if os.environ.get("STATEDIFF_DISABLE") == "1":
        return
    if not (os.environ.get("STATEDIFF_TRACE") or os.environ.get("STATEDIFF_SPLITS")
            or os.environ.get("STATEDIFF_EXACT_BLOCK") == "1"):
        return
    if _originals:
        return  # once per process
    check_version()
    from vllm.v1.worker import gpu_model_runner, mamba_utils

    runner_cls = gpu_model_runner.GPUModelRunner
    _patch(runner_cls, "execute_model", _wrap_execute_model)
    _patch(runner_cls, "sample_tokens", _wrap_sample_tokens)
    _patch(runner_cls, "_prepare_inputs", _wrap_prepare_inputs)  # hit K/V through the block table
    _patch(mamba_utils, "preprocess_mamba", _wrap_preprocess_mamba)
    _patch(runner_cls, "propose_draft_token_ids", _wrap_propose_draft_token_ids)  # spec_v1.py
    _patch(runner_cls, "initialize_kv_cache", _wrap_initialize_kv_cache)  # refuse a fault that cannot act
    if _fault_name() == "logits":  # the logits path is hooked only for the fault that edits it
        _patch(runner_cls, "_sample", _wrap_sample)
    from .sched_v1 import exact_wanted, load_plan, wrap_init_exact, wrap_split

    plan = load_plan()
    if plan or exact_wanted():
        from vllm.v1.core.sched.scheduler import Scheduler

        if plan:  # exact replay, split form: the cold run splits prefills where the hit run did
            _patch(Scheduler, "_mamba_block_aligned_split", lambda orig: wrap_split(orig, plan))
        if exact_wanted():  # exact replay, one block per step: of the block size the engine runs with
            _patch(Scheduler, "__init__", wrap_init_exact)
    try:  # Model Runner V2 has no adapter yet: refuse it loudly rather than record nothing
        from vllm.v1.worker.gpu import model_runner as v2

        _patch(v2.GPUModelRunner, "__init__", _refuse_v2)
    except ImportError:
        pass


def unregister() -> None:
    """Restore every patched attribute (tests; a process that stops recording)."""
    while _originals:
        owner, name, orig = _originals.pop()
        setattr(owner, name, orig)


class RecordingRefused(RuntimeError):
    """The recording asked for cannot mean what it says on this engine (message: one line)."""


def _fault_name() -> str | None:
    from ..faults import parse_fault

    try:
        spec = parse_fault(os.environ.get("STATEDIFF_FAULT") or "")
    except ValueError:
        return None  # reported by RecorderConfig.from_env when recording starts
    return spec.name if spec is not None and os.environ.get("STATEDIFF_TRACE") else None


def _wrap_initialize_kv_cache(orig: Any) -> Any:
    # vLLM 0.32 GPUModelRunner.initialize_kv_cache (CPUModelRunner calls it): the layers' cache
    # tensors exist right after it, at engine start, before any request.
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
    from ..faults import fault_problem
    from ..recorder import RecorderConfig
    from .effective import effective_config

    config = RecorderConfig.from_env()
    if config is None or config.fault is None:
        return
    problem = fault_problem(config.fault, effective_config(runner))
    if problem:
        raise RecordingRefused(problem)


def _wrap_sample(orig: Any) -> Any:
    # vLLM 0.32 GPUModelRunner._sample(logits, spec_decode_metadata): the sampler's input
    # (only patched for the ``logits`` fault).
    @functools.wraps(orig)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any, *a: Any, **kw: Any) -> Any:
        cap = _state["capture"]
        if cap is not None:
            _guard(lambda: cap.before_sample(logits, spec_decode_metadata))
        return orig(self, logits, spec_decode_metadata, *a, **kw)
    return _sample


def _refuse_v2(orig: Any) -> Any:
    @functools.wraps(orig)
    def init(self: Any, *a: Any, **kw: Any) -> None:
        raise UnsupportedEngine(
            "statediff has no adapter for vLLM Model Runner V2 yet; set "
            "VLLM_USE_V2_MODEL_RUNNER=0 to record with the V1 runner"
        )
    return init


def _capture_for(runner: Any) -> Any:
    """The capture bound to this process's runner, created at its first step."""
    cap = _state["capture"]
    if cap is not None or _state["error"]:
        return cap
    from ..recorder import Recorder, RecorderConfig
    from .v1 import V1Capture, run_metadata

    config = RecorderConfig.from_env()
    if config is None:
        return None
    if getattr(runner.parallel_config, "world_size", 1) > 1:
        raise UnsupportedEngine("statediff records single-GPU engines only (tensor/pipeline parallel size 1)")
    rec = Recorder(config, run_metadata(runner))
    # After the writer's own exit handler, so that it runs first (atexit is LIFO)
    # and finishes the trace file instead of leaving a partial one.
    atexit.register(close)
    _state["recorder"] = rec
    _state["capture"] = cap = V1Capture(rec, runner)
    return cap


def _guard(fn: Any) -> Any:
    """Run a capture callback; a capture bug stops recording, never the engine."""
    try:
        fn()
    except UnsupportedEngine:
        raise
    except Exception as e:  # noqa: BLE001 - report once, keep serving
        if not _state["error"]:
            _state["error"] = f"{type(e).__name__}: {e}"
            _log(f"recording stopped: {_state['error']}")
            _state["capture"] = None


def _wrap_execute_model(orig: Any) -> Any:
    @functools.wraps(orig)
    def execute_model(self: Any, scheduler_output: Any, *a: Any, **kw: Any) -> Any:
        cap = _capture_for(self)
        if cap is not None:
            _guard(lambda: cap.before_execute(scheduler_output))
        out = orig(self, scheduler_output, *a, **kw)
        if out is not None and _state["capture"] is not None:
            _guard(lambda: _state["capture"].after_step(out))  # runner skipped sample_tokens
        return out
    return execute_model


def _wrap_sample_tokens(orig: Any) -> Any:
    @functools.wraps(orig)
    def sample_tokens(self: Any, *a: Any, **kw: Any) -> Any:
        out = orig(self, *a, **kw)
        cap = _state["capture"]
        if cap is not None:
            _guard(lambda: cap.after_step(out))
        return out
    return sample_tokens


def _wrap_prepare_inputs(orig: Any) -> Any:
    # vLLM 0.32 GPUModelRunner._prepare_inputs starts with commit_block_table (host rows built by
    # _update_states -> device) and computes slot mappings from the device table: before it, a
    # planted KV fault edits the host rows; after it, the hit's K/V are read through the device rows.
    @functools.wraps(orig)
    def _prepare_inputs(self: Any, *a: Any, **kw: Any) -> Any:
        cap = _state["capture"]
        if cap is not None:
            _guard(cap.before_prepare_inputs)
        out = orig(self, *a, **kw)
        cap = _state["capture"]
        if cap is not None:
            _guard(cap.after_prepare_inputs)
        return out
    return _prepare_inputs


def _wrap_preprocess_mamba(orig: Any) -> Any:
    @functools.wraps(orig)
    def preprocess_mamba(scheduler_output: Any, kv_cache_config: Any, cache_config: Any,
                         mamba_state_idx: dict, *a: Any, **kw: Any) -> Any:
        out = orig(scheduler_output, kv_cache_config, cache_config, mamba_state_idx, *a, **kw)
        cap = _state["capture"]
        if cap is not None:
            _guard(lambda: cap.after_preprocess_mamba(mamba_state_idx))
        return out
    return preprocess_mamba


def _wrap_propose_draft_token_ids(orig: Any) -> Any:
    # speculative decoding: drafter inputs and acceptance (logic in spec_v1.py)
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def propose_draft_token_ids(self: Any, *a: Any, **kw: Any) -> Any:
        cap = _state["capture"]
        if cap is not None:
            _guard(lambda: cap.before_propose(sig.bind(self, *a, **kw).arguments))
        return orig(self, *a, **kw)
    return propose_draft_token_ids


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
    stats = rec.close()
    stats["error"] = _state["error"]
    return stats


def annotate_request(index: int, **fields: Any) -> None:
    """Add front-end facts (e.g. sampled-token logprobs) to a recorded request.

    Only meaningful when the engine runs in this process (the replay path).
    """
    rec = _state["recorder"]
    if rec is not None and not rec.closed and index in rec.writer.requests:
        rec.writer.update_request(index, **fields)


def mark_stopped(request: int, error: str, **where: Any) -> None:
    """Record that the replay stopped early at request ``request`` (run metadata ``stopped``).

    ``close()`` then finishes the trace marked incomplete (root attribute
    ``complete`` false): a reader says where and why it stopped.
    """
    rec = _state["recorder"]
    if rec is not None and not rec.closed:
        rec.writer.update_run(stopped={"request": request, "error": error, **where})


def fault_fired() -> bool:
    """Whether this process's recording planted its fault (run metadata ``fault`` set)."""
    rec = _state["recorder"]
    return rec is not None and bool(rec.writer.run.get("fault"))


def reset() -> None:
    """Forget this process's capture (a new engine in the same process records anew)."""
    _state.update(capture=None, recorder=None, error=None)
