"""The GPU's precision path on CPU (issue #39, fault 1): with BENCHTRAIN_CPU_BF16=1 bench and train
run accelerate's bf16 autocast on CPU, as they do on CUDA, and every step of both, before and after
bench switches the loss, runs its matmuls under autocast in bf16. Before the fix, bench's first
loss switch dropped accelerate's autocast wrapper: a full fine-tuning was measured in fp32 and
trained in bf16."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_GRID, assert_one_line_error, run_main

BF16_STEP = {(True, torch.bfloat16)}  # every nn.Linear call: autocast on, a bf16 output
SMALL_GRID = [
    "--batch-sizes",
    "1,2",
    "--workers",
    "0",
    "--accum",
    "1",
    "--seq-lens",
    "32,64",
    "--max-probe-seconds",
    "0.2",
    "--quiet",
]


@pytest.fixture()
def cpu_bf16(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """BENCHTRAIN_CPU_BF16=1. Accelerate keeps one precision per process (the tests before ran
    fp32): its state is reset before, and after for the tests that follow."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("BENCHTRAIN_CPU_BF16", "1")
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


class StepPrecision:
    """For each run of THE step (train.step.step.TrainingStep.run: bench's probes and train's
    steps alike): the command, the loss installed, and (autocast on, output dtype) of every
    nn.Linear call in it, its backward's recomputations included."""

    def __init__(self) -> None:
        self.command = ""
        self.current: set[tuple[bool, torch.dtype]] | None = None
        self.steps: list[tuple[str, str, set[tuple[bool, torch.dtype]]]] = []

    def record(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if self.current is not None and isinstance(module, torch.nn.Linear):
            self.current.add((torch.is_autocast_enabled("cpu"), output.dtype))

    def losses(self, command: str) -> list[str]:
        return [loss for ran, loss, _ in self.steps if ran == command]


@pytest.fixture()
def step_precision(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepPrecision]:
    from benchtrain.train.step.step import TrainingStep
    from benchtrain.train.workload.method import unwrap

    precision = StepPrecision()
    run = TrainingStep.run

    def recorded_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        loss, precision.current = unwrap(self.engine.model)._benchtrain_loss, set()
        try:
            return run(self, *args, **kwargs)
        finally:
            precision.steps.append((precision.command, loss, precision.current))
            precision.current = None

    monkeypatch.setattr(TrainingStep, "run", recorded_run)
    handle = torch.nn.modules.module.register_module_forward_hook(precision.record)
    yield precision
    handle.remove()


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_bf16")
@pytest.mark.parametrize("method", [[], ["--lora", "--lora-rank", "8"]], ids=["full", "lora"])
def test_bench_and_train_run_every_step_in_bf16_before_and_after_a_loss_switch(
    home: Path, step_precision: StepPrecision, capsys: pytest.CaptureFixture[str], method: list[str]
) -> None:
    step_precision.command = "bench"
    code, _, err = run_main("bench", ["run", "--gpu", "cpu", *method, *SMALL_GRID, "--no-report"], capsys)
    assert code == 0, err
    calibration = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert calibration["training"]["precision"] == "bf16"
    assert calibration["loss_choice"]["chosen"] == calibration["training"]["loss"]  # the losses were compared

    step_precision.command = "train"
    train_args = [
        "--data",
        "sample",
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        *method,
        "--max-steps",
        "3",
        "--no-report",
    ]
    code, _, err = run_main("train", train_args, capsys)
    assert code == 0, err
    run_dir = next((home / "runs").glob("*/run.json")).parent
    record = json.loads((run_dir / "run.json").read_text())
    assert record["training"]["precision"] == "bf16" and record["training"]["loss"] == calibration["training"]["loss"]
    assert (run_dir / "final" / ("adapter_config.json" if method else "config.json")).is_file()

    bench_losses = step_precision.losses("bench")
    switches = sum(before != after for before, after in itertools.pairwise(bench_losses))
    assert set(bench_losses) == {"chunked", "plain"} and switches >= 2, bench_losses  # chunked, plain, chunked, …
    assert len(step_precision.losses("train")) >= 3
    off = [
        (index, command, loss, seen)
        for index, (command, loss, seen) in enumerate(step_precision.steps)
        if seen != BF16_STEP
    ]
    assert not off, f"{len(off)} of {len(step_precision.steps)} steps ran outside bf16 autocast, the first: {off[:3]}"


@pytest.mark.usefixtures("cpu_bf16")
def test_the_engine_records_bf16_on_cpu_when_asked() -> None:
    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    engine = engine_from_options(resolve_model("tiny"), MethodConfig(), make_accelerator(), StepOptions())
    assert engine.accelerator.device.type == "cpu" and engine.record()["precision"] == "bf16"


def test_a_bad_cpu_bf16_value_is_one_line(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BENCHTRAIN_CPU_BF16", "maybe")
    code, _, err = run_main("bench", ["run", "--gpu", "cpu", *TINY_GRID, "--no-report"], capsys)
    assert_one_line_error(code, err, "BENCHTRAIN_CPU_BF16='maybe'")


def test_a_calibration_of_another_precision_is_refused_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 calibration planning an fp32 run (or the reverse) would be off by the precision's
    factor in speed and activation memory: refused in one line, warned with --force; calibrations
    that predate the record are planned as before."""
    from types import SimpleNamespace

    from benchtrain.calibration.hardware import Hardware
    from benchtrain.calibration.training import Training
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.recipes.choice import check_compatible
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model("tiny")
    hardware = Hardware.from_record({"name": "Test CPU", "device_type": "cpu"})

    def calibration(**training: Any) -> Any:
        return SimpleNamespace(
            id="cal",
            training=Training.from_record({"method": "full", **training}),
            model={"name": "tiny", "fingerprint": spec.fingerprint},
            hardware=hardware,
        )

    monkeypatch.delenv("BENCHTRAIN_CPU_BF16", raising=False)
    with pytest.raises(
        BenchtrainError, match=r"^calibration cal measured a bf16 step, this run would train in fp32 .*or pass --force$"
    ):
        check_compatible(calibration(precision="bf16"), spec, hardware, False, MethodConfig())
    assert (
        "measured a bf16 step"
        in check_compatible(calibration(precision="bf16"), spec, hardware, True, MethodConfig())[0]
    )
    assert check_compatible(calibration(precision="fp32"), spec, hardware, False, MethodConfig()) == []
    assert check_compatible(calibration(), spec, hardware, False, MethodConfig()) == []
    monkeypatch.setenv("BENCHTRAIN_CPU_BF16", "1")
    assert check_compatible(calibration(precision="bf16"), spec, hardware, False, MethodConfig()) == []
    with pytest.raises(BenchtrainError, match="measured a fp32 step, this run would train in bf16"):
        check_compatible(calibration(precision="fp32"), spec, hardware, False, MethodConfig())
