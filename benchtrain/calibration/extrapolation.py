"""How far a plan may miss where it extrapolates, measured per dimension at fit time.
The rule and why: docs/design.md#extrapolation-bounds"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from benchtrain.calibration.fit_tools import ErrorSummary
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict

# What a plan may stretch past the measured range along (tokens: micro batch × length).
STRETCHED = ("micro_batch_size", "seq_len", "grad_accum", "tokens")
FitOn = Callable[[np.ndarray], Callable[[StepConfig], float]]  # a fit on these rows, predicting micro-step seconds


def dimension_value(config: StepConfig, name: str) -> int:
    """`config`'s value along `name` (tokens: micro batch × length)."""
    if name == "tokens":
        return config.micro_batch_size * config.seq_len
    return int(getattr(config, name))


def held_out_by_dimension(
    configs: Sequence[StepConfig], micro_seconds: np.ndarray, fit_on: FitOn, leave_one_out: np.ndarray, min_rows: int
) -> dict[str, JsonDict | None]:
    """For each dimension: the probes at its largest value predicted by `fit_on(the other rows)` (micro-step seconds
    of a config): their tokens/s error, `stretch` and `basis`; None where one value or fewer than `min_rows` probes
    would be left. Accumulation at two values is judged by `leave_one_out` instead (docs/design.md#extrapolation-bounds)."""
    record: dict[str, JsonDict | None] = {}
    for name in STRETCHED:
        values = np.array([dimension_value(config, name) for config in configs])
        distinct = np.unique(values)
        train = np.flatnonzero(values < distinct[-1])
        if len(distinct) < 2 or len(train) < min_rows:
            record[name] = None
            continue
        test = np.flatnonzero(values == distinct[-1])
        if name == "grad_accum" and len(distinct) == 2:
            predicted, basis = leave_one_out[test], "leave-one-out"
        else:
            predict = fit_on(train)
            predicted, basis = np.array([predict(configs[int(index)]) for index in test]), "held out"
        # tokens/s error, actual over predicted on the same tokens, as the held-out error is.
        summary = ErrorSummary.from_pairs(1.0 / predicted, 1.0 / micro_seconds[test])
        record[name] = {**summary.to_json(), "stretch": float(distinct[-1] / distinct[-2]), "basis": basis}
    return record


def stretch_by_dimension(config: StepConfig, rows: Sequence[JsonDict]) -> dict[str, float]:
    """How far `config` lies past `rows` along each dimension: value / largest, or smallest / value below (1 inside);
    also `grad_accum_below`: 1, or the ratio below."""
    stretches: dict[str, float] = {}
    for name in STRETCHED:
        measured = [dimension_value(StepConfig.from_row(row), name) for row in rows]
        value = dimension_value(config, name)
        above = value / max(measured) if measured and value > max(measured) else 1.0
        below = min(measured) / value if measured and name != "tokens" and 0 < value < min(measured) else 1.0
        stretches[name] = max(above, below)
        if name == "grad_accum":
            stretches["grad_accum_below"] = below
    return stretches


def extrapolation_widening(record: JsonDict, stretches: dict[str, float], untested: float, inside: float) -> float:
    """What to add to the relative bound `inside` for a plan `stretches` past the range, from `record`'s measured errors."""

    def widening(name: str, per_doubling: bool = True) -> float:
        stretch = stretches.get(name, 1.0)
        if stretch <= 1.0:
            return 0.0
        measured = record.get(name)
        if not measured or not measured.get("count"):
            return untested * math.log2(stretch)
        error = float(measured.get("p90_abs_pct") or 0.0) / 100.0
        if not per_doubling:
            return max(0.0, error - inside)
        # Per doubling; a held-out step shorter than a doubling counts as one (its error is mostly the probes' noise).
        return error * math.log2(stretch) / max(1.0, math.log2(float(measured.get("stretch") or 2.0)))

    sizes = max(widening("micro_batch_size") + widening("seq_len"), widening("tokens"))
    if stretches.get("grad_accum_below", 1.0) > 1.0:
        accumulation = widening("grad_accum")  # below the range: the optimizer's share grows
    else:
        accumulation = widening("grad_accum", per_doubling=False)
    return sizes + accumulation
