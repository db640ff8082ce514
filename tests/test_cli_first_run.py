"""What a new user tripped on (issue 9): each test fails on the old behaviour.

Also: measurement that holds up on a busy machine (median probes, re-measuring disturbed ones, a
robust fit, a noisy calibration said out loud and planned on its central estimate).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    TRUE_THROUGHPUT,
    assert_one_line_error,
    heavy_tailed,
    micro_seconds,
    run_main,
    synthetic_calibration,
    synthetic_rows,
    tokenized,
)

from benchtrain.bench.runner import Budget, run_grid
from benchtrain.bench.space import SearchSpace
from benchtrain.calibration.accuracy import describe_estimate_error, estimate_error_pct
from benchtrain.calibration.fit import fit_measurements
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import save_calibration
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest


def short_calibration(**overrides: Any) -> Calibration:
    """Calibrated at lengths 32–128 only, like a CPU benchmark of the tiny preset."""
    return Calibration(synthetic_calibration(synthetic_rows(seq_lens=(32, 64, 128)), **overrides))


# 1. --------------------------------------------------------------------------------------------
def test_balanced_keeps_the_truncation_limit_on_long_chat_data() -> None:
    """89% of chat samples were cut to the longest calibrated length (256) with only a note."""
    lengths = [int(x) for x in np.random.default_rng(3).integers(300, 700, size=400)]
    plan = make_plan(
        short_calibration(),
        tokenized(lengths),
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_positions=4096),
    )
    assert plan.chosen.truncation["share_truncated"] <= 0.005
    assert plan.chosen.config.seq_len >= sorted(lengths)[int(0.995 * len(lengths)) - 1]
    assert plan.chosen.config.seq_len % 64 == 0
    assert any("extrapolates" in note for note in plan.notes)


def test_when_the_model_cannot_take_the_length_the_plan_says_so_loudly() -> None:
    lengths = [int(x) for x in np.random.default_rng(3).integers(300, 700, size=400)]
    plan = make_plan(
        short_calibration(),
        tokenized(lengths),
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_positions=256),
    )
    assert plan.chosen.config.seq_len == 256
    assert any("at most 256 tokens" in warning and "truncated" in warning for warning in plan.warnings)


def test_an_explicit_max_length_that_truncates_too_much_is_a_warning() -> None:
    lengths = [int(x) for x in np.random.default_rng(3).integers(300, 700, size=400)]
    plan = make_plan(
        short_calibration(),
        tokenized(lengths),
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=128),
    )
    assert any("--max-length 128 truncates 100.0%" in warning for warning in plan.warnings)


# 2. --------------------------------------------------------------------------------------------
def test_fit_deadline_on_resume_counts_the_steps_already_done() -> None:
    """A resumed run was capped at 4 steps when 8 were done: it trained nothing."""
    calibration, data = short_calibration(), tokenized(heavy_tailed(), fmt="text")
    whole = make_plan(
        calibration,
        data,
        PlanRequest(epochs=3, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=64),
    )
    per_step = whole.chosen.step_seconds / whole.chosen.optimizer_steps
    overhead = whole.chosen.overheads.total_seconds
    # A deadline with room for about 20 steps (and no margin to keep the arithmetic plain).
    deadline = overhead + 20 * per_step * (1 + calibration.promised_bound_for(whole.chosen.config))
    request = PlanRequest(
        epochs=3,
        deadline=Deadline.with_margin_share(deadline, 0.0),
        effective_batch=4,
        max_length=64,
        fit_deadline=True,
    )
    fresh = make_plan(calibration, data, request)
    resumed = make_plan(calibration, data, PlanRequest(**{**request.__dict__, "completed_steps": 8}))
    assert 15 <= fresh.step_limit <= 20
    assert resumed.step_limit == 8 + fresh.step_limit  # the steps that fit come after the 8 done
    assert resumed.chosen.remaining_steps == fresh.step_limit
    assert resumed.chosen.step_seconds == pytest.approx(fresh.chosen.step_seconds, rel=0.01)


def test_resume_estimates_only_the_steps_left() -> None:
    calibration, data = short_calibration(), tokenized(heavy_tailed(), fmt="text")
    request = PlanRequest(
        epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=64, max_steps=40
    )
    whole = make_plan(calibration, data, request)
    resumed = make_plan(calibration, data, PlanRequest(**{**request.__dict__, "completed_steps": 30}))
    assert resumed.chosen.optimizer_steps == 40 and resumed.chosen.remaining_steps == 10
    assert resumed.chosen.step_seconds == pytest.approx(whole.chosen.step_seconds / 4, rel=0.01)
    # All its steps done (a kill after the last checkpoint): planned, with nothing left to train but what comes after.
    done = make_plan(calibration, data, PlanRequest(**{**request.__dict__, "completed_steps": 40}))
    assert done.chosen.optimizer_steps == 40 and done.chosen.remaining_steps == 0


# 3. --------------------------------------------------------------------------------------------
def test_a_budget_too_small_or_a_grid_too_small_is_refused_before_anything_is_built(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchtrain.train.workload.model

    built: list[str] = []
    real_build = benchtrain.train.workload.model.build_model

    def recorded_build(spec: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(spec.name)
        return real_build(spec, *args, **kwargs)

    monkeypatch.setattr(benchtrain.train.workload.model, "build_model", recorded_build)
    # gpt2's FLOPs: even at this CPU's matmul peak, 3 probes cannot fit in 2 seconds.
    code, _, err = run_main("bench", ["run", "--model", "gpt2", "--budget", "2s", "--quiet", "--no-report"], capsys)
    assert_one_line_error(code, err, "cannot pay for even a minimum calibration")
    assert "use --budget" in err and "building" not in err
    assert built == []  # refused from the planner's prices, before a model was built
    code, _, err = run_main(
        "bench",
        ["run", "--batch-sizes", "1", "--workers", "0", "--accum", "1", "--seq-lens", "32,64", "--quiet"],
        capsys,
    )
    assert_one_line_error(code, err, "a fit needs at least 3")
    assert not list((home / "calibrations").glob("*.json"))


def test_a_benchmark_that_fits_nothing_fails_and_is_not_latest(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchtrain.bench.probe_tasks

    def failing(workload: Any, config: Any, settings: Any, peak_flops: Any = None) -> dict[str, Any]:
        return {**config.to_row(), "status": "error", "error": "RuntimeError: faked", "probe_seconds": 0.01}

    monkeypatch.setattr(benchtrain.bench.probe_tasks, "run_probe", failing)  # where the probe task calls it
    code, _, err = run_main(
        "bench",
        [
            "run",
            "--batch-sizes",
            "1,2",
            "--workers",
            "0",
            "--accum",
            "1",
            "--seq-lens",
            "32,64",
            "--quiet",
            "--no-report",
        ],
        capsys,
    )
    assert_one_line_error(code, err, "a fit needs at least", expected_code=4)
    assert "Nothing was stored as a calibration" in err
    assert not list((home / "calibrations").glob("*.json"))
    assert list((home / "calibrations" / "failed").glob("*.json"))
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "5m", "--dry-run"], capsys)
    assert_one_line_error(code, err, "run `bench run` first")


# 4. --------------------------------------------------------------------------------------------
def test_latest_names_the_newer_calibration_it_skipped(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    good = save_calibration(
        synthetic_calibration(
            hardware=detect_hardware(),
            model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        )
    )
    broken = good.parent / "cpu-tiny-29991231-235959.json"
    broken.write_text('{"schema_version": 1, "id": "half-writ')
    os.utime(broken, (good.stat().st_mtime + 10, good.stat().st_mtime + 10))
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "1h", "--dry-run"], capsys)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("warning: skipped"))
    assert broken.name in warning and "not valid JSON" in warning and good.stem in warning
    code, _, err = run_main("bench", ["show"], capsys)
    assert code == 0 and broken.name in err


# 5. --------------------------------------------------------------------------------------------
def test_dry_run_exits_like_the_real_run_when_the_plan_does_not_fit(
    calibrated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main("train", ["--data", "sample", "--deadline", "20s", "--epochs", "50", "--dry-run"], capsys)
    assert "plan (balanced)" in out and "DOES NOT fit" in out
    assert_one_line_error(code, err, "options: --epochs", expected_code=3)
    assert not (calibrated_home / "runs").exists()


# 6. --------------------------------------------------------------------------------------------
def test_one_estimate_error_convention_positive_means_it_took_longer() -> None:
    from benchtrain.train.planning.plan_text import describe_outcome

    assert estimate_error_pct(60.0, 75.0) == pytest.approx(25.0)
    assert estimate_error_pct(66.9, 53.2) < 0
    assert describe_estimate_error(25.0) == "+25.0% (took longer than estimated)"
    assert describe_estimate_error(-20.0) == "-20.0% (took less time than estimated)"
    # Three steps predicted at 15 s each, run at 20 s each; overheads planned at 15 s, all of which happened.
    overheads = {
        "model_build_seconds": 10.0,
        "warmup_seconds": 0.0,
        "checkpoint_seconds": 2.5,
        "checkpoint_count": 1,
        "export_seconds": 2.5,
    }
    record = {
        "run_id": "r",
        "plan": {"optimizer_steps": 3},
        "actual": {
            "status": "completed",
            "steps": 3,
            "final_loss": 1.0,
            "total_seconds": 75.0,
            "checkpoint_seconds": [2.0],
        },
        "estimate": {"total_seconds": 60.0, "train_seconds": 45.0, "steps": 3, "overheads": overheads},
        "losses": [{"step": step, "seconds": 20.0, "predicted_seconds": 15.0, "tokens": 100} for step in (1, 2, 3)],
        "final": {"path": "final"},
        "deadline_seconds": 300,
        "met_deadline": True,
    }
    text = "\n".join(describe_outcome(record, Path("."), None))
    assert "1m15s actual vs 1m00s estimated" in text and "+25.0% (took longer" in text
    assert "(25.0% lower throughput)" in text  # 15 s → 20 s a step: 25% fewer tokens per second


# 7. --------------------------------------------------------------------------------------------
def test_the_probe_bar_under_a_budget_shows_the_budget() -> None:
    from benchtrain.bench.cli import _progress_bar
    from benchtrain.common.progress import BudgetBar

    bar = _progress_bar(72, quiet=False, budget_seconds=150.0)
    assert isinstance(bar, BudgetBar)
    bar.close()
    stream = io.StringIO()
    bar = BudgetBar(150.0, 72, file=stream)
    bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert "/150s of the budget" in text and "probe 1/72" in text
    assert bar.bar.total == 150


# 8. --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module", "argv", "fragment"),
    [
        ("train", ["--data", "sample", "--deadline", "-5m"], "--deadline must be positive, got '-5m'"),
        (
            "train",
            ["--data", "sample", "--deadline", "5m", "--checkpoint-interval", "-1m"],
            "--checkpoint-interval must be positive",
        ),
        ("bench", ["run", "--budget", "-90s"], "--budget must be positive, got '-90s'"),
    ],
)
def test_a_negative_duration_gets_the_duration_error(
    home: Path, capsys: pytest.CaptureFixture[str], module: str, argv: list[str], fragment: str
) -> None:
    code, _, err = run_main(module, argv, capsys)
    assert_one_line_error(code, err, fragment)


# Robust measurement -------------------------------------------------------------------------------
def test_one_disturbed_probe_does_not_drag_the_fit() -> None:
    rows = synthetic_rows(noise=0.01, seed=2)
    disturbed = next(row for row in rows if row["micro_batch_size"] == 2 and row["seq_len"] == 256)
    disturbed["step_seconds"] *= 5  # a burst of other work during this probe
    fit = fit_measurements(rows)
    calibration = Calibration(synthetic_calibration(rows))
    for b, s, a, w in [(1, 128, 1, 0), (4, 512, 2, 2), (8, 256, 1, 0), (2, 512, 2, 2)]:
        config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s)
        assert calibration.throughput.micro_step_seconds(config) == pytest.approx(micro_seconds(config), rel=0.05)
    assert fit["held_out_error"]["p90_abs_pct"] < 10


def test_a_disturbed_probe_is_measured_again_and_combined_by_median() -> None:
    space = SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256))
    victim = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=128)
    calls: dict[StepConfig, int] = {}

    def probe(config: StepConfig, _remaining: float | None) -> dict[str, Any]:
        calls[config] = calls.get(config, 0) + 1
        step = micro_seconds(config) * config.grad_accum
        if config == victim and calls[config] == 1:
            step *= 4
        tokens = config.micro_batch_size * config.seq_len * config.grad_accum
        row = {**config.to_row(), "status": "ok", "step_seconds": step, "tokens_per_second": tokens / step}
        return {**row, "probe_seconds": 0.01, "step_seconds_spread": 0.01}

    result = run_grid(space, probe, Budget(None), reference_every=None)
    row = next(r for r in result.rows if StepConfig.from_row(r) == victim)
    assert calls[victim] == 3 and result.remeasured >= 2
    truth = micro_seconds(StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=128))
    assert row["step_seconds"] == pytest.approx(truth, rel=1e-6)  # median of (4x, 1x, 1x)
    assert len(row["repeats"]) == 3
    assert sum(calls.values()) <= space.size + max(2, space.size // 4)


def test_a_noisy_benchmark_says_so_with_a_cause_and_the_plan_uses_the_central_estimate(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.bench.record import assess_noise
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    rows = synthetic_rows(noise=0.0)
    rng = np.random.default_rng(4)
    for row in rows:  # steps scattered by a busy machine
        row["step_seconds"] *= float(np.exp(rng.normal(0, 0.6)))
        row["tokens_per_second"] = row["micro_batch_size"] * row["seq_len"] * row["grad_accum"] / row["step_seconds"]
        row["step_seconds_spread"] = 0.4
    data = synthetic_calibration(
        rows,
        hardware={**detect_hardware()},
        model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
    )
    data["search"] = {"load_average_before": 3.1, "drift": {"spread_pct": 53.0}}
    data["hardware"]["cpu_cores"] = 2
    noise = assess_noise(data)
    assert noise is not None and noise["held_out_median_pct"] > 15
    assert any("load average 3.1 on 2 cores" in cause for cause in noise["causes"])
    assert any("drift" in cause for cause in noise["causes"]) and any("unsteady" in cause for cause in noise["causes"])
    data["noise"] = noise
    data["warnings"] = [noise["message"]]
    calibration = Calibration(data)
    assert calibration.too_noisy_to_bound
    plan = make_plan(
        calibration,
        tokenized(heavy_tailed(), fmt="text"),
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=64),
    )
    assert plan.chosen.total_seconds_promised == pytest.approx(plan.chosen.total_seconds)
    assert plan.chosen.total_seconds_high - plan.chosen.overheads.total_seconds > 1.5 * plan.chosen.step_seconds
    assert any("too large to promise" in warning for warning in plan.warnings)

    save_calibration(data)
    code, out, err = run_main("bench", ["show"], capsys)
    assert code == 0, err
    assert "likely cause: a busy machine" in out
    code, out, err = run_main("train", ["--data", "sample", "--deadline", "1h", "--dry-run"], capsys)
    assert code == 0 and "central estimate fits" in out
    assert "likely cause: a busy machine" in err and "too large to promise" in err


def test_the_tail_factor_turns_median_probes_into_mean_run_time() -> None:
    rows = synthetic_rows(noise=0.0)
    for row in rows:
        row["step_seconds_mean"] = row["step_seconds"] * 1.1
    calibration = Calibration(synthetic_calibration(rows))
    assert calibration.step_tail_factor == pytest.approx(1.1)
    config = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=256)
    assert calibration.micro_step_seconds(config) == pytest.approx(micro_seconds(config) * 1.1, rel=1e-3)
    assert TRUE_THROUGHPUT["fixed"] > 0


def test_a_fitted_benchmark_on_this_machine_is_stored(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(
        "bench",
        [
            "run",
            "--batch-sizes",
            "1,2",
            "--workers",
            "0",
            "--accum",
            "1,2",
            "--seq-lens",
            "32,64",
            "--max-probe-seconds",
            "0.2",
            "--quiet",
            "--no-report",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    ok = [row for row in data["measurements"] if row["status"] == "ok"]
    # The probe's figure is its median step (before any drift rescaling), the mean kept beside it.
    assert all(
        row.get("step_seconds_raw", row["step_seconds"]) == row["step_seconds_median"]
        for row in ok
        if not row.get("repeats")
    )
    assert all("step_seconds_mean" in row and "position" in row for row in ok)
    assert data["fit"]["step_tail_factor"] >= 1.0
    assert "load_average_before" in data["search"]


# Issue 22: each smaller item a clear line or a fixed label ---------------------------------------
@pytest.mark.parametrize(
    ("module", "argv", "fragment"),
    [
        (
            "train",
            ["--data", "sample", "--deadline", "5m", "--use-calibration", "data.jsonl"],
            "data.jsonl is a data file, not a calibration",
        ),
        ("report", ["missing-run-dir"], "missing-run-dir is neither a run folder nor a calibration"),
        ("report", ["runs/missing-run-dir"], "runs/missing-run-dir is neither a run folder nor a calibration"),
        (
            "train",
            ["--data", "sample", "--dealine", "5m"],
            "required: --deadline (--dealine: did you mean --deadline?)",
        ),
        ("bench", ["run", "--budgett", "5m"], "--budgett: did you mean --budget?"),
    ],
)
def test_mix_ups_get_one_line_that_names_them(
    home: Path, capsys: pytest.CaptureFixture[str], module: str, argv: list[str], fragment: str
) -> None:
    """They said "calibration is not valid JSON", "calibration file does not exist", or printed 20 lines of usage."""
    code, out, err = run_main(module, argv, capsys)
    assert_one_line_error(code, err, fragment)
    assert len(err.strip().splitlines()) == 1 and not out


def test_after_the_demo_the_commands_say_where_its_calibrations_are(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo keeps ./.benchtrain; `report latest` and `train` then found nothing, without a word why."""
    demo = tmp_path / "checkout"
    (demo / ".benchtrain" / "calibrations").mkdir(parents=True)
    (demo / ".benchtrain" / "calibrations" / "cpu-tiny-20260101-000000.json").write_text(
        json.dumps(synthetic_calibration())
    )
    monkeypatch.chdir(demo)
    for module, argv in (("report", ["latest"]), ("train", ["--data", "sample", "--deadline", "5m"])):
        code, _, err = run_main(module, argv, capsys)
        assert_one_line_error(code, err, "export BENCHTRAIN_HOME=$PWD/.benchtrain")


def test_the_calibration_report_shows_no_python_none(home: Path) -> None:
    """CPU probes have no MFU (no peak FLOP/s): the table showed `None`."""
    from benchtrain.reports.calibration_report import write_calibration_report

    rows = synthetic_rows()
    for row in rows:
        row["mfu"] = None
    html = write_calibration_report(save_calibration(synthetic_calibration(rows))).read_text()
    assert "<th>mfu</th>" in html and ">None<" not in html


def test_ctrl_c_reaches_dataloader_workers_and_they_keep_serving(tmp_path: Path) -> None:
    """Ctrl-C goes to every process of the terminal's group: a worker that died of it failed the
    step in flight, and the checkpoint --help promises was never written."""
    import signal

    from benchtrain.train.workload.batching import make_loader

    loader = make_loader(list(range(12)), num_workers=1, pin_memory=False)
    batches = iter(loader)
    assert next(batches) == 0
    for worker in batches._workers:
        os.kill(worker.pid, signal.SIGINT)
    assert [next(batches) for _ in range(11)] == list(range(1, 12))
