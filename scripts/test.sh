#!/usr/bin/env bash
# Set up ./.venv (scripts/setup.sh) and run the whole test suite. CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
