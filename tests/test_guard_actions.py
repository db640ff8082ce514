"""Guard actions as a table carrying their status words (issue 42): adding an `--on-overrun` action
is one entry in train.running.guard.OVERRUN_ACTIONS — the CLI accepts it, the guard and the loop
carry it out — and the status words run.json holds do not change."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import FakeClock, guard_checkpointing_every, load_tokenized, synthetic_calibration, synthetic_rows

from benchtrain.calibration import run_file
from benchtrain.calibration.model import Calibration
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.running import guard
from benchtrain.train.running.checkpoint import list_checkpoints
from benchtrain.train.running.guard import DeadlineGuard, GuardSettings, Move, OverrunAction
from benchtrain.train.running.loop import LoopHooks, LoopSettings, ModelToTrain, TrainingData, TrainingRun
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model
from benchtrain.train.workload.tokenizer import byte_tokenizer

# A new action, written as a newcomer would add it: one entry in the table, nothing else.
CHECKPOINT = OverrunAction(
    "checkpoint", "checkpoint and go on", "checkpointing and continuing", when_over=Move.CHECKPOINT, stops=False
)


@pytest.fixture()
def checkpoint_action(monkeypatch: pytest.MonkeyPatch) -> OverrunAction:
    monkeypatch.setitem(guard.OVERRUN_ACTIONS, CHECKPOINT.word, CHECKPOINT)
    return CHECKPOINT


def observe_all(watch: DeadlineGuard, actual: list[float], start: float = 5.0, total: int = 100) -> list[guard.Verdict]:
    """Feed steps of 1 s predicted each until the guard stops the run (as tests/test_guard.py does)."""
    verdicts, elapsed = [], start
    for step, seconds in enumerate(actual, start=1):
        elapsed += seconds
        verdicts.append(watch.observe(step, elapsed, seconds, 1.0, max(0, min(watch.limit, total) - step) * 1.0))
        if verdicts[-1].move is Move.STOP:
            break
    return verdicts


def guard_for(on_overrun: str) -> DeadlineGuard:
    return DeadlineGuard(GuardSettings(Deadline(120.0, 5.0), reserve_seconds=5.0, on_overrun=on_overrun), limit=100)


# -- the words stay ------------------------------------------------------------------------------


def test_the_status_words_run_json_holds_are_unchanged() -> None:
    """People's scripts, the report and the model card read these: spelled out, not imported."""
    ends = (run_file.COMPLETED, run_file.STEP_LIMIT, run_file.STOPPED_FOR_DEADLINE, run_file.INTERRUPTED)
    assert ends == ("completed", "step_limit", "stopped_for_deadline", "interrupted")
    assert run_file.STOPPED_EARLY == ("stopped_for_deadline", "interrupted")
    assert (Move.STOP.status, Move.INTERRUPT.status, Move.CHECKPOINT.status, Move.CONTINUE.status) == (
        "stopped_for_deadline",
        "interrupted",
        None,
        None,
    )
    # What run.json writes is the plain word.
    assert json.dumps({"status": Move.STOP.status}) == '{"status": "stopped_for_deadline"}'


def test_the_built_in_actions_keep_their_cli_words_and_help() -> None:
    from benchtrain.train.cli import build_parser

    (option,) = [action for action in build_parser()._actions if "--on-overrun" in action.option_strings]
    assert option.choices == ("stop", "shrink", "warn") and option.default == "stop"
    assert (
        option.help
        == "when live speed says the deadline will be missed: checkpoint and stop (default), shrink the remaining steps, or warn"
    )


# -- a new action: one entry ------------------------------------------------------------------------


def test_the_cli_accepts_a_registered_action(checkpoint_action: OverrunAction) -> None:
    from benchtrain.train.cli import build_parser
    from benchtrain.train.recipes.config import TrainConfig

    args = build_parser().parse_args(["--data", "sample", "--deadline", "5m", "--on-overrun", "checkpoint"])
    assert TrainConfig.from_args(args).guard.on_overrun == "checkpoint"
    (option,) = [action for action in build_parser()._actions if "--on-overrun" in action.option_strings]
    assert option.help.endswith("shrink the remaining steps, warn, or checkpoint and go on")


def test_an_unregistered_action_is_refused() -> None:
    """Without its entry the word is bad input: one line (common.errors), and the guard refuses it."""
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.cli import build_parser

    with pytest.raises(
        BenchtrainError, match="invalid choice: 'checkpoint' \\(choose from 'stop', 'shrink', 'warn'\\)"
    ):
        build_parser().parse_args(["--data", "sample", "--deadline", "5m", "--on-overrun", "checkpoint"])
    with pytest.raises(ValueError):
        GuardSettings(Deadline(120.0, 5.0), reserve_seconds=5.0, on_overrun="checkpoint")


def test_the_guard_carries_out_a_registered_action(checkpoint_action: OverrunAction) -> None:
    """Checkpoint once per passing of the budget, say so, and never stop (even past the last safe moment)."""
    slow_then_fast_then_slow = [1.0] * 10 + [2.0] * 15 + [0.2] * 30 + [3.0] * 45
    verdicts = observe_all(guard_for("checkpoint"), slow_then_fast_then_slow)
    assert len(verdicts) == len(slow_then_fast_then_slow)  # never stopped
    checkpoints = [step for step, verdict in enumerate(verdicts, start=1) if verdict.move is Move.CHECKPOINT]
    assert len(checkpoints) == 2 and 10 < checkpoints[0] <= 25 and 55 < checkpoints[1]
    said = [
        verdict.message for verdict in verdicts if verdict.message and "passes the deadline budget" in verdict.message
    ]
    assert len(said) == 2 and all(message.endswith("; checkpointing and continuing") for message in said)
    assert (
        verdicts[checkpoints[0] - 1].move.value == "checkpoint"
        and "checkpointing and continuing" in verdicts[checkpoints[0]].summary
    )
    # The same steps under the built-in actions: stop stops, warn neither stops nor checkpoints.
    assert observe_all(guard_for("stop"), slow_then_fast_then_slow)[-1].move is Move.STOP
    assert {verdict.move for verdict in observe_all(guard_for("warn"), slow_then_fast_then_slow)} == {Move.CONTINUE}


def tiny_run(tmp_path: Path, data_path: Path, on_overrun: str, steps: int, clock: FakeClock) -> TrainingRun:
    """The tiny model on this machine, each step far slower than its prediction (0.3 s on the test's
    clock) under a 1 s deadline: over budget from the first steady step on, whatever the load."""
    clock.step_seconds = 0.3
    spec, tokenizer = resolve_model("tiny"), byte_tokenizer()
    model = {"name": "tiny", "parameter_count": 1, "fingerprint": spec.fingerprint}
    calibration = Calibration(
        synthetic_calibration(synthetic_rows(seq_lens=(32, 64)), hardware=detect_hardware(), model=model)
    )
    data = load_tokenized(str(data_path), tokenizer)
    request = PlanRequest(
        epochs=1,
        deadline=Deadline.with_margin_share(1e6, 0.05),
        effective_batch=4,
        max_length=32,
        num_workers=0,
        max_steps=steps,
    )
    plan = make_plan(calibration, data, request)
    plan.chosen = replace(plan.chosen, config=plan.chosen.config.switched(gradient_checkpointing=False))
    settings = LoopSettings(
        deadline=Deadline(1.0, 0.2, started_at=clock.now),
        guard=guard_checkpointing_every(1e6, on_overrun=on_overrun),
        epochs=1,
        step_limit=steps,
    )
    return TrainingRun(
        calibration=calibration,
        chosen=plan.chosen,
        model=ModelToTrain(spec, MethodConfig()),
        data=TrainingData(data, tokenizer.pad_token_id),
        out_dir=tmp_path / on_overrun,
        settings=settings,
        hooks=LoopHooks(),
    )


def test_the_loop_carries_out_a_registered_action(
    checkpoint_action: OverrunAction, tmp_path: Path, heavy_tailed_jsonl: Path, clock: FakeClock
) -> None:
    """The new action reaches the loop through LoopSettings.guard.on_overrun (what the CLI's word
    becomes): a checkpoint where the projection passed the budget, and the run goes on to its end."""
    run = tiny_run(tmp_path, heavy_tailed_jsonl, "checkpoint", steps=5, clock=clock)
    outcome = run.run()
    assert outcome.status == "step_limit" and outcome.position.step == 5  # not stopped, though far past the deadline
    assert any(
        "passes the deadline budget" in event and event.endswith("checkpointing and continuing")
        for event in outcome.events
    )
    saved = [event for event in outcome.events if event.startswith("checkpoint ")]
    # The guard's checkpoint at the first steady step (step 2: step 1 is the warm-up), the final one at step 5.
    assert [event.split()[1] for event in saved] == ["step-0000002", "step-0000005"]
    assert [path.name for path in list_checkpoints(tmp_path / "checkpoint" / "checkpoints")] == [
        "step-0000002",
        "step-0000005",
    ]
