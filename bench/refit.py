"""`bench refit`: fit a stored calibration's measurements again with the current model code.

The measurements are not touched; the result is stored as a new calibration (a new id, `refit_of`
naming the source) so that plans made with the old one stay reproducible.
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone

from bench.record import fit_record
from calibration.fit import MIN_ROWS_FOR_FIT, fit_eval
from calibration.schema import variant_data
from calibration.store import new_id
from common.errors import MeasurementError
from common.json_types import JsonDict
from train.step.hardware import device_label


def refit_record(source: JsonDict, created: datetime | None = None) -> JsonDict:
    """A new calibration record from `source`'s measurements, fitted by this version."""
    created = created or datetime.now(timezone.utc)
    record = copy.deepcopy(source)
    rows = record["measurements"]
    ok = sum(1 for row in rows if row["status"] == "ok")
    if ok < MIN_ROWS_FOR_FIT:
        raise MeasurementError(f"calibration {source['id']} has {ok} successful probes; a fit needs at least {MIN_ROWS_FOR_FIT}")
    record["id"] = new_id(device_label(record["hardware"]), record["model"]["name"], created)
    record["created_at"] = created.isoformat(timespec="seconds")
    record["refit_of"] = source["id"]
    record["warnings"] = [warning for warning in record.get("warnings", []) if not warning.startswith("held-out error")]
    fit_record(record, (record.get("process_check") or {}).get("measurements") or [])  # the fresh processes judge the new fit
    if record.get("eval"):
        record["eval"]["fit"] = fit_eval(record["eval"].get("measurements", []))
    # Past runs measured the old fit's predictions: their correction does not carry over.
    record["history"] = []
    if record.get("variants"):  # each other variant measured (bench run --quantize none,4bit …), fitted again too
        refitted = [refit_record(variant_data(source, index), created) for index in range(len(record["variants"]))]
        record["variants"] = [{key: value for key, value in entry.items() if key not in ("id", "variants")} for entry in refitted]
    return record
