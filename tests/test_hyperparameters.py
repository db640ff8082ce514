"""The hyper-parameters under HF Trainer's names (issue 34): each schedule's learning rate against
its formula, the warm-up, weight decay, betas, epsilon and clipping reaching the optimizer and the
step, SGD and fused AdamW as optimizers (their state bytes in the memory model, measured by bench
as setups of their own), one-line errors, run.json's `hyperparameters` and a resume that keeps them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import PEAK, assert_one_line_error, batches, pretend_interrupted, run_main, tiny_engine

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.hyperparameters import HF_KEYS, SCHEDULER_CHOICES, OptimizerSettings, make_optimizer
from benchtrain.train.workload.method import MethodConfig


def rates(settings: OptimizerSettings, total: int) -> list[float]:
    """The learning rate each of `total` optimizer steps trains at under `settings`' schedule."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = settings.scheduler(optimizer, total)
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def expected(kind: str, step: int, warmup: int, total: int) -> float:
    """HF's formulas: a linear warm-up from 0, then the shape (transformers.optimization)."""
    if kind == "constant":
        return PEAK
    if step < warmup:
        return PEAK * step / warmup
    if kind == "constant_with_warmup":
        return PEAK
    progress = (step - warmup) / (total - warmup)
    if kind == "linear":
        return PEAK * (1 - progress)
    return PEAK * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", SCHEDULER_CHOICES)
def test_each_schedule_warms_up_then_follows_its_formula(kind: str) -> None:
    total, warmup = 20, 4
    got = rates(OptimizerSettings(lr_scheduler_type=kind, warmup_steps=warmup), total)
    assert got == pytest.approx([expected(kind, step, warmup, total) for step in range(total)], abs=1e-12)
    if kind == "constant":
        assert got == [PEAK] * total  # no warm-up, as in transformers
    else:
        assert got[0] == 0.0 and got[warmup] == pytest.approx(PEAK)


def test_the_default_is_the_schedule_runs_had_before() -> None:
    """5% warm-up (at least one step), then cosine to zero."""

    total = 40
    assert OptimizerSettings().warmup_for(total) == 2
    assert OptimizerSettings().warmup_for(10) == 1
    assert rates(OptimizerSettings(), total) == pytest.approx(
        [expected("cosine", step, 2, total) for step in range(total)], abs=1e-12
    )
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = OptimizerSettings().scheduler(optimizer, total)
    before = []
    for _ in range(total):
        before.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert before == rates(OptimizerSettings(), total)


def test_warmup_steps_override_the_ratio() -> None:
    assert OptimizerSettings(warmup_ratio=0.5).warmup_for(100) == 50
    assert OptimizerSettings(warmup_ratio=0.5, warmup_steps=3).warmup_for(100) == 3
    assert OptimizerSettings(warmup_ratio=0.0).warmup_for(100) == 0
    assert OptimizerSettings(warmup_steps=0).warmup_for(100) == 0
    assert OptimizerSettings(lr_scheduler_type="constant", warmup_steps=7).warmup_for(100) == 0
    got = rates(OptimizerSettings(lr_scheduler_type="linear", warmup_ratio=0.5, warmup_steps=2), 10)
    assert got == pytest.approx([expected("linear", step, 2, 10) for step in range(10)], abs=1e-12)


def norms_before_each_update(engine, steps: int) -> list[float]:
    """The gradients' global norm the optimizer step sees (after clipping), at each of `steps` steps."""
    import torch

    optimizer = engine.optimizer
    original, seen = optimizer.step, []

    def step(*args, **kwargs):
        grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return original(*args, **kwargs)

    optimizer.step = step
    source = batches(steps)
    for _ in range(steps):
        engine.step.run(source, 1)
    return seen


def test_weight_decay_betas_epsilon_and_clipping_reach_the_optimizer_and_the_step() -> None:
    settings = OptimizerSettings(
        weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, max_grad_norm=1e-3
    )
    engine = tiny_engine(settings)
    decay, no_decay = engine.optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.99) and decay["eps"] == 1e-6 and decay["fused"] is True
    assert engine.step.max_grad_norm == 1e-3
    clipped = norms_before_each_update(engine, 3)
    assert all(norm <= 1e-3 * 1.0001 for norm in clipped), clipped
    # No clipping with 0: the same model's gradients are far larger than that bound.
    unclipped = norms_before_each_update(tiny_engine(OptimizerSettings(max_grad_norm=0.0)), 3)
    assert all(norm > 1e-2 for norm in unclipped), unclipped


def test_the_engine_follows_the_schedule_asked_for() -> None:
    engine = tiny_engine(OptimizerSettings(lr_scheduler_type="linear", warmup_steps=1), total_steps=4)
    source = batches(4)
    got = [engine.step.run(source, 1).learning_rate for _ in range(4)]
    assert got == pytest.approx([expected("linear", step, 1, 4) for step in range(4)], abs=1e-12)


def test_sgd_builds_with_momentum_and_its_state_is_the_bytes_the_plan_counts() -> None:
    import torch

    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.model import resolve_model
    from benchtrain.train.workload.optimizers import SGD_MOMENTUM, optimizer_state_bytes

    engine = tiny_engine(OptimizerSettings(weight_decay=0.05), optimizer="sgd")
    inner = engine.optimizer.optimizer  # accelerate's wrapper around torch's
    assert isinstance(inner, torch.optim.SGD)
    decay, no_decay = inner.param_groups
    assert decay["momentum"] == SGD_MOMENTUM and decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    source = batches(2)
    losses = [engine.step.run(source, 1).loss for _ in range(2)]
    assert all(math.isfinite(loss) for loss in losses)
    state_bytes = sum(
        value.numel() * value.element_size()
        for state in inner.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
    spec = resolve_model("tiny")
    need = memory_need(spec, MethodConfig(optimizer="sgd"), "cpu").optimizer_bytes
    assert need == state_bytes
    assert need * 2 == memory_need(spec, MethodConfig(), "cpu").optimizer_bytes
    assert optimizer_state_bytes("sgd", [10, 4096]) == 4 * 4106
    assert optimizer_state_bytes("adamw-fused", [10, 4096]) == optimizer_state_bytes("adamw", [10, 4096]) == 8 * 4106


def test_fused_adamw_builds_where_torch_has_it_and_is_one_line_where_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from benchtrain.train.workload import optimizers

    if "cpu" not in optimizers.fused_devices():
        pytest.skip(f"torch {torch.__version__} has no fused AdamW on CPU")
    engine = tiny_engine(OptimizerSettings(), optimizer="adamw-fused")
    assert (
        isinstance(engine.optimizer.optimizer, torch.optim.AdamW) and engine.optimizer.param_groups[0]["fused"] is True
    )
    source = batches(2)
    assert all(math.isfinite(engine.step.run(source, 1).loss) for _ in range(2))

    monkeypatch.setattr(optimizers, "fused_devices", lambda: ["cuda"])
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        BenchtrainError, match=r"^--optimizer adamw-fused: torch .* has no fused AdamW for cpu; use --optimizer adamw$"
    ):
        make_optimizer(model, PEAK, "adamw-fused")
    fallback = make_optimizer(model, PEAK, "adamw")  # adamw falls back, and says so
    assert not fallback.param_groups[0]["fused"]
    assert "warning: torch has no fused AdamW for this device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--warmup-ratio", "1", "--warmup-ratio must be a fraction in [0, 1), got 1.0"),
        ("--warmup-ratio", "-0.1", "--warmup-ratio must be a fraction in [0, 1)"),
        ("--warmup-steps", "-3", "--warmup-steps must be 0 or more, got -3"),
        ("--weight-decay", "-0.01", "--weight-decay must be 0 or more"),
        ("--max-grad-norm", "-1", "--max-grad-norm must be 0 or more"),
        ("--max-grad-norm", "nan", "--max-grad-norm must be 0 or more"),
        ("--adam-beta1", "1.0", "--adam-beta1 must be in [0, 1), got 1.0"),
        ("--adam-beta2", "-0.5", "--adam-beta2 must be in [0, 1)"),
        ("--adam-epsilon", "0", "--adam-epsilon must be positive"),
        ("--lr-scheduler-type", "cosine_with_restarts", "--lr-scheduler-type"),
        ("--optimizer", "lion", "--optimizer"),
    ],
)
def test_a_bad_hyperparameter_is_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, fragment: str
) -> None:
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "5m", "--dry-run", option, value], capsys)
    assert_one_line_error(code, err, fragment)


def test_run_json_records_the_hyperparameters_and_a_resume_keeps_them(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    common = [
        "--data",
        str(heavy_tailed_jsonl),
        "--effective-batch",
        "4",
        "--max-length",
        "64",
        "--workers",
        "0",
        "--out",
        str(out),
        "--no-report",
    ]
    named = [
        "--lr-scheduler-type",
        "linear",
        "--warmup-steps",
        "1",
        "--weight-decay",
        "0.01",
        "--max-grad-norm",
        "0.5",
        "--adam-beta2",
        "0.99",
    ]
    code, _, err = run_main(
        "train", [*common, "--deadline", "30m", "--max-steps", "2", "--learning-rate", "2e-4", *named], capsys
    )
    assert code == 0, err
    record = json.loads((out / "run.json").read_text())
    hyperparameters = record["hyperparameters"]
    assert tuple(hyperparameters) == HF_KEYS
    assert hyperparameters == {
        "learning_rate": 2e-4,
        "lr_scheduler_type": "linear",
        "warmup_ratio": 0.05,
        "warmup_steps": 1,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,
        "adam_beta1": 0.9,
        "adam_beta2": 0.99,
        "adam_epsilon": 1e-8,
        "optim": "adamw_torch_fused",
    }
    # The steps trained at the linear schedule's rates: warm-up over one step, then down to 0 at step 2.
    assert [entry["learning_rate"] for entry in record["losses"]] == pytest.approx([0.0, 2e-4])
    run_id = record["run_id"]

    pretend_interrupted(out, 6)
    resume = [*common, "--deadline", "30m", "--max-steps", "3", "--resume"]
    code, _, err = run_main("train", [*resume, "--dry-run", "--learning-rate", "3e-4"], capsys)
    assert_one_line_error(
        code,
        err,
        f"--resume: run {run_id} trained with --learning-rate 0.0002, this command asks for 0.0003: repeat the run's",
    )
    # Not given, the run's own rate (2e-4, not the default): the resume below trains with it.
    code, _, err = run_main("train", [*resume, "--dry-run", "--weight-decay", "0.1"], capsys)
    assert_one_line_error(
        code, err, f"--resume: run {run_id} trained with --weight-decay 0.01, this command asks for 0.1"
    )
    assert "or pass --force" in err
    code, _, err = run_main("train", [*resume, "--dry-run", "--lr-scheduler-type", "cosine"], capsys)
    assert_one_line_error(code, err, "trained with --lr-scheduler-type linear, this command asks for cosine")
    code, _, err = run_main("train", [*resume, "--dry-run", "--weight-decay", "0.1", "--force"], capsys)
    assert code == 0, err
    assert "warning: --resume: run" in err and "--weight-decay 0.01" in err

    # Not named: the run's own (the learning rate too), kept in run.json; named the same: accepted.
    code, _, err = run_main("train", [*resume, "--weight-decay", "0.01"], capsys)
    assert code == 0, err
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["hyperparameters"] == hyperparameters
    assert resumed["config"]["hyperparameters"]["lr_scheduler_type"] == "linear"


def test_a_run_from_before_the_section_resumes_with_the_defaults() -> None:
    from benchtrain.calibration.run_file import ResumedRun
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.running.resume import resumed_hyperparameters

    # What a resume reads of it (the epochs and configuration the read requires, as such a run had).
    row = StepConfig(1, 0, 1, 64).to_row()
    previous = ResumedRun.of(
        {"run_id": "old", "plan": {"optimizer_steps": 40, "epochs": 1.0, "configuration": dict(row)}}, "run.json"
    )
    kept = resumed_hyperparameters(previous, {"learning_rate": 3e-4}, force=False)
    assert OptimizerSettings(**kept).record(PEAK, "adamw", 40) == OptimizerSettings().record(PEAK, "adamw", 40)
    with pytest.raises(
        BenchtrainError,
        match=r"^--resume: run old trained with --max-grad-norm 1.0, this command asks for 0.0: drop it",
    ):
        resumed_hyperparameters(previous, {"max_grad_norm": 0.0}, force=False)
    # The same warm-up asked another way is the same schedule.
    assert resumed_hyperparameters(previous, {"warmup_steps": 2}, force=False) == kept


@pytest.mark.slow
def test_bench_measures_sgd_and_fused_adamw_as_setups_of_their_own(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.schema import read_calibration_file

    grid = [
        "--gpu",
        "cpu",
        "--batch-sizes",
        "1,2,4",
        "--seq-lens",
        "32,64",
        "--workers",
        "0",
        "--accum",
        "1",
        "--loss",
        "plain",
        "--budget",
        "5m",  # a cap, not a target: the grid takes seconds, and a busy machine must not cut it short
        "--quiet",
        "--no-report",
    ]
    code, printed, err = run_main("bench", ["run", "--optimizer", "sgd,adamw-fused", *grid], capsys)
    assert code == 0, err
    (path,) = (home / "calibrations").glob("*.json")
    calibration = Calibration(read_calibration_file(path), path)
    sgd, fused = calibration.variants()
    assert sgd.variant == ("none", "sgd") and fused.variant == ("none", "adamw-fused")
    assert len(sgd.ok_rows()) >= 3 and len(fused.ok_rows()) >= 3 and sgd.fit != fused.fit
    assert "variant 1:" in printed and "adamw-fused" in printed
    out = home / "run"
    code, printed, err = run_main(
        "train",
        [
            "--optimizer",
            "sgd",
            "--data",
            "sample",
            "--deadline",
            "5m",
            "--max-steps",
            "2",
            "--out",
            str(out),
            "--no-report",
        ],
        capsys,
    )
    assert code == 0, err
    record = json.loads((out / "run.json").read_text())
    assert record["plan"]["optimizer"] == "sgd" and record["hyperparameters"]["optim"] == "sgd"
