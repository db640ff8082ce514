"""The calibration file's schema: version, required fields and their types, migrations; every
failure is one line that names the file and the field."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

from benchtrain.calibration import extrapolation
from benchtrain.calibration.dimensions import DIMENSIONS, switches
from benchtrain.calibration.fit import EVAL_TERMS, smoother_switches, throughput_terms
from benchtrain.calibration.fit_tools import is_number
from benchtrain.calibration.memory_fit import BASES, MEMORY_FIELDS, memory_terms
from benchtrain.calibration.setup import variant_of
from benchtrain.common.errors import CalibrationFileError, CalibrationTooOldError
from benchtrain.common.home import benchtrain_home
from benchtrain.common.json_types import JsonDict

SCHEMA_VERSION = 4
# The version before the current one upgrades on read (_v3_to_v4); older files are refused for planning
# (CalibrationTooOldError): measure again with `bench run`, or re-fit their probes (read_for_refit).
OLDEST_READABLE = SCHEMA_VERSION - 1
# Since version 2 a probe's row holds what today's rows hold (what was trained, checkpointing, the median step); the
# versions since differ in their fits alone, which `bench refit` replaces. Version 1 stored the mean step.
REFITTABLE_FROM = 2


class ListedCalibration(NamedTuple):
    """A calibration file found (stored, pulled from the hub, or a bench's kept measurements): what it holds, or None
    and why it cannot be read."""

    path: Path
    data: JsonDict | None
    error: str | None = None


def _v3_to_v4(data: JsonDict) -> JsonDict:
    """Version 4's memory fit records its `basis` and `non_torch_bytes` (on a GPU, the reserved peak and the bytes outside
    the allocator); a version 3 fit was of the allocated peak with nothing added, and plans so (the plan says so)."""
    data = dict(data)
    for entry in (data, *(data.get("variants") or [])):
        fit = entry.get("fit") if isinstance(entry, dict) else None
        memory = fit.get("memory") if isinstance(fit, dict) else None
        if isinstance(memory, dict):
            memory.setdefault("basis", "allocated")
            memory.setdefault("non_torch_bytes", 0.0)
    data["schema_version"] = 4
    return data


_NUMBER = (int, float)
REQUIRED_TOP = {
    "schema_version": int,
    "id": str,
    "created_at": str,
    "hardware": dict,
    "software": dict,
    "model": dict,
    "measurements": list,
}
REQUIRED_HARDWARE = {"device_type": str, "name": str, "count": int, "memory_bytes": _NUMBER}
REQUIRED_MODEL = {"name": str, "parameter_count": int, "fingerprint": str}
REQUIRED_MEASUREMENT = {"micro_batch_size": int, "num_workers": int, "grad_accum": int, "seq_len": int, "status": str}
MEASUREMENT_NUMBERS = ("tokens_per_second", "step_seconds", *MEMORY_FIELDS)
STATUSES = {"ok", "oom", "error", "skipped"}


def read_calibration_file(path: Path) -> JsonDict:
    """Parse, migrate and validate a calibration file, or raise a one-line error naming it."""
    return validate(migrate(_parse(path), path), path)


def _parse(path: Path) -> object:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise CalibrationFileError(f"cannot read calibration {path}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CalibrationFileError(f"calibration {path} is not valid JSON ({error}); re-run `bench run`") from None


@dataclass(frozen=True)
class ProbesToRefit:
    """A calibration as `bench refit` reads it: the record at today's schema (an older one's fits set aside), the
    schema its file was written at, and its fit's held-out median error (None: it had no fit, or it was set aside)."""

    data: JsonDict
    schema_version: int
    held_out_median_pct: float | None


def read_for_refit(path: Path) -> ProbesToRefit:
    """A calibration whose probes `bench refit` fits again: one read today, as read_calibration_file reads it; one of
    schema REFITTABLE_FROM or later that planning refuses, its probes as they are and its fits set aside (the refit
    replaces them; their terms are what changed since); older still, refused in one line."""
    parsed = _parse(path)
    try:
        data = validate(migrate(parsed, path), path)
    except CalibrationTooOldError:
        version = cast(JsonDict, parsed)["schema_version"]  # migrate read it: an integer
        if version < REFITTABLE_FROM:
            raise
        return ProbesToRefit(validate(_fits_set_aside(cast(JsonDict, parsed)), path), version, None)
    fit = data.get("fit") or {}
    return ProbesToRefit(
        data, cast(JsonDict, parsed)["schema_version"], fit.get("held_out_error", {}).get("median_abs_pct")
    )


def _fits_set_aside(data: JsonDict) -> JsonDict:
    """An older record at today's schema with no fit: its measurements, setup and history as they were."""
    record = copy.deepcopy(data)
    for entry in (record, *(record.get("variants") or [])):
        if isinstance(entry, dict):
            entry.pop("fit", None)
            evaluation = entry.get("eval")
            if isinstance(evaluation, dict):
                evaluation.pop("fit", None)
    record["schema_version"] = SCHEMA_VERSION
    return record


def _refit_reference(data: JsonDict, path: Path | str) -> str:
    """What `bench refit` takes for this file: its id where it is in the store, else its path."""
    stored = Path(path).resolve().parent == (benchtrain_home() / "calibrations").resolve()
    identity = data.get("id")
    return identity if stored and isinstance(identity, str) and Path(path).stem == identity else str(path)


def migrate(parsed: object, path: Path | str) -> JsonDict:
    if not isinstance(parsed, dict):
        raise CalibrationFileError(f"calibration {path}: expected a JSON object, got {type(parsed).__name__}")
    data: JsonDict = parsed  # a JSON object: its keys are strings
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CalibrationFileError(f"calibration {path}: missing or non-integer schema_version")
    if version > SCHEMA_VERSION:
        raise CalibrationFileError(
            f"calibration {path} has schema_version {version}, newer than this benchtrain understands ({SCHEMA_VERSION}); upgrade benchtrain"
        )
    if version < OLDEST_READABLE:
        refit = (
            f", or `bench refit {_refit_reference(data, path)}` to re-fit its probes at schema {SCHEMA_VERSION}"
            if version >= REFITTABLE_FROM
            else ""
        )
        raise CalibrationTooOldError(
            f"calibration {path} has schema_version {version}, older than this benchtrain reads ({OLDEST_READABLE} to {SCHEMA_VERSION}); "
            f"measure again with `bench run`{refit}"
        )
    return _v3_to_v4(data) if version == 3 else data


def validate(data: JsonDict, path: Path | str) -> JsonDict:
    _check_fields(data, REQUIRED_TOP, f"calibration {path}")
    _check_fields(data["hardware"], REQUIRED_HARDWARE, f"calibration {path}: hardware")
    _check_fields(data["model"], REQUIRED_MODEL, f"calibration {path}: model")
    for index, row in enumerate(data["measurements"]):
        where = f"calibration {path}: measurements[{index}]"
        if not isinstance(row, dict):
            raise CalibrationFileError(f"{where} is not an object")
        _check_fields(row, REQUIRED_MEASUREMENT, where)
        if row["status"] not in STATUSES:
            raise CalibrationFileError(f"{where}.status is {row['status']!r}, expected one of {sorted(STATUSES)}")
        for name in MEASUREMENT_NUMBERS:
            value = row.get(name)
            if value is not None and not is_number(value):
                raise CalibrationFileError(f"{where}.{name} should be a number, got {type(value).__name__}")
        if row["status"] == "ok" and not (is_number(row.get("step_seconds")) and row["step_seconds"] > 0):
            raise CalibrationFileError(f"{where}: an ok row needs a positive step_seconds")
        for name in REQUIRED_MEASUREMENT:
            if name != "status" and row[name] < DIMENSIONS[name].minimum:
                raise CalibrationFileError(f"{where}.{name} is out of range: {row[name]}")
    fit = data.get("fit")
    if fit is not None:
        _check_fit(fit, f"calibration {path}: fit")
    history = data.get("history", [])
    if not isinstance(history, list):
        raise CalibrationFileError(f"calibration {path}: history should be a list")
    for index, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise CalibrationFileError(f"calibration {path}: history[{index}] is not an object")
        for name in ("predicted_tokens_per_second", "actual_tokens_per_second"):
            if entry.get(name) is not None and not is_number(entry[name]):
                raise CalibrationFileError(f"calibration {path}: history[{index}].{name} should be a number")
    evaluation = data.get("eval")
    if evaluation is not None:
        fit = evaluation.get("fit") if isinstance(evaluation, dict) else None
        if not isinstance(evaluation, dict) or (
            fit is not None and not (isinstance(fit, dict) and isinstance(fit.get("parameters"), dict))
        ):
            raise CalibrationFileError(f"calibration {path}: eval should be an object with measurements and a fit")
        if fit is not None and not all(is_number(fit["parameters"].get(term)) for term in EVAL_TERMS):
            raise CalibrationFileError(
                f"calibration {path}: eval.fit.parameters should hold numbers for {', '.join(EVAL_TERMS)}"
            )
    training = data.get("training")
    if training is not None and (not isinstance(training, dict) or not isinstance(training.get("method"), str)):
        raise CalibrationFileError(
            f"calibration {path}: training.method should be a method's name, e.g. 'full' or 'lora'"
        )
    flops_terms = (training or {}).get("flops_terms")
    if flops_terms is not None and not (
        isinstance(flops_terms, dict) and all(_non_negative(value) for value in flops_terms.values())
    ):
        raise CalibrationFileError(
            f"calibration {path}: training.flops_terms should map compute terms to non-negative FLOPs per token"
        )
    overheads = data.get("overheads", {})
    if not isinstance(overheads, dict) or not all(is_number(v) for v in overheads.values()):
        raise CalibrationFileError(f"calibration {path}: overheads should map names to numbers")
    if data.get("slices") is not None:
        _check_slices(data["slices"], f"calibration {path}: slices")
    variants = data.get("variants")
    if variants is not None:
        if not isinstance(variants, list) or not all(isinstance(entry, dict) for entry in variants):
            raise CalibrationFileError(f"calibration {path}: variants should be a list of objects")
        _check_variants(data, variants, path)
    return data


# What each variant measured for itself: without them a variant would inherit the first one's
# probes and fit through `variant_data` and plan as a variant nobody measured.
VARIANT_OWN_FIELDS = {"measurements": list, "training": dict}


def _check_variants(data: JsonDict, variants: list[JsonDict], path: Path | str) -> None:
    seen = {variant_of(data): "the first setup"}
    for index, entry in enumerate(variants):
        where = f"calibration {path}: variants[{index}]"
        _check_fields(entry, VARIANT_OWN_FIELDS, where)
        validate(variant_data(data, index), f"{path} (variants[{index}])")
        key = variant_of(entry)
        if key in seen:
            raise CalibrationFileError(
                f"{where} measured the same setup as {seen[key]} (quantize {key[0]}, optimizer {key[1]})"
            )
        seen[key] = f"variants[{index}]"


def variant_data(data: JsonDict, index: int | None) -> JsonDict:
    """The whole calibration as one of its variants sees it: `bench run --quantize none,4bit` stores the first variant measured at the top and each other one
    under `variants` (its measurements, fit, training, overheads, history), over the shared rest (device, model, data). None: the first."""
    shared = {key: value for key, value in data.items() if key != "variants"}
    return shared if index is None else {**shared, **data["variants"][index], "id": data["id"]}


def variant_history(data: JsonDict, index: int | None) -> list[JsonDict]:
    """The history list that runs planned with variant `index` append to (in place)."""
    # JSON read: validate() checked that variants are objects; history is a list wherever present.
    return cast(list[JsonDict], (data if index is None else data["variants"][index]).setdefault("history", []))


def _switch_own(term: str) -> bool:
    """A term a switch adds (a file from before the switch lacks it: zero)."""
    return any(
        term in (*(own.name for own in (*dimension.memory, *dimension.throughput)), *(dimension.activations or ()))
        for dimension in switches()
    )


def _check_fit(fit: Any, where: str) -> None:
    if not isinstance(fit, dict):
        raise CalibrationFileError(f"{where} should be an object")
    _check_fields(fit, {"kind": str, "parameters": dict, "held_out_error": dict}, where)
    for term in throughput_terms():  # a switch's term a file predates is absent (zero)
        if not is_number(fit["parameters"].get(term)) and (term in fit["parameters"] or not _switch_own(term)):
            raise CalibrationFileError(f"{where}.parameters.{term} is missing or not a number")
    smoother = fit.get("smoother")
    if smoother is not None:
        if not isinstance(smoother, dict):
            raise CalibrationFileError(f"{where}.smoother should be an object")
        points, residuals = smoother.get("points"), smoother.get("log_residuals")
        if not (isinstance(points, list) and isinstance(residuals, list) and len(points) == len(residuals)):
            raise CalibrationFileError(f"{where}.smoother needs points and log_residuals of equal length")
        widest = 4 + len(smoother_switches())  # the sizes' coordinates, then the switches' (a file may predate some)
        if not all(isinstance(p, list) and 4 <= len(p) <= widest and all(is_number(v) for v in p) for p in points):
            raise CalibrationFileError(f"{where}.smoother.points should be lists of 4 to {widest} numbers")
        if not all(is_number(v) for v in residuals) or not is_number(smoother.get("bandwidth")):
            raise CalibrationFileError(f"{where}.smoother has a non-number value")
    if fit.get("extrapolation_by_dimension") is not None:  # optional: older fits plan by the old rule
        _check_extrapolation(fit["extrapolation_by_dimension"], f"{where}.extrapolation_by_dimension")
    memory = fit.get("memory")
    if memory is not None:
        if not isinstance(memory, dict) or not isinstance(memory.get("parameters"), dict):
            raise CalibrationFileError(f"{where}.memory should be an object with parameters")
        for term in memory_terms():  # a switch's own term a file predates is absent (zero)
            if not is_number(memory["parameters"].get(term)) and (
                term in memory["parameters"] or not _switch_own(term)
            ):
                raise CalibrationFileError(f"{where}.memory.parameters.{term} is missing or not a number")
        if memory.get("basis", "allocated") not in BASES:
            raise CalibrationFileError(f"{where}.memory.basis is {memory['basis']!r}, expected one of {list(BASES)}")
        outside = memory.get("non_torch_bytes", 0.0)
        if not _non_negative(outside):
            raise CalibrationFileError(f"{where}.memory.non_torch_bytes should be a non-negative number")


def _non_negative(value: Any) -> bool:
    return is_number(value) and value >= 0


def _check_extrapolation(record: Any, where: str) -> None:
    """A stored `extrapolation_by_dimension` record (calibration.extrapolation)."""
    if not isinstance(record, dict):
        raise CalibrationFileError(f"{where} should be an object")
    for name, entry in record.items():
        if name not in extrapolation.STRETCHED:
            raise CalibrationFileError(
                f"{where}: unknown dimension {name!r} (known: {', '.join(extrapolation.STRETCHED)})"
            )
        if entry is not None and not isinstance(entry, dict):
            raise CalibrationFileError(f"{where}.{name} should be an object or null")
        for field in ("p90_abs_pct", "stretch"):
            value = (entry or {}).get(field)
            if value is not None and not _non_negative(value):
                raise CalibrationFileError(f"{where}.{name}.{field} should be a non-negative number")


def _check_slices(slices: Any, where: str) -> None:
    """The `slices` section of a calibration measured on layer slices (calibration.slices)."""
    if not isinstance(slices, dict):
        raise CalibrationFileError(f"{where} should be an object")
    depths, full = slices.get("depths"), slices.get("full_layers")
    if not (
        isinstance(depths, list)
        and len(depths) >= 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in depths)
    ):
        raise CalibrationFileError(f"{where}.depths should list two or more positive layer counts")
    if not (isinstance(full, int) and not isinstance(full, bool) and full >= max(depths)):
        raise CalibrationFileError(f"{where}.full_layers should be an integer at least the deepest slice")
    held = slices.get("held_out", {})
    if not isinstance(held, dict) or not all(isinstance(held.get(kind, {}), dict) for kind in ("time", "memory")):
        raise CalibrationFileError(f"{where}.held_out should hold time and memory error summaries")
    for kind in ("time", "memory"):
        p90 = (held.get(kind) or {}).get("p90_abs_pct")
        if p90 is not None and not _non_negative(p90):
            raise CalibrationFileError(f"{where}.held_out.{kind}.p90_abs_pct should be a non-negative number")


def _check_fields(obj: Any, required: JsonDict, where: str) -> None:
    if not isinstance(obj, dict):
        raise CalibrationFileError(f"{where} should be an object")
    for name, kind in required.items():
        if name not in obj:
            raise CalibrationFileError(f"{where}: missing field {name!r}")
        value = obj[name]
        ok = (
            is_number(value)
            if kind is _NUMBER
            else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        )
        if not ok:
            expected = "number" if kind is _NUMBER else kind.__name__
            raise CalibrationFileError(f"{where}: field {name!r} should be {expected}, got {type(value).__name__}")
