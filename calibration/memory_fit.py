"""The peak-memory model: what a training step holds at its highest point, fitted to the probes.

Two moments can set the peak of a step, and the model has one form for each:

- **forward/backward** (the larger micro-batches): what is always held (weights, optimizer state,
  workspace) + the gradients a run holds *while accumulating* (from the first micro-step's
  backward until the optimizer step; with accumulation 1 they only exist once the activations are
  gone) + activations per token (all of them, or only each layer's input with gradient
  checkpointing), + an attention term per token × length (zero with flash/SDPA kernels; the
  eager path keeps the scores), + the loss's logits per token (part of the per-token term);

      linear = static + accumulated_gradients·[A>1] + per_token·B·S + attention·B·S²      (checkpointing off)
             = static + accumulated_gradients·[A>1] + per_token_checkpointed·B·S + attention_checkpointed·B·S²  (on)

- **the optimizer step** (small micro-batches): weights + gradients + both AdamW moments + the
  optimizer's temporaries, whatever the batch: a floor under every step,

      peak = max(optimizer_floor, linear).

On the real H100 grid (llama-3.2-1b, full fine-tuning) accumulation adds the 4.9 GB of fp32
gradients at every size, and below ≈2k tokens a micro-step the optimizer step is the peak: a
straight line through both under-predicts the large configurations a plan uses. Both forms are
fitted (non-negative, on relative error); the floor form is kept when it predicts held-out probes
better. Terms no probe exercises stay zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from calibration.fit_tools import ErrorSummary, cross_validate, fit_nonnegative
from calibration.step_config import StepConfig

LINEAR_TERMS = ("static", "per_token", "attention", "per_token_checkpointed", "attention_checkpointed", "accumulated_gradients")
MEMORY_TERMS = (*LINEAR_TERMS, "optimizer_floor")
# The floor form has one more parameter and a kink: it needs a few probes on each side of it.
MIN_ROWS_FOR_FLOOR = 6


def memory_features(config: StepConfig) -> np.ndarray:
    """The linear form's features, in LINEAR_TERMS order."""
    tokens = config.micro_batch_size * config.seq_len
    kept = 0.0 if config.gradient_checkpointing else 1.0
    accumulating = 1.0 if config.grad_accum > 1 else 0.0
    return np.array([1.0, kept * tokens, kept * tokens * config.seq_len, (1 - kept) * tokens, (1 - kept) * tokens * config.seq_len, accumulating])


@dataclass
class MemoryModel:
    coefficients: dict[str, float]

    def peak_bytes(self, config: StepConfig) -> float:
        linear = float(np.dot(memory_features(config), [self.coefficients[t] for t in LINEAR_TERMS]))
        return max(self.coefficients.get("optimizer_floor", 0.0), linear)

    @property
    def kind(self) -> str:
        return "physical+floor" if self.coefficients.get("optimizer_floor", 0.0) > 0 else "physical"


def fit_memory(configs: Sequence[StepConfig], peak_bytes: np.ndarray, floor: bool = False) -> MemoryModel:
    """The linear form by robust NNLS; with `floor`, the max form refined from it."""
    features = np.stack([memory_features(c) for c in configs])
    linear = fit_nonnegative(features, peak_bytes)
    coefficients = {**dict(zip(LINEAR_TERMS, map(float, linear), strict=True)), "optimizer_floor": 0.0}
    if floor:
        coefficients = _fit_floor(features, peak_bytes, linear)
    return MemoryModel(coefficients)


def _fit_floor(features: np.ndarray, peak_bytes: np.ndarray, start: np.ndarray) -> dict[str, float]:
    """max(floor, features·θ) by bounded nonlinear least squares on relative error, from the linear
    fit and the smallest measured peak."""
    from scipy.optimize import least_squares

    scale = np.maximum(np.abs(features).max(axis=0), 1e-30)
    unit = float(np.median(peak_bytes))
    free = np.abs(features).max(axis=0) > 0  # unexercised terms stay zero

    def predict(x: np.ndarray) -> np.ndarray:
        theta = np.where(free, x[:-1], 0.0) * unit / scale
        return np.maximum(x[-1] * unit, features @ theta)

    x0 = np.concatenate([start * scale / unit, [peak_bytes.min() / unit]])
    solution = least_squares(lambda x: (predict(x) - peak_bytes) / peak_bytes, np.clip(x0, 0, None), bounds=(0, np.inf), loss="soft_l1", f_scale=0.05)
    theta = np.where(free, solution.x[:-1], 0.0) * unit / scale
    return {**dict(zip(LINEAR_TERMS, map(float, theta), strict=True)), "optimizer_floor": float(solution.x[-1] * unit)}


def fit_memory_section(configs: list[StepConfig], peak_bytes: np.ndarray) -> dict[str, object]:
    """The calibration's `fit.memory`: the form with the lower held-out median error (the linear
    one on a tie), its parameters and its held-out error."""
    forms = {"physical": False}
    if len(configs) >= MIN_ROWS_FOR_FLOOR:
        forms["physical+floor"] = True
    errors: dict[str, ErrorSummary] = {}
    for kind, floor in forms.items():

        def fit_on(train: np.ndarray, floor: bool = floor) -> Callable[[StepConfig], float]:
            return fit_memory([configs[i] for i in train], peak_bytes[train], floor).peak_bytes

        errors[kind] = cross_validate(len(configs), peak_bytes, fit_on, configs)
    kind = min(errors, key=lambda name: (round(errors[name].median_abs_pct, 3), name != "physical"))
    model = fit_memory(configs, peak_bytes, forms[kind])
    return {
        "kind": kind,
        "parameters": model.coefficients,
        "held_out_error": errors[kind].to_json(),
        "held_out_relative_errors": errors[kind].signed_relative,
        "alternatives": {name: summary.to_json() for name, summary in errors.items()},
    }


def memory_model_from_json(memory: dict[str, object]) -> MemoryModel:
    parameters = memory["parameters"]
    assert isinstance(parameters, dict)
    return MemoryModel({term: float(parameters.get(term, 0.0)) for term in MEMORY_TERMS})
