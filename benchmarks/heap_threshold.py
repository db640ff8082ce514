"""What the CPU heap setting costs: tiny's step speed and peak RSS at several glibc mmap thresholds.

train.step.peak_memory fixes glibc's mmap threshold so a probe and a run peak alike (issue 31). At
128 KiB every mid-sized tensor is mapped and zero-filled afresh on every step; issue 38 measured
what that costs. Each threshold runs the same `bench run` grid in its own process (interleaved over
--rounds, so the machine's load falls on all alike) and the table shows tokens/s and peak RSS per
shape; "glibc" leaves glibc's dynamic default.

    python benchmarks/heap_threshold.py                       # 128 KiB, 1 MiB, 8 MiB, 32 MiB, glibc
    python benchmarks/heap_threshold.py --thresholds 131072,8388608 --rounds 2
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

CHILD = """
import sys
import benchtrain.train.step.peak_memory as heap
if sys.argv[1] == "glibc":
    heap.physical_cpu_memory = lambda: False
else:
    heap.CPU_MMAP_THRESHOLD_BYTES = int(sys.argv[1])
from benchtrain.bench.cli import main
sys.exit(main(sys.argv[2:]))
"""


def measure(threshold: str, home: Path, bench_args: list[str]) -> dict[tuple[int, int], tuple[float, float]]:
    """{(micro-batch, length): (tokens/s, peak GiB)} of one bench run at this threshold."""
    env = {**os.environ, "BENCHTRAIN_HOME": str(home)}
    subprocess.run(
        [sys.executable, "-c", CHILD, threshold, "run", *bench_args], env=env, check=True, capture_output=True
    )
    data = json.loads(sorted((home / "calibrations").glob("*.json"))[-1].read_text())
    return {
        (row["micro_batch_size"], row["seq_len"]): (row["tokens_per_second"], row["peak_memory_bytes"] / 2**30)
        for row in data["measurements"]
        if row["status"] == "ok"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="131072,1048576,8388608,33554432,glibc")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--bench-args", default="--gpu cpu --budget 40s --batch-sizes 1,3,8 --seq-lens 96,128,320 --accum 1 --workers 0"
    )
    args = parser.parse_args()
    thresholds = args.thresholds.split(",")
    results: dict[str, list[dict[tuple[int, int], tuple[float, float]]]] = {t: [] for t in thresholds}
    with tempfile.TemporaryDirectory(prefix="benchtrain-heap-") as root:
        for round_index in range(args.rounds):
            for threshold in thresholds:
                home = Path(root) / f"{threshold}-{round_index}"
                results[threshold].append(measure(threshold, home, args.bench_args.split()))
    shapes = sorted({shape for runs in results.values() for run in runs for shape in run})
    print("threshold | " + " | ".join(f"{b}×{s} tok/s" for b, s in shapes) + " | largest peak GiB")
    print("--- | " + " | ".join("---" for _ in shapes) + " | ---")
    for threshold, runs in results.items():
        speeds = [[run[shape][0] for run in runs if shape in run] for shape in shapes]  # a shape the budget missed: —
        peak = max(figures[1] for run in runs for figures in run.values())
        label = threshold if threshold == "glibc" else f"{int(threshold) // 1024} KiB"
        print(
            f"{label} | " + " | ".join(f"{statistics.median(s):,.0f}" if s else "—" for s in speeds) + f" | {peak:.2f}"
        )


if __name__ == "__main__":
    main()
