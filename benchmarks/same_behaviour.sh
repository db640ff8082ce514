#!/usr/bin/env bash
# The behaviour a refactor must keep, captured: the exit codes, outputs and JSON files of a fixed
# set of commands on the tiny model, the bundled sample data and the bundled calibrations —
# a short `bench run` (its calibration and its report), `train` runs (with evaluation; interrupted
# by SIGINT and resumed; LoRA), dry runs as JSON and as text, `--consider` over four machines, a bad
# --resume, and `report` on a run, on the bench's calibration and on the --consider comparison.
# Runs plan from copies of the CPU fixture calibration (with --force: it was measured on another CPU) (train feeds its runs back into the
# calibration it used), with deadlines no load makes the guard act on (an hour for seconds of work).
#
#   bash benchmarks/same_behaviour.sh DIR              # with this checkout's code (≈2-3 min)
#   python benchmarks/same_behaviour.py BEFORE AFTER   # key trees, exit codes and masked outputs, diffed
#
# Capture BEFORE at the old commit (e.g. in a `git worktree`, with this script copied into it: it
# runs the code of the checkout it stands in) and AFTER at the new one. The
# comparison masks what the clock decides (numbers, time stamps, a bench's measured figures), so a
# loaded machine and a quiet one compare equal.
set -u
cd "$(dirname "$0")/.."
D=$(realpath -m "$1"); rm -rf "$D"; mkdir -p "$D/bench"
export BENCHTRAIN_HOME=$D/home PYTHONPATH=$PWD
PY=${PYTHON:-$PWD/.venv/bin/python}
# A copy of the calibration for each run (and one for the dry runs) that no other run fed: what a
# command plans must not follow how fast an earlier one went. Only the resume plans from the history
# its interrupted run left.
for copy in r1 r2 lora dry; do mkdir -p "$D/cal/$copy"; cp tests/fixtures/cpu-tiny-fullgrid.json "$D/cal/$copy/"; done
cal() { echo "$D/cal/$1/cpu-tiny-fullgrid.json"; }
started=$(date +%s)
# name, then the module and its arguments: the output goes to NAME.out, the exit code to rc.txt.
c() { name=$1; shift; module=$1; shift; "$PY" -m "benchtrain.$module" "$@" > "$D/$name.out" 2>&1; echo "$name rc=$?" >> "$D/rc.txt"; }
# A bench of 8 short probes (≈30 s on a quiet machine). No --budget: a budget makes what runs depend
# on the machine's load (fewer probes, or a refusal), and this compares behaviour, not speed. Its
# calibration is the only one in BENCHTRAIN_HOME (`latest`).
c bench bench run --gpu cpu --model tiny --batch-sizes 1,2 --workers 0 --accum 1,2 --seq-lens 32,64 --max-probe-seconds 0.2 --no-report
cp "$D"/home/calibrations/*.json "$D/bench/calibration.json"
c r1 train --use-calibration "$(cal r1)" --data sample --deadline 1h --max-steps 4 --force --out "$D/r1" --eval-split 0.1 --eval-every 2 --report-to none
# Interrupted once its first checkpoint exists, then resumed.
"$PY" -m benchtrain.train --use-calibration "$(cal r2)" --data sample --deadline 1h --max-steps 300 --force --checkpoint-interval 1s --out "$D/r2" > "$D/r2.out" 2>&1 &
run=$!
for _ in $(seq 1 120); do ls "$D"/r2/checkpoints/*/ >/dev/null 2>&1 && break; sleep 0.5; done; sleep 2
kill -INT "$run"; wait "$run"; echo "r2 rc=$?" >> "$D/rc.txt"; cp "$D/r2/run.json" "$D/r2-interrupted.json"
c r2resume train --use-calibration "$(cal r2)" --data sample --deadline 1h --out "$D/r2" --resume --max-steps 300 --force
c lora train --use-calibration "$(cal lora)" --data sample --deadline 1h --max-steps 3 --out "$D/lora" --method lora --no-report --force
c dry train --use-calibration "$(cal dry)" --data sample --deadline 10m --dry-run --json --force
c drytext train --use-calibration "$(cal dry)" --data sample-chat --deadline 1h --dry-run --epochs 2 --force
c consider train --dry-run --use-calibration h100-llama-3.2-1b --consider h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie \
  --price-per-hour h100=2.5,h200=3.8,a100=1.2 --model llama-3.2-1b --data sample-chat --deadline 24h
cp "$D"/home/plans/*/comparison.json "$D/consider-comparison.json"
c bad train --use-calibration "$(cal dry)" --data sample --deadline 10m --resume --out "$D/nothing"
c reportrun reports "$D/r1"
c reportcal reports latest
c reportplan reports "$D"/home/plans/*
# What each command left where (names only; the comparison masks numbers and stamps).
(cd "$D" && find r1 r2 lora home/calibrations home/plans -type f | sort) > "$D/files.txt"
echo "capture took $(( $(date +%s) - started ))s"
cat "$D/rc.txt"
