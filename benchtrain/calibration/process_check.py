"""How a calibration holds in another process, from the step measured again in fresh ones
(bench.fresh_process). Why: docs/design.md#fresh-processes"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchtrain.calibration.fit import throughput_model_from_json
from benchtrain.calibration.memory_fit import memory_model_from_json
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict

# The keys of a fresh-process measurement kept in the calibration (beside its configuration).
KEPT = (
    "process",
    "step_seconds",
    "step_seconds_mean",
    "tokens_per_second",
    "peak_memory_bytes",
    "rss_before_model_bytes",
)


def speed_ratios(fit: JsonDict, rows: Sequence[JsonDict]) -> list[float]:
    """Fresh-process speed ÷ predicted speed for each measurement (> 1: the process ran faster)."""
    model = throughput_model_from_json(fit)
    tail = float(fit.get("step_tail_factor") or 1.0)
    ratios = []
    for row in rows:
        config = StepConfig.from_row(row)
        predicted = model.micro_step_seconds(config) * tail * config.grad_accum
        measured = float(row.get("step_seconds_mean") or row["step_seconds"])
        ratios.append(float(predicted / measured))
    return ratios


def median_error(fit: JsonDict, rows: Sequence[JsonDict]) -> float:
    """Median |error| (%) of the fit's speed in the fresh processes."""
    return statistics.median(abs(ratio - 1) * 100 for ratio in speed_ratios(fit, rows))


def memory_ratios(fit: JsonDict, rows: Sequence[JsonDict], bench_rss_before_model: float | None) -> list[float]:
    """Fresh-process peak ÷ predicted peak, raised by what the process held before its model beyond the bench process,
    as `train` adds it (train.step.peak_memory.host_excess_bytes)."""
    if not fit.get("memory"):
        return []
    model = memory_model_from_json(fit["memory"])
    ratios = []
    for row in rows:
        if not row.get("peak_memory_bytes"):
            continue
        before = row.get("rss_before_model_bytes")
        offset = max(0.0, float(before) - float(bench_rss_before_model)) if before and bench_rss_before_model else 0.0
        ratios.append(float(row["peak_memory_bytes"]) / (model.peak_bytes(StepConfig.from_row(row)) + offset))
    return ratios


def judge(fit: JsonDict, rows: Sequence[JsonDict], bench_rss_before_model: float | None) -> JsonDict:
    """The `process_check` record of a calibration from its fresh-process measurements `rows`."""
    ratios = speed_ratios(fit, rows)
    memory = memory_ratios(fit, rows, bench_rss_before_model)
    return {
        "processes": len({row.get("process", 0) for row in rows}),
        "measurements": [
            {**StepConfig.from_row(row).to_row(), **{key: row[key] for key in KEPT if key in row}} for row in rows
        ],
        "speed_ratios": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
        "time_spread": round(max(abs(r - 1) for r in ratios), 4),
        "memory_spread": round(max((abs(m - 1) for m in memory), default=0.0), 4),
    }
