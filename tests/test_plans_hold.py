"""Plans a user can hold us to (issue 31): each test fails on the behaviour the issue found.

1. --fit-deadline planned the shortened run with the whole plan's overheads (25 checkpoints of a
   4-hour plan subtracted from a 4-minute one): it used a quarter of the deadline, or refused.
2. A resume re-planned the run: other steps, another learning-rate horizon; a finished run could be
   "resumed" into more steps.
4. Bounds did not widen where the plan extrapolated.

The planner tests use a real calibration: gpt2 on this project's 2-core CPU, a 2-minute
`bench run --gpu cpu --model gpt2 --budget 2m` (tests/fixtures/cpu-gpt2-bench2m.json).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_line_error, calibrated_home, run_main
from test_estimate_check import FakeClock, clock, train_arguments
from test_planner import tokenized

from calibration.model import Calibration
from calibration.schema import read_calibration_file
from calibration.step_config import StepConfig
from common.errors import DeadlineError
from train.planning.planner import PlanRequest, evaluate, make_plan

__all__ = ["calibrated_home", "clock"]

GPT2_CALIBRATION = Path(__file__).parent / "fixtures" / "cpu-gpt2-bench2m.json"


def gpt2_calibration() -> Calibration:
    return Calibration(read_calibration_file(GPT2_CALIBRATION), GPT2_CALIBRATION)


def chat_lengths(count: int, median: float, seed: int = 0) -> list[int]:
    """Byte lengths shaped like the issue's ShareGPT chats (median ≈2,260, a long tail)."""
    rng = np.random.default_rng(seed)
    return [int(min(23_000, max(40, x))) for x in rng.lognormal(math.log(median), 0.6, size=count)]


# 1. --------------------------------------------------------------------------------------------
def fit_deadline_plan(lengths: list[int], deadline: float) -> tuple[Calibration, object, object, PlanRequest]:
    calibration, data = gpt2_calibration(), tokenized(lengths)
    request = PlanRequest(epochs=1, deadline_seconds=deadline, max_length=256, fit_deadline=True, with_report=False)
    return calibration, data, make_plan(calibration, data, request), request


def test_fit_deadline_fills_the_deadline_with_the_shortened_run_s_own_overheads() -> None:
    """gpt2, 5,000 chats, --deadline 4m: the whole plan takes hours (checkpoints every 10 minutes);
    the shortened run has one checkpoint, and one more step than planned would not fit."""
    calibration, data, plan, request = fit_deadline_plan(chat_lengths(5000, 2260), 240.0)
    chosen = plan.chosen
    whole = evaluate(calibration, data, PlanRequest(epochs=1, deadline_seconds=1e9, max_length=256, with_report=False), chosen.config)
    assert whole.total_seconds > 3600 and whole.overheads.checkpoint_count > 5  # the run it shortens
    assert plan.meets_deadline and plan.step_limit == chosen.optimizer_steps
    assert chosen.overheads.checkpoint_count == 1  # its own: no periodic checkpoint in 4 minutes
    assert chosen.total_seconds_promised <= plan.available_seconds
    one_more = evaluate(calibration, data, PlanRequest(**{**request.__dict__, "max_steps": plan.step_limit + 1}), chosen.config)
    assert one_more.total_seconds_promised > plan.available_seconds  # filled to within one step
    assert chosen.total_seconds_promised > plan.available_seconds - one_more.total_seconds_promised + chosen.total_seconds_promised - 1e-6
    # The alternatives are shortened the same way: none is shown at its hours-long length.
    assert plan.alternatives and all(c.total_seconds_promised <= plan.available_seconds for c in plan.alternatives)


def test_fit_deadline_refuses_only_when_one_step_with_its_own_overheads_does_not_fit() -> None:
    """4,000 longer chats: one step's upper bound fits the usable time (the old shrink subtracted the
    whole plan's checkpoints first and refused); a deadline shorter than one step is refused in words."""
    calibration, data, plan, _ = fit_deadline_plan(chat_lengths(4000, 3000, seed=1), 240.0)
    assert plan.meets_deadline and plan.step_limit >= 1
    with pytest.raises(DeadlineError, match=r"not even one optimizer step fits before the deadline: one step \(batch .*needs up to"):
        fit_deadline_plan(chat_lengths(4000, 3000, seed=1), 20.0)


def test_the_guard_s_projection_counts_the_periodic_checkpoints_of_the_steps_left() -> None:
    from train.running.guard import DeadlineGuard, GuardSettings

    plain = DeadlineGuard(GuardSettings(1000.0, 0.0, reserve_seconds=10.0, on_overrun="shrink"), limit=100)
    periodic = DeadlineGuard(GuardSettings(1000.0, 0.0, reserve_seconds=10.0, on_overrun="shrink", periodic_share=0.25), limit=100)
    for guard in (plain, periodic):
        guard.observe(1, 10.0, 10.0, 10.0, 990.0)
    verdicts = [guard.observe(2, 20.0, 10.0, 10.0, 980.0) for guard in (plain, periodic)]
    assert verdicts[1].projected_finish == pytest.approx(20.0 + 980.0 * 1.25 + 10.0)
    # Shrunk to what fits with the checkpoints those steps bring: (1000 − 20 − 10) / (10 × 1.25) = 77 more.
    assert verdicts[0].limit == 2 + 97 and verdicts[1].limit == 2 + 77


# 2. --------------------------------------------------------------------------------------------
def learning_rates(record: dict) -> list[float]:
    return [entry["learning_rate"] for entry in record["losses"]]


def test_a_resume_continues_the_run_it_resumes_whatever_this_command_says(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C at step 3 of 6; resumed without --max-steps (the old resume planned the whole epoch:
    more steps, the learning rate's horizon moved), then with --max-steps 10 (it extended the run)."""
    straight = tmp_path / "straight"
    code, _, err = run_main("train", train_arguments(heavy_tailed_jsonl, straight, "--deadline", "30m", "--max-steps", "6", "--no-report"), capsys)
    assert code == 0, err
    uninterrupted = json.loads((straight / "run.json").read_text())

    out = tmp_path / "run"
    clock.on_step = lambda step: os.kill(os.getpid(), signal.SIGINT) if step == clock.steps_at_start + 3 else None
    clock.steps_at_start = clock.steps
    code, _, err = run_main("train", train_arguments(heavy_tailed_jsonl, out, "--deadline", "30m", "--max-steps", "6", "--no-report"), capsys)
    assert code == 130, err
    first = json.loads((out / "run.json").read_text())
    assert first["plan"]["total_steps"] == 6 and first["actual"]["steps"] == 3
    clock.on_step = None

    code, _, err = run_main("train", [*train_arguments(heavy_tailed_jsonl, out, "--deadline", "30m", "--no-report"), "--max-steps", "10", "--resume"], capsys)
    assert_one_line_error(code, err, "has 6 optimizer steps; --max-steps 10 would extend it")
    code, printed, err = run_main("train", [*train_arguments(heavy_tailed_jsonl, out, "--deadline", "45m", "--no-report"), "--resume"], capsys)
    assert code == 0, err
    assert "resuming from step 3 of 6 with the run's configuration and learning-rate schedule" in printed
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["actual"]["steps"] == 6 and resumed["plan"]["total_steps"] == 6
    for key in ("micro_batch_size", "grad_accum", "num_workers", "max_length", "gradient_checkpointing"):
        assert resumed["plan"][key] == first["plan"][key]
    assert learning_rates(resumed) == pytest.approx(learning_rates(uninterrupted), rel=1e-12)

    before = (out / "run.json").read_text()
    code, _, err = run_main("train", [*train_arguments(heavy_tailed_jsonl, out, "--deadline", "30m", "--no-report"), "--resume"], capsys)
    assert_one_line_error(code, err, "already did all 6 of its optimizer steps")
    assert (out / "run.json").read_text() == before  # a refused resume changes nothing


def test_a_fit_deadline_run_that_ran_all_its_steps_is_not_resumed(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny run the issue saw: all 391 steps --fit-deadline allowed, then 'resumed from step 391 of 785'."""
    out = tmp_path / "run"
    clock.step_seconds = 0.001  # faster than planned: the guard never stops it, it runs all its steps
    arguments = [*train_arguments(heavy_tailed_jsonl, out, "--epochs", "50", "--no-report", "--margin", "0"), "--fit-deadline"]
    code, printed, err = run_main("train", [*arguments, "--deadline", "6s"], capsys)
    assert code == 0, err
    record = json.loads((out / "run.json").read_text())
    assert "--fit-deadline: limited to" in printed and record["plan"]["total_steps"] == record["actual"]["steps"]
    code, _, err = run_main("train", [*arguments, "--deadline", "1h", "--resume"], capsys)
    assert_one_line_error(code, err, f"already did all {record['actual']['steps']} of its optimizer steps")


# 4. --------------------------------------------------------------------------------------------
def test_bounds_widen_past_what_bench_measured() -> None:
    """gpt2 measured lengths up to 256: a plan at 960 (3.75× past it) had exactly the inside bound."""
    calibration = gpt2_calibration()
    inside = StepConfig(micro_batch_size=4, num_workers=0, grad_accum=2, seq_len=256)
    bound = calibration.relative_bound_for(inside)
    assert bound == pytest.approx(calibration.relative_bound)
    longer = calibration.relative_bound_for(StepConfig(micro_batch_size=4, num_workers=0, grad_accum=2, seq_len=960))
    bigger_batch = calibration.relative_bound_for(StepConfig(micro_batch_size=16, num_workers=0, grad_accum=1, seq_len=256))
    a_bit_longer = calibration.relative_bound_for(StepConfig(micro_batch_size=4, num_workers=0, grad_accum=2, seq_len=320))
    assert bound < a_bit_longer < longer
    assert longer >= bound * (1 + math.log2(960 / 256)) - 1e-9 and bigger_batch > bound
    # Tokens per micro-step past the largest measured (4 × 256), each size within its own range.
    many_tokens = calibration.relative_bound_for(StepConfig(micro_batch_size=8, num_workers=0, grad_accum=1, seq_len=256))
    assert calibration.measured_values("micro_batch_size")[-1] >= 8 and many_tokens > bound
