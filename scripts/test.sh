#!/usr/bin/env bash
# Set up, then run the linter, the type check and the whole test suite (real processes on 127.0.0.1, real models).
# Arguments go to pytest: `scripts/test.sh -m "not swarm"` is the fast tier (no process started).
# Without arguments, the whole suite runs in two phases: every test not marked `alone` on SWARMBATCH_TEST_WORKERS
# pytest-xdist workers (default: one per core; a file's tests stay on one worker, so its module fixtures and the
# swarms they start are built once), then the `alone` tests, which measure time against a bound, one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
.venv/bin/ruff check .
.venv/bin/python -m mypy
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
.venv/bin/python -m pytest -n "${SWARMBATCH_TEST_WORKERS:-auto}" --dist loadfile -m "not alone" || status=$?
.venv/bin/python -m pytest -m alone || status=$((status ? status : $?))
exit "$status"
