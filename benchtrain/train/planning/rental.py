"""What renting a machine adds to a plan: spot or on-demand, the task's longest run, a node's disk;
the allowances below are stated, not measured (docs/design.md#rental)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchtrain.common.durations import format_duration
from benchtrain.train.planning.disk import disk_need
from benchtrain.train.planning.memory_check import BF16_BYTES, memory_need

if TYPE_CHECKING:
    from benchtrain.train.planning.types import Candidate, Plan
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import ModelSpec

GB = 10**9
PROVISION_SECONDS = 600.0  # a fresh machine found, booted and set up after a preemption: an allowance, not measured
SETUP_SECONDS = (
    900.0  # installing benchtrain (torch and its CUDA wheels) on a fresh machine: an allowance, not measured
)
MAX_DURATION_MARGIN = 0.2  # past the upper end before the engine stops the task: the guard acts first
SOFTWARE_BYTES = 30 * GB  # the Python environment, the CUDA wheels and caches: an allowance, not measured


@dataclass(frozen=True)
class Spot:
    use: bool
    reason: str  # how it was priced, in words
    restart_seconds: float  # one preemption: the work redone, a fresh machine and the startup again


def spot_choice(plan: Plan, available_seconds: float, checkpoint_interval_seconds: float) -> Spot:
    """Spot only where one preemption still meets the deadline (docs/design.md#rental)."""
    chosen, overheads = plan.chosen, plan.chosen.overheads
    startup = (
        overheads.model_build_seconds
        + overheads.warmup_seconds
        + overheads.compile_seconds
        + overheads.data_prep_seconds
    )
    training = max(0.0, chosen.total_seconds_promised - chosen.overheads.total_seconds)
    lost = min(checkpoint_interval_seconds, training)  # the work since the last checkpoint, at most all of it
    restart = lost + PROVISION_SECONDS + startup
    with_restart = chosen.total_seconds_promised + restart
    fmt = format_duration
    priced = (
        f"upper end {fmt(chosen.total_seconds_promised)} + one preemption {fmt(restart)} (work since the last checkpoint {fmt(lost)}, "
        f"a fresh machine {fmt(PROVISION_SECONDS)} assumed, startup {fmt(startup)} as planned) = {fmt(with_restart)} "
        f"vs {fmt(max(0.0, available_seconds))} usable"
    )
    if with_restart <= available_seconds:
        return Spot(True, f"spot: {priced}", restart)
    return Spot(False, f"on-demand: with one preemption priced in it would miss the deadline ({priced})", restart)


@dataclass(frozen=True)
class Duration:
    seconds: float
    basis: str  # how it was reckoned, in words


def max_duration(upper_seconds: float, spot: Spot, deadline_seconds: float) -> Duration:
    """The longest the engine lets the task run (docs/design.md#rental)."""
    run = upper_seconds + (spot.restart_seconds if spot.use else 0.0)
    seconds = min(run * (1 + MAX_DURATION_MARGIN), deadline_seconds) + SETUP_SECONDS
    restart = " + one preemption" if spot.use else ""
    basis = (
        f"(upper end{restart} {format_duration(run)}) × {1 + MAX_DURATION_MARGIN:g}, at most the deadline {format_duration(deadline_seconds)} "
        f"(the guard has stopped the run with a checkpoint by then), + {format_duration(SETUP_SECONDS)} to install benchtrain (an allowance)"
    )
    return Duration(seconds, basis)


@dataclass(frozen=True)
class ShutdownGrace:
    seconds: int  # whole seconds: torchrun's --shutdown-timeout takes them so
    basis: str  # how it was reckoned, in words


def shutdown_grace(chosen: Candidate) -> ShutdownGrace:
    """How long a node's processes get from SIGTERM to SIGKILL (torchrun's --shutdown-timeout, the engine's stop): the
    step in flight, then all a stopped run writes (its checkpoint, the final evaluation, final/, the push and the report:
    Overheads.after_training_seconds), each as the plan priced it from bench's measurements, at the plan's upper bound.
    torchrun's own default, 30 s, fits neither a large model's checkpoint nor its export (docs/design.md#rental)."""
    step = chosen.step_seconds / max(1, chosen.remaining_steps)
    after = chosen.overheads.after_training_seconds
    seconds = max(1, math.ceil((step + after) * (1 + chosen.bound_fraction)))
    basis = (
        f"(a step {format_duration(step)} + checkpoint, final evaluation, export, push and report {format_duration(after)}, "
        f"as planned from bench's measurements) × {1 + chosen.bound_fraction:.2f} (the plan's bound)"
    )
    return ShutdownGrace(seconds, basis)


@dataclass(frozen=True)
class DiskSize:
    total_bytes: int
    basis: str  # what it is made of, in words


def node_disk(
    spec: ModelSpec, method: MethodConfig, merge: bool, keep: int, device_type: str, uploaded_bytes: int
) -> DiskSize:
    """What one node writes and holds: the run's checkpoints and export as `train` counts them
    before its first step, the model's weights where it downloads them, the uploads, the software."""
    need = memory_need(spec, method, device_type)
    run = disk_need(need, method.is_lora, not spec.has_weights, merge and method.is_lora, device_type, keep)
    weights = need.total_parameters * BF16_BYTES if spec.has_weights else 0
    total = run.total_bytes + weights + uploaded_bytes + SOFTWARE_BYTES
    basis = (
        f"{run.checkpoints_written} checkpoints × {run.checkpoint_bytes / GB:.2f} GB + export {run.export_bytes / GB:.2f} GB (train.planning.disk, "
        f"counted on the meta device) + weights {weights / GB:.2f} GB + uploads {uploaded_bytes / GB:.2f} GB + {SOFTWARE_BYTES / GB:.0f} GB "
        "for the Python environment (an allowance)"
    )
    return DiskSize(total, basis)
