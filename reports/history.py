"""Across every run in BENCHTRAIN_HOME: how wrong was each estimate, oldest first?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from calibration.accuracy import ERROR_LABEL, estimate_error_pct
from calibration.home import benchtrain_home


def run_records(runs_dir: Path | None = None) -> list[dict[str, Any]]:
    folder = runs_dir or benchtrain_home() / "runs"
    records = []
    for path in sorted(folder.glob("*/run.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and record.get("actual") and record.get("estimate"):
            records.append(record)
    records.sort(key=lambda record: record.get("created_at", ""))
    return records


def error_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        actual = record["actual"].get("total_seconds")
        estimate = record["estimate"].get("total_seconds")
        if not actual or estimate is None:
            continue
        rows.append(
            {
                "run": record.get("run_id", "?"),
                "created": record.get("created_at", ""),
                "calibration": record.get("calibration_id", ""),
                "estimate (s)": round(estimate, 1),
                "actual (s)": round(actual, 1),
                ERROR_LABEL: round(estimate_error_pct(estimate, actual), 1),
                "deadline met": "yes" if record.get("met_deadline") else "no",
            }
        )
    return rows
