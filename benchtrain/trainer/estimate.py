"""The estimate the callback makes once, at the start of a Trainer's run, and holds the run to: the
step time it expects — the calibration's prediction for this device, model and method at the
batches' real shape, or else the steps measured after the warm-up — its bound, the tokens of an
optimizer step, and the finish it projects against the deadline."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchtrain.bench.disk_write import disk_bandwidth
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import checkpoint_save_seconds
from benchtrain.train.running.checkpoint import checkpoint_bytes
from benchtrain.train.workload.model import ModelSpec

CALIBRATED, MEASURED = "calibration", "measured"
ADAM_MOMENTS = 2  # fp32 tensors AdamW keeps per trainable parameter


@dataclass(frozen=True)
class RunEstimate:
    basis: str  # CALIBRATED | MEASURED
    source: str  # which calibration, or which steps were measured
    config: StepConfig  # the Trainer's step: its micro-batch, accumulation, workers, padded length
    world_size: int
    step_seconds: float  # one optimizer step, expected
    bound_fraction: float  # relative bound on step_seconds
    tokens_per_step: float  # real tokens per optimizer step, every process
    padded_tokens_per_step: float
    start_step: int  # where this command started (a resumed run: its checkpoint's step)
    planned_at_step: int  # the step at whose end the estimate was made
    planned_at_seconds: float  # elapsed since the run's start then
    total_steps: int  # the Trainer's max_steps
    save_seconds: float  # one save, expected (0: not known until the first is measured)
    save_count: int  # the saves the Trainer's save_strategy asks for, the last one included

    @property
    def remaining_steps(self) -> int:
        return max(0, self.total_steps - self.planned_at_step)

    @property
    def finish_seconds(self) -> float:
        """Projected finish, from the run's start: the steps left and the saves to come."""
        return self.planned_at_seconds + self.remaining_steps * self.step_seconds + self.save_count * self.save_seconds

    def finish_bounds(self) -> tuple[float, float]:
        train = self.remaining_steps * self.step_seconds
        rest = self.finish_seconds - train
        return rest + train / (1 + self.bound_fraction), rest + train * (1 + self.bound_fraction)

    def describe(self, deadline: Deadline) -> str:
        low, high = self.finish_bounds()
        budget = deadline.budget_seconds
        return (
            f"{self.tokens_per_step:,.0f} real tokens per optimizer step ({self.padded_tokens_per_step:,.0f} computed, padding included) "
            f"on {self.world_size} process{'es' if self.world_size != 1 else ''}; step {self.step_seconds:.3g}s from {self.source}; "
            f"{self.total_steps:,} steps finish at {format_duration(self.finish_seconds)} ({format_duration(low)}–{format_duration(high)}) "
            f"of a {format_duration(budget)} budget ({format_duration(deadline.deadline_seconds)} deadline less its margin)"
        )

    def to_json(self) -> JsonDict:
        """run.json's `estimate` section (its keys as calibration.accuracy and reports/ read them)."""
        low, high = self.finish_bounds()
        steps = max(0, self.total_steps - self.start_step)
        train = steps * self.step_seconds
        tokens = steps * self.tokens_per_step
        speed = self.tokens_per_step / self.step_seconds if self.step_seconds else 0.0
        return {
            "basis": self.basis,
            "source": self.source,
            "total_seconds": self.finish_seconds,
            "total_seconds_low": low,
            "total_seconds_high": high,
            "train_seconds": train,
            "overhead_seconds": self.finish_seconds - train,
            "steps": steps,
            "start_step": self.start_step,
            "tokens": int(tokens),
            "padded_tokens": int(steps * self.padded_tokens_per_step),
            "tokens_per_second": speed,
            "tokens_per_second_low": speed / (1 + self.bound_fraction),
            "tokens_per_second_high": speed * (1 + self.bound_fraction),
            "bound_fraction": self.bound_fraction,
            "step_seconds": self.step_seconds,
            "overheads": {
                # Warm-up: what the steps before the estimate took beyond its step time (measured).
                "warmup_seconds": max(
                    0.0, self.planned_at_seconds - (self.planned_at_step - self.start_step) * self.step_seconds
                ),
                "checkpoint_seconds": self.save_seconds,
                "checkpoint_count": self.save_count,
            },
            "projected_finish_seconds": self.finish_seconds,
        }


def measured_step(seconds: list[float]) -> tuple[float, float]:
    """(mean step time, relative bound) of the measured steady steps: the bound is their widest
    relative distance from the mean, as the steps showed it."""
    mean = sum(seconds) / len(seconds)
    spread = max(abs(value - mean) for value in seconds) / mean if mean > 0 else 0.0
    return mean, spread


def calibrated_step(calibration: Calibration, config: StepConfig) -> tuple[float, float]:
    """(step seconds, relative bound) the calibration predicts for the Trainer's step."""
    prediction = calibration.predict(config)
    return prediction.step_seconds, calibration.relative_bound_for(config)


def calibrated_save_seconds(calibration: Calibration | None) -> float:
    """One checkpoint save as the calibration measured it on this device (0: none measured)."""
    return checkpoint_save_seconds(calibration.overheads) if calibration is not None and calibration.overheads else 0.0


def model_setup(model: Any) -> tuple[ModelSpec, str]:
    """The user's model as benchtrain names it — its spec (whose fingerprint calibrations are keyed
    by) — and its method: LoRA for a peft model, else full fine-tuning."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict()
    name = (
        str(getattr(base.config, "name_or_path", "") or config.get("model_type", "model")).rstrip("/").split("/")[-1]
        or "model"
    )
    return ModelSpec(name, config), "lora" if hasattr(model, "peft_config") else "full"


def trainer_precision(args: Any) -> str:
    """The precision of the Trainer's step, as calibrations record it."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def check_calibration(
    calibration: Calibration, spec: ModelSpec, method: str, hardware: Hardware, precision: str
) -> None:
    """A calibration of another model, method, precision or device is refused in one line."""
    measured = calibration.setup
    if measured.model_fingerprint != spec.fingerprint:
        raise BenchtrainError(
            f"calibration {calibration.id} was measured for model {measured.model_name}, not this Trainer's {spec.name}: "
            f"run `bench run --model DIR` with this model's folder, or leave calibration= out (the first steps are measured instead)"
        )
    measured_method = calibration.training.method
    if measured_method != method:
        raise BenchtrainError(
            f"calibration {calibration.id} measured {measured_method} fine-tuning, this Trainer trains {method}: pick one of {method}"
        )
    measured_precision = calibration.training.precision  # calibrations before issue 39 did not record it
    if measured_precision and measured_precision != precision:
        raise BenchtrainError(
            f"calibration {calibration.id} measured a {measured_precision} step, this Trainer trains in {precision}: "
            f"set {'bf16=True' if measured_precision == 'bf16' else 'bf16=False'} in its arguments, or leave calibration= out"
        )
    if calibration.hardware.name != hardware.name:
        raise BenchtrainError(
            f"calibration {calibration.id} was measured on {calibration.hardware.name}, this is {hardware.name}: "
            "measure here with `bench run`, or leave calibration= out"
        )


def first_save_seconds(model: Any, folder: Path) -> float:
    """One checkpoint save before any was timed: its bytes (the weights, and Adam's two moments of
    each trainable parameter) at this disk's write speed, measured with a short fsync'd write."""
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    size = checkpoint_bytes(model, ADAM_MOMENTS * 4 * trainable)
    folder.mkdir(parents=True, exist_ok=True)
    return size / disk_bandwidth(folder)


def save_count(args: Any, max_steps: int, start_step: int) -> int:
    """The saves the Trainer's save_strategy makes in the steps left (the last step's included)."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "steps" and args.save_steps:
        every = args.save_steps if args.save_steps >= 1 else max(1, math.ceil(args.save_steps * max_steps))
        return max_steps // int(every) - start_step // int(every) + (1 if max_steps % int(every) else 0)
    return 0
