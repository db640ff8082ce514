"""The variants (calibration.setup.Variant) one calibration may measure side by side for a model and
method: the base's quantization × the optimizer (`bench run --quantize none,4bit --optimizer
adamw,adamw-8bit`), each probed, fitted and stored in one calibration (calibration.schema.variant_data),
and chosen among by the planner (train.recipes.choice)."""

from __future__ import annotations

from calibration.setup import Variant
from common.errors import BenchtrainError
from train.workload.method import MethodConfig
from train.workload.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS
from train.workload.quantize import QUANTIZE_CHOICES


def parse_choices(text: str | None, choices: tuple[str, ...], option: str, default: str) -> list[str]:
    """`none,4bit` → ["none", "4bit"], each one of `choices`, in the order given, once."""
    values = [part.strip() for part in (text or default).split(",") if part.strip()] or [default]
    unknown = [value for value in values if value not in choices]
    if unknown:
        raise BenchtrainError(f"{option}: {', '.join(unknown)} is not one of {', '.join(choices)}")
    return list(dict.fromkeys(values))


def measured_methods(quantize: str | None, optimizer: str | None, method: MethodConfig) -> list[MethodConfig]:
    """`method` with every variant bench is asked to measure, the first listed first."""
    quantizations = parse_choices(quantize, QUANTIZE_CHOICES, "--quantize", "none")
    optimizers = parse_choices(optimizer, tuple(OPTIMIZERS), "--optimizer", DEFAULT_OPTIMIZER)
    return [method.with_variant(Variant(q, o)) for q in quantizations for o in optimizers]
