"""`train --dry-run --use-calibration A,B,C|all`: the comparison (train.recipes.compare) as a table, as
JSON (`--json`) and as an HTML report with a time-vs-cost plot (reports.comparison_report); with
`--consider MACHINES`, a row per machine (train.recipes.consider) in the same three forms."""

from __future__ import annotations

import argparse
import shlex
from datetime import datetime
from pathlib import Path
from typing import Any

from common.atomic import json_text
from common.console import say
from common.durations import format_duration
from common.errors import EXIT_OK, BenchtrainError, DeadlineError
from train.recipes.compare import Comparison, Row, compare, no_row_meets_the_deadline, plan_of, select_calibrations
from train.recipes.config import TrainConfig
from train.recipes.consider import consider, parse_machines

GIB = 2**30


def run_comparison(args: argparse.Namespace, started: float) -> int:
    from train.recipes.run_data import hub_weights, load_data
    from train.recipes.run_plan import PlanContext
    from train.step.engine import process_layout
    from train.step.hardware import detect_hardware
    from train.workload.model import resolve_model
    from train.workload.tokenizer import is_byte_tokenizer

    config = TrainConfig.from_args(args, started_at=started)
    method = config.tuning.method
    if process_layout(config.step, method).world_size > 1:
        raise BenchtrainError("a comparison of calibrations plans in one process: run it without accelerate launch or torchrun")
    machines = parse_machines(config.plan.consider) if config.plan.consider else None  # a bad machine is said before the data loads
    spec = resolve_model(config.model)
    calibrations = select_calibrations(str(config.plan.use_calibration), spec, method, on_skip=lambda message: say(f"warning: {message}"))
    spec = hub_weights(spec, dry_run=True)
    loaded = load_data(config.data, spec, config.seed)
    tokenizer, profile = loaded.tokenizer, loaded.profile
    context = PlanContext(config, spec, loaded.data, loaded.eval_data, config.run_deadline.elapsed(), loaded.prep_seconds, loaded.uncertainty)
    if machines:
        comparison = consider(context, method, calibrations, detect_hardware(), profile, machines)
    else:
        comparison = compare(context, method, calibrations, detect_hardware(), profile)
    report = None if config.output.no_report else write_comparison(comparison, config.output.out, spec.name)
    if config.output.json:
        print(json_text(comparison.to_json()), flush=True)
    else:
        from train.planning.plan_text import describe_data

        data_lines = [*describe_data(profile, is_byte_tokenizer(tokenizer)), *[f"  {note}" for note in loaded.prepared.describe()]]
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
        from train.launch_command import emit_task
        from train.recipes.launch_task import comparison_task

        emit_task(config.output.emit, comparison_task(comparison, config, spec, method, getattr(args, "command_line", None) or []))
    return EXIT_OK


def write_comparison(comparison: Comparison, out: str | None, model_name: str) -> Path:
    """comparison.json and report.html (with its PNG) in --out, or in BENCHTRAIN_HOME/plans/<model>-<time>."""
    from common.atomic import write_json_atomic
    from common.home import writable_subdir
    from reports.comparison_report import write_comparison_report

    folder = Path(out).expanduser() if out else writable_subdir("plans") / f"{model_name.replace('/', '--')}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BenchtrainError(f"cannot create folder {folder}: {error.strerror or error}") from None
    write_json_atomic(folder / "comparison.json", comparison.to_json())
    return write_comparison_report(folder)


def describe_comparison(comparison: Comparison, command_line: list[str] | None = None) -> list[str]:
    """The table, a line per row's plan, what was predicted, and the recommendation."""
    rows = comparison.rows
    if rows and rows[0].consider is not None:
        return describe_machines(comparison, train_command(command_line, comparison.recommended) if comparison.recommended else None)
    lines = [heading(comparison, "option(s)", ":"), *table([HEADER, *[cells(index, row) for index, row in enumerate(rows, 1)]])]
    for index, row in enumerate(rows, 1):
        lines.append(f"  {index}: {row_plan(row)}")
    for note in comparison.notes:
        lines.append(f"  note: {note}")
    best = comparison.recommended
    if best is None:
        return lines
    chosen = plan_of(best).chosen
    cost = f"${best.cost:,.2f}, " if best.cost is not None else ""
    why = "meets the deadline at the lowest cost" if comparison.ranked_by == "cost" else "the fastest that meets the deadline"
    lines.append(f"recommended: 1, {best.reference} on {best.device['name']} × {best.processes}: {why} ({cost}≈{format_duration(chosen.total_seconds)})")
    command = train_command(command_line, best)
    if command:
        lines.append(f"  train it there with: {command}")
    return lines


def heading(comparison: Comparison, noun: str, end: str) -> str:
    usable = format_duration(max(0.0, comparison.available_seconds))
    return (
        f"{len(comparison.rows)} {noun} for {comparison.model} ({comparison.method}), priority {comparison.priority}, "
        f"deadline {format_duration(comparison.deadline_seconds)} ({usable} usable), ranked by {comparison.ranked_by}{end}"
    )


HEADER = ["#", "calibration", "device", "×", "source", "time", "bounds", "cost", "peak memory (headroom)", "MFU", "deadline"]


def cells(index: int, row: Row) -> list[str]:
    mark = f"{index}*" if row.recommended else str(index)
    assert row.option is not None  # a comparison of calibrations: every row has one
    source = "predicted" if row.option.predicted else "measured"
    fixed = [mark, row.reference, row.device["name"], str(row.processes), source]
    if row.plan is None:
        return [*fixed, "–", "–", "–", "–", "–", "no plan"]
    chosen = row.plan.chosen
    bounds = f"{format_duration(chosen.total_seconds_low)} – {format_duration(chosen.total_seconds_high)}"
    cost = f"${row.cost:,.2f}" if row.cost is not None else "–"
    memory = "–"
    if chosen.peak_memory_bytes is not None:
        memory = f"{chosen.peak_memory_bytes / GIB:.1f} of {row.device['memory_bytes'] / GIB:.1f} GiB ({row.memory_headroom:.0%})"
    mfu = f"{row.compute['mfu']:.1%}" if row.compute.get("mfu") is not None else "–"
    deadline = "meets" if row.meets_deadline else "MISSES"
    return [*fixed, format_duration(chosen.total_seconds), bounds, cost, memory, mfu, deadline]


def table(lines: list[list[str]]) -> list[str]:
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines]


def row_plan(row: Row) -> str:
    if row.plan is None or row.option is None:
        return f"no plan: {row.problem}"
    chosen = row.plan.chosen
    price = f"; ${row.price_per_hour:,.2f} per device-hour × {row.processes}" if row.price_per_hour is not None else ""
    upper = "central estimate" if row.option.calibration.too_noisy_to_bound else "upper bound"
    text = (
        f"{chosen.label()}; {chosen.optimizer_steps:,} optimizer steps at {chosen.tokens_per_second:,.0f} real tokens/s; "
        f"{upper} {format_duration(chosen.total_seconds_promised)} vs {format_duration(max(0.0, row.plan.available_seconds))} usable{price}"
    )
    if row.option.predicted:
        text += f"; predicted with {row.option.collectives_source}"
    provenance = row.option.calibration.provenance
    if provenance.startswith("hub:"):  # whose measurement the row rests on (calibration.hub)
        text += f"; rests on a measurement shared as {provenance}"
    return text


def train_command(command_line: list[str] | None, row: Row) -> str | None:
    """This command for the recommended row, without --dry-run: the command to run on that machine."""
    if command_line is None:
        return None
    kept: list[str] = []
    skip = False
    for token in command_line:
        if skip:
            skip = False
            continue
        if token in ("--dry-run", "--json"):
            continue
        if token in ("--use-calibration", "--out", "--consider", "--emit"):
            skip = True
            continue
        if token.startswith(("--use-calibration=", "--out=", "--consider=", "--emit=")):
            continue
        kept.append(token)
    launcher = ["accelerate", "launch", "--num_processes", str(row.processes), "-m", "train"] if row.processes > 1 else ["train"]
    return shlex.join([*launcher, "--use-calibration", row.reference, *kept])


# -- `--consider`: a row per machine (train.recipes.consider) --------------------------------


MACHINE_HEADER = ["#", "machine", "source", "time (low – upper)", "cost (low – upper)", "peak memory", "deadline", ""]


def describe_machines(comparison: Any, train_command: str | None) -> list[str]:
    """The table, what each row rests on and what would settle it, and the recommendation."""
    rows = comparison.rows
    cells_of = [machine_cells(index, row) for index, row in enumerate(rows, 1)]
    lines = [heading(comparison, "machine(s)", " at the upper end:"), *table([MACHINE_HEADER, *cells_of])]
    for index, row in enumerate(rows, 1):
        lines.append(f"  {index}: {machine_text(row)}")
        if row.consider.settle:
            cost = f" (≈ ${row.consider.settle_cost:,.2f})" if row.consider.settle_cost is not None else ""
            lines.append(f"     settle with: {row.consider.settle}{cost}")
    lines += [f"  note: {note}" for note in comparison.notes]
    best = comparison.recommended
    if best is None:
        return lines
    rivals = [str(index) for index, row in enumerate(rows, 1) if row.consider.could_overtake]
    cost = cost_text(best)
    lines.append(f"recommended: 1, {best.consider.machine} ({best.consider.kind}): meets the deadline at its upper end{', ' + cost if cost else ''}")
    if rivals:
        lines.append(f"  could overtake it within their brackets: {', '.join(rivals)} (measure them to know)")
    if best.consider.settle:
        lines.append(f"  not measured: run `{best.consider.settle}` on it first, then train with --use-calibration latest")
    elif train_command:
        lines.append(f"  train it there with: {train_command}")
    return lines


def machine_cells(index: int, row: Any) -> list[str]:
    mark = f"{index}*" if row.recommended else str(index)
    fixed = [mark, row.consider.machine, row.consider.kind]
    if row.plan is None:
        return [*fixed, "–", "–", "–", "no plan", ""]
    chosen = row.plan.chosen
    time = f"{format_duration(chosen.total_seconds_low)} – {format_duration(chosen.total_seconds_promised)}"
    memory = "–" if chosen.peak_memory_bytes is None else f"{chosen.peak_memory_bytes / GIB:.1f} of {row.device['memory_bytes'] / GIB:.1f} GiB"
    deadline = "meets" if row.meets_deadline else "MISSES"
    return [*fixed, time, cost_text(row) or "–", memory, deadline, "could overtake" if row.consider.could_overtake else ""]


def cost_text(row: Any) -> str:
    """The cost bracket the row holds (train.recipes.consider.machine_row: the same figures as its JSON and report)."""
    low, upper = row.consider.cost_low, row.consider.cost_upper
    return f"${low:,.2f} – ${upper:,.2f}" if low is not None and upper is not None else ""


def machine_text(row: Any) -> str:
    if row.plan is None:
        return f"no plan: {row.problem}"
    chosen = row.plan.chosen
    price = f"; ${row.price_per_hour:,.2f} per GPU-hour × {row.processes}" if row.price_per_hour is not None else ""
    return f"{chosen.label()}, {chosen.optimizer_steps:,} optimizer steps{price}; rests on {row.consider.rests_on}"
