#!/usr/bin/env bash
# The main job, end to end: measure → plan → train → report, on the built-in tiny model and the
# bundled sample data (CPU when there is no GPU). Everything lands in $BENCHTRAIN_HOME
# (default: ./.benchtrain here, so the demo leaves your ~/.benchtrain alone).
#
# It always completes: when the measured plan does not fit the deadline (a slow or busy
# machine), `--fit-deadline` trains as many steps as fit, says so, and the report is still written.
# Override the benchmark budget and the training deadline: BUDGET=5m DEADLINE=10m bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export BENCHTRAIN_HOME=${BENCHTRAIN_HOME:-$PWD/.benchtrain}
BUDGET=${BUDGET:-150s}
DEADLINE=${DEADLINE:-5m}

echo "== 1/3 bench: measuring the training step (budget $BUDGET) =="
# Exit 4: too few probes succeeded to fit (a machine far busier than the budget assumed). bench
# said why; the demo measures once more with a longer budget (RETRY_BUDGET) and goes on.
status=0
.venv/bin/bench run --budget "$BUDGET" || status=$?
if [ "$status" -eq 4 ]; then
  echo "bench could not fit a model within $BUDGET on this machine now; measuring again within ${RETRY_BUDGET:-5m}"
  .venv/bin/bench run --budget "${RETRY_BUDGET:-5m}"
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi
echo
echo "== 2/3 train: planning to a $DEADLINE deadline with the measured calibration, then training =="
.venv/bin/train --use-calibration latest --data sample --deadline "$DEADLINE" --epochs 1 --fit-deadline
echo
echo "== 3/3 report =="
run_dir=$(ls -dt "$BENCHTRAIN_HOME"/runs/*/ | head -n 1)
.venv/bin/report "$run_dir"
echo "calibration report: $(ls -dt "$BENCHTRAIN_HOME"/calibrations/*-report/ | head -n 1)report.html"
echo
echo "The demo kept everything in $BENCHTRAIN_HOME. For bench, train and report to use it (report latest, train …):"
echo "  export BENCHTRAIN_HOME=$BENCHTRAIN_HOME PATH=$PWD/.venv/bin:\$PATH"
