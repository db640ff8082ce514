#!/usr/bin/env bash
# Install (if needed), lint, and run the test suite on CPU. GPU tests skip without CUDA; the
# browser test skips without Debian's chromium (.ci/run installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .  # code at the line length in pyproject.toml
.venv/bin/mypy  # the packages named in pyproject.toml's [tool.mypy]
# The tests that wait on a real scheduler (SLURM: its signal and requeue come on its own ~30 s ticks) run in a
# process of their own beside the others: they spend their minutes waiting, not computing.
scheduler_log=$(mktemp)
# Its own temporary folder: pytest prunes older sessions' folders under the shared one.
.venv/bin/python -m pytest -q -p no:cacheprovider -m scheduler --basetemp "$(mktemp -d)" "$@" >"$scheduler_log" 2>&1 &
scheduler=$!
# One test worker per core (each test one thread: tests/conftest.py); --durations shows the
# slowest tests, to keep CI inside its budget.
status=0
.venv/bin/python -m pytest -q -n auto --dist worksteal --durations=12 -m "not scheduler" "$@" || status=$?
scheduler_status=0
wait "$scheduler" || scheduler_status=$?
echo "--- the tests on a real scheduler (-m scheduler):"
cat "$scheduler_log"
# pytest exits 5 when it selects nothing (a run of other files, "$@"): not a failure.
if [ "$scheduler_status" -ne 0 ] && [ "$scheduler_status" -ne 5 ]; then status=$scheduler_status; fi
exit "$status"
