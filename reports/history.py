"""Across every run in BENCHTRAIN_HOME: how wrong was each estimate, oldest first?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from calibration.accuracy import ERROR_LABEL, check_estimate
from common.home import benchtrain_home


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
    """One row per finished run: its estimate check (calibration.accuracy.check_estimate), the
    same figures its own report, run.json and the console give."""
    rows = []
    for record in records:
        check = check_estimate(record)
        if check is None or not check.actual_seconds or check.error_pct is None:
            continue
        rows.append(
            {
                "run": record.get("run_id", "?"),
                "created": record.get("created_at", ""),
                "calibration": record.get("calibration_id", ""),
                "steps run": f"{check.steps_run} of {check.planned_steps}",
                "estimate (s)": round(check.estimated_seconds, 1),
                "actual (s)": round(check.actual_seconds, 1),
                ERROR_LABEL: round(check.error_pct, 1),
                "deadline met": "yes" if record.get("met_deadline") else "no",
            }
        )
    return rows
