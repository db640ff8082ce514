"""What a plan lacks of its calibration (a max length longer than any it measured, an accumulation or a worker count
outside what it measured), measured before the plan is made again: `bench run --extend` in a child process (train does
not import bench), priced and said first, within --measure-budget. Why this way: docs/design.md#measuring-what-a-plan-lacks"""

from __future__ import annotations

import itertools
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass

from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import is_bundled, list_calibrations
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.planner import LENGTH_GRANULE
from benchtrain.train.recipes.run_plan import RunPlan
from benchtrain.train.step.hardware import this_device
from benchtrain.train.step.runtime import job_world_size

# Batch sizes measured at the new lengths: the plan's and those of its first alternatives.
BATCH_SIZES_AT_MOST = 3
# A length between the measured ones and the plan's is measured too where the plan's lies this far past them: the fit
# then sees how the step grows on the way, not only at its end.
MIDDLE_LENGTH_STRETCH = 2.0
# The child bench ends itself within its budget; this much more before train stops waiting (a hung child).
CHILD_GRACE_SECONDS = 120.0


@dataclass(frozen=True)
class Lacking:
    """What a plan lacks of its calibration, and the probes that would settle it."""

    calibration: Calibration
    reason: str  # "the data needs max length 1728; calibration X measured lengths up to 256"
    axes: dict[str, tuple[int, ...]]  # bench run's grid options (--seq-lens …) and their values
    probe_seconds: dict[StepConfig, float]  # each configuration of the grid priced from the calibration's own probes
    build_seconds: float  # the model build, as the calibration measured it

    @property
    def all_seconds(self) -> float:
        return self.build_seconds + sum(self.probe_seconds.values())

    @property
    def least_seconds(self) -> float:
        """The model build and the cheapest probe: less than this measures nothing."""
        return self.build_seconds + min(self.probe_seconds.values(), default=0.0)

    def what(self) -> str:
        """The values to measure in words: "lengths 704,1728 at batch 2,4,8"."""
        words = {"--seq-lens": "lengths", "--batch-sizes": "batch", "--accum": "accumulation", "--workers": "workers"}
        parts = [f"{words[flag]} {','.join(map(str, values))}" for flag, values in self.axes.items() if flag in words]
        return parts[0] + (f" at {', '.join(parts[1:])}" if parts[1:] else "")

    def arguments(self, model: str, budget_seconds: float) -> list[str]:
        """The `bench run --extend` that measures it."""
        grid = [part for flag, values in self.axes.items() for part in (flag, ",".join(map(str, values)))]
        reference = str(self.calibration.path) if self.calibration.path is not None else self.calibration.id
        return ["run", "--extend", reference, "--model", model, *grid, "--budget", f"{math.ceil(budget_seconds)}s"]


def lengths_lacking(calibration: Calibration, length: int) -> tuple[int, ...]:
    """The plan's length and, where it lies far past the measured ones, one between (their geometric middle)."""
    longest = calibration.measured_values("seq_len")[-1]
    middle = round(math.sqrt(longest * length) / LENGTH_GRANULE) * LENGTH_GRANULE
    if length > MIDDLE_LENGTH_STRETCH * longest and longest * math.sqrt(MIDDLE_LENGTH_STRETCH) <= middle < length:
        return (middle, length)
    return (length,)


def what_the_plan_lacks(run: RunPlan) -> Lacking | None:
    """The values past what the calibration measured that the chosen configuration needs (None: it lies inside)."""
    calibration, chosen = run.fitted.cal, run.plan.chosen
    config = chosen.config
    if calibration.extrapolation_ratio(config) <= 1.0 and calibration.within_measured_range(config):
        return None
    lengths = calibration.measured_values("seq_len")
    reasons = []
    batches = [config.micro_batch_size, *(other.config.micro_batch_size for other in run.plan.alternatives)]
    axes: dict[str, tuple[int, ...]] = {"--seq-lens": (config.seq_len,), "--batch-sizes": (config.micro_batch_size,)}
    if config.seq_len > lengths[-1]:
        reasons.append(
            f"the data needs max length {config.seq_len:,}; calibration {calibration.id} measured lengths up to {lengths[-1]:,}"
        )
        axes = {
            "--seq-lens": lengths_lacking(calibration, config.seq_len),
            "--batch-sizes": tuple(sorted(list(dict.fromkeys(batches))[:BATCH_SIZES_AT_MOST])),
        }
    # New lengths are probed at an accumulation and a worker count measured (the cheapest to settle); those are
    # measured at the plan's own values only when they are all it lacks.
    outside = []
    for flag, name, value in (
        ("--accum", "grad_accum", config.grad_accum),
        ("--workers", "num_workers", config.num_workers),
    ):
        measured = calibration.measured_values(name)
        if value not in measured:
            outside.append(f"the plan's {name.replace('_', ' ')} {value} lies outside the measured {measured}")
        axes[flag] = (nearest(measured, value),) if reasons else (value,)
    reasons = reasons or outside
    if not reasons:
        reasons.append(
            f"the plan's batch {config.micro_batch_size} at length {config.seq_len} holds more tokens than calibration {calibration.id} measured"
        )
    return Lacking(
        calibration, "; ".join(reasons), axes, probe_prices(calibration, axes, config), build_seconds(calibration)
    )


def nearest(measured: list[int], value: int) -> int:
    """The measured value closest to `value` (the smaller of two as close)."""
    return min(measured, key=lambda known: (abs(known - value), known))


def probe_prices(
    calibration: Calibration, axes: dict[str, tuple[int, ...]], chosen: StepConfig
) -> dict[StepConfig, float]:
    """Each configuration of the grid, priced as the calibration's own probes took: its predicted step × their seconds per
    step (warm-up and timed steps); none where they did not record their seconds."""
    per_step = [
        float(row["probe_seconds"]) / float(row["step_seconds"])
        for row in calibration.ok_rows()
        if row.get("probe_seconds") and row.get("step_seconds")
    ]
    if not per_step:
        return {}
    steps = statistics.median(per_step)
    configs = [
        StepConfig(micro, workers, accum, length, chosen.switches)
        for length, micro, accum, workers in itertools.product(
            axes["--seq-lens"], axes["--batch-sizes"], axes["--accum"], axes["--workers"]
        )
    ]
    return {config: steps * calibration.predict(config).step_seconds for config in configs}


def build_seconds(calibration: Calibration) -> float:
    return float(calibration.overheads.get("model_build_seconds", 0.0))


def why_not_measurable(run: RunPlan) -> str | None:
    """Why the calibration cannot be extended here (one line), or None: it can."""
    calibration = run.fitted.cal
    data: JsonDict = calibration.file_data
    if run.fitted.foreign or not calibration.hardware.same_device(this_device()):
        return f"calibration {calibration.id} measured {calibration.hardware.name}, not this machine"
    if calibration.path is None or is_bundled(calibration.path) or calibration.from_hub or calibration.translation:
        return f"calibration {calibration.id} was not measured here ({calibration.provenance})"
    if data.get("variants") or data.get("slices") or calibration.world_size > 1 or calibration.training.trainer:
        return (
            f"calibration {calibration.id} measured several setups, layer slices, several processes or a Trainer's step"
        )
    return None


def measure_lacking(lacking: Lacking, model: str, budget_seconds: float) -> str | None:
    """`bench run --extend` in a child process (its lines on stderr, so --json's stdout stays JSON): the id of the new
    calibration, or None after saying why nothing was stored (the plan is then made as before)."""
    old = lacking.calibration
    command = [sys.executable, "-m", "benchtrain.bench", *lacking.arguments(model, budget_seconds), "--quiet"]
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, text=True, timeout=budget_seconds + CHILD_GRACE_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        say(f"warning: measuring {lacking.what()} did not end in time; planning with calibration {old.id} as before")
        return None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0:
        say(
            f"warning: measuring {lacking.what()} stored nothing (bench exited {done.returncode}); planning with calibration {old.id} as before"
        )
        return None
    if lines:
        say(lines[-1])
    extensions = [entry.data for entry in list_calibrations() if entry.data and entry.data.get("extends") == old.id]
    return str(extensions[0]["id"]) if extensions else None


def measure_what_the_plan_lacks(run: RunPlan, model: str, budget_seconds: float | None, resuming: bool) -> str | None:
    """Said and measured when the plan lacks what the calibration did not measure: the new calibration's id, or None (nothing
    lacking, --no-measure, a resumed run, a calibration not measured here, a budget too small, or a failed measurement)."""
    lacking = what_the_plan_lacks(run)
    if lacking is None or budget_seconds is None or resuming:
        return None
    if job_world_size() > 1:
        run.plan.notes.append(
            f"{lacking.reason}: a train of several processes does not measure it; "
            f"`bench {' '.join(lacking.arguments(model, budget_seconds))}` (one process) measures it first"
        )
        return None
    refused = why_not_measurable(run)
    if refused is not None:
        return None
    if lacking.probe_seconds and lacking.least_seconds > budget_seconds:
        say(
            f"{lacking.reason}: measuring one probe of {lacking.what()} needs ≈ {format_duration(lacking.least_seconds)} with the model build, "
            f"more than --measure-budget {format_duration(budget_seconds)}: planning without it "
            f"(--measure-budget {format_duration(math.ceil(lacking.least_seconds * 1.5))} measures it)"
        )
        return None
    about = f"≈ {format_duration(min(lacking.all_seconds, budget_seconds))}, " if lacking.probe_seconds else ""
    say(
        f"{lacking.reason}: measuring {lacking.what()} first, {about}at most {format_duration(budget_seconds)} "
        "(--measure-budget; --no-measure plans without)"
    )
    return measure_lacking(lacking, model, budget_seconds)
