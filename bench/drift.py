"""Machine drift during a benchmark, measured on a reference probe and corrected.
Why: docs/design.md#bench-drift
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from bench.remeasure import measurements_of, recombine
from calibration.step_config import StepConfig

REFERENCE_EVERY = 8


# The speeds a correction may bring every probe to: the reference's median over the benchmark, or
# its first (smoothed) measurement, the speed of the process before the benchmark ran long in it
# (which a fresh process, the run, starts at). bench.record chooses by fresh processes.
LEVELS = ("median", "first")


def correct_for_drift(rows: list[dict[str, Any]], references: list[tuple[int, float]], config: StepConfig, level: str = "median") -> dict[str, Any]:
    """Rescale the ok rows in place to the reference's speed at `level`; `references` are
    (position, reference tokens/s)."""
    summary: dict[str, Any] = {"reference": config.to_row(), "measurements": [{"position": p, "tokens_per_second": t} for p, t in references]}
    if len(references) < 2:
        return {**summary, "applied": False, "spread_pct": 0.0}
    positions = np.array([position for position, _ in references], dtype=float)
    speeds = median_of_three(np.array([speed for _, speed in references], dtype=float))
    typical = float(speeds[0]) if level == "first" else statistics.median(speeds)
    for index, row in enumerate(rows):
        if row["status"] != "ok":
            continue
        for measurement in measurements_of(row):
            # Rows written before positions were recorded were measured in row order.
            factor = float(np.interp(measurement.get("position", index), positions, speeds)) / typical
            measurement["drift_factor"] = factor
            measurement["step_seconds_raw"] = measurement["step_seconds"]
            measurement["step_seconds"] = measurement["step_seconds"] * factor
            if "step_seconds_mean" in measurement:
                measurement["step_seconds_mean_raw"] = measurement["step_seconds_mean"]
                measurement["step_seconds_mean"] = measurement["step_seconds_mean"] * factor
        row["tokens_per_second_raw"] = row["tokens_per_second"]
        recombine(row)
    return {**summary, "applied": True, "level": level, "spread_pct": float((speeds.max() - speeds.min()) / typical * 100)}


def median_of_three(values: np.ndarray) -> np.ndarray:
    """A running median over neighbours: one disturbed reference probe (a burst of load from
    something else) must not rescale the probes around it."""
    if len(values) < 3:
        return values
    padded = np.concatenate(([values[0]], values, [values[-1]]))
    return np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)


def undo_correction(rows: list[dict[str, Any]]) -> None:
    """Put the raw figures back (when the correction did not make the fit better)."""
    for row in rows:
        changed = False
        for measurement in measurements_of(row):
            if "step_seconds_raw" in measurement:
                measurement["step_seconds"] = measurement.pop("step_seconds_raw")
                if "step_seconds_mean_raw" in measurement:
                    measurement["step_seconds_mean"] = measurement.pop("step_seconds_mean_raw")
                measurement.pop("drift_factor", None)
                changed = True
        if changed:
            row.pop("tokens_per_second_raw", None)
            recombine(row)
