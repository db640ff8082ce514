"""How wrong an estimate was: (actual − estimated) / estimated, positive when the run took longer;
one convention, computed here and nowhere else. Why: docs/design.md#estimate-error"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from benchtrain.calibration.run_file import COMPLETED, INTERRUPTED, STEP_LIMIT, STOPPED_FOR_DEADLINE
from benchtrain.common.durations import format_duration
from benchtrain.common.json_types import JsonDict


def estimate_error_pct(estimated_seconds: float | None, actual_seconds: float | None) -> float | None:
    """Percent by which the actual time exceeded the estimate (None when either is missing)."""
    if not estimated_seconds or actual_seconds is None or not math.isfinite(estimated_seconds):
        return None
    return (actual_seconds - estimated_seconds) / estimated_seconds * 100


def describe_estimate_error(pct: float | None) -> str:
    """`+12.3% (took longer than estimated)`, `-4.0% (took less time than estimated)`."""
    if pct is None:
        return "n/a"
    if abs(pct) < 0.05:
        return "+0.0% (as estimated)"
    return f"{pct:+.1f}% (took {'longer' if pct > 0 else 'less time'} than estimated)"


ERROR_LABEL = "estimate error % (+ = took longer than estimated)"


# -- one run command's estimate against what happened, like for like ----------------------------
# The steps that ran as predicted, plus the overheads that happened (why: docs/design.md#estimate-error).

STOP_REASONS = {
    COMPLETED: "completed: every planned step ran",
    STEP_LIMIT: "reached its step limit",
    STOPPED_FOR_DEADLINE: "stopped by the deadline guard: at the live speed the rest would have missed the deadline",
    INTERRUPTED: "interrupted",
}
SIGNAL_NAMES = {2: "SIGINT, Ctrl-C", 15: "SIGTERM"}


@dataclass(frozen=True)
class EstimateCheck:
    """One `train` command's estimate against what happened, for the same steps."""

    status: str
    reason: str  # why the run ended, in words
    start_step: int  # optimizer steps done before this command (a resumed run)
    planned_steps: int  # the steps this command's estimate covers
    run_steps: int  # the run's target, all of it
    steps_run: int  # the steps this command ran
    actual_seconds: float  # from the plan to the end of the export
    estimated_seconds: float  # the estimate for the steps that ran + the overheads that happened
    error_pct: float | None  # estimate_error_pct(estimated_seconds, actual_seconds)
    plan_seconds: float  # the whole plan's estimate, as the plan printed it (report included)
    projected_seconds: float | None  # the whole plan at the live speed (report included); None if nothing ran
    actual_train_seconds: float  # the steps that ran, measured
    predicted_train_seconds: float  # the steps that ran, predicted
    overhead_seconds: float  # the estimated overheads that happened
    tokens: int  # real tokens the steps that ran trained on

    @property
    def partial(self) -> bool:
        return self.steps_run < self.planned_steps

    @property
    def actual_tokens_per_second(self) -> float | None:
        return self.tokens / self.actual_train_seconds if self.actual_train_seconds > 0 else None

    @property
    def predicted_tokens_per_second(self) -> float | None:
        return self.tokens / self.predicted_train_seconds if self.predicted_train_seconds > 0 else None

    @property
    def throughput_change_pct(self) -> float | None:
        """How much higher (+) or lower (−) the real tokens/s were than predicted, for these steps."""
        actual, predicted = self.actual_tokens_per_second, self.predicted_tokens_per_second
        return (actual - predicted) / predicted * 100 if actual is not None and predicted else None

    def to_json(self) -> JsonDict:
        return {
            **asdict(self),
            "actual_tokens_per_second": self.actual_tokens_per_second,
            "predicted_tokens_per_second": self.predicted_tokens_per_second,
            "throughput_change_pct": self.throughput_change_pct,
        }


def check_estimate(record: JsonDict) -> EstimateCheck | None:
    """The like-for-like comparison of a run record (run.json; what the summary, banner and charts read); None before it ends."""
    actual, estimate = record.get("actual"), record.get("estimate") or {}
    if not actual or actual.get("total_seconds") is None:
        return None
    start = int(actual.get("start_step", estimate.get("start_step", 0)) or 0)
    ran = [entry for entry in record.get("losses") or [] if entry.get("step", 0) > start]
    actual_train = float(sum(entry.get("seconds", 0.0) for entry in ran))
    predicted_train = float(sum(entry.get("predicted_seconds", 0.0) for entry in ran))
    overheads = estimate.get("overheads")
    # The report and the hub push come after the compared span, each timed on its own.
    report = float((overheads or {}).get("report_seconds", 0.0)) + float((overheads or {}).get("upload_seconds", 0.0))
    if overheads:
        happened = overheads_that_happened(overheads, record, start, len(ran))
    else:  # a record from before overheads were itemised: all of them
        happened = float(estimate.get("total_seconds", 0.0)) - float(estimate.get("train_seconds", 0.0))
    planned_steps = int(estimate.get("steps") or (record.get("chosen") or {}).get("remaining_steps") or len(ran))
    estimated = predicted_train + happened
    actual_seconds = float(actual["total_seconds"])
    projected = None
    if ran and predicted_train > 0:
        # The steps not run, at the live speed, and the overheads still to come as planned.
        left = (
            max(0.0, float(estimate.get("train_seconds", 0.0)) - predicted_train) if len(ran) < planned_steps else 0.0
        )
        still_planned = (
            overheads_still_planned(overheads, record, start) if overheads and len(ran) < planned_steps else 0.0
        )
        projected = actual_seconds + left * actual_train / predicted_train + still_planned + report
    status = str(actual.get("status") or record.get("status") or "unknown")
    return EstimateCheck(
        status=status,
        reason=stop_reason(status, actual, record),
        start_step=start,
        planned_steps=planned_steps,
        run_steps=int((record.get("plan") or {}).get("optimizer_steps") or start + planned_steps),
        steps_run=len(ran),
        actual_seconds=actual_seconds,
        estimated_seconds=estimated,
        error_pct=estimate_error_pct(estimated, actual_seconds),
        plan_seconds=float(estimate.get("total_seconds", 0.0)),
        projected_seconds=projected,
        actual_train_seconds=actual_train,
        predicted_train_seconds=predicted_train,
        overhead_seconds=happened,
        tokens=int(sum(entry.get("tokens", 0) for entry in ran)),
    )


def overheads_that_happened(overheads: JsonDict, record: JsonDict, start: int, steps_run: int) -> float:
    """The planned seconds of each overhead, counted as often as it took place in this command (the report aside)."""
    actual = record["actual"]
    seconds = float(overheads.get("model_build_seconds", 0.0))
    if steps_run:
        seconds += float(overheads.get("warmup_seconds", 0.0))
    shapes = int(overheads.get("compile_shapes") or 0)
    if shapes:
        seconds += float(overheads.get("compile_seconds", 0.0)) / shapes * int(actual.get("batch_shapes") or 0)
    seconds += float(overheads.get("checkpoint_seconds", 0.0)) * len(actual.get("checkpoint_seconds") or [])
    if record.get("final"):
        seconds += float(overheads.get("export_seconds", 0.0))
    seconds += float(overheads.get("eval_pass_seconds", 0.0)) * evaluations_run(record, start)
    return seconds


def overheads_still_planned(overheads: JsonDict, record: JsonDict, start: int) -> float:
    """Planned checkpoints and evaluations that a run stopped early did not get to."""
    saved = len(record["actual"].get("checkpoint_seconds") or [])
    checkpoints = max(0, int(overheads.get("checkpoint_count", 0)) - saved) * float(
        overheads.get("checkpoint_seconds", 0.0)
    )
    evaluations = max(0, int(overheads.get("eval_count", 0)) - evaluations_run(record, start)) * float(
        overheads.get("eval_pass_seconds", 0.0)
    )
    return checkpoints + evaluations


def evaluations_run(record: JsonDict, start: int) -> int:
    return sum(1 for entry in record.get("evals") or [] if entry.get("step", 0) > start)


def stop_reason(status: str, actual: JsonDict, record: JsonDict) -> str:
    if status == INTERRUPTED and actual.get("exit_signal") is not None:
        number = int(actual["exit_signal"])
        return f"interrupted ({SIGNAL_NAMES.get(number, f'signal {number}')})"
    if status == STEP_LIMIT:
        if actual.get("shrunk_to") is not None:  # only the guard's shrink sets it
            return f"shrunk by the deadline guard to {actual['shrunk_to']:,} steps (--on-overrun shrink)"
        planned = (record.get("plan") or {}).get("step_limit")
        return f"reached the plan's step limit{f' of {planned:,}' if planned else ''} (--max-steps or --fit-deadline)"
    return STOP_REASONS.get(status, status)


def describe_steps(check: EstimateCheck) -> str:
    """`34 of 161 planned steps ran` (and which, after a resume)."""
    text = f"{check.steps_run:,} of {check.planned_steps:,} planned steps ran"
    if check.start_step:
        text += f" (steps {check.start_step + 1:,}–{check.start_step + check.steps_run:,} of the run's {check.run_steps:,}, after a resume)"
    return text


def describe_time(check: EstimateCheck) -> str:
    """`4m08s actual vs 2m20s estimated for the steps that ran: estimate error +77.1% (…)`."""
    return (
        f"{format_duration(check.actual_seconds)} actual vs {format_duration(check.estimated_seconds)} estimated for the steps that ran: "
        f"estimate error {describe_estimate_error(check.error_pct)}"
    )


def describe_check(check: EstimateCheck) -> list[str]:
    """The comparison in words: the console summary and the report's banner print these lines, the charts their parts."""
    lines = [
        f"{describe_steps(check)}; {check.reason}",
        f"time: {describe_time(check)}; the estimate for them is {format_duration(check.predicted_train_seconds)} of training "
        f"+ {format_duration(check.overhead_seconds)} of the overheads that happened",
    ]
    if check.partial and check.projected_seconds is not None:
        lines.append(
            f"the whole plan at the live speed: {format_duration(check.projected_seconds)} projected vs {format_duration(check.plan_seconds)} estimated"
        )
    speed = describe_throughput(check)
    if speed:
        lines.append(speed)
    return lines


def describe_throughput(check: EstimateCheck) -> str | None:
    """`speed: 5,000 real tokens/s actual vs 41,000 predicted for the same steps (87.8% lower throughput)`."""
    change = check.throughput_change_pct
    if change is None:
        return None
    relation = (
        "as predicted" if abs(change) < 0.05 else f"{abs(change):.1f}% {'higher' if change > 0 else 'lower'} throughput"
    )
    return (
        f"speed: {check.actual_tokens_per_second:,.0f} real tokens/s actual vs {check.predicted_tokens_per_second:,.0f} predicted "
        f"for the same steps ({relation})"
    )
