"""Bench a step someone else built (a user's own Trainer: benchtrain.trainer.calibrate): the task, probe planner and
budget of `bench run` from what the built model says of itself, the probes run by a given coordinator, the record
fitted and stored as `bench run` stores it. Why: docs/design.md#calibrate-a-trainer"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchtrain.bench.calibrate import (
    AfterProbePrices,
    BenchRun,
    BenchTask,
    TaskRunner,
    after_probes_seconds,
    calibrate,
)
from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, MemoryPrior, device_speed
from benchtrain.bench.outlook import minimum_from_scratch, outlook
from benchtrain.bench.probe import machine_load
from benchtrain.bench.runner import Budget
from benchtrain.bench.space import default_space
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import save_calibration, save_failed
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.common.progress import Bar, BudgetBar
from benchtrain.train.planning.memory_check import compute_bytes
from benchtrain.train.step.hardware import device_label


@dataclass(frozen=True)
class GivenStep:
    """What bench needs of a step it did not build: the records of the calibration, the values of each dimension the
    step's owner uses (added to the device's grid), the lengths their data holds, and the model's facts that price a
    probe before it runs (FLOPs per token, bytes it keeps, layers and width)."""

    who: str  # how the lines name the step: "Trainer", "SFTTrainer"
    hardware: JsonDict
    software: JsonDict
    model: JsonDict
    training: JsonDict
    data: JsonDict
    batch_size: int
    workers: int
    accumulation: int
    lengths: list[int]
    world_size: int
    flops_per_token: Callable[[StepConfig], float]
    forward_share: float  # forward FLOPs ÷ training FLOPs per token (prices evaluation)
    static_bytes: float  # weights, gradients and optimizer state
    gradient_bytes: float  # what accumulating keeps
    layers: int
    hidden: int


class GivenBench:
    """The probes of a `GivenStep` within a budget: priced before any runs, then measured, fitted and stored."""

    def __init__(self, step: GivenStep, budget_seconds: float) -> None:
        hardware = step.hardware
        device_type = hardware["device_type"]
        space = default_space(device_type, hardware["memory_bytes"])
        space = space.with_axes(
            batch_sizes=tuple(sorted({*space.axis("batch_sizes"), step.batch_size})),
            workers=tuple(sorted({*space.axis("workers"), step.workers})),
            accums=tuple(sorted({*space.axis("accums"), step.accumulation})),
            seq_lens=tuple(sorted(set(step.lengths))),
            checkpointing=(0, 1),
        )
        settings = ProbeSettings.for_device(device_type).for_budget(budget_seconds)
        self.who = step.who
        self.budget_seconds = budget_seconds
        self.task = BenchTask(
            space=space,
            settings=settings,
            hardware=hardware,
            software=step.software,
            model=step.model,
            training=step.training,
            device_label=device_label(hardware),
            data=step.data,
            world_size=step.world_size,
            load_before=machine_load(),
            prices=AfterProbePrices(forward_share=step.forward_share),
            one_off_timings=False,  # no checkpoint is written: the owner's folders stay as they were
        )
        memory = MemoryPrior(
            static_bytes=step.static_bytes,
            accumulated_gradient_bytes=step.gradient_bytes,
            layers=step.layers,
            hidden=step.hidden,
            compute_bytes=compute_bytes(device_type),
        )
        cost = CostModel(step.flops_per_token, device_speed(hardware), settings)
        limit = float(hardware["memory_bytes"]) if device_type == "cuda" else None
        self.planner = ProbePlanner(space, cost, memory, limit, host_cores=hardware.get("cpu_cores"))

    @property
    def peak_flops(self) -> float | None:
        peak = self.task.hardware.get("peak_bf16_flops")
        return float(peak) if peak else None

    def refuse_small_budget(self, spent_seconds: float) -> None:
        """A budget that cannot pay for a minimum calibration (MIN_ROWS_FOR_FIT configurations, both checkpointing
        modes), priced by the planner before any probe, is one line."""
        view = outlook(self.planner, self.budget_seconds, spent_seconds, after_probes_seconds(self.task, self.planner))
        if view.affordable:
            return
        raise BenchtrainError(
            f"calibrate: budget {format_duration(self.budget_seconds)} cannot pay for {MIN_ROWS_FOR_FIT} configurations "
            f"of this {self.who}'s step (one of each checkpointing mode): even at the device's peak they need ≈ "
            f"{format_duration(view.least_seconds)} (≈ {format_duration(view.minimum_seconds)} at {view.prices}); "
            f'give budget="{format_duration(max(1, round(view.minimum_seconds)))}" or more'
        )

    def measure(self, coordinator: TaskRunner, budget: Budget, say: Callable[[str], None], bar: bool) -> str:
        """Rank 0: the probes, the fit and the stored calibration's path (one line when too few probes ran)."""
        task, planner = self.task, self.planner
        say(
            f"calibrating {self.who}'s step: up to {task.space.size} configurations within "
            f"{format_duration(self.budget_seconds)}"
        )
        progress: Bar | None = BudgetBar(self.budget_seconds, task.space.size) if bar else None
        before_probes = budget.elapsed()
        try:
            record, _ = calibrate(BenchRun(task, coordinator, planner, budget), 0.0, progress)
        finally:
            if progress is not None:
                progress.close()
        if record["fit"] is None:
            rows = record["measurements"]
            ok = sum(1 for row in rows if row["status"] == "ok")
            kept = save_failed(record)
            needed = minimum_from_scratch(planner, before_probes, after_probes_seconds(task, planner))
            raise BenchtrainError(
                f"calibrate: only {ok} of {len(rows)} configurations of the {self.who}'s step ran; a fit needs "
                f'{MIN_ROWS_FOR_FIT}: at the prices measured give budget="{format_duration(max(1, round(needed)))}" '
                f"or more (nothing stored as a calibration; the measurements are in {kept})"
            )
        path = save_calibration(record)
        say(f"calibration {record['id']} of {self.who}'s step saved to {path}")
        return str(path)


def one_sequence(lengths: list[int]) -> StepConfig:
    """One sequence of the middle length: where evaluation's forward share is priced."""
    ordered = sorted(set(lengths))
    return StepConfig(1, 0, 1, ordered[len(ordered) // 2])
