"""What a `train` command has settled once it has a plan, and how the console shows it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibration.comm import describe_communication
from calibration.run_file import ResumedRun
from common.console import say
from common.durations import format_duration
from train.planning.memory_check import MemoryNeed, describe_needs
from train.planning.plan_text import describe_compute, describe_plan
from train.planning.planner import deadline_options
from train.recipes.config import TrainConfig
from train.recipes.plan_setup import LoadedData, Placement, planned_compute
from train.step.runtime import scaled_learning_rate
from train.workload.tokenizer import is_byte_tokenizer

if TYPE_CHECKING:
    from calibration.model import Calibration
    from train.planning.types import Plan, PlanRequest
    from train.workload.method import MethodConfig
    from train.workload.model import ModelSpec


def learning_rate_record(config: TrainConfig, plan: Plan) -> dict[str, Any]:
    """The learning rate this run uses, and how it was scaled from --learning-rate."""
    effective = plan.chosen.config.micro_batch_size * plan.chosen.world_size * plan.chosen.config.grad_accum
    return {
        "learning_rate": scaled_learning_rate(config.tuning.learning_rate, config.tuning.lr_scaling, config.tuning.base_batch, effective),
        "base_learning_rate": config.tuning.learning_rate,
        "lr_scaling": config.tuning.lr_scaling,
        "base_batch": config.tuning.base_batch or effective,
    }


def plan_deadline_message(plan: Plan, resumed: bool) -> str:
    what = "the steps left need" if resumed else "the plan needs"
    return (
        f"{what} up to {format_duration(plan.chosen.total_seconds_promised)} but only "
        f"{format_duration(max(0.0, plan.available_seconds))} are left before the deadline; options: {deadline_options(plan, resumed)}"
    )


@dataclass
class PlannedRun:
    """What a `train` command has settled by the time it has a plan (one per setup it weighs)."""

    config: TrainConfig
    spec: ModelSpec
    method: MethodConfig
    out_dir: Path | None
    resumed: ResumedRun | None  # what this command continues of the run it resumes
    cal: Calibration
    need: MemoryNeed
    loaded: LoadedData  # what the plan saw, and the way to the exact data
    completed: int  # optimizer steps the resumed run already did
    placement: Placement
    communication: dict[str, Any]
    request: PlanRequest
    plan: Plan

    @property
    def rate(self) -> dict[str, Any]:
        return learning_rate_record(self.config, self.plan)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def profile(self) -> dict[str, Any]:
        return self.loaded.profile

    @property
    def deadline_message(self) -> str:
        return plan_deadline_message(self.plan, self.resumed is not None)


def print_plan(run: PlannedRun) -> None:
    """The plan as the console shows it (rank 0)."""
    plan, rate, placement = run.plan, run.rate, run.placement
    hardware = placement.hardware
    if run.resumed:
        total = run.resumed.total_steps
        stop = f", stopping at step {plan.step_limit or plan.chosen.optimizer_steps:,}" if (plan.step_limit or plan.chosen.optimizer_steps) < total else ""
        print(
            f"resuming from step {run.completed:,} of {total:,} with the run's configuration and learning-rate schedule{stop}: "
            f"planning the {plan.chosen.remaining_steps:,} steps left",
            flush=True,
        )
    notes = tuple(run.loaded.prepared.describe())
    print("\n".join(describe_plan(plan, run.profile, run.cal, is_byte_tokenizer(run.tokenizer), notes)), flush=True)
    compute = describe_compute(planned_compute(run.spec, run.method, plan.chosen, hardware), hardware)
    if compute:
        print(compute, flush=True)
    communication_line = describe_communication(run.communication)
    if communication_line:
        print(f"  {communication_line}", flush=True)
    if rate["lr_scaling"] != "none":
        print(
            f"  learning rate {rate['learning_rate']:.3g}: {rate['lr_scaling']} scaling of {rate['base_learning_rate']:.3g} "
            f"from base batch {rate['base_batch']} to this plan's effective batch",
            flush=True,
        )
    needs = describe_needs(run.spec, run.method, hardware, placement.sharding, placement.world_size, placement.setup.foreign)
    print(f"  training {run.method.describe()}: {run.need.trainable_parameters:,} of {run.need.total_parameters:,} parameters trainable; {needs}", flush=True)
    for warning in plan.warnings:
        say(f"warning: {warning}")
