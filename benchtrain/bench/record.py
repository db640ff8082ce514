"""Fit a calibration record's models (the drift correction kept only where it helps), say when it is noisy, and fit again for `bench refit`."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

from benchtrain.bench.disturbed import LEVELS, correct_for_drift, undo_correction
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT, fit_eval, fit_measurements
from benchtrain.calibration.memory_fit import held_gradient_bytes
from benchtrain.calibration.model import NOISY_MEDIAN_PCT
from benchtrain.calibration.process_check import judge, median_error
from benchtrain.calibration.schema import variant_data
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import new_id
from benchtrain.common.errors import MeasurementError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.step.hardware import device_label
from benchtrain.train.step.peak_memory import HOST_BASELINE_KEY

# Reserved this far above allocated (the caching allocator's fragmentation) is worth saying.
FRAGMENTATION_SHARE = 0.10


def fragmentation_warning(rows: list[JsonDict]) -> str | None:
    """On a GPU, when a probe's reserved peak lay well above its allocated peak: the plan counts it
    (calibration.memory_fit), and PyTorch's expandable segments may shrink it, unmeasured here."""
    gaps = [
        (row["peak_reserved_bytes"] - row["peak_memory_bytes"]) / row["peak_memory_bytes"]
        for row in rows
        if row["status"] == "ok" and row.get("peak_reserved_bytes") and row.get("peak_memory_bytes")
    ]
    if not gaps or max(gaps) <= FRAGMENTATION_SHARE:
        return None
    return (
        f"the CUDA allocator reserved up to {max(gaps):.0%} more than it allocated (fragmentation; plans count it): "
        "PYTORCH_ALLOC_CONF=expandable_segments:True may reduce it; measure it with its own `bench run` before training with it"
    )


def assess_noise(record: JsonDict) -> JsonDict | None:
    """When the fit's held-out error says estimates will be rough: how rough, and the likely cause
    (a busy machine, drift, unsteady steps, too few probes), in one sentence."""
    median = (record["fit"].get("held_out_error") or {}).get("median_abs_pct")
    if median is None or median <= NOISY_MEDIAN_PCT:
        return None
    ok = [row for row in record["measurements"] if row["status"] == "ok"]
    causes = []
    load, cores = record["search"].get("load_average_before"), record["hardware"].get("cpu_cores")
    if load is not None and cores and load > 0.5 * cores:
        causes.append(f"a busy machine (load average {load:.1f} on {cores} cores before the benchmark started)")
    drift = record["search"].get("drift") or {}
    if drift.get("spread_pct", 0) > 20:
        causes.append(f"drift (the repeated reference probe varied {drift['spread_pct']:.0f}%)")
    spreads = sorted(row.get("step_seconds_spread") or 0.0 for row in ok)
    if spreads and spreads[len(spreads) // 2] > 0.10:
        causes.append(f"unsteady steps (median spread {spreads[len(spreads) // 2]:.0%} within a probe)")
    if len(ok) < 12:
        causes.append(f"too few probes ({len(ok)})")
    if not causes:
        causes.append("configurations that the model does not describe well (steady steps, no drift)")
    message = (
        f"held-out error {median:.0f}% (median) is above {NOISY_MEDIAN_PCT:.0f}%: estimates from this calibration are rough; "
        f"likely cause: {'; '.join(causes)}. Re-run `bench run` on a quieter machine or with a larger --budget"
    )
    return {"held_out_median_pct": median, "causes": causes, "message": message}


def fit_record(record: JsonDict, fresh_rows: list[JsonDict]) -> None:
    """Fit the record's measurements (choosing the drift correction), judge the fit in the fresh
    processes' rows (bench.fresh_process) when there are any, and say when it is noisy."""
    record["fit"] = fit_with_drift_choice(
        record["measurements"], (record.get("search") or {}).get("drift"), record, fresh_rows
    )
    if fresh_rows:
        record["process_check"] = judge(record["fit"], fresh_rows, record["hardware"].get(HOST_BASELINE_KEY))
    record["noise"] = assess_noise(record)
    if record["noise"]:
        record["warnings"].append(record["noise"]["message"])


def fit_with_drift_choice(
    rows: list[JsonDict], drift: JsonDict | None, record: JsonDict, fresh_rows: list[JsonDict]
) -> JsonDict:
    """Keep the drift correction (and its level, bench.disturbed.LEVELS) only if it makes the fit better
    where a calibration is used: in fresh processes (`fresh_rows`), else on the held-out probes."""
    flops, gradients = (record.get("training") or {}).get("flops_terms"), held_gradient_bytes(record)
    corrected = fit_measurements(rows, flops, gradients)
    if not drift or not drift.get("applied"):
        return corrected
    raw_rows = copy.deepcopy(rows)
    undo_correction(raw_rows)
    fits = {
        drift.get("level", "median"): (rows, corrected),
        "raw": (raw_rows, fit_measurements(raw_rows, flops, gradients)),
    }
    if fresh_rows:
        judged_by = "fresh processes"
        references = [(m["position"], m["tokens_per_second"]) for m in drift["measurements"]]
        for level in LEVELS:
            if level not in fits:
                level_rows = copy.deepcopy(raw_rows)
                correct_for_drift(level_rows, references, StepConfig.from_row(drift["reference"]), level)
                fits[level] = (level_rows, fit_measurements(level_rows, flops, gradients))
        errors = {name: median_error(fit, fresh_rows) for name, (_, fit) in fits.items()}
    else:
        judged_by = "held-out probes"
        errors = {name: fit["held_out_error"]["median_abs_pct"] for name, (_, fit) in fits.items()}
    best = min(errors, key=lambda name: (errors[name], name == "raw"))  # a tie keeps the correction
    drift["median_error_pct"] = {**errors, "judged_by": judged_by}
    chosen_rows, chosen_fit = fits[best]
    if chosen_rows is not rows:
        rows[:] = chosen_rows  # the record's measurements are this list
    if best == "raw":
        drift["applied"] = False
        drift.pop("level", None)
        corrected_error = min(error for name, error in errors.items() if name != "raw")
        drift["reason"] = (
            f"the correction did not help: median error in {judged_by} {corrected_error:.1f}% corrected vs {errors['raw']:.1f}% raw"
        )
    else:
        drift["level"] = best
    return chosen_fit


def refit_record(source: JsonDict, created: datetime | None = None) -> JsonDict:
    """`bench refit`: a new calibration record from `source`'s measurements (untouched), fitted by
    this version; a new id with `refit_of` naming the source, so plans made with it stay reproducible."""
    created = created or datetime.now(timezone.utc)
    record = copy.deepcopy(source)
    rows = record["measurements"]
    ok = sum(1 for row in rows if row["status"] == "ok")
    if ok < MIN_ROWS_FOR_FIT:
        raise MeasurementError(
            f"calibration {source['id']} has {ok} successful probes; a fit needs at least {MIN_ROWS_FOR_FIT}"
        )
    record["id"] = new_id(device_label(record["hardware"]), record["model"]["name"], created)
    record["created_at"] = created.isoformat(timespec="seconds")
    record["refit_of"] = source["id"]
    record["warnings"] = [warning for warning in record.get("warnings", []) if not warning.startswith("held-out error")]
    # the fresh processes judge the new fit
    fit_record(record, (record.get("process_check") or {}).get("measurements") or [])
    if record.get("eval"):
        record["eval"]["fit"] = fit_eval(record["eval"].get("measurements", []))
    # Past runs measured the old fit's predictions: their correction does not carry over.
    record["history"] = []
    if record.get("variants"):  # each other variant measured (bench run --quantize none,4bit …), fitted again too
        refitted = [refit_record(variant_data(source, index), created) for index in range(len(record["variants"]))]
        record["variants"] = [
            {key: value for key, value in entry.items() if key not in ("id", "variants")} for entry in refitted
        ]
    return record
