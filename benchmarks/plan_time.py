"""How long does planning take on a large dataset? (It counts the exact batches of every candidate.)

python benchmarks/plan_time.py --samples 600000 --epochs 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=600_000)
    parser.add_argument("--epochs", type=float, default=3)
    args = parser.parse_args()

    from helpers import synthetic_calibration, synthetic_rows, tokenized_from_samples

    from benchtrain.calibration.model import Calibration
    from benchtrain.train.planning.deadline import Deadline
    from benchtrain.train.planning.planner import make_plan
    from benchtrain.train.planning.types import PlanRequest

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.8, args.samples).astype(int), 8, 4000)
    data = tokenized_from_samples([np.zeros(n, np.int32) for n in lengths], [0] * len(lengths), "messages", "synthetic")
    calibration = Calibration(synthetic_calibration(synthetic_rows(seq_lens=(512, 1024, 2048, 4096))))
    started = time.perf_counter()
    plan = make_plan(calibration, data, PlanRequest(epochs=args.epochs, deadline=Deadline.with_margin_share(1e9, 0.05)))
    print(
        f"{args.samples:,} samples × {args.epochs:g} epochs: planned in {time.perf_counter() - started:.1f}s → {plan.chosen.config.phrase}"
    )


if __name__ == "__main__":
    main()
