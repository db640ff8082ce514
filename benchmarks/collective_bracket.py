"""Does the collective model hold a real DDP step? Two gloo processes on this host, one thread each.

Each run starts tests/topology_checks.py under torchrun (2 processes, OMP_NUM_THREADS=1), which
times all-reduces as `bench` times them (beside a computing thread), then alternates THE step of
`tiny` without communication and under DDP, step by step (both under the same load). From its
report this script fits the loopback link from the all-reduces (calibration.comm.fit_comm,
tests/helpers.link_from_all_reduce), prices the ring all-reduce of the model's gradients over
that link, and puts the planner's overlap bracket around it (full overlap with backward … none,
calibration.topology.overlap_bracket); the row says whether what DDP added to the step (the median
of the paired differences, ± three standard errors of it) falls inside.

This is a timing claim, so it lives here and not in the suite: on a shared 2-core machine a busy
neighbour moves the measured extra by more than the bracket is wide. The suite checks the same
arithmetic on a recorded run (tests/fixtures/gloo-ddp-step.json; `--save` writes one).

    python benchmarks/collective_bracket.py                        # 3 runs of 60 paired steps
    python benchmarks/collective_bracket.py --runs 5 --steps 100
    python benchmarks/collective_bracket.py --runs 1 --save tests/fixtures/gloo-ddp-step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import link_from_all_reduce  # the tests' helper

from benchtrain.calibration.comm import fit_comm
from benchtrain.calibration.topology import overlap_bracket, ring_model

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "topology_checks.py"


def measure(steps: int, micro: int, seq: int) -> dict[str, Any]:
    """One torchrun job of tests/topology_checks.py: rank 0's JSON report."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), str(CHECKS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(CHECKS),
        str(steps),
        str(micro),
        str(seq),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: {CHECKS.name} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bracket_row(found: dict[str, Any]) -> dict[str, float | bool]:
    """The link, the priced all-reduce, its bracket and the measured extra of one report."""
    measured = fit_comm(found["all_reduce"], found["processes"], found["backend"])
    link = link_from_all_reduce(measured)
    comm = ring_model("all_reduce", found["processes"], link, found["backend"]).all_reduce_seconds(
        found["gradient_bytes"]
    )
    low, high = overlap_bracket(comm, found["step_alone"])
    noise = 3 * found["extra_error"]
    return {
        "hop_latency_us": link.hop_latency_seconds * 1e6,
        "bandwidth_gb_s": link.bandwidth_bytes_per_second / 1e9,
        "comm_ms": comm * 1e3,
        "step_alone_ms": found["step_alone"] * 1e3,
        "step_ddp_ms": found["step_ddp"] * 1e3,
        "low_ms": low * 1e3,
        "high_ms": high * 1e3,
        "extra_ms": found["extra"] * 1e3,
        "noise_ms": noise * 1e3,
        "inside": low - noise <= found["extra"] <= high + noise,
    }


def print_table(rows: list[dict[str, float | bool]]) -> None:
    header = f"{'run':>3}  {'hop µs':>7}  {'GB/s':>6}  {'comm ms':>7}  {'step ms':>7}  {'ddp ms':>7}  {'bracket ms':>13}  {'DDP extra ms':>14}  inside"
    print(header)
    for number, row in enumerate(rows, start=1):
        bracket = f"{row['low_ms']:.2f}–{row['high_ms']:.2f}"
        extra = f"{row['extra_ms']:.2f} ± {row['noise_ms']:.2f}"
        print(
            f"{number:>3}  {row['hop_latency_us']:>7.1f}  {row['bandwidth_gb_s']:>6.2f}  {row['comm_ms']:>7.2f}  {row['step_alone_ms']:>7.2f}"
            f"  {row['step_ddp_ms']:>7.2f}  {bracket:>13}  {extra:>14}  {'yes' if row['inside'] else 'NO'}"
        )
    inside = sum(bool(row["inside"]) for row in rows)
    print(f"{inside} of {len(rows)} runs inside the bracket (± 3 standard errors of the paired median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="torchrun jobs, one row each (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="paired steps per job (default 60)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch of the step (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length of the step (default 64)")
    parser.add_argument("--save", type=Path, help="write the first run's report here (the suite's recorded run)")
    args = parser.parse_args()
    reports = [measure(args.steps, args.micro, args.seq) for _ in range(args.runs)]
    if args.save:
        args.save.write_text(json.dumps(reports[0], indent=1) + "\n")
    print_table([bracket_row(found) for found in reports])


if __name__ == "__main__":
    main()
