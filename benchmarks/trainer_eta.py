"""DeadlineCallback in a real-time CPU Trainer: is its ETA after 10% of the run right, and how early
before its deadline does a cut run stop (with its checkpoint written)?

Run 1 trains the whole run under a generous deadline and compares the finish the callback
projected at 10% of the steps with the finish that happened. Run 2 gives the same run a deadline
of `--cut` of run 1's time: the guard must save and stop before it; the table says how early.

    PYTHONPATH=. python benchmarks/trainer_eta.py --steps 1000

On a machine others share, step times drift (the table prints the load and the steps' spread):
the ETA can be no better than the speed it projects is steady.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from trainer_checks import trainer  # the tests' tiny llama Trainer with a real collator
from transformers import TrainerCallback

from benchtrain import DeadlineCallback


class EtaAt(TrainerCallback):
    """Listed after DeadlineCallback: the finish it projects at step `step` (seconds from its start)."""

    def __init__(self, deadline: DeadlineCallback, step: int) -> None:
        self.deadline, self.step, self.projected = deadline, step, None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.projected = self.deadline.verdict.projected_finish


def run(out: Path, deadline: str, steps: int, eta_step: int) -> tuple[DeadlineCallback, EtaAt, float]:
    callback = DeadlineCallback(deadline=deadline, report=False)
    eta = EtaAt(callback, eta_step)
    started = time.time()
    trainer(
        out,
        [callback, eta],
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        logging_steps=10,
    ).train()
    return callback, eta, time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--cut", type=float, default=0.6, help="run 2's deadline as a share of run 1's time")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (one: steadier steps on a machine others share)"
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    folder = Path(tempfile.mkdtemp(prefix="trainer-eta-"))
    try:
        tenth = max(1, options.steps // 10)
        full, eta, _ = run(folder / "full", "1h", options.steps, tenth)
        actual = full.used_seconds
        projected = eta.projected or 0.0
        deadline = actual * options.cut
        cut, _, _ = run(folder / "cut", f"{deadline:.1f}s", options.steps, tenth)
        ended = cut.used_seconds
        saved = sorted(path.name for path in (folder / "cut").glob("checkpoint-*"))
        seconds = [record.seconds for record in full.watch.steps[full.warmup_steps :]]
        spread = statistics.pstdev(seconds) / statistics.fmean(seconds)
        rows = [
            ("load average (1 min) at the end, cores", f"{os.getloadavg()[0]:.1f}, {os.cpu_count()}"),
            ("steps (full run), torch threads", f"{options.steps}, {torch.get_num_threads()}"),
            ("step time: mean, spread (std / mean)", f"{statistics.fmean(seconds):.3f} s, {spread:.0%}"),
            (f"ETA at step {tenth} (10%): projected finish", f"{projected:.1f} s"),
            ("actual finish", f"{actual:.1f} s"),
            ("ETA error", f"{(projected - actual) / actual:+.1%}"),
            (f"cut run: deadline ({options.cut:.0%} of the full run)", f"{deadline:.1f} s"),
            ("cut run: stopped at step", f"{cut.watch.steps[-1].step if cut.watch.steps else 0} ({cut.status})"),
            ("cut run: ended (after its save)", f"{ended:.1f} s"),
            (
                "cut run: before the deadline by",
                f"{deadline - ended:.1f} s ({(deadline - ended) / deadline:.1%} of it)",
            ),
            ("cut run: checkpoint", ", ".join(saved) or "none"),
            ("cut run: lead time a signal needs", f"{cut.lead_seconds():.2f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        print()
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
