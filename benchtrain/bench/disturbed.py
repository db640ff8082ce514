"""Measurements disturbed by other work: drift corrected against a reference probe measured again every
few probes, and probes that look disturbed measured again. Why: docs/design.md#bench-disturbed
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT, fit_throughput
from benchtrain.calibration.memory_fit import MEMORY_FIELDS
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict
from benchtrain.common.progress import Bar

MAX_REPEATS = 3
# A probe is suspect when its spread is this many times the typical spread (and above the floor),
# or when a quick robust fit misses it by this many robust standard deviations (and by the floor).
SPREAD_RATIO = 2.5
SPREAD_FLOOR = 0.05
RESIDUAL_SIGMAS = 3.0
RESIDUAL_FLOOR = 0.10
MEASUREMENT_KEYS = (
    "position",
    "step_seconds",
    "step_seconds_mean",
    "step_seconds_spread",
    "timed_steps",
    "load_average",
    "data_wait_share",
)


def measurements_of(row: JsonDict) -> list[JsonDict]:
    """The row's measurements: its repeats when it was measured again, else the row itself."""
    return row["repeats"] if row.get("repeats") else [row]


def recombine(row: JsonDict) -> None:
    """The row's figures from the median of its repeats, and its tokens/s from its step time."""
    tokens = row["micro_batch_size"] * row["seq_len"] * row["grad_accum"]
    repeats = row.get("repeats")
    if not repeats:
        row["tokens_per_second"] = tokens / row["step_seconds"]
        return
    row["step_seconds"] = statistics.median(m["step_seconds"] for m in repeats)
    means = [m["step_seconds_mean"] for m in repeats if m.get("step_seconds_mean")]
    if means:
        row["step_seconds_mean"] = statistics.median(means)
    row["step_seconds_spread"] = statistics.median(m.get("step_seconds_spread", 0.0) for m in repeats)
    row["timed_steps"] = sum(int(m.get("timed_steps", 0)) for m in repeats)
    row["data_wait_share"] = statistics.median(m.get("data_wait_share", 0.0) for m in repeats)
    row["tokens_per_second"] = tokens / row["step_seconds"]


def add_repeat(row: JsonDict, new: JsonDict) -> None:
    """Record a further measurement of the same configuration and recombine."""
    if not row.get("repeats"):
        row["repeats"] = [{key: row[key] for key in MEASUREMENT_KEYS if key in row}]
    row["repeats"].append({key: new[key] for key in MEASUREMENT_KEYS if key in new})
    for name in MEMORY_FIELDS:  # the allocated peak, and on CUDA reserved and outside PyTorch: the most seen
        if new.get(name):
            row[name] = max(row.get(name) or 0, new[name])
    recombine(row)


def suspects(rows: list[JsonDict]) -> list[JsonDict]:
    """Ok rows worth measuring again, worst first: large residual against a quick robust fit, then
    large spread. Rows already measured MAX_REPEATS times are not suspects."""
    ok = [row for row in rows if row["status"] == "ok"]
    candidates = [
        index
        for index, row in enumerate(ok)
        if len(measurements_of(row)) < MAX_REPEATS and not row.get("remeasure_failed")
    ]
    if not candidates:
        return []
    scores: dict[int, float] = {}
    spreads = np.array([row.get("step_seconds_spread") or 0.0 for row in ok])
    typical_spread = float(np.median(spreads))
    for index, value in enumerate(spreads):
        if value > max(SPREAD_FLOOR, SPREAD_RATIO * typical_spread):
            scores[index] = value / max(typical_spread, 1e-9)
    residuals = quick_residuals(rows, ok)
    if residuals is not None:
        scale = max(1.4826 * float(np.median(np.abs(residuals - np.median(residuals)))), 0.01)
        for index, value in enumerate(np.abs(residuals)):
            if value > max(RESIDUAL_FLOOR, RESIDUAL_SIGMAS * scale):
                # Residual outliers come first: they move the fit, a scattered probe only widens it.
                scores[index] = 1000.0 + value / scale
    return [ok[index] for index in sorted(scores, key=lambda i: -scores[i]) if index in candidates]


def quick_residuals(rows: list[JsonDict], ok: list[JsonDict]) -> np.ndarray | None:
    """Relative residuals of each ok row against one robust fit of all of them (no cross-validation)."""
    if len(ok) < max(MIN_ROWS_FOR_FIT, 8):
        return None
    configs = [StepConfig.from_row(row) for row in ok]
    micro = np.array([row["step_seconds"] / row["grad_accum"] for row in ok])
    model = fit_throughput(configs, micro)
    predicted = np.array([model.micro_step_seconds(config) for config in configs])
    return (micro - predicted) / predicted


def remeasure(
    rows: list[JsonDict],
    probe_again: Callable[[JsonDict], JsonDict],
    allows: Callable[[JsonDict], bool],
    progress: Bar | None = None,
) -> int:
    """Measure suspects again while the budget `allows(row)` it (and at most a quarter of the
    probes, so an unbounded benchmark stays bounded); returns how many measurements were added."""
    added = 0
    limit = max(2, sum(1 for row in rows if row["status"] == "ok") // 4)
    while added < limit:
        pending = [row for row in suspects(rows) if allows(row)]
        if not pending:
            break
        row = pending[0]
        new = probe_again(row)
        if new["status"] != "ok":
            # It failed this time (e.g. memory): keep what we had, and do not try it again.
            row["remeasure_failed"] = new.get("error", new["status"])
            continue
        add_repeat(row, new)
        added += 1
        if progress is not None:
            progress.set_postfix_str(
                f"re-measured B={row['micro_batch_size']} W={row['num_workers']} A={row['grad_accum']} S={row['seq_len']}",
                refresh=False,
            )
    return added


REFERENCE_EVERY = 8


# The speeds a correction may bring every probe to: the reference's median over the benchmark, or
# its first (smoothed) measurement, the speed of the process before the benchmark ran long in it
# (which a fresh process, the run, starts at). bench.record chooses by fresh processes.
LEVELS = ("median", "first")


def correct_for_drift(
    rows: list[JsonDict], references: list[tuple[int, float]], config: StepConfig, level: str = "median"
) -> JsonDict:
    """Rescale the ok rows in place to the reference's speed at `level`; `references` are (position, reference tokens/s)."""
    summary: JsonDict = {
        "reference": config.to_row(),
        "measurements": [{"position": p, "tokens_per_second": t} for p, t in references],
    }
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
    return {
        **summary,
        "applied": True,
        "level": level,
        "spread_pct": float((speeds.max() - speeds.min()) / typical * 100),
    }


def median_of_three(values: np.ndarray) -> np.ndarray:
    """A running median over neighbours: one disturbed reference probe (a burst of load from something else) must not rescale the probes around it."""
    if len(values) < 3:
        return values
    padded = np.concatenate(([values[0]], values, [values[-1]]))
    return np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)


def undo_correction(rows: list[JsonDict]) -> None:
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
