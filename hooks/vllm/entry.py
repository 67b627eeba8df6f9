"""What vLLM calls in every process: statediff's ``vllm.general_plugins`` entry point.

Wherever statediff is installed, vLLM imports this module and calls ``register()`` in every
process it starts (front end, engine core, workers, ``vllm serve``), and it does not catch
what ``register()`` raises (``vllm/plugins/__init__.py`` ``load_general_plugins``, vLLM
0.29-0.32; it does catch a failed import of the entry point, logs it and starts the engine
without the plugin). So this module imports the standard library only, and ``register()``
looks at the environment before it imports anything of statediff:

- Asked for nothing (no variable of ``ASKING`` asks, or ``STATEDIFF_DISABLE=1``): it returns
  having imported and patched nothing, and nothing on that path can raise. The engine patches
  (the CPU stand-ins of ``plugin.install_engine_patches``, which a hybrid target with a drafter
  and prefix caching needs on a CPU) are not installed either: an installed statediff leaves a
  vLLM it was not asked into running vLLM's own code. ``STATEDIFF_ENGINE_PATCHES=1`` asks for
  them alone (docs/engines.md).
- Asked: ``plugin.register()`` installs what was asked for. Its refusals pass as they are
  (``UnsupportedEngine``, ``RecordingRefused``, and a bad live-audit value: one line, exit
  status 2); anything else that stops it, a module of statediff that cannot be imported
  included, is one line on stderr and exit status 2 before the engine starts
  (``STATEDIFF_DEBUG=1``: the exception with its traceback instead), never an engine that runs
  without the recording or audit it was asked for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

__all__ = ["ASKING", "asked", "register"]


def _set(value: str) -> bool:
    return value != ""


def _one(value: str) -> bool:
    return value == "1"


#: The variables that ask the plugin for something -> which values ask (what ``plugin.register``
#: acts on): a recording, exact replay (split plan; one block per step), a live audit (its
#: prompts switch alone is refused there), the engine patches alone.
ASKING: dict[str, Callable[[str], bool]] = {
    "STATEDIFF_TRACE": _set,
    "STATEDIFF_SPLITS": _set,
    "STATEDIFF_EXACT_BLOCK": _one,
    "STATEDIFF_LIVE_AUDIT": _set,
    "STATEDIFF_LIVE_AUDIT_PROMPTS": _set,
    "STATEDIFF_ENGINE_PATCHES": _one,
}


def asked(env: Mapping[str, str] | None = None) -> list[str]:
    """The variables of ``env`` (default: this process's environment) that ask the plugin for
    something (``ASKING``), in ``ASKING``'s order; [] when none does or ``STATEDIFF_DISABLE=1``."""
    env = os.environ if env is None else env
    if env.get("STATEDIFF_DISABLE") == "1":
        return []
    return [name for name, asks in ASKING.items() if asks(env.get(name) or "")]


def register() -> None:
    """vLLM plugin hook (every vLLM process): install what the environment asks for; nothing else.

    Raises:
        SystemExit: status 2, after one line ``statediff: error: ...`` on stderr, when something
            was asked for and statediff cannot provide it.
        UnsupportedEngine, RecordingRefused: ``plugin.register``'s refusals (one line each).
    """
    try:
        names = asked()
    except Exception:  # noqa: BLE001 - nothing may stop a vLLM that did not ask for statediff
        return
    _check_known_bugs()
    if not names:
        return
    plugin = None
    try:
        from . import plugin

        plugin.register()
    except Exception as e:
        if plugin is not None and isinstance(e, (plugin.UnsupportedEngine, plugin.RecordingRefused)):
            raise
        if os.environ.get("STATEDIFF_DEBUG", "") not in ("", "0"):
            raise
        text = (str(e).strip().splitlines() or [""])[0]
        variables = " and ".join(names)
        print(f"statediff: error: {variables} {'is' if len(names) == 1 else 'are'} set, but statediff cannot "
              f"start in this vLLM process: {type(e).__name__}{': ' + text if text else ''} (a broken install? "
              f"STATEDIFF_DEBUG=1 shows the traceback; unset {variables} to run vLLM without statediff)",
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _check_known_bugs() -> None:
    """Known engine bugs (issue 35: ``statediff/enginebugs/known_bugs.toml``, ``startup.py``): one
    WARNING per match in vLLM's log when this process makes an engine's config, statediff asked for
    or not. Only where vLLM's ``engine.arg_utils`` is already loaded (the process that makes the
    config: vLLM loads plugins from there); skipped with ``STATEDIFF_DISABLE=1`` or
    ``STATEDIFF_KNOWN_BUGS=off``. Never raises: a failure is one line on stderr, vLLM goes on."""
    try:
        if (os.environ.get("STATEDIFF_DISABLE") == "1" or os.environ.get("STATEDIFF_KNOWN_BUGS") == "off"
                or "vllm.engine.arg_utils" not in sys.modules):
            return
        from . import startup

        startup.install()
    except Exception as e:  # noqa: BLE001 - an installed statediff never stops vLLM for this
        print(f"statediff: known-bug check off: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
              file=sys.stderr, flush=True)
