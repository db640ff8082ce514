"""The run report: did the estimate hold, and why (or why not)?"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.calibration.accuracy import (
    ERROR_LABEL,
    check_estimate,
    describe_check,
    describe_steps,
    describe_throughput,
    describe_time,
)
from benchtrain.calibration.comm import describe_communication
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.atomic import read_json_file
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict, JsonValue
from benchtrain.common.pause import pause_at
from benchtrain.reports import figures
from benchtrain.reports.html import bullet_list, figure_grid, key_values, section, table, verdict, write_page

if TYPE_CHECKING:
    from benchtrain.calibration.accuracy import EstimateCheck

ROLLING_STEPS = 20


def read_run(run_dir: Path) -> JsonDict:
    path = Path(run_dir) / "run.json"
    record = read_json_file(path, missing=f"{run_dir} has no run.json: pass a run folder or a calibration")
    if not isinstance(record, dict) or "plan" not in record or "estimate" not in record:
        raise BenchtrainError(f"{path} is not a benchtrain run record (no plan/estimate)")
    return record


def write_run_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    record = read_run(run_dir)
    check = check_estimate(record)  # the same comparison the console printed and run.json holds
    history = history_rows(run_dir.parent)
    sections = [verdict_of(record, check), estimate_against_actual(record, check)]
    figure_paths = run_figures(record, check, run_dir, history)
    if figure_paths:
        sections.append(section("Figures", figure_grid(figure_paths)))
    sections += plan_sections(record)
    if history:
        import pandas as pd

        sections.append(section("History: estimate error of every run", table(pd.DataFrame(history))))
    if record.get("events"):
        sections.append(section("Events", bullet_list(record["events"][-30:])))
    title, subtitle = (
        f"Run {record.get('run_id', run_dir.name)}",
        f"calibration {record.get('calibration_id')} — created {record.get('created_at')}",
    )
    pause_at("report")
    return write_page(run_dir / "report.html", title, subtitle, sections)


def history_rows(runs_dir: Path) -> list[JsonDict]:
    """How wrong each estimate was, one row per finished run in `runs_dir`, oldest first: its estimate
    check (calibration.accuracy.check_estimate), as its own report, run.json and the console give it."""
    rows = []
    for path in sorted(runs_dir.glob("*/run.json")):
        try:
            record = read_json_file(path)
        except BenchtrainError:
            continue
        check = check_estimate(record) if record.get("actual") and record.get("estimate") else None
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
    return sorted(rows, key=lambda row: row["created"])  # a stable sort: runs created together stay in folder order


def verdict_of(record: JsonDict, check: EstimateCheck | None) -> str:
    """Did the estimate hold and the deadline too: the banner."""
    if check is None:
        return verdict("This run has a plan but has not finished training.", False)
    met = bool(record.get("met_deadline"))
    lines = [
        *describe_check(check),
        f"deadline {format_duration(record['deadline_seconds'])} {'met' if met else 'missed'}; status {check.status}",
    ]
    return verdict([*lines, *push_lines(record)], met and check.error_pct is not None and abs(check.error_pct) <= 15)


def push_lines(record: JsonDict) -> list[str]:
    """--push-to-hub: where the model went, how much and how long against the plan, or the retry."""
    push, overheads = record.get("push"), (record.get("estimate") or {}).get("overheads") or {}
    if not push:
        return []
    if push.get("status") != "pushed":
        return [
            f"the push to {push['repo_id']} failed ({push.get('error')}); final/ is intact: from the run folder, {push['retry']}"
        ]
    planned = overheads.get("upload_seconds")
    against = f" (planned {format_duration(planned)})" if planned else ""
    return [f"pushed to {push['url']}: {push['bytes'] / 1e6:,.1f} MB in {format_duration(push['seconds'])}{against}"]


def estimate_against_actual(record: JsonDict, check: EstimateCheck | None) -> str:
    """The table of estimate (with its bounds) against actual, for the steps that ran and the whole plan, and the held-out error the bounds stand on."""
    import pandas as pd

    estimate, actual = record["estimate"], record.get("actual") or {}
    ran = check.to_json() if check is not None else {}
    bound = estimate.get("bound_fraction")
    train = ran.get("predicted_train_seconds")
    overheads = (
        ran["estimated_seconds"] - train if train is not None and ran.get("estimated_seconds") is not None else None
    )
    speed = ran.get("predicted_tokens_per_second")

    def bounded(value: float | None, extra: float = 0.0) -> tuple[float | None, float | None]:
        """(low, high) of a predicted time: the configuration's bound on it, the overheads added as measured."""
        if value is None or bound is None:
            return None, None
        return value / (1 + bound) + extra, value * (1 + bound) + extra

    speed_bounds = (speed / (1 + bound), speed * (1 + bound)) if speed and bound is not None else (None, None)
    rows = [
        (
            "time of the steps that ran, with the overheads that happened (s)",
            ran.get("estimated_seconds"),
            *bounded(train, overheads or 0.0),
            ran.get("actual_seconds"),
        ),
        ("training time of the steps that ran (s)", train, *bounded(train), ran.get("actual_train_seconds")),
        ("real tokens/s of the steps that ran", speed, *speed_bounds, ran.get("actual_tokens_per_second")),
        (
            "whole plan (s; actual: projected at the live speed)",
            estimate["total_seconds"],
            estimate["total_seconds_low"],
            estimate["total_seconds_high"],
            check.projected_seconds if check is not None and check.partial else None,
        ),
        (
            "peak memory (GiB)",
            _gib(estimate.get("peak_memory_bytes")),
            None,
            _gib(estimate.get("peak_memory_bytes_high")),
            _gib(actual.get("peak_memory_bytes")),
        ),
        ("TFLOP/s per process", None, None, None, actual.get("tflops")),
        ("MFU", None, None, None, actual.get("mfu")),
        ("data-wait share", None, None, None, actual.get("data_wait_share")),
        ("naive estimate (s)", estimate.get("naive_seconds"), None, None, None),
        ("cost ($)", estimate.get("cost"), None, None, actual.get("cost")),
    ]
    summary = pd.DataFrame(rows, columns=["", "estimate", "low", "high", "actual"])
    return section(
        "Estimate vs actual",
        table(summary.round(2)),
        f"<p>{describe_bounds(estimate)}</p>"
        "<p>Times run from the plan to the end of the export; the report is timed on its own. A run that stopped early or was "
        "resumed is compared with the estimate for the steps it ran (each step's prediction, recorded as it ran) plus the "
        "overheads that took place; the whole plan at the live speed is shown beside it.</p>"
        "<p>The naive estimate is samples × mean tokens / the best measured tokens/s: what people compute by hand. It is shown, never used.</p>",
    )


def describe_bounds(estimate: JsonDict) -> str:
    """What the low/high columns stand on: the calibration's held-out error, wider where the plan extrapolated."""
    errors = estimate.get("held_out_error") or {}
    time_error, memory_error = errors.get("time") or {}, errors.get("memory") or {}
    if not time_error:
        return "Bounds: this run's record predates the held-out error in run.json."
    parts = [
        f"the calibration's held-out error on step time: median {time_error['median_abs_pct']:.1f}%, 90th percentile {time_error['p90_abs_pct']:.1f}%"
    ]
    if memory_error:
        parts.append(
            f"on peak memory: median {memory_error['median_abs_pct']:.1f}%, 90th percentile {memory_error['p90_abs_pct']:.1f}%"
        )
    bound = estimate.get("bound_fraction")
    text = "Bounds: " + "; ".join(parts)
    if bound is not None:
        text += f". This plan's time bound is ±{bound:.0%}" + (
            " (widened: the plan extrapolated past the measured sizes)" if estimate.get("extrapolated") else ""
        )
    return text + "."


def run_figures(
    record: JsonDict, check: EstimateCheck | None, run_dir: Path, history: list[JsonDict]
) -> list[tuple[Path, str]]:
    """The run's figures, drawn into its folder: progress and throughput against the estimate,
    loss, learning rate, and the estimate error of every run beside it."""
    estimate, deadline = record["estimate"], record["deadline_seconds"]
    figure_paths = []
    losses = record.get("losses", [])
    before = record.get("elapsed_before_plan", 0.0)
    # This command's steps (a resumed run's losses hold the earlier ones too), on the time axis of the estimate: seconds since the plan.
    ran = [entry for entry in losses if entry.get("step", 0) > (check.start_step if check else 0)]
    if ran and check is not None:
        overheads = estimate["total_seconds"] - estimate["train_seconds"]
        predicted = {
            "start": max(0.0, overheads),
            "end": estimate["total_seconds"],
            "end_low": estimate["total_seconds_low"],
            "end_high": estimate["total_seconds_high"],
            "tokens": estimate["tokens"],
            "ran_end": check.estimated_seconds,
        }
        since_plan = [entry["elapsed"] - before for entry in ran]
        tokens = list(itertools.accumulate(entry.get("tokens", 0) for entry in ran))
        words = [describe_steps(check), describe_time(check)]
        progress = figures.progress_over_time(
            since_plan,
            tokens,
            predicted,
            deadline - before,
            run_dir / "progress.png",
            (check.actual_seconds, check.tokens),
            words,
        )
        figure_paths.append(
            (progress, "Tokens trained since the plan against the estimate, its bounds and the deadline")
        )
        rolling_actual, rolling_predicted = _rolling_rates(ran)
        throughput = figures.throughput_over_time(
            since_plan, rolling_actual, rolling_predicted, run_dir / "throughput.png", describe_throughput(check)
        )
        figure_paths.append((throughput, "Real tokens/s over time against the calibration's prediction"))
    # A Trainer's run (benchtrain.DeadlineCallback) logs its loss every `logging_steps`: the steps between carry none.
    logged = [entry for entry in losses if entry.get("loss") is not None]
    if logged:
        evals = record.get("evals", [])
        steps, eval_steps = [e["step"] for e in logged], [e["step"] for e in evals]
        loss = figures.loss_curve(
            steps, [e["loss"] for e in logged], run_dir / "loss.png", eval_steps, [e["eval_loss"] for e in evals]
        )
        figure_paths.append((loss, "Training loss per optimizer step, and the held-out eval loss"))
        rated = [entry for entry in logged if "learning_rate" in entry]  # older run.json files did not record it
        if rated:
            rate = figures.learning_rate_curve(
                [e["step"] for e in rated], [e["learning_rate"] for e in rated], run_dir / "learning_rate.png"
            )
            figure_paths.append((rate, "Learning rate of each optimizer step (warm-up, then the schedule's decay)"))
    if history:
        errors = figures.estimate_error_history(
            [row["run"] for row in history], [row[ERROR_LABEL] for row in history], run_dir / "history.png"
        )
        figure_paths.append((errors, "Estimate error of every run in this folder, oldest first"))
    return figure_paths


def plan_sections(record: JsonDict) -> list[str]:
    """The plan, the alternatives the planner weighed, and the data it planned for."""
    import pandas as pd

    plan = record["plan"]
    sections = []
    plan_pairs = [(key, _plan_value(key, value)) for key, value in plan.items() if key != "notes"]
    sections.append(
        section("The plan", key_values(plan_pairs), bullet_list(plan.get("notes", [])) if plan.get("notes") else "")
    )
    alternatives = record.get("alternatives", [])
    if alternatives:
        columns = "micro_batch_size grad_accum num_workers max_length total_seconds total_seconds_high tokens_per_second peak_memory_bytes".split()
        frame = pd.DataFrame(alternatives).reindex(columns=columns)
        frame["peak_memory_bytes"] = frame["peak_memory_bytes"] / 2**20
        sections.append(
            section(
                "Alternatives the planner considered",
                table(frame.rename(columns={"peak_memory_bytes": "peak MiB"}).round(2)),
            )
        )
    data = record.get("data", {})
    profile = data.get("profile", {})
    if profile:
        pairs = [
            ("source", data.get("source")),
            ("format", data.get("format")),
            ("packing", data.get("packing")),
            *profile.items(),
        ]
        sections.append(section("Data", key_values([*pairs, *(data.get("truncation") or {}).items()])))
    preparation = data.get("preparation")
    if preparation:
        sections.append(section("Data preparation", key_values(preparation_rows(preparation))))
    return sections


def preparation_rows(preparation: JsonDict) -> list[tuple[str, JsonValue]]:
    """Where the plan's lengths came from (a sample's estimate against the exact total) and the
    tokenizing, predicted against measured (train.workload.prepare.PreparedData.record)."""
    rows: list[tuple[str, JsonValue]] = [
        ("lengths profiled from", preparation.get("profiled_from")),
        ("records", preparation.get("records")),
    ]
    estimate, exact = preparation.get("sampled_estimate"), preparation.get("exact_total_tokens")
    if estimate:
        rows.append(("sampled records", estimate["sampled"]))
        rows.append(
            ("token total, sampled estimate", f"{estimate['total_tokens']:,.0f} ± {estimate['half_width']:,.0f} (95%)")
        )
        if exact:
            error = preparation.get("sampled_error")  # train.workload.sampling.TotalEstimate.error_of
            rows.append(
                (
                    "token total, exact",
                    f"{exact:,}" + (f" ({error:+.2%} from the estimate)" if error is not None else ""),
                )
            )
    elif exact:
        rows.append(("token total, exact", f"{exact:,}"))
    predicted, actual = preparation.get("predicted_seconds"), preparation.get("actual_seconds")
    if predicted:
        rows.append(("tokenizing, predicted", format_duration(predicted)))
    elif actual is not None:
        rows.append(("tokenizing, predicted", "none: done before the plan (every record profiled)"))
    rows.append(("tokenizing, actual", format_duration(actual) if actual is not None else "0 (cached)"))
    rows.append(("cache", preparation.get("cache")))
    return rows


def _plan_value(key: str, value: JsonValue) -> JsonValue:
    """A plan entry as the plan text says it: the communication record as its one line."""
    if key == "communication" and isinstance(value, dict):
        return describe_communication(value) or "one process: none"
    if key == "configuration" and isinstance(value, dict):
        return StepConfig.from_row(value).phrase
    return value


def _rolling_rates(losses: list[JsonDict]) -> tuple[list[float], list[float]]:
    actual, predicted = [], []
    for index in range(len(losses)):
        window = losses[max(0, index - ROLLING_STEPS + 1) : index + 1]
        tokens = sum(entry.get("tokens", 0) for entry in window)
        actual.append(tokens / max(1e-9, sum(entry.get("seconds", 0) for entry in window)))
        predicted.append(tokens / max(1e-9, sum(entry.get("predicted_seconds", 0) for entry in window)))
    return actual, predicted


def _gib(value: float | None) -> float | None:
    return value / 2**30 if value else None
