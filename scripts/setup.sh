#!/usr/bin/env bash
# Create .venv (once) and install swarmbatch into it. torch goes first, alone, as the CPU build
# (`torch==2.13.0` is the CPU wheel on this machine's index); the project's range then keeps pip from
# replacing it with a CUDA build.
# Usage: setup.sh [runtime|test]: runtime installs the project alone (`pip install -e .`: what a user runs, as
# scripts/demo.sh does); test (the default, scripts/test.sh) adds the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-test}" in
  runtime) TARGET="." ;;
  test) TARGET=".[test]" ;;
  *) echo "usage: $0 [runtime|test]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e "$TARGET"
