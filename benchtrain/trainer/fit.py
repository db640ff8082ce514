"""`fit_to_deadline`: a user's own Trainer planned to a deadline as `train` plans its runs — from a calibration of
this device and model (the Trainer's own step, measured by `benchtrain.calibrate(trainer)`, or ours) and the real
token lengths of the Trainer's data — its micro-batch, accumulation, DataLoader workers, activation checkpointing
and evaluation batch set on its `TrainingArguments`, and `DeadlineCallback` attached to hold the run to it.
Why and how: docs/trainer.md#fit-a-trainer-to-a-deadline."""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import benchtrain.calibration as calibration_api
from benchtrain.calibration.comm import gradient_bytes
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.setup import Setup
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.atomic import json_text
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration, parse_duration
from benchtrain.common.errors import BenchtrainError, DeadlineError, DoesNotFitError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import Traffic
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.plan_text import describe_plan
from benchtrain.train.planning.planner import deadline_room, eval_pass_seconds
from benchtrain.train.planning.trainer_fields import step_differences as our_step_differences
from benchtrain.train.planning.types import Plan, PlanRequest
from benchtrain.train.recipes.run_plan import plan_trainer
from benchtrain.train.step.evaluation import EvalSchedule
from benchtrain.train.step.hardware import this_device
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.tokens import TokenizedData
from benchtrain.trainer.calibrate import calibrate
from benchtrain.trainer.callback import ON_OVERRUN, DeadlineCallback
from benchtrain.trainer.deadline_text import parse_deadline
from benchtrain.trainer.estimate import check_calibration, model_setup, trainer_precision
from benchtrain.trainer.trainer_data import TrainerData, trainer_data

LARGEST_EVAL_BATCH = 1024  # the eval batches tried: powers of two up to this (or the eval set's share of a process)
ArgumentValue = int | bool | None


@dataclass(frozen=True)
class TrainerPlan:
    """What `fit_to_deadline` planned and set: train's plan (the request it answered, the configuration chosen, its
    estimate and bounds), the TrainingArguments fields set on the Trainer as set, and where the Trainer's step is not
    the one the calibration measured (empty: it measured this Trainer's)."""

    plan: Plan
    calibration_id: str
    deadline: str  # as given
    on_overrun: str
    arguments: Mapping[str, ArgumentValue]
    differences: tuple[str, ...]

    def to_json(self) -> JsonDict:
        """As plain JSON values (the plan's numpy scalars as numbers), so that it round-trips through JSON text."""
        record: JsonDict = json.loads(
            json_text(
                {
                    "calibration_id": self.calibration_id,
                    "deadline": self.deadline,
                    "on_overrun": self.on_overrun,
                    "training_arguments": dict(self.arguments),
                    "differences": list(self.differences),
                    "plan": self.plan.to_json(),
                }
            )
        )
        return record


def fit_to_deadline(
    trainer: Any,
    deadline: str | float,
    calibration: Calibration | str | None = None,
    *,
    budget: str = "3m",
    on_overrun: str = "stop",
    margin: float = 0.05,
    priority: str = "balanced",
    quiet: bool = False,
) -> TrainerPlan:
    """Plan `trainer` to finish before `deadline` (a duration counted from `trainer.train()`, or a time) at its
    bounds' upper end, set the plan on `trainer.args`, attach DeadlineCallback, and return the plan.

    calibration: a Calibration, an id, a path or "latest"; None: `benchtrain.calibrate(trainer, budget=budget)` measures
        this Trainer's step first. on_overrun: "stop" (the whole run must fit; the callback saves and stops in time if
        it runs slower) or "fit" (max_steps cut to the steps that fit). Nothing fits: one line (BenchtrainError) with
        what would, and the Trainer unchanged."""
    if on_overrun not in ON_OVERRUN:
        raise BenchtrainError(
            f"on_overrun={on_overrun!r}: use 'stop' (the run must fit; saved and stopped in time) or 'fit' (cut to the steps that fit)"
        )
    if not 0 <= margin < 0.5:
        raise BenchtrainError(f"margin={margin}: a share of the deadline between 0 and 0.5")
    parse_duration(budget, "budget")
    now = time.time()
    text = parse_deadline(deadline, now)
    args = trainer.args
    spec, method = model_setup(trainer.model)
    world_size = int(args.world_size)
    measured = resolve_calibration(trainer, calibration, budget, Setup(spec.name, spec.fingerprint, method), world_size)
    check_calibration(measured, spec, method, this_device(), trainer_precision(args))
    if not measured.ok_rows():
        raise BenchtrainError(f"calibration {measured.id} has no successful probes: measure again")
    data = trainer_data(trainer)
    effective = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * world_size
    eval_batch = eval_batch_size(measured, data.eval, data.max_length, world_size, int(args.seed))
    seconds = text.budget_seconds if text.budget_seconds is not None else float(text.at_epoch or now) - now
    request = PlanRequest(
        epochs=planned_epochs(args, effective, data.sample_count),
        deadline=Deadline.with_margin_share(seconds, margin, time.monotonic()),
        priority=priority,
        effective_batch=effective,
        max_length=data.max_length,
        world_size=world_size,
        checkpoint_interval_seconds=0.0,
        checkpoint_every_steps=save_every(args, effective, data.sample_count),
        max_steps=int(args.max_steps) if int(args.max_steps) > 0 else None,
        fit_deadline=on_overrun == "fit",
        seed=int(args.seed),
        max_positions=spec.max_positions,
        eval_schedule=eval_schedule(args, effective, data.sample_count) if data.eval is not None else None,
        length_grouping=str(getattr(args, "train_sampling_strategy", "random")) == "group_by_length",
        eval_micro_batch_size=eval_batch,
    )
    trainable = sum(parameter.numel() for parameter in trainer.model.parameters() if parameter.requires_grad)
    try:
        plan = plan_trainer(
            already_built(measured), data.train, request, data.eval, Traffic("ddp", gradient_bytes(trainable))
        )
    except DoesNotFitError:
        raise BenchtrainError(
            f"fit_to_deadline: no micro-batch of effective batch {effective} fits this device's memory according to calibration "
            f"{measured.id}: a smaller effective batch (per_device_train_batch_size × gradient_accumulation_steps) or a shorter max_length"
        ) from None
    except DeadlineError as error:
        raise BenchtrainError(
            f"fit_to_deadline: {str(error).removeprefix('--fit-deadline: ')}; a later deadline"
        ) from None
    if not plan.meets_deadline:
        raise BenchtrainError(f"fit_to_deadline: {what_would_fit(plan, text.text)}")
    differences = step_differences(measured, trainer)
    arguments = planned_arguments(args, plan, eval_batch if data.eval is not None else None, on_overrun)
    apply(trainer, arguments)
    attach(trainer, DeadlineCallback(deadline=deadline, calibration=measured, on_overrun=on_overrun, margin=margin))
    fitted = TrainerPlan(plan, measured.id, text.text, on_overrun, arguments, differences)
    if not quiet:
        announce(fitted, data, measured)
    return fitted


def resolve_calibration(
    trainer: Any, calibration: Calibration | str | None, budget: str, run: Setup, world_size: int
) -> Calibration:
    """The calibration to plan with: the one given, one loaded as `train --use-calibration` loads it (`latest`
    preferring this model and method measured with this many processes), or this Trainer's step measured now."""
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is None:
        measured: Calibration = calibrate(trainer, budget=budget)
        return measured

    def this_run(setup: Setup) -> bool:
        return (setup.model_fingerprint, setup.method) == (run.model_fingerprint, run.method)

    return calibration_api.load(
        calibration,
        on_skip=lambda message: say(f"warning: {message}"),
        preferences=(lambda setup: this_run(setup) and setup.world_size == world_size, this_run),
    )


def already_built(calibration: Calibration) -> Calibration:
    """The calibration as the Trainer's plan prices it: its model is built before the deadline's clock starts."""
    built = copy.copy(calibration)
    built.overheads = {**calibration.overheads, "model_build_seconds": 0.0}
    return built


def planned_epochs(args: Any, effective_batch: int, samples: int) -> float:
    """The epochs the Trainer runs: num_train_epochs, or with max_steps the share of the data those steps take."""
    if int(args.max_steps) > 0:
        return int(args.max_steps) * effective_batch / samples
    return float(args.num_train_epochs)


def steps_per_epoch(effective_batch: int, samples: int) -> int:
    return max(1, math.ceil(samples / effective_batch))


def interval(strategy: object, every: float, effective_batch: int, samples: int) -> int | None:
    """Optimizer steps between two events of an IntervalStrategy/SaveStrategy (None: never); a fractional `every` is a
    share of the run, taken here as a share of one epoch's steps (the Trainer's is of max_steps: as often or less)."""
    name = str(getattr(strategy, "value", strategy))
    if name == "epoch":
        return steps_per_epoch(effective_batch, samples)
    if name in ("steps", "best") and every:
        return max(1, math.ceil(every * steps_per_epoch(effective_batch, samples)) if every < 1 else int(every))
    return None


def eval_schedule(args: Any, effective_batch: int, samples: int) -> EvalSchedule | None:
    """The Trainer's evaluation cadence (eval_steps defaults to logging_steps, as the Trainer takes it)."""
    every = interval(args.eval_strategy, args.eval_steps or args.logging_steps, effective_batch, samples)
    return EvalSchedule(every_steps=every) if every else None


def save_every(args: Any, effective_batch: int, samples: int) -> int | None:
    """Optimizer steps between the Trainer's saves; `best` saves at most at each evaluation."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    every = args.eval_steps or args.logging_steps if strategy == "best" else args.save_steps
    return interval(strategy, every, effective_batch, samples)


def eval_batch_size(
    calibration: Calibration, eval_data: TokenizedData | None, max_length: int, world_size: int, seed: int
) -> int:
    """The evaluation batch: of the powers of two whose training step at the eval set's longest sample the
    calibration's measured memory fits (a forward without gradients holds less), and no eval probe of that size or
    less ran out of memory, the one whose pass over the eval set the calibration's eval measurements price fastest."""
    if eval_data is None:
        return 1
    length = min(max_length, int(eval_data.lengths.max()))
    checkpointing = bool(max(calibration.measured_values("gradient_checkpointing") or [0]))
    share = max(1, math.ceil(len(eval_data) / world_size))
    failed = [
        row["micro_batch_size"]
        for row in (calibration.data.get("eval") or {}).get("measurements") or []
        if row.get("status") == "oom" and row.get("seq_len", 0) <= length
    ]
    sizes, size = [], 1
    while size <= min(LARGEST_EVAL_BATCH, share):
        step = StepConfig(size, 0, 1, length).switched(gradient_checkpointing=checkpointing)
        if not calibration.fits_in_memory(step) or any(size >= oom for oom in failed):
            break
        sizes.append(size)
        size *= 2
    if not sizes:
        return 1
    if calibration.eval_batch_seconds(1, 1) is None:
        return sizes[-1]
    return min(sizes, key=lambda rows: (eval_pass_seconds(calibration, eval_data, rows, length, seed), -rows))


def what_would_fit(plan: Plan, deadline: str) -> str:
    """The one line when the whole run does not fit: its promised time, and what would (in the Trainer's words)."""
    chosen, room = plan.chosen, deadline_room(plan)
    options = [
        *([f"num_train_epochs={room.epochs:g}"] if room.epochs is not None else []),
        *([f"max_steps={room.max_steps}"] if room.max_steps is not None else []),
        "a shorter max_length",
        'on_overrun="fit" to cut the steps automatically',
        "a later deadline",
    ]
    return (
        f"the run needs up to {format_duration(chosen.total_seconds_promised)} ({chosen.optimizer_steps:,} optimizer steps of "
        f"{chosen.config.phrase}) but the deadline {deadline} leaves {format_duration(max(0.0, plan.available_seconds))} "
        f"after its margin; options: {', '.join(options)}"
    )


def step_differences(calibration: Calibration, trainer: Any) -> tuple[str, ...]:
    """Where this Trainer's step is not the one the calibration measured: ours (its loss and compile setting; the
    plan prices the Trainer's own random batches), or another Trainer's (class or collator); none when it measured
    this Trainer."""
    measured = calibration.training.trainer
    if measured is None:
        return our_step_differences(calibration)
    here = (type(trainer).__name__, type(trainer.data_collator).__name__)
    if (measured.class_name, measured.collator) == here:
        return ()
    return (
        f"calibration {calibration.id} measured a {measured.class_name} with collator {measured.collator}; "
        f"this is a {here[0]} with collator {here[1]}: speed and memory may differ",
    )


def planned_arguments(args: Any, plan: Plan, eval_batch: int | None, on_overrun: str) -> dict[str, ArgumentValue]:
    """The TrainingArguments fields the plan sets, by their names in this transformers (activation_checkpointing,
    gradient_checkpointing before 5.24); the DataLoader's prefetch and persistent workers cleared where it has none."""
    step = plan.chosen.config
    checkpointing = (
        "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    )
    arguments: dict[str, ArgumentValue] = {
        "per_device_train_batch_size": step.micro_batch_size,
        "gradient_accumulation_steps": step.grad_accum,
        "dataloader_num_workers": step.num_workers,
        checkpointing: step.gradient_checkpointing,
    }
    if eval_batch is not None:
        arguments["per_device_eval_batch_size"] = eval_batch
    if on_overrun == "fit":
        arguments["max_steps"] = plan.step_limit or plan.chosen.optimizer_steps
    if step.num_workers == 0:
        # torch's DataLoader refuses these without workers (TrainingArguments checks them only when built).
        if getattr(args, "dataloader_prefetch_factor", None) is not None:
            arguments["dataloader_prefetch_factor"] = None
        if getattr(args, "dataloader_persistent_workers", False):
            arguments["dataloader_persistent_workers"] = False
    return arguments


def apply(trainer: Any, arguments: Mapping[str, ArgumentValue]) -> None:
    """The fields set on the Trainer's arguments (TrainingArguments' fields stay settable after it is built), and its
    own copy of the training batch (Trainer.__init__ took `args.train_batch_size`)."""
    args = trainer.args
    for name, value in arguments.items():
        setattr(args, name, value)
    if "activation_checkpointing" in arguments and hasattr(args, "gradient_checkpointing"):
        args.gradient_checkpointing = arguments["activation_checkpointing"]  # the deprecated alias mirrors it
    trainer._train_batch_size = args.train_batch_size


def attach(trainer: Any, callback: DeadlineCallback) -> None:
    """`callback` in the Trainer's callbacks, in place of any DeadlineCallback already there (one guard per run)."""
    while any(isinstance(each, DeadlineCallback) for each in trainer.callback_handler.callbacks):
        trainer.remove_callback(DeadlineCallback)
    trainer.add_callback(callback)


def announce(fitted: TrainerPlan, data: TrainerData, calibration: Calibration) -> None:
    """The plan in the words `train --dry-run` uses, the fields set, and where the step measured is not this one."""
    plan = fitted.plan
    lines = describe_plan(plan, length_profile(data.train.lengths), calibration)
    set_fields = ", ".join(f"{name}={value!r}" for name, value in fitted.arguments.items())
    print("\n".join([*lines, f"  set on trainer.args: {set_fields}; DeadlineCallback attached"]), flush=True)
    if fitted.differences:
        whose = "benchtrain's own step" if calibration.training.trainer is None else "another Trainer's step"
        say(
            f"warning: calibration {calibration.id} measured {whose}, not this Trainer's (benchtrain.calibrate(trainer) "
            "measures it):\n" + "\n".join(f"  - {line}" for line in fitted.differences)
        )
    for warning in plan.warnings:
        say(f"warning: {warning}")
