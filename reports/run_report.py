"""The run report: did the estimate hold, and why (or why not)?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from calibration.accuracy import ERROR_LABEL, describe_estimate_error, estimate_error_pct
from calibration.errors import BenchtrainError
from reports import figures
from reports.history import error_rows, run_records
from reports.html import bullet_list, figure_grid, key_values, page, section, table, verdict

ROLLING_STEPS = 20


def read_run(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "run.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise BenchtrainError(f"{run_dir} has no run.json: pass a run folder or a calibration") from None
    except (OSError, json.JSONDecodeError) as error:
        raise BenchtrainError(f"cannot read {path}: {error}") from None
    if not isinstance(record, dict) or "plan" not in record or "estimate" not in record:
        raise BenchtrainError(f"{path} is not a benchtrain run record (no plan/estimate)")
    return record


def write_run_report(run_dir: Path) -> Path:
    import pandas as pd

    run_dir = Path(run_dir)
    record = read_run(run_dir)
    estimate, actual, plan = record["estimate"], record.get("actual") or {}, record["plan"]
    deadline = record["deadline_seconds"]
    sections = []
    if actual:
        error = estimate_error_pct(estimate["total_seconds"], actual.get("total_seconds"))
        met = bool(record.get("met_deadline"))
        sections.append(
            verdict(
                f"Estimate {estimate['total_seconds']:.0f}s, actual {actual['total_seconds']:.0f}s: estimate error "
                f"{describe_estimate_error(error)}; deadline {deadline:.0f}s {'met' if met else 'missed'}; status {actual.get('status')}.",
                met and error is not None and abs(error) <= 15,
            )
        )
    else:
        sections.append(verdict("This run has a plan but has not finished training.", False))

    summary = pd.DataFrame(
        [
            {
                "": "total time (s)",
                "estimate": estimate["total_seconds"],
                "low": estimate["total_seconds_low"],
                "high": estimate["total_seconds_high"],
                "actual": actual.get("total_seconds"),
            },
            {
                "": "training time (s)",
                "estimate": estimate["train_seconds"],
                "low": None,
                "high": None,
                "actual": actual.get("train_seconds"),
            },
            {
                "": "real tokens/s",
                "estimate": estimate["tokens_per_second"],
                "low": estimate["tokens_per_second_low"],
                "high": estimate["tokens_per_second_high"],
                "actual": actual.get("tokens_per_second"),
            },
            {
                "": "peak memory (GiB)",
                "estimate": _gib(estimate.get("peak_memory_bytes")),
                "low": None,
                "high": None,
                "actual": _gib(actual.get("peak_memory_bytes")),
            },
            {"": "TFLOP/s per process", "estimate": None, "low": None, "high": None, "actual": actual.get("tflops")},
            {"": "MFU", "estimate": None, "low": None, "high": None, "actual": actual.get("mfu")},
            {"": "data-wait share", "estimate": None, "low": None, "high": None, "actual": actual.get("data_wait_share")},
            {"": "naive estimate (s)", "estimate": estimate.get("naive_seconds"), "low": None, "high": None, "actual": None},
            {"": "cost ($)", "estimate": estimate.get("cost"), "low": None, "high": None, "actual": actual.get("cost")},
        ]
    )
    sections.append(
        section(
            "Estimate vs actual",
            table(summary.round(2)),
            "<p>The naive estimate is samples × mean tokens / the best measured tokens/s: what people compute by hand. It is shown, never used.</p>",
        )
    )

    figure_paths = []
    losses = record.get("losses", [])
    start = estimate["total_seconds"] - estimate["train_seconds"]
    start = record.get("elapsed_before_plan", 0.0) + max(0.0, start)
    before = record.get("elapsed_before_plan", 0.0)
    if losses:
        tokens_done = list(_cumulative(entry.get("tokens", 0) for entry in losses))
        predicted = {
            "start": start,
            "end": before + estimate["total_seconds"],
            "end_low": before + estimate["total_seconds_low"],
            "end_high": before + estimate["total_seconds_high"],
            "tokens": estimate["tokens"],
        }
        figure_paths.append(
            (
                figures.progress_over_time([e["elapsed"] for e in losses], tokens_done, predicted, deadline, run_dir / "progress.png"),
                "Tokens trained over time against the estimate, its bounds and the deadline",
            )
        )
        rolling_actual, rolling_predicted = _rolling_rates(losses)
        figure_paths.append(
            (
                figures.throughput_over_time([e["elapsed"] for e in losses], rolling_actual, rolling_predicted, run_dir / "throughput.png"),
                "Real tokens/s over time against the calibration's prediction",
            )
        )
        figure_paths.append(
            (
                figures.loss_curve(
                    [e["step"] for e in losses],
                    [e["loss"] for e in losses],
                    run_dir / "loss.png",
                    [e["step"] for e in record.get("evals", [])],
                    [e["eval_loss"] for e in record.get("evals", [])],
                ),
                "Training loss per optimizer step, and the held-out eval loss",
            )
        )
        rated = [entry for entry in losses if "learning_rate" in entry]  # recorded since issue 24
        if rated:
            figure_paths.append(
                (
                    figures.learning_rate_curve([e["step"] for e in rated], [e["learning_rate"] for e in rated], run_dir / "learning_rate.png"),
                    "Learning rate of each optimizer step (warm-up, then the schedule's decay)",
                )
            )
    history = error_rows(run_records(run_dir.parent))
    if len(history) >= 1:
        figure_paths.append(
            (
                figures.estimate_error_history([row["run"] for row in history], [row[ERROR_LABEL] for row in history], run_dir / "history.png"),
                "Estimate error of every run in this folder, oldest first",
            )
        )
    if figure_paths:
        sections.append(section("Figures", figure_grid(figure_paths)))

    plan_pairs = [(key, _plan_value(key, value)) for key, value in plan.items() if key != "notes"]
    sections.append(section("The plan", key_values(plan_pairs), bullet_list(plan.get("notes", [])) if plan.get("notes") else ""))
    alternatives = record.get("alternatives", [])
    if alternatives:
        frame = pd.DataFrame(alternatives).reindex(
            columns=[
                "micro_batch_size",
                "grad_accum",
                "num_workers",
                "max_length",
                "total_seconds",
                "total_seconds_high",
                "tokens_per_second",
                "peak_memory_bytes",
            ]
        )
        frame["peak_memory_bytes"] = frame["peak_memory_bytes"] / 2**20
        sections.append(section("Alternatives the planner considered", table(frame.rename(columns={"peak_memory_bytes": "peak MiB"}).round(2))))
    data = record.get("data", {})
    profile = data.get("profile", {})
    if profile:
        sections.append(
            section(
                "Data",
                key_values(
                    [
                        ("source", data.get("source")),
                        ("format", data.get("format")),
                        ("packing", data.get("packing")),
                        *profile.items(),
                        *(data.get("truncation") or {}).items(),
                    ]
                ),
            )
        )
    if history:
        sections.append(section("History: estimate error of every run", table(pd.DataFrame(history))))
    if record.get("events"):
        sections.append(section("Events", bullet_list(record["events"][-30:])))

    html_path = run_dir / "report.html"
    html_path.write_text(
        page(
            f"Run {record.get('run_id', run_dir.name)}",
            f"calibration {record.get('calibration_id')} — created {record.get('created_at')}",
            sections,
        ),
        encoding="utf-8",
    )
    return html_path


def _plan_value(key: str, value: Any) -> Any:
    """A plan entry as the plan text says it: the communication record as its one line."""
    if key == "communication" and isinstance(value, dict):
        from calibration.comm import describe_communication

        return describe_communication(value) or "one process: none"
    return value


def _cumulative(values: Any) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _rolling_rates(losses: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    actual, predicted = [], []
    for index in range(len(losses)):
        window = losses[max(0, index - ROLLING_STEPS + 1) : index + 1]
        tokens = sum(entry.get("tokens", 0) for entry in window)
        actual.append(tokens / max(1e-9, sum(entry.get("seconds", 0) for entry in window)))
        predicted.append(tokens / max(1e-9, sum(entry.get("predicted_seconds", 0) for entry in window)))
    return actual, predicted


def _gib(value: float | None) -> float | None:
    return value / 2**30 if value else None
