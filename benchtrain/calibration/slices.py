"""A calibration of a whole model measured on layer slices of it (`bench run --layers`): lines in depth
per configuration, the full depth's rows derived, and how far plans widen for it.
The model and why: docs/design.md#layer-slices"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from benchtrain.calibration.fit_tools import ErrorSummary
from benchtrain.calibration.split import SPLIT_FIELDS, usable_record
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict

# The relative error assumed when no deeper probe was held out (two depths only): docs/design.md#layer-slices.
UNTESTED_SLICE_ERROR = 0.35
# Row fields in bytes that grow with depth (extrapolated above the exact static bytes), and those that do not (outside PyTorch).
DEPTH_BYTES_FIELDS = ("peak_memory_bytes", "peak_reserved_bytes", "device_used_bytes")
CONSTANT_BYTES_FIELDS = ("non_torch_bytes",)


@dataclass(frozen=True)
class DepthLine:
    """value(L) = fixed + per_layer · L, fitted over slice depths."""

    fixed: float
    per_layer: float

    def at(self, layers: float) -> float:
        return self.fixed + self.per_layer * layers

    @classmethod
    def fit(cls, depths: Sequence[float], values: Sequence[float]) -> DepthLine:
        """Least squares over two or more distinct depths; a negative slope (noise) is taken as flat: deeper never costs less."""
        x, y = np.asarray(depths, dtype=float), np.asarray(values, dtype=float)
        if len(set(x.tolist())) < 2:
            raise ValueError(f"a line in depth needs two distinct depths, got {sorted(set(x.tolist()))}")
        slope, intercept = np.polyfit(x, y, 1)
        if slope < 0:
            return cls(float(y.mean()), 0.0)
        return cls(float(intercept), float(slope))


@dataclass(frozen=True)
class SliceFit:
    """The full depth's rows derived from the slices, each configuration's lines, and the held-out error in depth."""

    rows: list[JsonDict]
    per_config: list[JsonDict]
    held_out_time: ErrorSummary
    held_out_memory: ErrorSummary


def derive_full_rows(
    by_depth: Mapping[int, Sequence[JsonDict]], full_layers: int, static_bytes: dict[int, float]
) -> SliceFit:
    """The whole model's rows (`full_layers` deep) for every configuration measured ok at two depths or more.
    `static_bytes[K]`: what a K-layer model keeps before activations (exact, from `meta`), for every depth and `full_layers`."""
    ok = {
        depth: [row for row in rows if row.get("status") == "ok" and row.get("step_seconds")]
        for depth, rows in by_depth.items()
    }
    measured = {depth: {StepConfig.from_row(row): row for row in rows} for depth, rows in ok.items()}
    configs = sorted({config for rows in measured.values() for config in rows})
    derived, per_config = [], []
    time_pairs: list[tuple[float, float]] = []
    memory_pairs: list[tuple[float, float]] = []
    for config in configs:
        found = {depth: rows[config] for depth, rows in sorted(measured.items()) if config in rows}
        if len(found) < 2:
            continue
        row, lines = derive_row(config, found, full_layers, static_bytes)
        derived.append(row)
        per_config.append({**config.to_row(), **lines})
        if len(found) >= 3:
            time_pair, memory_pair = held_out_pairs(found, static_bytes)
            time_pairs.append(time_pair)
            if memory_pair is not None:
                memory_pairs.append(memory_pair)
    return SliceFit(derived, per_config, summary(time_pairs), summary(memory_pairs))


def derive_step_split(by_depth: Mapping[int, Sequence[JsonDict]], full_layers: int) -> list[JsonDict]:
    """The whole model's step split from each depth's: every part a line in depth at `full_layers`, for each configuration
    split at two depths or more (docs/design.md#layer-slices: the deepest slice's split is not the whole model's).
    []: none was, and the FLOP-count split of the whole model's fit stands (calibration.split.step_splits)."""
    found: dict[StepConfig, dict[int, JsonDict]] = {}
    for depth, records in sorted(by_depth.items()):
        for entry in records:
            if usable_record(entry):
                found.setdefault(StepConfig.from_row(entry), {})[depth] = entry
    derived = []
    for config, at_depth in found.items():
        if len(at_depth) < 2:
            continue
        depths = sorted(at_depth)
        fields = [
            *SPLIT_FIELDS,
            *(["comm_seconds"] if all("comm_seconds" in at_depth[depth] for depth in depths) else []),
        ]
        parts = {
            field: max(0.0, DepthLine.fit(depths, [float(at_depth[depth][field]) for depth in depths]).at(full_layers))
            for field in fields
        }
        methods = {at_depth[depth]["method"] for depth in depths}
        derived.append(
            {
                **config.to_row(),
                **parts,
                "method": methods.pop() if len(methods) == 1 else "flops",
                "slice_depths": depths,
            }
        )
    return derived


def summary(pairs: list[tuple[float, float]]) -> ErrorSummary:
    array = np.array(pairs, dtype=float).reshape(-1, 2)  # (predicted, actual) rows
    return ErrorSummary.from_pairs(array[:, 0], array[:, 1])


def activation_values(found: dict[int, JsonDict], field: str, static_bytes: dict[int, float]) -> list[float] | None:
    """`field` less the exact static bytes at each depth, or None where a row lacks it."""
    values = [row.get(field) for row in found.values()]
    if not all(isinstance(value, (int, float)) and value > 0 for value in values):
        return None
    return [float(value) - static_bytes[depth] for depth, value in zip(found, values, strict=True)]  # type: ignore[arg-type]


def measured_seconds(row: JsonDict) -> float:
    """The probe's measured median step (rows whose step time a fit smoothed keep it aside)."""
    # Not row.get(key, default): mypy reads that as `Any | None` for a JsonDict.
    return float(row["step_seconds_measured"] if "step_seconds_measured" in row else row["step_seconds"])


def derive_row(
    config: StepConfig, found: dict[int, JsonDict], full_layers: int, static_bytes: dict[int, float]
) -> tuple[JsonDict, JsonDict]:
    """One configuration's row at full depth, and its fitted lines (for the record)."""
    depths = list(found)
    deepest = found[depths[-1]]
    time_line = DepthLine.fit(depths, [row["step_seconds"] for row in found.values()])
    step = max(time_line.at(full_layers), min(row["step_seconds"] for row in found.values()))
    tokens = config.micro_batch_size * config.seq_len * config.grad_accum
    # Waiting for data does not depend on depth: its seconds carry over, its share shrinks.
    waits = [
        row["data_wait_share"] * measured_seconds(row)
        for row in found.values()
        if isinstance(row.get("data_wait_share"), (int, float))
    ]
    tails = [
        row["step_seconds_mean"] / measured_seconds(row)
        for row in found.values()
        if isinstance(row.get("step_seconds_mean"), (int, float))
    ]
    row: JsonDict = {
        **config.to_row(),
        "status": "ok",
        "step_seconds": step,
        "step_seconds_median": step,
        "tokens_per_second": tokens / step,
        "step_seconds_spread": max(float(r.get("step_seconds_spread") or 0.0) for r in found.values()),
        "from_slices": {"depths": depths, "step_seconds": [measured_seconds(r) for r in found.values()]},
    }
    if len(waits) == len(found):
        row["data_wait_share"] = min(1.0, float(np.median(waits)) / step)
    if len(tails) == len(found):
        row["step_seconds_mean"] = step * float(np.median(tails))
    lines: JsonDict = {"fixed_seconds": time_line.fixed, "per_layer_seconds": time_line.per_layer}
    for field in DEPTH_BYTES_FIELDS:
        values = activation_values(found, field, static_bytes)
        if values is None:
            continue
        memory_line = DepthLine.fit(depths, values)
        row[field] = round(static_bytes[full_layers] + max(0.0, memory_line.at(full_layers)))
        row["from_slices"][field] = [r[field] for r in found.values()]
        if field == "peak_memory_bytes":
            lines.update(fixed_activation_bytes=memory_line.fixed, per_layer_activation_bytes=memory_line.per_layer)
    for field in CONSTANT_BYTES_FIELDS:
        if isinstance(deepest.get(field), (int, float)):
            row[field] = deepest[field]
    if deepest.get("loss"):
        row["loss"] = deepest["loss"]
    return row, lines


def held_out_pairs(
    found: dict[int, JsonDict], static_bytes: dict[int, float]
) -> tuple[tuple[float, float], tuple[float, float] | None]:
    """(predicted, measured) step seconds and peak bytes at the deepest depth, from the others."""
    depths = list(found)
    shallow, deepest = depths[:-1], depths[-1]
    time_line = DepthLine.fit(shallow, [found[depth]["step_seconds"] for depth in shallow])
    # Against what the deepest probe measured (rows smoothed by their depth's fit keep it aside).
    time_pair = (time_line.at(deepest), measured_seconds(found[deepest]))
    values = activation_values(found, "peak_memory_bytes", static_bytes)
    if values is None:
        return time_pair, None
    memory_line = DepthLine.fit(shallow, values[:-1])
    predicted = static_bytes[deepest] + max(0.0, memory_line.at(deepest))
    return time_pair, (predicted, float(found[deepest]["peak_memory_bytes"]))


# -- what a stored calibration says about its slices ---------------------------------------------
def slices_record(data: JsonDict) -> JsonDict | None:
    slices = data.get("slices")
    return slices if isinstance(slices, dict) else None


def slice_error(slices: JsonDict, kind: str) -> float:
    """The relative error a plan adds for extrapolating in depth (`kind`: time or memory): the held-out 90th percentile
    (UNTESTED_SLICE_ERROR when none was held out), × (1 + log2 of the stretch to full depth)."""
    held_out = (slices.get("held_out") or {}).get(kind) or {}
    p90 = held_out.get("p90_abs_pct")
    base = UNTESTED_SLICE_ERROR if p90 is None or not held_out.get("count") else float(p90) / 100.0
    # How far the full depth lies past the deepest depth the held-out error was measured at.
    stretch = max(1.0, float(slices["full_layers"]) / max(slices["depths"]))
    return base * (1 + math.log2(stretch))


def slice_widening(data: JsonDict, bound: float, kind: str = "time") -> float:
    """`bound` widened by the slices' extrapolation error, (1 + bound)(1 + error) − 1; itself for a whole-model calibration."""
    slices = slices_record(data)
    if slices is None:
        return bound
    return (1 + bound) * (1 + slice_error(slices, kind)) - 1


def describe_slices(slices: JsonDict) -> str:
    """One line for `bench show` and the plan: what was measured and how well it extrapolated."""
    depths = ", ".join(str(depth) for depth in slices["depths"])
    held = slices.get("held_out") or {}
    time, memory = held.get("time") or {}, held.get("memory") or {}
    if time.get("count"):
        error = (
            f"the deepest slice predicted from the shallower ones within {time['median_abs_pct']:.1f}% step time (median, "
            f"{time['p90_abs_pct']:.1f}% 90th percentile over {time['count']} configurations)"
            + (f" and {memory['median_abs_pct']:.1f}% peak memory" if memory.get("count") else "")
        )
    else:
        error = (
            f"no deeper slice held out (two depths): bounds widen by an assumed {UNTESTED_SLICE_ERROR:.0%} per stretch"
        )
    terms = slices.get("per_layer") or {}
    per_layer = ""
    if terms.get("seconds") is not None:
        per_layer = f"; per layer {terms['seconds'] * 1000:.3g} ms and {terms.get('activation_bytes', 0) / 2**20:.3g} MiB (median over configurations)"
    return (
        f"measured on layer slices of {depths} of its {slices['full_layers']} layers, extrapolated to the whole model{per_layer}; "
        f"{error}; plans widen time bounds by {slice_error(slices, 'time'):.0%}"
    )


def slices_plan_note(data: JsonDict) -> str | None:
    """The plan's note for a calibration measured on slices (None: measured whole)."""
    slices = slices_record(data)
    if slices is None:
        return None
    return f"calibration {data.get('id')} was {describe_slices(slices)}"
