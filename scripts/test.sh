#!/usr/bin/env bash
# Install (if needed), lint, and run the test suite on CPU. GPU tests skip without CUDA; the
# browser test skips without Debian's chromium (.ci/run installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .  # code at the line length in pyproject.toml
.venv/bin/mypy  # the packages named in pyproject.toml's [tool.mypy]
# One test worker per core (each test one thread: tests/conftest.py); --durations shows the
# slowest tests, to keep CI inside its budget.
.venv/bin/python -m pytest -q -n auto --dist worksteal --durations=12 "$@"
