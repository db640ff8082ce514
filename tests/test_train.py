"""Training: the deadline guard, checkpoint/resume reproducing the loss curve, SIGTERM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import FakeClock, guard_checkpointing_every, make_run

from benchtrain.train.running.checkpoint import list_checkpoints

# Each step takes 0.3 s on the test's clock (tests/helpers.py FakeClock), far slower than the
# calibration predicts, so the run cannot finish its ~100 steps before the 12 s deadline: the guard
# acts on its own arithmetic, whatever the load on this machine.
SLOW_STEP_SECONDS = 0.3
GUARD_DEADLINE_SECONDS = 12.0


def test_the_deadline_guard_stops_in_time_when_the_step_is_slowed(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, clock: FakeClock
) -> None:
    clock.step_seconds = SLOW_STEP_SECONDS
    run = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=GUARD_DEADLINE_SECONDS, clock=clock)
    outcome = run.run()
    elapsed = run.settings.deadline.elapsed()  # the deadline counts from the command's start
    assert outcome.status == "stopped_for_deadline"
    assert elapsed < GUARD_DEADLINE_SECONDS, elapsed
    assert outcome.position.step > 3 and outcome.position.step == clock.steps
    assert outcome.last_checkpoint and Path(outcome.last_checkpoint).is_dir()
    assert any("passes the deadline" in event for event in outcome.events)


def test_shrink_cuts_the_remaining_steps(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, clock: FakeClock) -> None:
    clock.step_seconds = SLOW_STEP_SECONDS
    run = make_run(
        tmp_path, heavy_tailed_jsonl, tokenizer, deadline=GUARD_DEADLINE_SECONDS, on_overrun="shrink", clock=clock
    )
    outcome = run.run()
    assert run.settings.deadline.elapsed() < GUARD_DEADLINE_SECONDS
    assert any("shrinking to" in event for event in outcome.events)
    assert (
        outcome.shrunk_to is not None
        and outcome.position.step <= outcome.shrunk_to
        and outcome.position.step == clock.steps
    )


def test_checkpoint_then_resume_reproduces_the_uninterrupted_loss_curve(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer
) -> None:
    full_run = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=10, out="full")
    full = full_run.run()
    assert full.status == "step_limit" and full.position.step == 10

    def sigterm_at_step_4(step: int) -> None:
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    interrupted = make_run(
        tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=10, out="split", hook=sigterm_at_step_4
    ).run()
    assert interrupted.status == "interrupted" and interrupted.exit_signal == signal.SIGTERM
    assert interrupted.position.step == 5  # the step in flight finished, then a checkpoint
    saved = list_checkpoints(tmp_path / "split" / "checkpoints")
    assert saved and saved[-1].name == "step-0000005"

    resumed = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=10, out="split", resume=True).run()
    assert resumed.resumed_from and resumed.position.step == 10
    assert [entry["loss"] for entry in resumed.position.losses] == [entry["loss"] for entry in full.position.losses]
    # The learning rate of every step is recorded, and the resumed run continues the schedule.
    assert [entry["learning_rate"] for entry in resumed.position.losses] == [
        entry["learning_rate"] for entry in full.position.losses
    ]
    assert [entry["learning_rate"] for entry in full.position.losses] == pytest.approx(
        _schedule(10, full_run.settings.learning_rate)
    )


def _schedule(steps: int, peak: float) -> list[float]:
    """The learning rate each of `steps` optimizer steps trains at, by the run's own schedule."""
    import torch

    from benchtrain.train.step.hyperparameters import OptimizerSettings

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = OptimizerSettings().scheduler(optimizer, steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_tflops_count_each_padded_batch_at_its_own_length(tmp_path: Path, tokenizer) -> None:
    """TFLOP/s (and MFU) take each padded micro-batch's attention at its own length, not max_length."""
    import json
    import random

    from benchtrain.train.workload.batching import batch_shapes

    rng = random.Random(3)
    data_path = tmp_path / "pairs.jsonl"
    lines = [{"prompt": "q" * rng.randint(5, 20), "completion": "a" * rng.randint(5, 60)} for _ in range(40)]
    data_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = make_run(tmp_path, data_path, tokenizer, deadline=1e6, steps=3, max_length=128)
    outcome = run.run()
    c = run.chosen
    shapes = batch_shapes(run.inputs.data, run.epoch_batches(0), c.config.seq_len, run.shape_bucket)[
        : outcome.position.micro_batches
    ]
    flops = sum(shape.rows * shape.length * run.flops_per_token(shape.length) for shape in shapes)
    assert max(shape.length for shape in shapes) < c.config.seq_len  # padded batches shorter than max_length
    assert outcome.figures["tflops"] * 1e12 * outcome.position.step_seconds == pytest.approx(flops, rel=1e-9)


def test_checkpoints_are_kept_to_the_last_n(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer) -> None:
    run = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=6)
    run.settings.guard = guard_checkpointing_every(0.0, on_overrun=run.settings.guard.on_overrun, keep=2)
    run.run()
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-0000005", "step-0000006"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.endswith(".tmp")]
