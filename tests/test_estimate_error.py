"""What a person reads is true (issue 22): the estimate error of a run that stopped early, was
interrupted or was resumed is computed like for like — the time of the steps that ran against the
estimate for those steps plus the overheads that happened — and run.json, the console, the report's
banner and its charts all say the same.

A test double for the clock makes every expected value exact: the training code's clock stands
still except while a step runs, and each step takes exactly STEP seconds on it. So the actual time
of a command is (steps run) × STEP, and the estimate for those steps is the calibration's
prediction of each of them plus the overheads the synthetic calibration states (model build 1.0 s,
warm-up 0.2 s, a checkpoint 0.5 s, the export 0.5 s; the report, 2.0 s, is timed on its own).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
from helpers import FakeClock, run_main, train_arguments

from benchtrain.calibration.accuracy import (
    check_estimate,
    describe_estimate_error,
    describe_steps,
    describe_throughput,
    describe_time,
)
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.train.running.guard import NEXT_STEP_SAFETY

# The synthetic calibration's overheads (tests/helpers.py): what happened in each command below.
MODEL_BUILD, WARMUP, CHECKPOINT, EXPORT, REPORT = 1.0, 0.2, 0.5, 0.5, 2.0


def stored_calibration(home: Path) -> Calibration:
    """The calibration as the next command loads it (a finished run appends its speed to the history)."""
    path = next((home / "calibrations").glob("*.json"))
    return Calibration(read_calibration_file(path), path)


def predicted_step_seconds(calibration: Calibration, plan: dict) -> float:
    """The calibration's prediction of one optimizer step of full packed rows."""
    config = StepConfig.from_row(plan["configuration"])
    return config.grad_accum * calibration.micro_step_seconds(config)


def expected_error(steps: int, step_seconds: float, predicted_step: float, checkpoints: int) -> float:
    estimated = steps * predicted_step + MODEL_BUILD + WARMUP + checkpoints * CHECKPOINT + EXPORT
    return (steps * step_seconds - estimated) / estimated * 100


def read_record(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


@pytest.mark.slow
def test_an_interrupted_run_then_its_resume_each_report_the_error_of_the_steps_they_ran(
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    clock: FakeClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C after 5 of 20 steps, every step at its planned speed or not: the error is that of the
    5 steps (it was −74.9% against the whole plan's estimate), and the resume's that of the 15 left."""
    out = tmp_path / "run"
    # --no-measure: the error is checked against the calibration as stored (train would measure its longer lengths first).
    common = train_arguments(
        heavy_tailed_jsonl, out, "--deadline", "30m", "--max-steps", "20", "--no-report", "--no-measure"
    )
    before = stored_calibration(calibrated_home)
    clock.on_step = lambda step: os.kill(os.getpid(), signal.SIGINT) if step == 5 else None
    code, stdout, err = run_main("train", common, capsys)
    assert code == 130, err
    record = read_record(out)
    check = check_estimate(record)
    assert record["status"] == "interrupted" and check.steps_run == 5 and check.planned_steps == 20
    expected = expected_error(5, clock.step_seconds, predicted_step_seconds(before, record["plan"]), checkpoints=1)
    assert check.error_pct == pytest.approx(expected, rel=1e-9)
    assert record["estimate_error_pct"] == pytest.approx(expected, rel=1e-9)
    assert check.actual_seconds == pytest.approx(5 * clock.step_seconds)
    assert "5 of 20 planned steps ran" in stdout and "SIGINT" in stdout
    assert f"estimate error {describe_estimate_error(expected)}" in stdout
    # --help promises it: a checkpoint, and the command that continues from it.
    assert (out / "checkpoints" / "step-0000005").is_dir()
    resume_line = next(
        line for line in stdout.splitlines() if line.startswith("checkpoint saved (step-0000005); resume with: train ")
    )
    assert resume_line.endswith(f"--resume --out {out}") and "--max-steps 20" in resume_line

    clock.on_step = None
    after_first = stored_calibration(calibrated_home)  # the interrupted run's speed is in its history now
    assert len(after_first.history) == 1
    code, stdout, err = run_main("train", [*common, "--resume"], capsys)
    assert code == 0, err
    record = read_record(out)
    check = check_estimate(record)
    assert (check.start_step, check.steps_run, check.planned_steps) == (5, 15, 15)
    expected = expected_error(
        15, clock.step_seconds, predicted_step_seconds(after_first, record["plan"]), checkpoints=1
    )
    assert check.error_pct == pytest.approx(expected, rel=1e-9)
    assert "15 of 15 planned steps ran" in stdout and "steps 6–20" in stdout
    assert f"estimate error {describe_estimate_error(expected)}" in stdout
    # Tokens/s compare the same 15 steps: their tokens, not the whole run's.
    assert check.tokens == sum(entry["tokens"] for entry in record["losses"][5:])


@pytest.mark.slow
def test_a_deadline_stopped_run_and_its_banner_console_and_charts_tell_the_same_story(
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchtrain.reports import figures

    titles: dict[str, str] = {}
    real_save = figures.save

    def save_and_read_the_title(figure: object, path: Path) -> Path:
        titles[Path(path).name] = " ".join(axis.get_title() for axis in figure.axes).replace("\n", " ")
        return real_save(figure, path)

    monkeypatch.setattr(figures, "save", save_and_read_the_title)
    out = tmp_path / "run"
    deadline = 30.0
    clock.step_seconds = 2.0  # far slower than predicted: the guard must stop the run
    before = stored_calibration(calibrated_home)
    code, stdout, err = run_main(
        "train",
        train_arguments(heavy_tailed_jsonl, out, "--deadline", f"{deadline:.0f}s", "--max-steps", "40", "--no-measure"),
        capsys,
    )
    assert code == 0, err
    record = read_record(out)
    check = check_estimate(record)
    assert record["status"] == "stopped_for_deadline"
    # The guard stops at the last moment that leaves one more step (×1.5) and the reserve in the budget.
    budget, reserve = deadline * (1 - 0.05), CHECKPOINT + EXPORT + REPORT
    stop_step = math.floor((budget - reserve - NEXT_STEP_SAFETY * clock.step_seconds) / clock.step_seconds) + 1
    assert check.steps_run == stop_step and check.planned_steps == 40
    expected = expected_error(
        stop_step, clock.step_seconds, predicted_step_seconds(before, record["plan"]), checkpoints=1
    )
    assert check.error_pct == pytest.approx(expected, rel=1e-9)
    assert check.projected_seconds > check.plan_seconds and check.throughput_change_pct < -50

    # run.json holds the check; the console, the banner and the charts say its words.
    assert record["estimate_check"] == check.to_json()
    banner_match = re.search(r'<p class="verdict[^"]*">(.*?)</p>', (out / "report.html").read_text(), re.S)
    banner = html.unescape(banner_match.group(1)).split("<br>")
    steps, time, speed = describe_steps(check), describe_time(check), describe_throughput(check)
    assert f"{stop_step} of 40 planned steps ran" in steps
    for text in (steps, time, speed):
        assert text in stdout and any(text in line for line in banner)
    assert steps in titles["progress.png"] and time in titles["progress.png"]
    assert speed in titles["throughput.png"] and "lower throughput" in speed

    # One story: once the guard says the run is over budget, the live log says so too, never "on track".
    lines = stdout.splitlines()
    said = next(index for index, line in enumerate(lines) if "passes the deadline budget" in line)
    later = [line for line in lines[said:] if re.match(r"step \d+: ", line)]
    assert later and all("over budget" in line for line in later)
    assert not any("on track" in line for line in lines[said:])
    assert "back on track" not in " ".join(record["events"])
