#!/usr/bin/env bash
# The behaviour a refactor must keep, captured: the CLI output and run.json of a fixed set of
# `train` commands (a run with evaluation, a run interrupted by SIGINT and resumed, LoRA, a dry
# run as JSON and as text, a bad --resume) on the tiny model, the bundled sample data and the
# bundled CPU calibration (a copy: train feeds its runs back into the calibration it used).
#
#   bash benchmarks/same_behaviour.sh DIR          # with this checkout's code
#   python benchmarks/same_behaviour.py BEFORE AFTER   # the run.json key trees and masked outputs, diffed
#
# Capture BEFORE at the old commit (e.g. in a `git worktree`) and AFTER at the new one, each on a
# quiet machine: a loaded one changes the plan's words (central estimate vs upper bound).
set -u
cd "$(dirname "$0")/.."
D=$(realpath -m "$1"); rm -rf "$D"; mkdir -p "$D/cal"
export BENCHTRAIN_HOME=$D/home PYTHONPATH=$PWD
PY=${PYTHON:-$PWD/.venv/bin/python}
cp tests/fixtures/cpu-tiny-fullgrid.json "$D/cal/"; CAL=$D/cal/cpu-tiny-fullgrid.json
t() { name=$1; shift; "$PY" -m train "$@" > "$D/$name.out" 2>&1; echo "$name rc=$?" >> "$D/rc.txt"; }
t r1 --use-calibration "$CAL" --data sample --deadline 10m --max-steps 4 --out "$D/r1" --eval-split 0.1 --eval-every 2 --report-to none
# Interrupted once its first checkpoint exists, then resumed.
( "$PY" -m train --use-calibration "$CAL" --data sample --deadline 10m --max-steps 40 --checkpoint-interval 1s --out "$D/r2" > "$D/r2.out" 2>&1
  echo "r2 rc=$?" >> "$D/rc.txt" ) &
for _ in $(seq 1 120); do ls "$D"/r2/checkpoints/*/ >/dev/null 2>&1 && break; sleep 0.5; done; sleep 2
pkill -INT -f "out $D/r2"; wait; cp "$D/r2/run.json" "$D/r2-interrupted.json"
t r2resume --use-calibration "$CAL" --data sample --deadline 10m --out "$D/r2" --resume --max-steps 40
t lora --use-calibration "$CAL" --data sample --deadline 10m --max-steps 3 --out "$D/lora" --method lora --no-report --force
t dry --use-calibration "$CAL" --data sample --deadline 10m --dry-run --json
t drytext --use-calibration "$CAL" --data sample-chat --deadline 1h --dry-run --epochs 2
t bad --use-calibration "$CAL" --data sample --deadline 10m --resume --out "$D/nothing"
cat "$D/rc.txt"
