"""Adding an optimizer is one entry in train/workload/optimizers.py's OPTIMIZERS (issue 42): an
entry registered there alone (torch's Adagrad, here) is a choice of `train` and `bench run`, its
state is counted by the memory check, run.json names it as HF Trainer does, and the engine builds
it; and no other module names an optimizer."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from benchtrain.calibration.hardware import Hardware
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.optimizers import OPTIMIZERS, Optimizer

ROOT = Path(__file__).resolve().parents[1]
FP32_BYTES = 4


def adagrad(groups: list[dict[str, Any]], learning_rate: float, betas: tuple[float, float], eps: float) -> Any:
    import torch

    return torch.optim.Adagrad(groups, lr=learning_rate, eps=eps)


def adagrad_state_bytes(trainable_sizes: list[int]) -> int:
    """One fp32 sum of squared gradients per value (the step count is a scalar)."""
    return sum(trainable_sizes) * FP32_BYTES


@pytest.fixture()
def with_adagrad(monkeypatch: pytest.MonkeyPatch) -> Optimizer:
    """The whole change: one entry in the table, nothing else touched."""
    entry = Optimizer(
        name="adagrad",
        build=adagrad,
        state_bytes=adagrad_state_bytes,
        hf_optim="adagrad",
        help="one fp32 sum of squares",
    )
    monkeypatch.setitem(OPTIMIZERS, entry.name, entry)
    return entry


def test_the_argument_parsers_offer_it(with_adagrad: Optimizer) -> None:
    from benchtrain.train.cli import build_parser
    from benchtrain.train.workload.method import measured_methods, method_from_args

    parser = build_parser()
    assert "adagrad (one fp32 sum of squares)" in " ".join(parser.format_help().split())  # `train --help`
    args = parser.parse_args(["--data", "sample", "--deadline", "1h", "--optimizer", "adagrad"])
    assert method_from_args(args).optimizer == "adagrad"
    # bench run
    assert [method.optimizer for method in measured_methods(None, "adamw,adagrad", MethodConfig())] == [
        "adamw",
        "adagrad",
    ]
    with pytest.raises(
        BenchtrainError,
        match=r"^--optimizer must be one of adamw, adamw-8bit, paged-adamw-8bit, adamw-fused, sgd, adagrad, got 'lion'$",
    ):
        MethodConfig(optimizer="lion")


def test_the_memory_check_counts_its_state_and_the_engine_builds_it(with_adagrad: Optimizer) -> None:
    import torch
    from helpers import PEAK, batches, tiny_engine

    from benchtrain.train.planning.memory_check import describe_needs, memory_need
    from benchtrain.train.step.hyperparameters import OptimizerSettings
    from benchtrain.train.workload.model import resolve_model

    engine = tiny_engine(OptimizerSettings(weight_decay=0.05), optimizer="adagrad")
    inner = engine.optimizer.optimizer  # accelerate's wrapper around torch's
    assert isinstance(inner, torch.optim.Adagrad)
    decay, no_decay = inner.param_groups
    # the peak rate: the warm-up starts at 0
    assert decay["initial_lr"] == PEAK and decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    source = batches(1)
    engine.step.run(source, 1)
    kept = sum(
        value.numel() * value.element_size()
        for state in inner.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    spec = resolve_model("tiny")
    need = memory_need(spec, MethodConfig(optimizer="adagrad"), "cpu").optimizer_bytes
    assert need == kept > 0
    hardware = Hardware.from_record({"device_type": "cpu", "name": "cpu", "memory_bytes": 2**34})
    line = describe_needs(spec, MethodConfig(optimizer="adagrad"), hardware)  # the dry run's line
    assert f", {need / 2**20:.3g} MiB with adagrad (this run: adagrad);" in line, line
    assert "MiB with adamw or adamw-fused, " in line and "MiB with adamw-8bit or paged-adamw-8bit, " in line


def test_run_json_names_it_as_hf_trainer_does(with_adagrad: Optimizer) -> None:
    from benchtrain.train.step.hyperparameters import OptimizerSettings

    assert OptimizerSettings().record(1e-3, "adagrad", 10)["optim"] == "adagrad"
    assert OptimizerSettings().record(1e-3, "paged-adamw-8bit", 10)["optim"] == "paged_adamw_8bit"


def named_optimizers(path: Path) -> list[str]:
    """`path:line "name"` for each string in the module's code (docstrings and help aside: they
    are read, not run) that is exactly the name of an optimizer other than the default."""
    names = set(OPTIMIZERS) - {"adamw"}  # "adamw": what a run.json from before the choice trained with
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    return found


def test_no_module_but_the_table_names_an_optimizer() -> None:
    modules = [
        path
        for package in ("bench", "train", "calibration", "reports", "common")
        for path in sorted((ROOT / "benchtrain" / package).rglob("*.py"))
    ]
    table = ROOT / "benchtrain" / "train" / "workload" / "optimizers.py"
    assert [name for path in modules if path != table for name in named_optimizers(path)] == []
    assert named_optimizers(table)  # the check sees names where they are


def test_the_dry_run_s_state_line_needs_no_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8-bit optimizers' state is arithmetic: said without bitsandbytes installed (it was an
    error: "--optimizer adamw-8bit needs bitsandbytes", for a run that asked for adamw)."""
    from helpers import hide_bitsandbytes

    from benchtrain.train.planning.memory_check import describe_needs
    from benchtrain.train.workload.model import resolve_model

    hide_bitsandbytes(monkeypatch)
    line = describe_needs(
        resolve_model("tiny"),
        MethodConfig(),
        Hardware.from_record({"device_type": "cpu", "name": "cpu", "memory_bytes": 2**34}),
    )
    assert (
        "MiB with adamw or adamw-fused, " in line
        and "MiB with adamw-8bit or paged-adamw-8bit, " in line
        and "(this run: adamw);" in line
    )
    assert "8-bit base" not in line  # the quantized bases do need it
