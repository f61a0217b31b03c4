#!/usr/bin/env bash
# Set up (the runtime dependencies only, no test extra), then run the main job: `swarmbatch demo` (embedded:
# local DHT + two block servers + SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh runtime
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/swarmbatch demo "$@"
