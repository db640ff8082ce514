"""DeadlineCallback's behaviour at the edges of a user's Trainer run, on CPU with the real
libraries: signal handlers restored at any exit of train() and chained to the user's, the token
hook gone, a signal saving under any save strategy, bookkeeping failures that warn instead of
raising out of a finished train(), one collective per step, and what reaches the Trainer's
trackers (tokens/s, the ETA with its bounds, the deadline left)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_checks import FakeClock, Pace, trainer
from transformers import TrainerCallback

from benchtrain import DeadlineCallback
from benchtrain.calibration.run_file import INTERRUPTED


class Boom(TrainerCallback):
    """Raises at `step` (the first `times` runs that reach it): a failure inside train()."""

    def __init__(self, step: int, error: Exception, times: int = 1) -> None:
        self.step, self.error, self.times = step, error, times

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and self.times > 0:
            self.times -= 1
            raise self.error


class SendAt(TrainerCallback):
    """Sends this process `number` at the end of `step`."""

    def __init__(self, step: int, number: int) -> None:
        self.step, self.number = step, number

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), self.number)


@pytest.fixture()
def user_usr1() -> Iterator[list[int]]:
    """The user's own SIGUSR1 handler (a SLURM requeue handler, say), put back after the test."""
    calls: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda number, frame: calls.append(number))
    yield calls
    signal.signal(signal.SIGUSR1, before)


def deliver(number: int) -> None:
    """Signal this process and give Python the chance to run the handler."""
    os.kill(os.getpid(), number)
    for _ in range(50):
        time.sleep(0.001)


def pre_hooks(model: Any) -> int:
    return len(model._forward_pre_hooks) + len(model._forward_pre_hooks_with_kwargs)


def test_an_exception_inside_train_leaves_the_users_handlers_working(
    tmp_path: Path, home: Path, user_usr1: list[int]
) -> None:
    run = trainer(
        tmp_path / "out",
        [Boom(3, ValueError("the user's bug")), DeadlineCallback(deadline="1h", clock=FakeClock(), report=False)],
        max_steps=10,
    )
    with pytest.raises(ValueError, match="the user's bug"):
        run.train()
    deliver(signal.SIGUSR1)
    assert user_usr1 == [signal.SIGUSR1]  # not swallowed by a handler of a run that is over
    assert signal.getsignal(signal.SIGUSR1) is not None and len(user_usr1) == 1
    # The first Ctrl-C interrupts again, as without the callback.
    with pytest.raises(KeyboardInterrupt):
        deliver(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # The token hook left the model: a forward after the failed run is nobody's to count.
    run.model.train()
    run.model(input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert pre_hooks(run.model) == 0


def test_a_second_train_after_a_failure_restores_the_users_handlers(
    tmp_path: Path, home: Path, user_usr1: list[int]
) -> None:
    users = signal.getsignal(signal.SIGUSR1)
    callback = DeadlineCallback(deadline="1h", clock=FakeClock(), report=False)
    run = trainer(tmp_path / "out", [Boom(3, ValueError("once")), callback], max_steps=6)
    with pytest.raises(ValueError):
        run.train()
    run.train()  # the user tries again, and it completes
    assert run.state.global_step == 6
    assert signal.getsignal(signal.SIGUSR1) is users and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert pre_hooks(run.model) == 0


def test_an_auto_find_batch_size_retry_restores_the_users_handlers(
    tmp_path: Path, home: Path, user_usr1: list[int]
) -> None:
    """transformers halves the batch after an out-of-memory error and calls on_train_begin again."""
    users = signal.getsignal(signal.SIGUSR1)
    callback = DeadlineCallback(deadline="1h", clock=FakeClock(), report=False)
    run = trainer(
        tmp_path / "out",
        [Boom(2, RuntimeError("CUDA out of memory.")), callback],
        max_steps=4,
        auto_find_batch_size=True,
    )
    run.train()
    assert run.state.global_step == 4 and run._train_batch_size < 4  # the retry ran
    assert signal.getsignal(signal.SIGUSR1) is users
    assert pre_hooks(run.model) == 0


def test_the_users_handler_is_chained(tmp_path: Path, home: Path, user_usr1: list[int]) -> None:
    clock = FakeClock()
    callback = DeadlineCallback(deadline="10h", clock=clock, report=False)
    run = trainer(tmp_path / "out", [Pace(clock, step=10.0), SendAt(3, signal.SIGUSR1), callback], max_steps=20)
    run.train()
    assert callback.status == INTERRUPTED and run.state.global_step in (3, 4)
    assert user_usr1 == [signal.SIGUSR1]  # the user's requeue handler ran too


class NeverBest(TrainerCallback):
    """Before the evaluation is scored: a best metric no evaluation beats (lower is better)."""

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.best_metric = float("-inf")


class SignalDuringEvaluation(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_an_evaluation_saves_under_save_strategy_best(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="10h", clock=clock, report=False)
    run = trainer(
        out,
        [Pace(clock, step=10.0, save=2.0, evaluation=30.0), SignalDuringEvaluation(step=6), NeverBest(), callback],
        eval_count=8,
        max_steps=20,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="best",
        metric_for_best_model="loss",
        greater_is_better=False,
        per_device_eval_batch_size=4,
    )
    run.train()
    assert run.state.global_step == 6 and callback.status == INTERRUPTED
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-6"]


def test_bookkeeping_that_fails_warns_and_train_returns(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run folder that cannot be written (here a file stands where the folder goes: the tests
    may run as root, where a read-only folder is still written) costs the record, not the run."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", clock=clock, output_dir=str(blocker / "benchtrain"))
    run = trainer(tmp_path / "out", [Pace(clock, step=10.0, save=1.0), callback], max_steps=6, save_strategy="steps")
    run.train()
    assert run.state.global_step == 6
    run.save_model(str(tmp_path / "final"))  # what the user's script does next
    assert (tmp_path / "final" / "config.json").is_file()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "could not" in line]
    assert warnings and all(line.startswith("benchtrain: warning:") for line in warnings)


def test_a_calibration_that_cannot_be_fed_warns(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import synthetic_calibration
    from trainer_checks import tiny_model

    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.trainer.estimate import model_setup

    spec, _ = model_setup(tiny_model())
    path = tmp_path / "calibration.json"
    calibration = synthetic_calibration(
        model={"name": spec.name, "parameter_count": 1000, "fingerprint": spec.fingerprint},
        hardware={**detect_hardware(), "memory_bytes": 64 * 2**30},
        training={"method": "full", "lora": None},
    )
    path.write_text(json.dumps(calibration))
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", calibration=str(path), clock=clock, report=False)
    run = trainer(tmp_path / "out", [Pace(clock, step=0.05), callback], max_steps=4)
    path.unlink()
    path.mkdir()  # the calibration's file is gone: a shared home someone else cleaned
    run.train()
    assert run.state.global_step == 4
    assert json.loads((tmp_path / "out" / "benchtrain" / "run.json").read_text())["status"] == "completed"
    assert any(line.startswith("benchtrain: warning:") for line in capsys.readouterr().err.splitlines())


class TwoProcesses:
    """accelerate's process state as a 2-process run has it, for counting the collectives."""

    num_processes = 2
    process_index = 0
    device = torch.device("cpu")


def test_one_collective_per_step(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import benchtrain.trainer.callback as callback_module

    calls: list[int] = []

    class Count(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            calls.append(0)

    def all_reduce(tensor: Any, op: Any = None, **kwargs: Any) -> None:
        calls[-1] += 1  # the other process contributed nothing: this one's values stand

    monkeypatch.setattr(callback_module, "_state", TwoProcesses)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", clock=clock, report=False)
    run = trainer(tmp_path / "out", [Count(), Pace(clock, step=10.0), callback], max_steps=6)
    run.train()
    assert calls == [1] * 6
    assert callback.watch.steps[-1].tokens > 0  # this process's tokens survived the agreement


class Batches:
    """The collator, recording what it made."""

    def __init__(self, collator: Any) -> None:
        self.collator, self.masks = collator, []

    def __call__(self, features: Any) -> Any:
        batch = self.collator(features)
        self.masks.append(batch["attention_mask"])
        return batch


def test_tokens_per_second_and_the_eta_reach_tensorboard(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))

    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", clock=clock, report=False)
    run = trainer(
        out,
        [Pace(clock, step=10.0), callback],
        max_steps=8,
        logging_steps=2,
        report_to=["tensorboard"],
    )
    batches = Batches(run.data_collator)
    run.data_collator = batches
    run.train()
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {
        "train/tokens_per_second",
        "train/padded_tokens_per_second",
        "train/eta_seconds",
        "train/eta_low_seconds",
        "train/eta_high_seconds",
        "train/deadline_left_seconds",
    } <= scalars
    assert "train/mfu" not in scalars  # a CPU has no peak FLOP/s: no MFU rather than an assumed one
    # Accumulation counted right: every micro-batch of an optimizer step (2 here) is in its tokens.
    steps = callback.watch.steps
    assert sum(record.micro_steps for record in steps) == len(batches.masks) == 16
    assert sum(record.tokens for record in steps) == sum(int(mask.sum()) for mask in batches.masks)
    # The last two steps' real tokens over their 20 s, as the step-8 log says.
    speed = [event.value for event in events.Scalars("train/tokens_per_second")]
    assert speed[-1] == pytest.approx((steps[-1].tokens + steps[-2].tokens) / 20.0, abs=0.06)
    eta = {event.step: event.value for event in events.Scalars("train/eta_seconds")}
    assert eta[2] == pytest.approx(60.0, abs=1.0)  # six steps of 10 s left after step 2
    low = {event.step: event.value for event in events.Scalars("train/eta_low_seconds")}
    high = {event.step: event.value for event in events.Scalars("train/eta_high_seconds")}
    assert all(low[step] <= eta[step] <= high[step] for step in eta)


def test_mfu_is_held_against_the_devices_peak_where_it_has_one() -> None:
    """On a GPU of the datasheets (here its peak given): the padded tokens per second of one process
    times the model's FLOPs per token over the peak; without a peak, no MFU."""
    from trainer_checks import tiny_model

    from benchtrain.train.running.guard import Move, Verdict
    from benchtrain.train.workload.model import model_shape
    from benchtrain.trainer.log_values import LogValues
    from benchtrain.trainer.step_watch import StepTokens, StepWatch

    now = [0.0]
    watch = StepWatch(lambda: now[0])
    watch.start(0.0)
    now[0] = 2.0
    watch.end_step(1, StepTokens(1800, 2000, 2, 50.0))  # two processes' tokens of one step
    verdict = Verdict(Move.CONTINUE, 10, 20.0, 1.0, budget_seconds=100.0)
    model = tiny_model()
    values = LogValues.of(model, False, (), {"peak_bf16_flops": 1e9}, 2).values(watch, verdict, 0.2)
    assert values["mfu"] == pytest.approx(500.0 * model_shape(model).flops_per_token(50) / 1e9, rel=1e-3)
    assert values["eta_low_seconds"] < values["eta_seconds"] == 18.0 < values["eta_high_seconds"]
    assert "mfu" not in LogValues.of(model, False, (), {"peak_bf16_flops": None}, 2).values(watch, verdict, 0.2)
