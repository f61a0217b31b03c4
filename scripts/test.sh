#!/usr/bin/env bash
# Set up, then run the linter, the type check and the whole test suite (real processes on 127.0.0.1, real models).
# Arguments go to pytest: `scripts/test.sh -m "not swarm"` is the fast tier (no process started).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
.venv/bin/ruff check .
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest "$@"
