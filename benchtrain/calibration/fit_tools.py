"""Shared pieces of the fits: robust non-negative least squares on relative error, and held-out
error by leave-one-out (or k-fold) cross-validation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
from scipy.optimize import nnls

from benchtrain.common.json_types import JsonDict

MAX_FOLDS = 10
LEAVE_ONE_OUT_UP_TO = 60  # rows; past that, MAX_FOLDS interleaved folds


# Robust fitting (docs/design.md#throughput-fit): Huber reweighting on the relative residuals, their MAD floored.
ROBUST_ITERATIONS = 6
HUBER_K = 2.0
MIN_RESIDUAL_SCALE = 0.01
# What the model cannot express, beside a probe's own spread: rows are weighted by 1 / their uncertainty.
UNCERTAINTY_FLOOR = 0.02


def is_number(value: object) -> TypeGuard[float]:
    """A JSON number: not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def fit_nonnegative(
    features: np.ndarray, targets: np.ndarray, scale: np.ndarray | None = None, uncertainty: np.ndarray | None = None
) -> np.ndarray:
    """NNLS on relative error (each row divided by its `scale`, default its target), each row also
    divided by its relative `uncertainty`, with Huber reweighting against outliers."""
    relative = 1.0 / (targets if scale is None else scale)
    prior = 1.0 / (uncertainty if uncertainty is not None else np.ones_like(targets))
    # Columns span many orders of magnitude (1 vs B*S*S): scale them for a well-posed solve.
    base = features * relative[:, None]
    column_scale = np.maximum(np.abs(base).max(axis=0), 1e-30)
    huber = np.ones_like(targets)
    solution = np.zeros(features.shape[1])
    for _ in range(ROBUST_ITERATIONS):
        row_weight = prior * np.sqrt(huber)
        solution, _ = nnls(base / column_scale * row_weight[:, None], targets * relative * row_weight, maxiter=2000)
        residuals = (base / column_scale) @ solution - targets * relative
        spread = max(1.4826 * float(np.median(np.abs(residuals - np.median(residuals)))), MIN_RESIDUAL_SCALE)
        huber = np.minimum(1.0, HUBER_K * spread / np.maximum(np.abs(residuals), 1e-12))
    scaled_back: np.ndarray = solution / column_scale  # nnls comes from untyped scipy
    return scaled_back


def folds(count: int) -> list[np.ndarray]:
    """Leave-one-out up to LEAVE_ONE_OUT_UP_TO rows, then MAX_FOLDS interleaved folds."""
    if count <= LEAVE_ONE_OUT_UP_TO:
        return [np.array([index]) for index in range(count)]
    return [np.arange(start, count, MAX_FOLDS) for start in range(MAX_FOLDS)]


@dataclass
class ErrorSummary:
    """Absolute percentage errors on held-out rows, plus signed relative errors for bounds."""

    median_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float
    count: int
    signed_relative: list[float] = field(default_factory=list)

    @classmethod
    def from_pairs(cls, predicted: np.ndarray, actual: np.ndarray) -> ErrorSummary:
        relative = (predicted - actual) / actual
        absolute = np.abs(relative) * 100
        if len(absolute) == 0:
            return cls(math.nan, math.nan, math.nan, 0, [])
        return cls(
            float(np.median(absolute)),
            float(np.percentile(absolute, 90)),
            float(absolute.max()),
            len(absolute),
            [float(value) for value in relative],
        )

    def to_json(self) -> JsonDict:
        errors = {
            "median_abs_pct": self.median_abs_pct,
            "p90_abs_pct": self.p90_abs_pct,
            "max_abs_pct": self.max_abs_pct,
        }
        return {
            **{name: value if math.isfinite(value) else None for name, value in errors.items()},
            "count": self.count,
        }


def held_out_predictions(configs: Sequence[Any], fit_on: Callable[[np.ndarray], Callable[[Any], float]]) -> np.ndarray:
    """Each config predicted by `fit_on(train indices)`, a model fitted on folds that never saw it."""
    held_out = np.empty(len(configs))
    for test in folds(len(configs)):
        predict = fit_on(np.setdiff1d(np.arange(len(configs)), test))
        for index in test:
            held_out[index] = predict(configs[index])
    return held_out
