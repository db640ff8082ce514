"""`train --dry-run --use-calibration A,B,C|all` and `--consider MACHINES`: the ranked rows of train.recipes.machines as a
table, as JSON (`--json`) and as an HTML report with a time-vs-cost plot (reports.comparison_report)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from benchtrain.common.atomic import json_text
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import EXIT_OK, BenchtrainError, DeadlineError
from benchtrain.train.planning.memory_check import GIB
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.recipes.launch_task import DROPPED_FLAGS, comparison_task
from benchtrain.train.recipes.machines import (
    Comparison,
    Row,
    compare,
    consider,
    no_row_meets_the_deadline,
    parse_machines,
    plan_of,
    select_calibrations,
)
from benchtrain.train.running.resume import Continuation, train_command_line, without_options


def run_comparison(args: argparse.Namespace, started: float, continuation: Continuation) -> int:
    from benchtrain.train.recipes.run_data import hub_weights, load_data
    from benchtrain.train.recipes.run_plan import PlanContext
    from benchtrain.train.step.engine import process_layout
    from benchtrain.train.step.hardware import this_device
    from benchtrain.train.workload.model import resolve_model
    from benchtrain.train.workload.tokenizer import is_byte_tokenizer

    config = TrainConfig.from_args(args, started_at=started, continuation=continuation)
    method = config.tuning.method
    if process_layout(config.step, method).world_size > 1:
        raise BenchtrainError(
            "a comparison of calibrations plans in one process: run it without accelerate launch or torchrun"
        )
    # a bad machine is said before the data loads
    machines = parse_machines(config.plan.consider) if config.plan.consider else None
    spec = resolve_model(config.model)
    calibrations = select_calibrations(
        str(config.plan.use_calibration), spec, method, on_skip=lambda message: say(f"warning: {message}")
    )
    spec = hub_weights(spec, dry_run=True)
    loaded = load_data(config.data, spec, config.seed)
    tokenizer, profile = loaded.tokenizer, loaded.profile
    context = PlanContext(
        config,
        spec,
        loaded.data,
        loaded.eval_data,
        config.run_deadline.elapsed(),
        loaded.prep_seconds,
        loaded.uncertainty,
    )
    here = this_device()
    comparison = (
        consider(context, method, calibrations, here, profile, machines)
        if machines
        else compare(context, method, calibrations, here, profile)
    )
    report = None if config.output.no_report else write_comparison(comparison, config.output.out, spec.name)
    if config.output.json:
        print(json_text(comparison.to_json()), flush=True)
    else:
        from benchtrain.train.planning.plan_text import describe_data

        data_lines = [
            *describe_data(profile, is_byte_tokenizer(tokenizer)),
            *[f"  {note}" for note in loaded.prepared.describe()],
        ]
        lines = [*data_lines, *describe_comparison(comparison, getattr(args, "command_line", None))]
        print("\n".join(lines), flush=True)
    for row in comparison.rows:
        for warning in dict.fromkeys(row.warnings):
            say(f"warning: [{row.reference}] {warning}")
    if report is not None:
        say(f"report: {report}")
    if comparison.recommended is None:
        raise DeadlineError(no_row_meets_the_deadline(comparison, config.plan.margin))
    if config.output.emit:
        from benchtrain.train.launch_command import emit_task

        emit_task(
            config.output.emit,
            comparison_task(comparison, config, spec, method, getattr(args, "command_line", None) or []),
        )
    return EXIT_OK


def write_comparison(comparison: Comparison, out: str | None, model_name: str) -> Path:
    """comparison.json and report.html (with its PNG) in --out, or in BENCHTRAIN_HOME/plans/<model>-<time>."""
    from benchtrain.common.atomic import write_json_atomic
    from benchtrain.common.home import writable_subdir
    from benchtrain.reports.comparison_report import write_comparison_report

    folder = (
        Path(out).expanduser()
        if out
        else writable_subdir("plans") / f"{model_name.replace('/', '--')}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BenchtrainError(f"cannot create folder {folder}: {error.strerror or error}") from None
    write_json_atomic(folder / "comparison.json", comparison.to_json())
    return write_comparison_report(folder)


def describe_comparison(comparison: Comparison, command_line: list[str] | None = None) -> list[str]:
    """The table, a line per row's plan (a machine's: what it rests on, what would settle it), the notes, the recommendation."""
    rows, machines = comparison.rows, comparison.at_upper_end
    columns = MACHINE_COLUMNS if machines else CALIBRATION_COLUMNS
    cells = [[header for header, _, _ in columns]]
    cells += [
        [cell(index, row) if row.run_plan is not None or not planned else "–" for _, cell, planned in columns]
        for index, row in enumerate(rows, 1)
    ]
    lines = [
        heading(comparison, "machine(s)" if machines else "option(s)", " at the upper end:" if machines else ":"),
        *table(cells),
    ]
    for index, row in enumerate(rows, 1):
        lines.append(f"  {index}: {machine_text(row) if machines else row_plan(row)}")
        if row.settle:
            cost = f" (≈ ${row.settle_cost:,.2f})" if row.settle_cost is not None else ""
            lines.append(f"     settle with: {row.settle}{cost}")
    lines += [f"  note: {note}" for note in comparison.notes]
    best = comparison.recommended
    if best is None:
        return lines
    command = train_command(command_line, best)
    if machines:
        cost, machine = cost_text(best), best.source.machine
        assert machine is not None  # every row of --consider plans a machine
        lines.append(
            f"recommended: 1, {machine.label} ({best.kind}): meets the deadline at its upper end{', ' + cost if cost else ''}"
        )
        rivals = [str(index) for index, row in enumerate(rows, 1) if row.could_overtake]
        if rivals:
            lines.append(f"  could overtake it within their brackets: {', '.join(rivals)} (measure them to know)")
        if best.settle:
            lines.append(f"  not measured: run `{best.settle}` on it first, then train with --use-calibration latest")
            command = None
    else:
        dollars = plan_of(best).cost
        cost = f"${dollars:,.2f}, " if dollars is not None else ""
        why = (
            "meets the deadline at the lowest cost"
            if comparison.ranked_by == "cost"
            else "the fastest that meets the deadline"
        )
        estimate = format_duration(plan_of(best).chosen.total_seconds)
        lines.append(
            f"recommended: 1, {best.reference} on {best.device.name} × {best.processes}: {why} ({cost}≈{estimate})"
        )
    if command:
        lines.append(f"  train it there with: {command}")
    return lines


def heading(comparison: Comparison, noun: str, end: str) -> str:
    usable = format_duration(max(0.0, comparison.available_seconds))
    return (
        f"{len(comparison.rows)} {noun} for {comparison.model} ({comparison.method}), priority {comparison.priority}, "
        f"deadline {format_duration(comparison.deadline_seconds)} ({usable} usable), ranked by {comparison.ranked_by}{end}"
    )


def table(lines: list[list[str]]) -> list[str]:
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    return [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    ]


def mark(index: int, row: Row) -> str:
    return f"{index}*" if row.recommended else str(index)


def memory(row: Row, headroom: bool) -> str:
    peak = plan_of(row).chosen.peak_memory_bytes
    if peak is None:
        return "–"
    return f"{peak / GIB:.1f} of {row.device.memory_bytes / GIB:.1f} GiB" + (
        f" ({row.memory_headroom:.0%})" if headroom else ""
    )


def deadline(index: int, row: Row) -> str:
    return "no plan" if row.run_plan is None else "meets" if row.run_plan.plan.meets_deadline else "MISSES"


def seconds(low: float, high: float) -> str:
    return f"{format_duration(low)} – {format_duration(high)}"


# The columns of each table: (header, the cell of row `index`, "–" where the row has no plan).
Column = tuple[str, Callable[[int, Row], str], bool]
CALIBRATION_COLUMNS: list[Column] = [
    ("#", mark, False),
    ("calibration", lambda _, row: row.reference, False),
    ("device", lambda _, row: row.device.name, False),
    ("×", lambda _, row: str(row.processes), False),
    (
        "source",
        lambda _, row: "predicted" if row.source.option is not None and row.source.option.predicted else "measured",
        False,
    ),
    ("time", lambda _, row: format_duration(plan_of(row).chosen.total_seconds), True),
    (
        "bounds",
        lambda _, row: seconds(plan_of(row).chosen.total_seconds_low, plan_of(row).chosen.total_seconds_high),
        True,
    ),
    ("cost", lambda _, row: f"${plan_of(row).cost:,.2f}" if plan_of(row).cost is not None else "–", True),
    ("peak memory (headroom)", lambda _, row: memory(row, headroom=True), True),
    ("MFU", lambda _, row: f"{row.compute['mfu']:.1%}" if row.compute.get("mfu") is not None else "–", True),
    ("deadline", deadline, False),
]
MACHINE_COLUMNS: list[Column] = [
    ("#", mark, False),
    ("machine", lambda _, row: row.source.machine.label if row.source.machine is not None else "–", False),
    ("source", lambda _, row: row.kind, False),
    (
        "time (low – upper)",
        lambda _, row: seconds(plan_of(row).chosen.total_seconds_low, plan_of(row).chosen.total_seconds_promised),
        True,
    ),
    ("cost (low – upper)", lambda _, row: cost_text(row) or "–", True),
    ("peak memory", lambda _, row: memory(row, headroom=False), True),
    ("deadline", deadline, False),
    ("", lambda _, row: "could overtake" if row.could_overtake else "", False),
]


def row_plan(row: Row) -> str:
    option = row.source.option
    if row.run_plan is None or option is None:
        return f"no plan: {row.problem}"
    plan = row.run_plan.plan
    chosen = plan.chosen
    price = f"; ${row.price_per_hour:,.2f} per device-hour × {row.processes}" if row.price_per_hour is not None else ""
    upper = "central estimate" if option.calibration.too_noisy_to_bound else "upper bound"
    text = (
        f"{chosen.config.phrase}; {chosen.optimizer_steps:,} optimizer steps at {chosen.tokens_per_second:,.0f} real tokens/s; "
        f"{upper} {format_duration(chosen.total_seconds_promised)} vs {format_duration(max(0.0, plan.available_seconds))} usable{price}"
    )
    if option.predicted:
        text += f"; predicted with {option.collectives_source}"
    provenance = option.calibration.provenance
    if provenance.startswith("hub:"):  # whose measurement the row rests on (calibration.hub)
        text += f"; rests on a measurement shared as {provenance}"
    return text


def machine_text(row: Row) -> str:
    if row.run_plan is None:
        return f"no plan: {row.problem}"
    chosen = row.run_plan.plan.chosen
    price = f"; ${row.price_per_hour:,.2f} per GPU-hour × {row.processes}" if row.price_per_hour is not None else ""
    return f"{chosen.config.phrase}, {chosen.optimizer_steps:,} optimizer steps{price}; rests on {row.rests_on}"


def cost_text(row: Row) -> str:
    """The cost bracket of a machine's row (the same figures as its JSON and report)."""
    costs = row.cost_bracket
    return f"${costs.low:,.2f} – ${costs.upper:,.2f}" if costs is not None else ""


def train_command(command_line: list[str] | None, row: Row) -> str | None:
    """This command for the recommended row, without --dry-run: the command to run on that machine."""
    if command_line is None:
        return None
    kept = without_options(command_line, DROPPED_FLAGS, ("--use-calibration", "--out", "--consider", "--emit"))
    return train_command_line(row.processes, ["--use-calibration", row.reference, *kept])
