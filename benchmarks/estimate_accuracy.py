"""Does `train` finish when it says it will? Estimate vs actual total time, several runs.

Uses the newest calibration in BENCHTRAIN_HOME (run `bench run` first), trains the bundled sample
data (3,000 samples with heavy-tailed lengths) and prints a table from each run.json; then asks
for far more epochs than fit and shows that the run is refused up front (exit 3), and that
`--fit-deadline` cuts it to finish in time.

    python benchmarks/estimate_accuracy.py --runs 3 --deadline 5m
    python benchmarks/estimate_accuracy.py --epochs 0.3,1,3 --deadline 10m --skip-limits   # runs of ~20 s, 1 min, 3 min on cpu-vm
    python benchmarks/estimate_accuracy.py --train-args "--compile on" --skip-limits     # after `bench run --compile on`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from benchtrain.calibration.accuracy import check_estimate


def train(args: list[str], env: dict[str, str]) -> tuple[int, float]:
    started = time.monotonic()
    result = subprocess.run(
        ["train", "--no-report", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode not in (0, 3):
        print(result.stderr[-2000:])
    return result.returncode, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--deadline", default="5m")
    parser.add_argument("--data", default="sample")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--epochs", default="1", help="comma list: one run per value (each --runs times)")
    parser.add_argument("--skip-limits", action="store_true", help="skip the too-many-epochs and --fit-deadline runs")
    parser.add_argument("--train-args", default="", help='more train options for every run, e.g. "--compile on"')
    args = parser.parse_args()
    extra = args.train_args.split()
    env = dict(os.environ)
    home = Path(env.get("BENCHTRAIN_HOME", "~/.benchtrain")).expanduser()
    print(
        f"{'run':<28} {'steps':>9} {'estimate':>9} {'actual':>8} {'error':>7} {'tok/s est':>10} {'tok/s act':>10} deadline"
    )
    errors = []
    for epochs in [value for value in args.epochs.split(",") for _ in range(args.runs)]:
        before = set((home / "runs").glob("*")) if (home / "runs").exists() else set()
        code, _ = train(
            ["--data", args.data, "--model", args.model, "--deadline", args.deadline, "--epochs", epochs, *extra], env
        )
        new = sorted(set((home / "runs").glob("*")) - before)
        if code != 0 or not new:
            print(f"train exited {code}")
            continue
        record = json.loads((new[-1] / "run.json").read_text())
        check = check_estimate(record)  # like for like: the steps that ran, the overheads that happened
        error = check.error_pct  # + = took longer than estimated
        errors.append(abs(error))
        print(
            f"{record['run_id']:<28} {f'{check.steps_run}/{check.planned_steps}':>9} {check.estimated_seconds:>8.1f}s "
            f"{check.actual_seconds:>7.1f}s {error:>+6.1f}% {check.predicted_tokens_per_second:>10,.0f} {check.actual_tokens_per_second:>10,.0f} "
            f"{'met' if record['met_deadline'] else 'MISSED'}"
        )
    if errors:
        print(
            f"|estimate error|: median {statistics.median(errors):.1f}%, max {max(errors):.1f}% over {len(errors)} runs"
        )
    if args.skip_limits:
        return
    code, seconds = train(["--data", args.data, "--model", args.model, "--deadline", "2m", "--epochs", "30"], env)
    print(
        f"30 epochs in a 2m deadline: exit {code} after {seconds:.1f}s ({'refused up front' if code == 3 else 'ran'})"
    )
    before = set((home / "runs").glob("*"))
    code, seconds = train(
        ["--data", args.data, "--model", args.model, "--deadline", "2m", "--epochs", "30", "--fit-deadline"], env
    )
    new = sorted(set((home / "runs").glob("*")) - before)
    if new:
        record = json.loads((new[-1] / "run.json").read_text())
        print(
            f"30 epochs with --fit-deadline: exit {code}, {record['actual']['steps']} steps, {record['actual']['total_seconds']:.1f}s "
            f"of 120s, deadline {'met' if record['met_deadline'] else 'MISSED'}, status {record['status']}"
        )


if __name__ == "__main__":
    main()
