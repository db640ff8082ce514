"""Does the plan hold in the next process? The demo, several times, each step in a fresh process.

Each round runs the demo's bench (`bench run --budget 150s` in a fresh BENCHTRAIN_HOME), then
predicts configurations that bench did not measure (off its grid) and measures each one in a
fresh process of its own (bench.fresh_process: the Workload train builds); then runs the demo's
`train` on that calibration and checks its time and peak memory against the plan's bounds.

    PYTHONPATH=. python benchmarks/fresh_process.py --rounds 5
    PYTHONPATH=. python benchmarks/fresh_process.py --rounds 1 --held-out 8 --skip-train

It prints one line per held-out configuration (predicted, measured, error, inside the bound?),
one per demo run, and the summary the plan is judged by: the held-out median |error|, whether
every error has the same sign, and how many runs landed inside their bounds (time and memory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Off the demo's grid (batch 1,2,4,8 × workers 0,2 × accumulation 1,2 × length 64,128,256), inside its range.
HELD_OUT = [(b, w, a, s) for b in (3, 6) for w in (0, 1) for a in (1, 3) for s in (96, 192)]


def run(command: list[str], env: dict[str, str], log: Path) -> int:
    with log.open("w") as out:
        return subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def held_out_errors(home: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """Predict `count` off-grid configurations from the newest calibration in `home`, and measure
    each in a fresh process."""
    os.environ["BENCHTRAIN_HOME"] = str(home)
    from benchtrain import calibration
    from benchtrain.bench.fresh_process import measure_in_fresh_processes
    from benchtrain.bench.timing import ProbeSettings
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    cal = calibration.load("latest")
    drift, check = cal.data["search"].get("drift") or {}, cal.process_check
    speeds = [m["tokens_per_second"] for m in drift.get("measurements", [])]
    print(
        f"  calibration {cal.id}: held-out p90 {cal.fit['held_out_error']['p90_abs_pct']:.1f}%; drift reference "
        f"{StepConfig.from_row(drift['reference']).label if drift.get('reference') else '-'} "
        f"{' → '.join(f'{v:,.0f}' for v in speeds) or '-'} tok/s, correction {'kept' if drift.get('applied') else 'not applied'} "
        f"({drift.get('median_error_pct') or drift.get('reason', '')}); fresh processes: ratios {check.get('speed_ratios')}, "
        f"median {check.get('median_ratio', 1):.3f}, spread time {check.get('time_spread', 0):.1%} memory {check.get('memory_spread', 0):.1%}; "
        f"bound ±{cal.relative_bound:.1%}"
    )
    results = []
    for b, w, a, s in random.Random(seed).sample(HELD_OUT, count):
        config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s)
        predicted = cal.predict(config)
        measured = measure_in_fresh_processes(
            resolve_model("tiny"), MethodConfig(), StepOptions(), [config], ProbeSettings(), 600, processes=1
        )
        row = measured[0] if measured else {}
        if row.get("status") != "ok":
            results.append({"config": config, "status": row.get("status", "failed")})
            continue
        # The run pays mean steps, and the plan predicts the mean (the fit's tail factor).
        actual = row["tokens_per_second"] * row["step_seconds"] / row.get("step_seconds_mean", row["step_seconds"])
        results.append(
            {
                "config": config,
                "status": "ok",
                "predicted": predicted.tokens_per_second,
                "low": predicted.tokens_per_second_low,
                "high": predicted.tokens_per_second_high,
                "measured": actual,
                "error_pct": (actual / predicted.tokens_per_second - 1) * 100,
            }
        )
    return results


def demo_run(home: Path, env: dict[str, str], deadline: str, log: Path) -> dict[str, Any]:
    out = home / "demo-run"
    code = run(
        [
            sys.executable,
            "-m",
            "train",
            "--use-calibration",
            "latest",
            "--data",
            "sample",
            "--deadline",
            deadline,
            "--epochs",
            "1",
            "--fit-deadline",
            "--out",
            str(out),
            "--no-report",
        ],
        env,
        log,
    )
    if code != 0 or not (out / "run.json").is_file():
        return {"exit": code}
    document = json.loads((out / "run.json").read_text())
    estimate, actual = document["estimate"], document["actual"]
    seconds = document["estimate_check"]["actual_seconds"]
    plan_low, plan_high = estimate["total_seconds_low"], estimate["total_seconds_high"]
    peak, peak_high = actual.get("peak_memory_bytes"), estimate.get("peak_memory_bytes_high")
    return {
        "exit": code,
        "seconds": seconds,
        "estimate": estimate["total_seconds"],
        "low": plan_low,
        "high": plan_high,
        "time_inside": plan_low <= seconds <= plan_high,
        "peak": peak,
        "peak_high": peak_high,
        "memory_inside": peak is not None and peak_high is not None and peak <= peak_high,
        "bound": estimate.get("bound_parts") or {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", default="150s", help="bench run --budget (the demo's)")
    parser.add_argument("--deadline", default="5m", help="train --deadline (the demo's)")
    parser.add_argument(
        "--held-out", type=int, default=4, help="off-grid configurations per round, each in a fresh process"
    )
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    root = args.out or Path(tempfile.mkdtemp(prefix="benchtrain-fresh-"))
    root.mkdir(parents=True, exist_ok=True)
    errors: list[float] = []
    inside: list[bool] = []
    runs: list[dict[str, Any]] = []
    print(f"{'round':>5} {'config B/W/A/S':>15} {'predicted':>10} {'measured':>10} {'error':>7}  in bound")
    for index in range(args.rounds):
        home = root / f"round-{index}"
        env = {**os.environ, "BENCHTRAIN_HOME": str(home)}
        code = run(
            [sys.executable, "-m", "benchtrain.bench", "run", "--budget", args.budget, "--no-report", "--quiet"],
            env,
            home.with_suffix(".bench.log"),
        )
        if code != 0:
            print(f"{index:>5} bench exited {code} (see {home.with_suffix('.bench.log')})")
            continue
        for result in held_out_errors(home, args.held_out, seed=index):
            c = result["config"]
            name = f"{c.micro_batch_size}/{c.num_workers}/{c.grad_accum}/{c.seq_len}"
            if result["status"] != "ok":
                print(f"{index:>5} {name:>15} {result['status']}")
                continue
            within = result["low"] <= result["measured"] <= result["high"]
            errors.append(result["error_pct"])
            inside.append(within)
            print(
                f"{index:>5} {name:>15} {result['predicted']:>10,.0f} {result['measured']:>10,.0f} {result['error_pct']:>+6.1f}%  {'yes' if within else 'NO'}"
            )
        if not args.skip_train:
            runs.append(demo_run(home, env, args.deadline, home.with_suffix(".train.log")))
    if errors:
        signs = {error > 0 for error in errors}
        print(
            f"held-out in fresh processes: median |error| {statistics.median(abs(e) for e in errors):.1f}%, median error {statistics.median(errors):+.1f}%, "
            f"{sum(e > 0 for e in errors)} faster / {sum(e < 0 for e in errors)} slower than predicted"
            f"{' (ALL THE SAME SIGN)' if len(signs) == 1 and len(errors) > 1 else ''}; {sum(inside)}/{len(inside)} inside their bounds"
        )
    if runs:
        print(
            f"{'run':>3} {'exit':>4} {'actual s':>9} {'estimate s':>10} {'bounds s':>15} {'time':>5} {'peak MiB':>9} {'bound MiB':>9} {'memory':>6}  bound"
        )
        for index, result in enumerate(runs):
            if "seconds" not in result:
                print(f"{index:>3} {result['exit']:>4}")
                continue
            peak = f"{result['peak'] / 2**20:,.0f}" if result["peak"] else "-"
            peak_high = f"{result['peak_high'] / 2**20:,.0f}" if result["peak_high"] else "-"
            print(
                f"{index:>3} {result['exit']:>4} {result['seconds']:>9.1f} {result['estimate']:>10.1f} {result['low']:>7.1f}–{result['high']:<7.1f} "
                f"{'in' if result['time_inside'] else 'OUT':>5} {peak:>9} {peak_high:>9} {'in' if result['memory_inside'] else 'OUT':>6}  {result['bound']}"
            )
        both = sum(1 for r in runs if r.get("time_inside") and r.get("memory_inside"))
        print(f"demo runs inside their bounds (time and peak memory): {both} of {len(runs)}")
    print(f"everything is in {root}")


if __name__ == "__main__":
    main()
