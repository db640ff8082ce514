#!/usr/bin/env bash
# Create .venv (if missing) and install benchtrain with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned to 2.13.0 in pyproject.toml: a CPU build where one is provided locally.
.venv/bin/python -m pip install --quiet -e '.[test,launch]'
