"""Predict an N-process step from a 1-process calibration plus measured collectives, and compare
with the step measured by `bench` under N processes.

1. `bench run` in one process (one device per process: on CPU one thread, as torchrun gives each
   of its processes), 2. the same grid under `torchrun --nproc_per_node N --sharding S` (which
   also times all-reduces, all-gathers and reduce-scatters among the N processes), 3. for every
   configuration the N-process run measured: predicted = 1-process fitted step + the sharding's
   traffic (train.planning.comm.Traffic: DDP's gradient all-reduce per optimizer step, FSDP's gathers and
   reduce-scatter per micro-step) priced with the measured latency and bandwidth, against the
   measured N-process step — the same prediction `train` makes from a 1-process calibration.

    python benchmarks/multi_process.py                      # tiny, 2 processes on CPU (gloo), DDP
    python benchmarks/multi_process.py --sharding fsdp      # the same with FSDP
    python benchmarks/multi_process.py --model llama-3.2-1b --gpu h100 --processes 4 --grid "--batch-sizes 4,8 --seq-lens 1024,2048"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CPU_GRID = "--batch-sizes 2,4 --seq-lens 64,128 --workers 0 --accum 1,2"


def bench(home: Path, args: argparse.Namespace, processes: int) -> dict:
    env = {**os.environ, "BENCHTRAIN_HOME": str(home)}
    command = ["bench", "run", "--gpu", args.gpu, "--model", args.model, "--no-report", "--quiet", *args.grid.split()]
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "-m",
            "benchtrain.bench",
            *command[1:],
            "--sharding",
            args.sharding,
        ]
    elif args.gpu == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # one device per process, as under torchrun
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:6])} … failed:\n{done.stderr[-3000:]}")
    (path,) = sorted((home / "calibrations").glob("*.json"))[-1:]
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--gpu", default="cpu")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--grid", default=CPU_GRID, help="bench run options for both runs")
    parser.add_argument("--sharding", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()

    from benchtrain.calibration.comm import CommModel, fsdp_micro_step_seconds
    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.planning.comm import traffic_of
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    root = Path(tempfile.mkdtemp(prefix="benchtrain-multi-"))
    single = Calibration(bench(root / "one", args, 1))
    several_data = bench(root / "several", args, args.processes)
    models = {
        kind: CommModel.from_json(entry["fit"]) for kind, entry in several_data["distributed"]["collectives"].items()
    }
    need = memory_need(resolve_model(args.model), MethodConfig(), single.hardware["device_type"])
    traffic = traffic_of(args.sharding, need, single.hardware["device_type"])
    per_step = per_micro_step = 0.0
    if args.sharding == "fsdp":
        per_micro_step = fsdp_micro_step_seconds(
            models["all_gather"],
            models["reduce_scatter"],
            traffic.parameter_bytes,
            traffic.gradient_bytes,
            traffic.units,
        )
    else:
        per_step = models["all_reduce"].all_reduce_seconds(traffic.gradient_bytes)
    for kind, model in models.items():
        print(
            f"{kind}: {model.bandwidth_bytes_per_second / 1e9:.2f} GB/s, {model.latency_seconds * 1e3:.2f} ms latency"
        )
    print(
        f"{args.model}, {args.processes} processes, {args.sharding}: {traffic.gradient_bytes / 2**20:.1f} MiB of gradients"
        + (
            f", {traffic.parameter_bytes / 2**20:.1f} MiB of parameters, {traffic.units} units"
            if args.sharding == "fsdp"
            else ""
        )
        + f" → +{per_step * 1e3:.1f} ms per optimizer step, +{per_micro_step * 1e3:.1f} ms per micro-step"
    )
    print(
        f"{'batch':>5} {'accum':>5} {'seq':>5} {'1-proc fit ms':>13} {'predicted ms':>12} {'measured ms':>11} {'error':>7}"
    )
    errors = []
    for row in several_data["measurements"]:
        if row["status"] != "ok":
            continue
        config = StepConfig.from_row(row)
        # a median step, like the probe's figure
        alone = single.throughput.micro_step_seconds(config) * config.grad_accum
        predicted = alone + per_step + config.grad_accum * per_micro_step
        error = (row["step_seconds"] - predicted) / predicted * 100  # + = slower than predicted
        errors.append(abs(error))
        print(
            f"{config.micro_batch_size:>5} {config.grad_accum:>5} {config.seq_len:>5} {alone * 1e3:>13.1f} {predicted * 1e3:>12.1f} "
            f"{row['step_seconds'] * 1e3:>11.1f} {error:>+6.1f}%"
        )
    if errors:
        print(
            f"|error|: median {statistics.median(errors):.1f}%, max {max(errors):.1f}% over {len(errors)} configurations"
        )


if __name__ == "__main__":
    main()
