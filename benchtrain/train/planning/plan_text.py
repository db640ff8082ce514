"""The plan and the outcome in words, for the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.calibration.accuracy import check_estimate, describe_check
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.memory_fit import device_peak_bytes
from benchtrain.calibration.run_file import STOPPED_EARLY
from benchtrain.calibration.translate import describe_translation
from benchtrain.common.durations import format_duration
from benchtrain.common.json_types import JsonDict
from benchtrain.common.run_paths import run_path
from benchtrain.train.planning.types import Candidate, Plan

if TYPE_CHECKING:
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.workload.prepare import PreparedData


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


BYTE_TOKENS_NOTE = (
    "  tokens are bytes: this preset has no tokenizer of its own, so counts, lengths and tokens/s are the byte-level "
    "tokenizer's (a model's own tokenizer makes fewer, longer tokens); --tokenizer DIR counts with the real one"
)


def describe_compute(figures: JsonDict, hardware: Hardware) -> str | None:
    """`compute: ≈305 TFLOP/s per process predicted, MFU 30.9% of the H100 SXM's 989 TFLOP/s`."""
    if figures.get("mfu") is None:
        return None
    peak = figures["tflops"] / figures["mfu"]
    entry = hardware.peak_flops_entry or hardware.name
    return f"  compute: ≈{figures['tflops']:,.0f} TFLOP/s per process predicted, MFU {figures['mfu']:.1%} of the {entry}'s {peak:,.0f} TFLOP/s (dense bf16)"


def describe_data(profile: JsonDict, byte_tokens: bool = False) -> list[str]:
    about = "≈" if profile.get("sampled") else ""  # lengths from a sample: train.workload.sampling
    return [
        f"data: {profile['count']:,} samples, {about}{profile['total_tokens']:,} tokens{' (bytes)' if byte_tokens else ''}; length mean {profile['mean']:.0f}, "
        f"p50 {profile['p50']:.0f}, p99 {profile['p99']:.0f}, p99.5 {profile['p99.5']:.0f}, max {profile['max']}",
        *([BYTE_TOKENS_NOTE] if byte_tokens else []),
    ]


def describe_exact_profile(prepared: PreparedData, sampled_plan: Plan, plan: Plan) -> list[str]:
    """After tokenizing every record: the exact total against the sample's estimate, and the plan's
    steps and estimate on the exact profile (the configuration the sample chose)."""
    estimate = prepared.estimate
    total = prepared.exact_tokens  # every record's (with --eval-split, the profile is the training part's)
    assert total is not None, "describe_exact_profile is called after every record is tokenized"
    error = estimate.error_of(total) if estimate else 0.0
    took = (
        f" in {format_duration(prepared.built_seconds)} (predicted {format_duration(prepared.predicted_seconds)})"
        if prepared.built_seconds
        else ""
    )
    c = plan.chosen
    return [
        f"tokenized all {prepared.records:,} records{took}: {total:,} tokens, "
        + (
            f"{error:+.2%} from the sample's {estimate.total_tokens:,.0f} ± {estimate.half_width:,.0f}"
            if estimate
            else "exact"
        ),
        f"  on the exact profile: {c.optimizer_steps:,} optimizer steps (sampled plan: {sampled_plan.chosen.optimizer_steps:,}), "
        f"estimate {format_duration(c.total_seconds)} (≤ {format_duration(c.total_seconds_high)})",
    ]


def describe_plan(
    plan: Plan, profile: JsonDict, calibration: Calibration, byte_tokens: bool = False, data_notes: tuple[str, ...] = ()
) -> list[str]:
    """The plan as the console shows it; `data_notes`: where the lengths came from and what
    preparing the tokens costs (train.workload.prepare.PreparedData.describe)."""
    c, device = plan.chosen, calibration.hardware
    history = f", history factor {calibration.history_factor:.3f}" if calibration.history else ""
    lines = [
        *describe_data(profile, byte_tokens),
        *[f"  {note}" for note in data_notes],
        f"calibration: {calibration.id} ({describe_error(calibration, c)}{history})",
        f"plan ({plan.request.priority}): {c.config.phrase}, {c.world_size} process(es); effective batch {plan.effective_batch} "
        f"{'packed rows' if plan.packing else 'samples'}; {_steps(c.optimizer_steps, 'optimizer ')}"
        + (f" ({c.remaining_steps:,} left to run)" if c.remaining_steps != c.optimizer_steps else ""),
        f"  {'translated ' if getattr(calibration, 'translation', None) else ''}estimate {format_duration(c.total_seconds)} "
        f"(bounds {format_duration(c.total_seconds_low)} – {format_duration(c.total_seconds_high)}): training {format_duration(c.step_seconds)} at "
        f"{c.tokens_per_second:,.0f} real tokens/s + {format_duration(c.overheads.total_seconds)} start-up, checkpoints"
        + (
            f", evaluation ({format_duration(c.overheads.evaluation_seconds)})"
            if c.overheads.evaluation_seconds
            else ""
        )
        + " and report",
        f"  {c.overheads.describe()}",
        f"  tokens: {c.tokens:,} real (those the loss is on, within the max length) of {c.padded_tokens:,} computed "
        f"(padding and prompts included; {_share(c.tokens, c.padded_tokens)} useful)"
        + (f"; {c.truncation['share_truncated']:.2%} of samples truncated" if c.truncation else ""),
        f"  peak memory: {_gib(c.peak_memory_bytes)} predicted (≤ {_gib(c.peak_memory_bytes_high)} with margin) "
        f"of the {_gib(device.memory_bytes)} of the {device.name} the calibration {'was translated to' if device.translated else 'measured'}",
        f"  deadline: {format_duration(plan.request.deadline.deadline_seconds)}; {format_duration(plan.available_seconds)} usable after margin "
        f"and time already spent; {'central estimate' if calibration.too_noisy_to_bound else 'upper bound'} "
        f"{'fits' if plan.meets_deadline else 'DOES NOT fit'}",
        f"  naive estimate (samples × mean tokens / best measured tokens/s): {format_duration(plan.naive_seconds)}",
    ]
    if plan.cost is not None:
        lines.append(f"  cost: ${plan.cost:,.2f}")
    for alternative in plan.alternatives:
        steps = f"{_steps(alternative.optimizer_steps)} in " if plan.step_limit is not None else ""
        peak = _gib(alternative.peak_memory_bytes)
        lines.append(
            f"  alternative: {alternative.config.phrase}: {steps}{format_duration(alternative.total_seconds)}, peak {peak}"
        )
    return lines + [f"  note: {note}" for note in plan.notes]


def describe_error(calibration: Calibration, chosen: Candidate) -> str:
    """The calibration's held-out error, and the bound this plan's configuration gets: wider where
    it extrapolates past the measured sizes (Calibration.relative_bound_for)."""
    held_out = calibration.fit.get("held_out_error") or {}
    text = (
        f"held-out error median {held_out.get('median_abs_pct', 0.0):.1f}%, p90 {held_out.get('p90_abs_pct', 0.0):.1f}%"
    )
    stretch = calibration.extrapolation_ratio(chosen.config)
    parts = calibration.bound_parts
    machine = (
        f" + {parts.machine:.0%} between processes (measured in {parts.machine_source})"
        if parts.machine
        else " (no spread between processes measured)"
    )
    text += f"; bounds ±{chosen.bound_fraction:.0%}: the fit's {parts.fit:.0%}{machine}"
    if stretch > 1.0:
        text += f", wider here: {stretch:.2g}× past the measured sizes"
    translation = getattr(calibration, "translation", None)  # calibration.translate: a device nobody measured
    return f"{text}; {describe_translation(translation)}" if translation else text


def _steps(count: int, kind: str = "") -> str:
    return f"{count:,} {kind}step{'' if count == 1 else 's'}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "n/a"


def describe_peak_memory(predicted: float | None, measured: float | None) -> str | None:
    """`peak memory: 5.66 GiB actual vs 5.47 GiB predicted (+3.6%)`."""
    if not predicted or not measured:
        return None
    return f"peak memory: {_gib(measured)} actual vs {_gib(predicted)} predicted ({(measured - predicted) / predicted:+.1%})"


def describe_outcome(
    record: JsonDict, out_dir: Path, report_path: Path | None, resume_command: str | None = None
) -> list[str]:
    """The end of a run in words: the estimate check (the lines the report's banner shows too),
    the deadline, where things are, and how to continue a run that stopped early."""
    actual = record["actual"]
    loss = f", final loss {actual['final_loss']:.4f}" if actual.get("final_loss") is not None else ""
    lines = [f"run {record['run_id']}: {actual['status']} after {actual['steps']} steps{loss}"]
    check = check_estimate(record)
    if check is not None:
        lines += [f"  {line}" for line in describe_check(check)]
    memory = describe_peak_memory(record["estimate"].get("peak_memory_bytes"), device_peak_bytes(actual))
    if memory:
        lines.append(f"  {memory}")
    used = actual.get("command_seconds")
    report = (
        f"; the report took {format_duration(actual['report_seconds'])} more"
        if actual.get("report_seconds") is not None
        else ""
    )
    lines.append(
        f"  deadline {format_duration(record['deadline_seconds'])} {'met' if record['met_deadline'] else 'MISSED'}"
        + (f" ({format_duration(used)} used by the whole command{report})" if used is not None else "")
    )
    lines.append(f"  run folder: {out_dir}")
    final = record.get("final")
    if final:
        partial = " (partial: the run stopped before its planned end)" if final.get("partial") else ""
        # run.json keeps them relative to the run folder (older records: absolute); shown where they are.
        lines.append(f"  model: {run_path(final['path'], out_dir)}{partial}")
        if final.get("merged_path"):
            lines.append(f"  merged model: {run_path(final['merged_path'], out_dir)}")
    push = record.get("push")
    if push:
        pushed = push.get("status") == "pushed"
        lines.append(
            f"  hub: {push['url']}: {push['bytes'] / 1e6:,.1f} MB in {format_duration(push['seconds'])}"
            if pushed
            else f"  hub: the push to {push['repo_id']} failed; retry with: {push['retry'].replace('--out .', f'--out {out_dir}', 1)}"
        )
    if report_path:
        lines.append(f"  report: {report_path}")
    if actual["status"] in STOPPED_EARLY:
        checkpoint = actual.get("last_checkpoint")
        if checkpoint and resume_command:
            lines.append(f"checkpoint saved ({Path(checkpoint).name}); resume with: {resume_command}")
        elif not checkpoint:
            lines.append("no checkpoint was saved (no step had finished): nothing to resume")
    return lines
