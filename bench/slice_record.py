"""The calibration of a whole model from the calibrations of its layer slices (bench.layer_slices).

The model's record is the whole model's (from the `meta` device), so `train` plans the model it
trains. Each configuration measured at two depths or more gets a row at full depth (`from_slices`)
from its time and activation lines in depth (calibration.slices), fitted like measured rows. The
evaluation batches, the one-off costs that grow with depth and the step's split are lines in depth
too; those that do not grow are taken from the depths that measured them. `slices` records the
depths, the per-layer terms and the extrapolation's held-out error (plans widen their bounds by it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.record import assess_noise, fit_with_drift_choice
from calibration.fit import MIN_ROWS_FOR_FIT, fit_eval
from calibration.model import Calibration
from calibration.slices import DepthLine, SliceFit, derive_full_rows, derive_step_split, slice_error
from calibration.step_config import StepConfig
from common.errors import MeasurementError

# One-off costs that do not grow with depth (counts, rates, flags, the one compiled block): measured at
# the depths that timed them (bench.layer_slices); per shape, weighted by the shapes each compiled.
KEPT_OVERHEADS = {"warmup_steps", "disk_write_bytes_per_second", "checkpoint_extrapolated", "compile_cached_seconds_per_shape"}
PER_SHAPE_OVERHEADS = {"compile_seconds_per_shape": "compile_shapes_measured"}


@dataclass(frozen=True)
class WholeModel:
    """What the slices stand for: the whole model's record and its exact fixed bytes."""

    layers: int
    layer_key: str
    model: dict[str, Any]  # the calibration's `model` section
    training: dict[str, Any]  # trainable/total parameters and FLOPs terms of the whole model
    static_bytes: dict[int, float]  # before activations, per process, at each slice depth and at `layers`
    gpus_needed: int | None  # devices like the bench's the whole model needs (FSDP); None: no count holds it
    rule: str  # how the depths were chosen
    checkpoint_bytes: int = 0  # what the whole model's checkpoint holds (bench.calibrate.AfterProbePrices)


def combine_slices(records: dict[int, dict[str, Any]], whole: WholeModel) -> dict[str, Any]:
    """One calibration of the whole model from each depth's record (`records[K]`, K layers)."""
    depths = sorted(records)
    deepest = records[depths[-1]]
    fitted = derive_full_rows({depth: smoothed_rows(records[depth]) for depth in depths}, whole.layers, whole.static_bytes)
    if len(fitted.rows) < MIN_ROWS_FOR_FIT:
        raise MeasurementError(
            f"only {len(fitted.rows)} configurations were measured at two slice depths or more; a fit of the whole model needs "
            f"{MIN_ROWS_FOR_FIT}: raise --budget or narrow the grid (--batch-sizes, --seq-lens)"
        )
    record = {key: value for key, value in deepest.items() if key not in ("noise", "left_out_configs")}
    record.update(model=whole.model, training={**deepest["training"], **whole.training}, measurements=fitted.rows, history=[])
    record["fit"] = fit_with_drift_choice(fitted.rows, None, record, [])
    eval_rows = derive_eval_rows(records, whole.layers)
    record["eval"] = {"measurements": eval_rows, "fit": fit_eval(eval_rows)}
    record["overheads"] = derive_overheads(records, whole.layers, whole.checkpoint_bytes)
    record["search"] = {**deepest["search"], "slice_depths": {str(depth): depth_summary(records[depth]) for depth in depths}}
    record["slices"] = slices_section(fitted, depths, whole)
    # The deepest slice's split is not the whole model's (its head weighs more): lines in depth, or
    # none (the whole model's FLOP-count split then stands).
    record["step_split"] = derive_step_split({depth: records[depth].get("step_split") or [] for depth in depths}, whole.layers)
    if not record["step_split"]:
        del record["step_split"]
    record["warnings"] = list(dict.fromkeys(warning for depth in depths for warning in records[depth].get("warnings", [])))
    noise = assess_noise(record)
    if noise:
        record["noise"] = noise
        record["warnings"].append(noise["message"])
    record["left_out_configs"] = deepest.get("left_out_configs", [])
    return record


def smoothed_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A depth's ok rows with their step time as that depth's (robust) fit predicts it, the measured
    median kept as `step_seconds_measured`: one disturbed probe would otherwise bend a line through
    two or three depths. Memory stays measured (it is exact to a fraction of a percent)."""
    model = Calibration(record).throughput
    rows = []
    for row in record["measurements"]:
        if row.get("status") == "ok" and row.get("step_seconds"):
            fitted = model.micro_step_seconds(StepConfig.from_row(row)) * row["grad_accum"]
            row = {**row, "step_seconds": fitted, "step_seconds_measured": row["step_seconds"]}
        rows.append(row)
    return rows


def depth_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What one depth's bench measured and how well its own fit held out."""
    rows = record["measurements"]
    fit = record.get("fit") or {}
    return {
        "probes": len(rows),
        "ok": sum(1 for row in rows if row["status"] == "ok"),
        "held_out_median_pct": (fit.get("held_out_error") or {}).get("median_abs_pct"),
        "benchmark_seconds": (record.get("overheads") or {}).get("benchmark_seconds"),
        "budget_seconds": (record.get("search") or {}).get("budget_seconds"),
    }


def slices_section(fitted: SliceFit, depths: list[int], whole: WholeModel) -> dict[str, Any]:
    per_layer = [entry["per_layer_seconds"] for entry in fitted.per_config]
    activations = [entry["per_layer_activation_bytes"] for entry in fitted.per_config if "per_layer_activation_bytes" in entry]
    fixed = [entry["fixed_seconds"] for entry in fitted.per_config]
    section: dict[str, Any] = {
        "depths": depths,
        "full_layers": whole.layers,
        "layer_key": whole.layer_key,
        "rule": whole.rule,
        "per_layer": {
            "seconds": statistics.median(per_layer),
            "activation_bytes": statistics.median(activations) if activations else None,
            "fixed_seconds": statistics.median(fixed),
        },
        "per_config": fitted.per_config,
        "held_out": {
            "time": {**fitted.held_out_time.to_json(), "signed_relative": fitted.held_out_time.signed_relative},
            "memory": {**fitted.held_out_memory.to_json(), "signed_relative": fitted.held_out_memory.signed_relative},
        },
        "static_bytes": {str(depth): whole.static_bytes[depth] for depth in sorted(whole.static_bytes)},
        "gpus_needed": whole.gpus_needed,
    }
    time = section["held_out"]["time"]
    section["held_out_error_pct"] = time["median_abs_pct"]
    section["bound_widening"] = {"time": slice_error(section, "time"), "memory": slice_error(section, "memory")}
    return section


def derive_eval_rows(records: dict[int, dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Forward-only batches at full depth, one per (batch, length) evaluated at two depths or more."""
    found: dict[tuple[int, int], dict[int, float]] = {}
    for depth, record in records.items():
        for row in (record.get("eval") or {}).get("measurements") or []:
            if row.get("status") == "ok" and row.get("batch_seconds"):
                found.setdefault((row["micro_batch_size"], row["seq_len"]), {})[depth] = float(row["batch_seconds"])
    rows = []
    for (batch, length), seconds in sorted(found.items()):
        if len(seconds) < 2:
            continue
        line = DepthLine.fit(list(seconds), list(seconds.values()))
        value = max(line.at(layers), max(seconds.values()))
        rows.append({"micro_batch_size": batch, "seq_len": length, "status": "ok", "batch_seconds": value, "tokens_per_second": batch * length / value})
    return rows


def derive_overheads(records: dict[int, dict[str, Any]], layers: int, checkpoint_bytes: int = 0) -> dict[str, float]:
    """The one-off costs at full depth: lines in depth where every depth measured them (model
    build, warm-up), the depth-free ones as measured (KEPT_OVERHEADS, PER_SHAPE_OVERHEADS), the
    whole model's checkpoint written at the measured disk speed, and the whole bench's seconds."""
    depths = sorted(records)
    found = {depth: records[depth].get("overheads") or {} for depth in depths}
    overheads: dict[str, Any] = {}
    for name in dict.fromkeys(key for depth in depths for key in found[depth]):
        values = {depth: found[depth][name] for depth in depths if isinstance(found[depth].get(name), (int, float))}
        if name in PER_SHAPE_OVERHEADS or name in PER_SHAPE_OVERHEADS.values():
            continue
        if name in KEPT_OVERHEADS or len(values) < len(depths):
            overheads[name] = next((found[depth][name] for depth in depths if name in found[depth]), None)
        else:
            overheads[name] = max(0.0, DepthLine.fit(depths, list(values.values())).at(layers))
    for name, count in PER_SHAPE_OVERHEADS.items():
        weights = {depth: float(found[depth].get(count) or 0) for depth in depths if isinstance(found[depth].get(name), (int, float))}
        if weights:
            total = sum(weights.values())
            mean = sum(weights[d] * found[d][name] for d in weights) / total if total else max(found[d][name] for d in weights)
            overheads.update({name: mean, count: int(total)})
    rate = overheads.get("disk_write_bytes_per_second")
    if checkpoint_bytes:
        overheads["checkpoint_bytes"] = checkpoint_bytes
    if rate and overheads.get("checkpoint_bytes"):
        overheads["checkpoint_save_seconds"] = round(overheads["checkpoint_bytes"] / rate, 4)
        overheads["checkpoint_bytes"] = round(overheads["checkpoint_bytes"])
    overheads["benchmark_seconds"] = round(sum(float(found[d].get("benchmark_seconds") or 0.0) for d in depths), 2)
    return overheads
