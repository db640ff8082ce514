"""How well does a calibration predict configurations the benchmark did NOT measure?

Runs `bench run` (fresh BENCHTRAIN_HOME), then measures configurations off the grid (other batch
sizes, lengths, accumulation and worker counts, some beyond the measured range) with the same
probe, and prints predicted vs measured tokens/s.

    python benchmarks/holdout_accuracy.py                                  # tiny on CPU
    python benchmarks/holdout_accuracy.py --model llama-3.2-1b --gpu h100 \
        --configs 3x4x1x768,6x4x2x1536,12x2x1x512,2x4x8x3072
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CPU_CONFIGS = "3x0x1x96,6x1x3x192,3x2x2x192,6x0x1x96,5x1x2x160,12x0x1x64,2x0x4x384,1x1x3x320,16x2x1x128,7x3x2x224"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--gpu", default="cpu")
    parser.add_argument("--budget", default="150s")
    parser.add_argument("--configs", default=CPU_CONFIGS, help="BxWxAxS,… (batch x workers x accum x length)")
    parser.add_argument("--bench-args", default="", help="extra arguments for bench run")
    parser.add_argument("--skip-bench", action="store_true", help="use the latest calibration in BENCHTRAIN_HOME")
    args = parser.parse_args()

    home = os.environ.get("BENCHTRAIN_HOME") or tempfile.mkdtemp(prefix="benchtrain-holdout-")
    env = {**os.environ, "BENCHTRAIN_HOME": home}
    started = time.monotonic()
    command = [
        "bench",
        "run",
        "--gpu",
        args.gpu,
        "--model",
        args.model,
        "--budget",
        args.budget,
        "--no-report",
        "--quiet",
        *args.bench_args.split(),
    ]
    if not args.skip_bench:
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    calibrating = time.monotonic() - started
    os.environ["BENCHTRAIN_HOME"] = home

    import calibration
    from bench.probe import ProbeSettings, Workload, run_probe
    from calibration.step_config import StepConfig
    from train.step.hardware import detect_hardware
    from train.workload.model import resolve_model

    cal = calibration.load("latest")
    hardware = detect_hardware()
    workload = Workload(resolve_model(args.model))
    settings = ProbeSettings.for_device(hardware["device_type"])
    print(
        f"calibration {cal.id}: {len(cal.ok_rows())} ok probes in {calibrating:.0f}s; held-out (cross-validated) median "
        f"{cal.fit['held_out_error']['median_abs_pct']:.1f}%, p90 {cal.fit['held_out_error']['p90_abs_pct']:.1f}% ({cal.fit['kind']})"
    )
    print(f"{'batch':>5} {'workers':>7} {'accum':>5} {'seq_len':>7} {'predicted':>10} {'measured':>10} {'error':>7} {'adjusted':>9} {'MFU':>6}  range")
    # The machine may run at another speed now than during the calibration: the reference probe,
    # run again just before each configuration, tells how much (drift-adjusted column).
    drift = (cal.data.get("search") or {}).get("drift") or {}
    reference = StepConfig.from_row(drift["reference"]) if drift.get("reference") else None
    reference_typical = statistics.median(m["tokens_per_second"] for m in drift["measurements"]) if drift.get("measurements") else None
    errors, adjusted_errors = [], []
    for spec in args.configs.split(","):
        b, w, a, s = (int(x) for x in spec.split("x"))
        predicted = cal.predict(StepConfig(b, w, a, s))
        speed_now = None
        if reference is not None and reference_typical:
            reference_row = run_probe(workload, reference, settings)
            speed_now = reference_row["tokens_per_second"] / reference_typical if reference_row["status"] == "ok" else None
        row = run_probe(workload, StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s), settings, hardware.get("peak_bf16_flops"))
        if row["status"] != "ok":
            print(f"{b:>5} {w:>7} {a:>5} {s:>7} {predicted.tokens_per_second:>10,.0f} {row['status']:>10}")
            continue
        error = (predicted.tokens_per_second - row["tokens_per_second"]) / row["tokens_per_second"] * 100
        errors.append(abs(error))
        adjusted = "-"
        if speed_now:
            adjusted_error = (predicted.tokens_per_second * speed_now - row["tokens_per_second"]) / row["tokens_per_second"] * 100
            adjusted_errors.append(abs(adjusted_error))
            adjusted = f"{adjusted_error:+.1f}%"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "-"
        where = "inside" if predicted.within_measured_range else "beyond"
        print(
            f"{b:>5} {w:>7} {a:>5} {s:>7} {predicted.tokens_per_second:>10,.0f} {row['tokens_per_second']:>10,.0f} {error:>+6.1f}% "
            f"{adjusted:>9} {mfu:>6}  {where}"
        )
    if errors:
        print(f"unmeasured configurations: median |error| {statistics.median(errors):.1f}%, max {max(errors):.1f}% over {len(errors)}")
    if adjusted_errors:
        print(
            f"drift-adjusted (machine speed now vs during calibration, from the reference probe): median |error| "
            f"{statistics.median(adjusted_errors):.1f}%, max {max(adjusted_errors):.1f}%"
        )
    print(f"time spent calibrating: {calibrating:.0f}s; BENCHTRAIN_HOME={home}")
    sys.exit(0)


if __name__ == "__main__":
    main()
