"""The peak-memory model: what a training step holds at its highest point (a linear form, and
max(optimizer floor, linear)), fitted to the probes' reserved or allocated peak.
The model and why: docs/design.md#peak-memory-fit"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from benchtrain.calibration.comm import gradient_bytes
from benchtrain.calibration.dimensions import scaled, switches
from benchtrain.calibration.fit_tools import ErrorSummary, fit_nonnegative, held_out_predictions, is_number
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict

# A row's memory fields: the allocated peak (CUDA) or peak RSS (CPU); on CUDA also reserved, device-used and outside the allocator.
CUDA_MEMORY_FIELDS = ("peak_reserved_bytes", "device_used_bytes", "non_torch_bytes")
MEMORY_FIELDS = ("peak_memory_bytes", *CUDA_MEMORY_FIELDS)
BASES = ("allocated", "reserved")


def linear_terms() -> tuple[str, ...]:
    """The linear form's terms: static, activations (plain, then each switch's that replace them), each switch's own, accumulated gradients."""
    replacing = [name for dimension in switches() if dimension.activations for name in dimension.activations]
    own = [term.name for dimension in switches() for term in dimension.memory]
    return ("static", "per_token", "attention", *replacing, *own, "accumulated_gradients")


def memory_terms() -> tuple[str, ...]:
    return (*linear_terms(), "optimizer_floor")


MIN_ROWS_FOR_FLOOR = 6  # the floor form's kink needs a few probes on each side of it


def memory_features(config: StepConfig) -> np.ndarray:
    """The linear form's features, in linear_terms() order (activations as plainly kept, or as the switch on keeps them)."""
    tokens, length = config.micro_batch_size * config.seq_len, config.seq_len
    activations = [(dimension.name, config.on(dimension.name)) for dimension in switches() if dimension.activations]
    kept = 0.0 if any(on for _, on in activations) else 1.0
    replaced = [value * float(on) for _, on in activations for value in (tokens, tokens * length)]
    own = [
        scaled(term.scale, tokens, length) if config.on(dimension.name) else 0.0
        for dimension in switches()
        for term in dimension.memory
    ]
    accumulating = 1.0 if config.grad_accum > 1 else 0.0
    return np.array([1.0, kept * tokens, kept * tokens * length, *replaced, *own, accumulating])


@dataclass
class MemoryModel:
    coefficients: dict[str, float]
    basis: str = "allocated"  # what the coefficients were fitted to (BASES)
    non_torch_bytes: float = 0.0  # held outside PyTorch's allocator, added to every peak

    def peak_bytes(self, config: StepConfig) -> float:
        """The device bytes a step needs: the fitted peak plus what lies outside the allocator."""
        linear = float(np.dot(memory_features(config), [self.coefficients.get(t, 0.0) for t in linear_terms()]))
        return max(self.coefficients.get("optimizer_floor", 0.0), linear) + self.non_torch_bytes

    def with_gradient_shards(self, shards: int) -> MemoryModel:
        """This model for an FSDP process of `shards` planned from a 1-process calibration: it accumulates its shard
        of the gradients (the rest of the sharding is the plan's memory offset: train.recipes.run_plan)."""
        held = self.coefficients["accumulated_gradients"] / max(1, shards)
        return MemoryModel({**self.coefficients, "accumulated_gradients": held}, self.basis, self.non_torch_bytes)


def fit_memory(
    configs: Sequence[StepConfig], peak_bytes: np.ndarray, floor: bool = False, gradient_bytes: float = 0.0
) -> MemoryModel:
    """The linear form by robust NNLS; with `floor`, the max form refined from it. Accumulation holds at least
    `gradient_bytes` once some probe accumulated (a term no probe exercises stays zero)."""
    features = np.stack([memory_features(c) for c in configs])
    linear = fit_nonnegative(features, peak_bytes)
    coefficients = {**dict(zip(linear_terms(), map(float, linear), strict=True)), "optimizer_floor": 0.0}
    if floor:
        coefficients = _fit_floor(features, peak_bytes, linear)
    if any(config.grad_accum > 1 for config in configs):
        coefficients["accumulated_gradients"] = max(coefficients["accumulated_gradients"], float(gradient_bytes))
    return MemoryModel(coefficients)


def held_gradient_bytes(record: JsonDict) -> float:
    """The fp32 gradients a calibration's step holds while accumulating: every trainable parameter's,
    or this rank's share of them under FSDP (train.step.sharding shards gradients)."""
    training = record.get("training") or {}
    trainable = training.get("trainable_parameters")
    if not isinstance(trainable, int) or trainable <= 0:
        return 0.0
    world_size = int((record.get("distributed") or {}).get("world_size", 1) or 1)
    shards = world_size if training.get("sharding") == "fsdp" else 1
    return gradient_bytes(trainable) / shards


def _fit_floor(features: np.ndarray, peak_bytes: np.ndarray, start: np.ndarray) -> dict[str, float]:
    """max(floor, features·θ) by bounded nonlinear least squares on relative error, from the linear fit and the least peak."""
    scale = np.maximum(np.abs(features).max(axis=0), 1e-30)
    unit = float(np.median(peak_bytes))
    free = np.abs(features).max(axis=0) > 0  # unexercised terms stay zero

    def predict(x: np.ndarray) -> np.ndarray:
        theta = np.where(free, x[:-1], 0.0) * unit / scale
        peaks: np.ndarray = np.maximum(x[-1] * unit, features @ theta)
        return peaks

    x0 = np.concatenate([start * scale / unit, [peak_bytes.min() / unit]])
    solution = least_squares(
        lambda x: (predict(x) - peak_bytes) / peak_bytes,
        np.clip(x0, 0, None),
        bounds=(0, np.inf),
        loss="soft_l1",
        f_scale=0.05,
    )
    theta = np.where(free, solution.x[:-1], 0.0) * unit / scale
    return {
        **dict(zip(linear_terms(), map(float, theta), strict=True)),
        "optimizer_floor": float(solution.x[-1] * unit),
    }


def fit_memory_section(configs: list[StepConfig], peak_bytes: np.ndarray, gradient_bytes: float = 0.0) -> JsonDict:
    """The calibration's `fit.memory`: the form with the lower held-out median error (linear on a tie), and that error."""
    forms = {"physical": False}
    if len(configs) >= MIN_ROWS_FOR_FLOOR:
        forms["physical+floor"] = True
    errors: dict[str, ErrorSummary] = {}
    for kind, floor in forms.items():

        def fit_on(train: np.ndarray, floor: bool = floor) -> Callable[[StepConfig], float]:
            return fit_memory([configs[i] for i in train], peak_bytes[train], floor, gradient_bytes).peak_bytes

        errors[kind] = ErrorSummary.from_pairs(held_out_predictions(configs, fit_on), peak_bytes)
    kind = min(errors, key=lambda name: (round(errors[name].median_abs_pct, 3), name != "physical"))
    model = fit_memory(configs, peak_bytes, forms[kind], gradient_bytes)
    return {
        "kind": kind,
        "parameters": model.coefficients,
        "held_out_error": errors[kind].to_json(),
        "held_out_relative_errors": errors[kind].signed_relative,
        "alternatives": {name: summary.to_json() for name, summary in errors.items()},
    }


def fit_memory_rows(rows: Sequence[JsonDict], gradient_bytes: float = 0.0) -> JsonDict:
    """`fit.memory` from ok rows with a peak: fitted to the reserved peak when every row recorded one (then plus the most
    any row used outside the allocator), else to the allocated peak; `basis` says which."""
    configs = [StepConfig.from_row(row) for row in rows]
    reserved = all(is_number(row.get("peak_reserved_bytes")) for row in rows)
    field = "peak_reserved_bytes" if reserved else "peak_memory_bytes"
    section = fit_memory_section(configs, np.array([float(row[field]) for row in rows]), gradient_bytes)
    outside = (
        [float(row["non_torch_bytes"]) for row in rows if is_number(row.get("non_torch_bytes"))] if reserved else []
    )
    return {**section, "basis": "reserved" if reserved else "allocated", "non_torch_bytes": max(outside, default=0.0)}


def device_peak_bytes(figures: JsonDict) -> float | None:
    """What the device held at a measurement's highest point, to compare with a plan's predicted peak: reserved +
    outside the allocator where recorded (CUDA), else the peak as recorded (allocated, or the peak RSS on CPU)."""
    reserved, outside = figures.get("peak_reserved_bytes"), figures.get("non_torch_bytes")
    if is_number(reserved) and is_number(outside):
        return float(reserved) + float(outside)
    peak = figures.get("peak_memory_bytes")
    return float(peak) if is_number(peak) else None


def memory_model_from_json(memory: JsonDict) -> MemoryModel:
    coefficients = {term: float(memory["parameters"].get(term, 0.0)) for term in memory_terms()}
    outside = memory.get("non_torch_bytes")
    return MemoryModel(
        coefficients, str(memory.get("basis") or "allocated"), float(outside) if is_number(outside) else 0.0
    )
