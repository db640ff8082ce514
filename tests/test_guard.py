"""The deadline guard on its own, without a model (issue 13)."""

from __future__ import annotations

import pytest

from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.running.guard import DeadlineGuard, GuardSettings

STEP = 1.0  # predicted seconds per step


def run(guard: DeadlineGuard, actual: list[float], start: float = 5.0, total: int = 100) -> list:
    """Feed steps; remaining prediction = the steps left up to the guard's limit × STEP."""
    verdicts, elapsed = [], start
    for step, seconds in enumerate(actual, start=1):
        elapsed += seconds
        verdict = guard.observe(step, elapsed, seconds, STEP, max(0, min(guard.limit, total) - step) * STEP)
        verdicts.append(verdict)
        if verdict.move.value == "stop":
            break
    return verdicts


def settings(deadline_seconds: float = 120.0, margin_seconds: float = 5.0, **overrides) -> GuardSettings:
    values = {"reserve_seconds": 5.0, "on_overrun": "stop", "warmup_steps": 1}
    return GuardSettings(Deadline(deadline_seconds, margin_seconds), **{**values, **overrides})


def test_on_track_says_nothing_and_never_stops() -> None:
    verdicts = run(DeadlineGuard(settings(), 100), [1.0] * 100)
    assert all(v.move.value == "continue" and v.message is None for v in verdicts)


def test_a_slow_warm_up_step_is_not_a_warning() -> None:
    """On an H100 the first step printed 'passes the deadline budget' (three times) in a run that
    then finished in time."""
    verdicts = run(DeadlineGuard(settings(), 100), [20.0] + [0.9] * 99, start=0.0)
    assert [v.message for v in verdicts if v.message] == []
    assert verdicts[0].ratio == 1.0  # the warm-up step did not set the live speed


def test_a_slowdown_is_said_once_and_the_run_stops_at_the_last_safe_moment() -> None:
    verdicts = run(DeadlineGuard(settings(), 100), [1.0] * 10 + [2.0] * 100)
    messages = [v.message for v in verdicts if v.message]
    assert len(messages) == 1 and "115s" in messages[0] and "will checkpoint and stop" in messages[0]
    assert verdicts[-1].move.value == "stop"
    # Stopped with one step (×1.5) and the reserve still inside the budget.
    stopped_at = 5.0 + 10 * 1.0 + (len(verdicts) - 10) * 2.0
    assert 115 - 5 - 3.0 <= stopped_at <= 115 - 5


def test_back_on_track_is_said_once_too() -> None:
    verdicts = run(DeadlineGuard(settings(on_overrun="warn"), 100), [1.0] * 5 + [1.4] * 20 + [0.5] * 40)
    messages = [v.message for v in verdicts if v.message]
    assert len(messages) == 2
    assert "continuing (--on-overrun warn)" in messages[0] and "back on track" in messages[1]
    assert all(v.move.value == "continue" for v in verdicts)


def test_warn_never_stops() -> None:
    verdicts = run(DeadlineGuard(settings(on_overrun="warn"), 100), [3.0] * 100)
    assert all(v.move.value == "continue" for v in verdicts) and len(verdicts) == 100


def test_shrink_cuts_the_limit_to_what_fits_at_the_live_speed() -> None:
    guard = DeadlineGuard(settings(on_overrun="shrink"), 100)
    verdicts = run(guard, [2.0] * 100)
    shrinks = [v for v in verdicts if v.move.value == "shrink"]
    assert shrinks and "shrinking to" in shrinks[0].message
    finish = 5.0 + 2.0 * guard.limit + 5.0
    assert finish <= 115 and guard.limit < 100


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        settings(on_overrun="panic")


def test_a_run_near_its_limit_does_not_flip_between_states() -> None:
    """A resume flipped 7 times between "will checkpoint and stop" and "back on track": the
    projection wandered a little around the budget. Once over, the run is back on track only with
    a share of the time still to go to spare."""
    guard = DeadlineGuard(settings(on_overrun="warn"), 100)
    elapsed, verdicts = 10.0, []
    for step in range(1, 41):
        elapsed += 1.0
        # Projected finish (elapsed + remaining × 1.0 + 5 s reserve): 116 s, 113 s, 116 s, … around the 115 s budget.
        remaining = 110.0 - elapsed + (1.0 if step % 2 else -2.0)
        verdicts.append(guard.observe(step, elapsed, 1.0, STEP, remaining))
    messages = [v.message for v in verdicts if v.message]
    assert len(messages) == 1 and "passes the deadline budget" in messages[0]
    assert {v.state for v in verdicts[2:]} == {"over budget"}  # from step 3, the first over the budget
    # A real recovery (projection 105 s, well inside) is said once.
    recovered = guard.observe(41, elapsed + 1.0, 1.0, STEP, 100.0 - elapsed - 1.0)
    assert recovered.state == "on track" and "back on track" in recovered.message


def test_the_live_line_says_the_guards_state() -> None:
    """The live line said "on track" while the guard printed "projected finish 1409s of 300s"."""
    from types import SimpleNamespace

    from benchtrain.train.running.loop import TrainingRun

    guard = DeadlineGuard(settings(), 100)
    verdicts = run(guard, [1.0] * 3 + [10.0] * 3)
    step = SimpleNamespace(loss=1.0, target_tokens=100, seconds=10.0)
    line = TrainingRun._postfix(step, verdicts[-1])
    assert "over budget: projected finish" in line and "will checkpoint and stop" in line and "on track" not in line
    warming = TrainingRun._postfix(step, verdicts[0])
    assert "warming up" in warming and warming.endswith("110s of 115s budget")
