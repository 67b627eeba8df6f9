"""Interpreter start in an engine process vLLM spawns: Model Runner V2's Triton kernels on a CPU.

On ``PYTHONPATH`` only where statediff put it (``triton_interpreter.engine_env``); acts only with
``STATEDIFF_TRITON_INTERPRETER=1`` and ``TRITON_INTERPRET=1``, before vLLM is imported
(``triton_interpreter.activate``). Then hands over to the next ``sitecustomize`` on ``sys.path``,
if any, as Python would have run it without this folder.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("STATEDIFF_TRITON_INTERPRETER") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        # by name: this file runs at interpreter start, outside the package
        importlib.import_module("statediff_hooks.vllm.cpu.triton_interpreter").activate()
    except Exception as e:  # noqa: BLE001 - the plugin refuses in one line once vLLM loads it
        print(f"statediff: Triton interpreter not set up: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
