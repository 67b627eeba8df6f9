"""Run field ``engine_patches``: what ran in place of the engine's own code (``docs/trace-format.md``).

A recording adapter that replaces engine code so the engine runs at all (vLLM
on a CPU: ``statediff_hooks.vllm.cpu.mamba_align`` stands in for two Triton
kernels) lists each patch as an object: ``name``, ``replaces`` (the engine's
functions, fully qualified; absent for a route that runs the engine's own code
another way, such as Model Runner V2's Triton kernels in Triton's interpreter on a
CPU: ``statediff_hooks.vllm.cpu.triton_interpreter``), ``written_for``, ``why`` and
``note`` (what the patched run cannot show). ``[]``: the engine ran unpatched; null: not recorded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe_patches", "patches_problem"]


def patches_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid ``engine_patches`` (a list of objects with a string ``name``, or null)."""
    if value is None or (isinstance(value, list) and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) for p in value)):
        return None
    return "run field 'engine_patches' is not a list of objects {name: string, ...} or null"


def describe_patches(value: Any) -> str:
    """One line naming each patch, what it replaces and what it cannot show; ``none`` / ``unknown``."""
    if value is None or patches_problem(value):
        return "unknown (not recorded)"
    if not value:
        return "none (the engine's own code ran)"
    parts = []
    for p in value:
        replaced = ", ".join(str(r).rsplit(".", 1)[-1] for r in p.get("replaces") or [])
        head = f"replaces {replaced}" if replaced else str(p.get("why") or "")  # a route replaces nothing: why
        parts.append(p["name"] + f" ({head}" + (f"; {p['note']})" if p.get("note") else ")"))
    return "; ".join(parts)
