"""How steady is this machine? Times the same training step in several rounds, minutes apart.

The spread between rounds is a floor under any estimate's error on this machine.

    python benchmarks/step_drift.py --rounds 6 --pause 10
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--config", default="8x0x2x128", help="batch x workers x accum x length")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pause", type=float, default=10.0, help="seconds idle between rounds")
    args = parser.parse_args()

    from benchtrain.bench.probe import Workload
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.workload.batching import make_loader
    from benchtrain.train.workload.model import resolve_model

    workload = Workload(resolve_model(args.model))
    b, w, a, s = (int(x) for x in args.config.split("x"))
    config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s)
    means = []
    print(f"{'round':>5} {'mean step s':>12} {'median':>8} {'min':>8} {'max':>8} {'tokens/s':>10}")
    for index in range(args.rounds):
        if index:
            time.sleep(args.pause)
        iterator = iter(make_loader(workload.batches(config, (args.steps + 2) * a), w, workload.pin_memory))
        for _ in range(2):
            workload.engine.step.run(iterator, a)
        seconds = [workload.engine.step.run(iterator, a).seconds for _ in range(args.steps)]
        mean = statistics.fmean(seconds)
        means.append(mean)
        print(
            f"{index + 1:>5} {mean:>12.4f} {statistics.median(seconds):>8.4f} {min(seconds):>8.4f} {max(seconds):>8.4f} {b * s * a / mean:>10,.0f}"
        )
    spread = (max(means) - min(means)) / min(means) * 100
    print(f"slowest round is {spread:.1f}% slower than the fastest (same step, same process)")


if __name__ == "__main__":
    main()
