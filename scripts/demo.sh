#!/usr/bin/env bash
# The main job on the built-in tiny hybrid (Qwen3-Next architecture, random
# weights): replay a 5-request agent conversation whose later requests hit the
# prefix cache, record a hit run and a cold run in exact replay mode, compare
# them; then plant a restore fault (SSM state resumed from one block too early)
# and show that compare names it. Outputs land in ./out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p out
statediff build-tiny-model
echo "== record: hit run and cold run (exact replay) =="
statediff record --mode hit --exact -o out/hit.h5 --overwrite --no-progress
statediff record --mode cold --exact -o out/cold.h5 --overwrite --no-progress
echo "== compare hit vs cold (expect: no divergence, exit 0) =="
rc=0; statediff compare out/hit.h5 out/cold.h5 || rc=$?
echo "exit code: $rc"
[ "$rc" -eq 0 ] || { echo "unexpected: a fault-free pair diverged" >&2; exit 1; }
echo "== planted fault: ssm-wrong-block on layer 1 =="
statediff record --mode hit --exact --fault ssm-wrong-block:layer=1 -o out/hit-fault.h5 --overwrite --no-progress
rc=0; statediff compare out/hit-fault.h5 out/cold.h5 || rc=$?
echo "exit code: $rc"
[ "$rc" -eq 1 ] || { echo "unexpected: the planted fault was not found" >&2; exit 1; }
