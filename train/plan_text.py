"""The plan and the outcome in words, for the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibration.accuracy import describe_estimate_error
from calibration.durations import format_duration
from train.planner import Plan


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def describe_plan(plan: Plan, profile: dict[str, Any], calibration: Any) -> list[str]:
    c = plan.chosen
    lines = [
        f"data: {profile['count']:,} samples, {profile['total_tokens']:,} tokens; length mean {profile['mean']:.0f}, "
        f"p50 {profile['p50']:.0f}, p99 {profile['p99']:.0f}, p99.5 {profile['p99.5']:.0f}, max {profile['max']}",
        f"calibration: {calibration.id} (held-out error p90 {plan.bound_fraction:.1%}"
        + (f", history factor {calibration.history_factor:.3f}" if calibration.history else "")
        + ")",
        f"plan ({plan.priority}): {c.label()}, {c.world_size} process(es); effective batch {plan.effective_batch} "
        f"{'packed rows' if plan.packing else 'samples'}; {c.optimizer_steps:,} optimizer steps"
        + (f" ({c.remaining_steps:,} left to run)" if c.remaining_steps != c.optimizer_steps else ""),
        f"  estimate {format_duration(c.total_seconds)} (bounds {format_duration(c.total_seconds_low)} – "
        f"{format_duration(c.total_seconds_high)}): training {format_duration(c.step_seconds)} at "
        f"{c.tokens_per_second:,.0f} real tokens/s + {format_duration(c.overhead_seconds)} start-up, checkpoints"
        + (f", evaluation ({format_duration(c.eval_seconds)})" if c.eval_seconds else "")
        + " and report",
        *[f"  {line}" for line in (c.overheads.lines() if c.overheads else [])],
        f"  tokens: {c.tokens:,} real of {c.padded_tokens:,} computed ({_share(c.tokens, c.padded_tokens)} useful)"
        + (f"; {c.truncation['share_truncated']:.2%} of samples truncated" if c.truncation else ""),
        f"  peak memory: {_gib(c.peak_memory_bytes)} predicted (≤ {_gib(c.peak_memory_bytes_high)} with margin)",
        f"  deadline: {format_duration(plan.deadline_seconds)}; {format_duration(plan.available_seconds)} usable after margin "
        f"and time already spent; {'central estimate' if calibration.too_noisy_to_bound else 'upper bound'} "
        f"{'fits' if plan.meets_deadline else 'DOES NOT fit'}",
        f"  naive estimate (samples × mean tokens / best measured tokens/s): {format_duration(plan.naive_seconds)}",
    ]
    if plan.cost is not None:
        lines.append(f"  cost: ${plan.cost:,.2f}")
    for alternative in plan.alternatives:
        lines.append(f"  alternative: {alternative.label()}: {format_duration(alternative.total_seconds)}, peak {_gib(alternative.peak_memory_bytes)}")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    return lines


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "n/a"


def describe_outcome(record: dict[str, Any], out_dir: Path, report_path: Path | None) -> list[str]:
    actual, estimate = record["actual"], record["estimate"]
    lines = [
        f"run {record['run_id']}: {actual['status']} after {actual['steps']} steps, final loss {actual['final_loss']:.4f}"
        if actual.get("final_loss") is not None
        else f"run {record['run_id']}: {actual['status']} after {actual['steps']} steps",
        f"  time: {format_duration(actual['total_seconds'])} actual vs {format_duration(estimate['total_seconds'])} estimated "
        f"(estimate error {describe_estimate_error(record.get('estimate_error_pct'))}); deadline {format_duration(record['deadline_seconds'])} "
        f"{'met' if record['met_deadline'] else 'MISSED'}",
        f"  speed: {actual['tokens_per_second']:,.0f} real tokens/s actual vs {estimate['tokens_per_second']:,.0f} estimated",
        f"  run folder: {out_dir}",
    ]
    final = record.get("final")
    if final:
        partial = " (partial: the run stopped before its planned end)" if final.get("partial") else ""
        lines.append(f"  model: {final['path']}{partial}")
        if final.get("merged_path"):
            lines.append(f"  merged model: {final['merged_path']}")
    if report_path:
        lines.append(f"  report: {report_path}")
    return lines
