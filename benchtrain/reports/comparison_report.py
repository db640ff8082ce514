"""The report of which machine to rent (`train --dry-run --use-calibration A,B,C` or `--consider`,
train.recipes.machines): the table, and each row's time against its cost with the deadline, read
from the comparison.json the command wrote (reports read files, never train's objects)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.atomic import read_json_file
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.reports import figures
from benchtrain.reports.html import bullet_list, figure_grid, section, table, verdict, write_page

HOUR = 3600.0


def read_comparison(folder: Path) -> JsonDict:
    path = Path(folder) / "comparison.json"
    record = read_json_file(path, missing=f"{folder} has no comparison.json")
    if not isinstance(record, dict) or record.get("kind") != "comparison" or not isinstance(record.get("rows"), list):
        raise BenchtrainError(f"{path} is not a benchtrain comparison")
    return record


def option_label(index: int, row: JsonDict) -> str:
    if row.get("machine"):  # a row of --consider: the machine and where its figures come from
        return f"{index}. {row['machine']} ({row['kind']})"
    return f"{index}. {row['device']} × {row['world_size']}" + (" (predicted)" if row["source"] == "predicted" else "")


def name_of(row: JsonDict) -> str:
    return str(row.get("machine") or row.get("reference") or row.get("calibration_id"))


def write_comparison_report(folder: Path) -> Path:
    folder = Path(folder)
    record = read_comparison(folder)
    rows = record["rows"]
    deadline = record["deadline_seconds"]
    sections = []
    best = next((row for row in rows if row["recommended"]), None)
    if best is not None:
        chosen = best["plan"]["chosen"]
        cost = f" for ${best['cost']:,.2f}" if best["cost"] is not None else ""
        recommended = f"Recommended: {name_of(best)} on {best['device']} × {best['world_size']} — ≈{format_duration(chosen['total_seconds'])}{cost}"
        sections.append(verdict(f"{recommended}, meets the {format_duration(deadline)} deadline", True))
    else:
        sections.append(verdict(f"No option meets the {format_duration(deadline)} deadline.", False))
    frame = pd.DataFrame([table_row(index, row) for index, row in enumerate(rows, 1)])
    sections.append(section("Options, recommended first", table(frame)))
    planned = [(index, row) for index, row in enumerate(rows, 1) if row["plan"] is not None]
    if planned:
        options = [
            {
                "label": option_label(index, row),
                "hours": row["plan"]["chosen"]["total_seconds"] / HOUR,
                "low": row["plan"]["chosen"]["total_seconds_low"] / HOUR,
                "high": row["plan"]["chosen"][upper_key(row)] / HOUR,
                "cost": row["cost"],
                "predicted": row.get("kind", row["source"]) in ("predicted", "translated"),
                "recommended": row["recommended"],
            }
            for index, row in planned
        ]
        chosen = next((option for option in options if option["recommended"]), None)
        why = (
            "meets the deadline at the lowest cost"
            if record["ranked_by"] == "cost"
            else "is the fastest that meets the deadline"
        )
        finding = f"{chosen['label']} {why}" if chosen else "no option meets the deadline"
        title = f"{record['model']} ({record['method']}), priority {record['priority']}: {finding}"
        path = figures.time_vs_cost(options, deadline / HOUR, folder / "time_vs_cost.png", title)
        sections.append(
            section(
                "Time vs cost",
                figure_grid([(path, "Estimated time (bars: bounds) against cost; the dashed line is the deadline")]),
            )
        )
    notes = [*record.get("notes", []), *[f"{name_of(row)}: {row['problem']}" for row in rows if row.get("problem")]]
    notes += [f"{name_of(row)}: rests on {row['rests_on']}" for row in rows if row.get("rests_on") and row.get("plan")]
    notes += [f"{name_of(row)}: settle with `{row['settle']}`" for row in rows if row.get("settle")]
    notes.append(
        f"ranked by {record['ranked_by']}: the options that meet the deadline first, the cheapest first (ties by time)"
    )
    sections.append(section("Notes", bullet_list(notes)))
    subtitle = f"{len(rows)} option(s), deadline {format_duration(deadline)}, {format_duration(max(0.0, record['available_seconds']))} usable"
    return write_page(folder / "report.html", f"Which machine: {record['model']}", subtitle, sections)


def upper_key(row: JsonDict) -> str:
    """A --consider row is judged at the upper end its deadline is checked against."""
    return "total_seconds_promised" if row.get("machine") else "total_seconds_high"


def cost_cell(row: JsonDict) -> str | float | None:
    if row.get("cost_low") is not None and row.get("cost_upper") is not None:
        return f"{row['cost_low']:,.2f} – {row['cost_upper']:,.2f}"
    return None if row.get("cost") is None else round(row["cost"], 2)


def table_row(index: int, row: JsonDict) -> JsonDict:
    plan = row.get("plan")
    chosen = plan["chosen"] if plan else {}
    peak = chosen.get("peak_memory_bytes")
    compute = row.get("compute") or {}
    return {
        "#": f"{index}{' (recommended)' if row['recommended'] else ''}",
        "calibration": name_of(row),
        "device": row["device"],
        "processes": row["world_size"],
        "source": row.get("kind") or row["source"],
        "plan": (
            StepConfig.from_row({**chosen, "seq_len": chosen["max_length"]}).phrase if plan else row.get("problem")
        ),
        "time": format_duration(chosen["total_seconds"]) if plan else None,
        "bounds": f"{format_duration(chosen['total_seconds_low'])} – {format_duration(chosen[upper_key(row)])}"
        if plan
        else None,
        "cost ($)": cost_cell(row),
        "peak memory (GiB)": None if peak is None else round(peak / 2**30, 1),
        "headroom": None if row.get("memory_headroom") is None else f"{row['memory_headroom']:.0%}",
        "MFU": None if compute.get("mfu") is None else f"{compute['mfu']:.1%}",
        "deadline": ("meets" if row["meets_deadline"] else "misses") if plan else None,
    }
