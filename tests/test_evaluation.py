"""Evaluation: a deterministic held-out set, on a schedule and at the end, planned from measured
forward-only speed (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    TINY_GRID,
    TRUE_EVAL,
    assert_one_line_error,
    heavy_tailed,
    run_main,
    synthetic_calibration,
    tokenized,
)

from benchtrain.calibration.model import Calibration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.step.evaluation import EvalSchedule, parse_eval_every, split_eval


def test_the_eval_split_is_deterministic_and_disjoint() -> None:
    data = tokenized(heavy_tailed(200), fmt="text")
    train, held = split_eval(data, 0.1, seed=3)
    _, again_held = split_eval(data, 0.1, seed=3)
    assert len(held) == 20 and len(train) == 180
    assert [held.sample(i).tolist() for i in range(len(held))] == [
        again_held.sample(i).tolist() for i in range(len(again_held))
    ]
    assert {tuple(held.sample(i).tolist()) for i in range(len(held))}.isdisjoint(
        {tuple(train.sample(i).tolist()) for i in range(len(train))}
    )
    assert [split_eval(data, 0.1, seed=4)[1].sample(i).tolist() for i in range(len(held))] != [
        held.sample(i).tolist() for i in range(len(held))
    ]


@pytest.mark.parametrize(
    ("text", "schedule"),
    [
        ("500steps", EvalSchedule(every_steps=500)),
        ("20", EvalSchedule(every_steps=20)),
        ("10m", EvalSchedule(every_seconds=600.0)),
    ],
)
def test_eval_every_takes_steps_or_a_duration(text: str, schedule: EvalSchedule) -> None:
    assert parse_eval_every(text) == schedule


def test_a_bad_eval_every_is_one_line() -> None:
    with pytest.raises(BenchtrainError, match="--eval-every"):
        parse_eval_every("soon")


def test_the_plan_adds_evaluation_time() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed(), fmt="text")
    train, held = split_eval(data, 0.2, seed=0)
    request = PlanRequest(
        epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=128, num_workers=0
    )
    without = make_plan(calibration, train, request).chosen
    every_10 = make_plan(
        calibration, train, PlanRequest(**{**request.__dict__, "eval_schedule": EvalSchedule(every_steps=10)}), held
    ).chosen
    at_end = make_plan(
        calibration, train, PlanRequest(**{**request.__dict__, "eval_schedule": EvalSchedule()}), held
    ).chosen
    assert without.overheads.evaluation_seconds == 0
    assert at_end.overheads.eval_pass_seconds > 0 and at_end.overheads.evaluation_seconds == pytest.approx(
        at_end.overheads.eval_pass_seconds
    )
    assert every_10.overheads.evaluation_seconds == pytest.approx(
        every_10.overheads.eval_pass_seconds * (every_10.optimizer_steps // 10 + 1)
    )
    assert every_10.total_seconds == pytest.approx(without.total_seconds + every_10.overheads.evaluation_seconds)
    # One pass is the eval batches' predicted forward-only seconds (packed rows of 128 tokens).
    rows = -(-sum(held.lengths) // 128)
    assert at_end.overheads.eval_pass_seconds >= (rows // 4) * (TRUE_EVAL["fixed"] + TRUE_EVAL["per_token"] * 4 * 128)


def test_bench_measures_evaluation_and_train_evaluates_on_schedule(
    home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main("bench", ["run", "--gpu", "cpu", *TINY_GRID, "--no-report"], capsys)
    assert code == 0, err
    data = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert len(data["eval"]["measurements"]) == 4 and all(row["status"] == "ok" for row in data["eval"]["measurements"])
    assert data["eval"]["fit"]["parameters"]["per_token"] >= 0

    argv = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "5",
        "--no-report",
    ]
    code, out, err = run_main("train", [*argv, "--eval-split", "0.1", "--eval-every", "2steps"], capsys)
    assert code == 0, err
    record = json.loads(next((home / "runs").glob("*/run.json")).read_text())
    assert [entry["step"] for entry in record["evals"]] == [2, 4, 5]
    assert record["actual"]["final_eval_loss"] == record["evals"][-1]["eval_loss"] > 0
    assert record["actual"]["final_perplexity"] > 1
    assert record["estimate"]["eval_seconds"] > 0
    assert "eval loss" in err + out and "evaluation (" in out


def test_eval_options_that_do_not_go_together(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--data", "sample", "--deadline", "30m", "--dry-run"]
    code, _, err = run_main("train", [*common, "--eval-split", "0.1", "--eval-data", str(heavy_tailed_jsonl)], capsys)
    assert_one_line_error(code, err, "pass one")
    code, _, err = run_main("train", [*common, "--eval-every", "100steps"], capsys)
    assert_one_line_error(code, err, "--eval-every needs an eval set")
    code, _, err = run_main("train", [*common, "--eval-split", "1.5"], capsys)
    assert_one_line_error(code, err, "--eval-split must be a fraction")
