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
    if not os.environ.get("STATEDIFF_TRACE") and not os.environ.get("STATEDIFF_SPLITS"):
        return
    if _originals:
        return  # once per process
    check_version()
    from vllm.v1.worker import gpu_model_runner, mamba_utils

    runner_cls = gpu_model_runner.GPUModelRunner
    _patch(runner_cls, "execute_model", _wrap_execute_model)
    _patch(runner_cls, "sample_tokens", _wrap_sample_tokens)
    _patch(mamba_utils, "preprocess_mamba", _wrap_preprocess_mamba)
    _patch(runner_cls, "propose_draft_token_ids", _wrap_propose_draft_token_ids)  # spec_v1.py
    from .sched_v1 import load_plan, wrap_split

    plan = load_plan()
    if plan:  # exact replay, split form: the cold run splits prefills where the hit run did
        from vllm.v1.core.sched.scheduler import Scheduler

        _patch(Scheduler, "_mamba_block_aligned_split", lambda orig: wrap_split(orig, plan))
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


def fault_fired() -> bool:
    """Whether this process's recording planted its fault (run metadata ``fault`` set)."""
    rec = _state["recorder"]
    return rec is not None and bool(rec.writer.run.get("fault"))


def reset() -> None:
    """Forget this process's capture (a new engine in the same process records anew)."""
    _state.update(capture=None, recorder=None, error=None)
