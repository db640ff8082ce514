"""One `train` command from start to end: checks, data, plan, training, record, report."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from calibration.accuracy import check_estimate
from common.atomic import json_text
from common.console import is_main_process, say
from common.durations import format_duration
from common.errors import EXIT_INTERRUPTED, EXIT_OK, BenchtrainError, DeadlineError, DoesNotFitError
from train.planning.disk import RunLock, check_space, disk_need
from train.recipes.calibration_choice import calibration_for
from train.recipes.config import TrainConfig
from train.recipes.plan_setup import Placement, PlanContext, fit_setup, load_data, plan_fitted, plan_json, planned_compute
from train.recipes.resume import (
    check_same_data,
    completed_steps,
    data_fingerprint,
    resume_command,
    resume_target,
    resumed_configuration,
    resumed_step_limit,
    run_total_steps,
)
from train.running.checkpoint import list_checkpoints


def learning_rate_record(config: TrainConfig, plan: Any) -> dict[str, Any]:
    """The learning rate this run uses, and how it was scaled from --learning-rate."""
    from train.step.runtime import scaled_learning_rate

    effective = plan.chosen.micro_batch_size * plan.chosen.world_size * plan.chosen.grad_accum
    return {
        "learning_rate": scaled_learning_rate(config.learning_rate, config.lr_scaling, config.base_batch, effective),
        "base_learning_rate": config.learning_rate,
        "lr_scaling": config.lr_scaling,
        "base_batch": config.base_batch or effective,
    }


def plan_deadline_message(plan: Any, previous: dict[str, Any] | None) -> str:
    from train.planning.planner import deadline_options

    what = "the steps left need" if previous else "the plan needs"
    return (
        f"{what} up to {format_duration(plan.chosen.total_seconds_promised)} but only "
        f"{format_duration(max(0.0, plan.available_seconds))} are left before the deadline; options: {deadline_options(plan, bool(previous))}"
    )


@dataclass
class PlannedRun:
    """What a `train` command has settled by the time it has a plan."""

    config: TrainConfig
    spec: Any
    method: Any
    out_dir: Path | None
    previous: dict[str, Any] | None  # run.json of the run this command resumes
    cal: Any
    placement: Placement
    need: Any  # train.planning.memory_check.MemoryNeed
    loaded: Any  # train.recipes.plan_setup.LoadedData: what the plan saw, and the way to the exact data
    completed: int  # optimizer steps the resumed run already did
    communication: dict[str, Any]
    request: Any  # train.planning.planner.PlanRequest
    plan: Any  # train.planning.planner.Plan

    @property
    def rate(self) -> dict[str, Any]:
        return learning_rate_record(self.config, self.plan)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def profile(self) -> dict[str, Any]:
        return self.loaded.profile


def run_training(args: argparse.Namespace, started: float, write_report: Callable[[Path], Path]) -> int:
    """`write_report(run folder)` writes the run's report (the command layer's: train/cli.py)."""
    from train.recipes.config import TrainConfig

    run = plan_run(TrainConfig.from_args(args), started)
    if run.config.json:
        if is_main_process():
            hardware = run.placement.device.hardware
            print(json_text(plan_json(run.cal, run.plan, run.placement, run.communication, planned_compute(run.spec, run.method, run.plan.chosen, hardware))))
            for warning in run.plan.warnings:
                say(f"warning: {warning}")
        if not run.plan.meets_deadline:
            raise DeadlineError(plan_deadline_message(run.plan, run.previous))
        return EXIT_OK
    if is_main_process():
        print_plan(run)
    if not run.plan.meets_deadline:
        # A dry run ends the same way the real run would, so a script can tell; a resumed plan too.
        raise DeadlineError(plan_deadline_message(run.plan, run.previous))
    if run.config.dry_run:
        return EXIT_OK
    return train_planned(run, getattr(args, "command_line", None), started, write_report)


def plan_run(config: TrainConfig, started: float) -> PlannedRun:
    """From the validated command line to a plan: the model and the run to resume, the calibration,
    the device, the memory check, the data, communication, and the planner — for each setup the
    calibration measured that the run may train with (train.recipes.variant_choice), the fastest
    kept."""
    from train.recipes.variant_choice import asked_variant, setups_to_plan, unmeasured_bases

    spec, method, out_dir, previous = resume_target(config)
    completed = completed_steps(out_dir) if previous and out_dir else 0
    if previous:
        # The run's steps, not what this command's deadline would make of them (an earlier stop at most).
        config = replace(config, max_steps=resumed_step_limit(previous, config, completed))
    cal, world_size, sharding = calibration_for(config, spec, method, previous)
    if config.device_memory_bytes:
        cal = cal.with_device_memory(config.device_memory_bytes)
    before = previous["plan"].get("sharding", "none") if previous else sharding
    if (before == "fsdp") != (sharding == "fsdp"):  # FSDP checkpoints key the optimizer state by name
        raise BenchtrainError(f"--resume: {out_dir} was trained with sharding {before}; resume it with the same (now: {sharding})")
    candidates = setups_to_plan(cal, method, method.variant if previous else asked_variant(config.quantize, config.optimizer))
    layout = (world_size, sharding)
    setups, refused = [], []
    for index, (variant, variant_method) in enumerate(candidates):
        try:
            # Before any data or model work: a calibration that does not suit, a too-big model, in one line.
            setups.append(fitted_for(config, variant, spec, variant_method, layout, quiet=index > 0))
        except BenchtrainError as error:
            if len(candidates) == 1:
                raise
            refused.append((variant_method, str(error)))
    if not setups:
        raise BenchtrainError(f"no setup the calibration measured fits: {refused[0][1]}")
    # A hub model's weights: how many GB will come into which cache, then fetched, before the data.
    spec = hub_weights(spec, config.dry_run)

    loaded = load_data(setups[0].config, spec)
    if previous:
        problem = check_same_data(previous, loaded, config.force)
        if problem:
            say(f"warning: {problem} (--force: continuing on this data)")
    resumed = (previous["plan"]["epochs"], resumed_configuration(previous, config)) if previous else None
    context = PlanContext(
        config, spec, loaded.data, loaded.eval_data, time.monotonic() - started, loaded.prep_seconds, loaded.uncertainty, resumed, completed
    )
    runs = []
    for setup in setups:
        try:
            runs.append(planned_setup(setup, context, (out_dir, previous, loaded), layout))
        except DoesNotFitError as error:
            if len(candidates) == 1:
                raise DoesNotFitError(with_smaller_bases(str(error), spec, setup)) from None
            refused.append((setup.method, str(error)))
    if not runs:
        message = f"no setup the calibration measured fits: {refused[0][1]}"
        raise DoesNotFitError(with_smaller_bases(message, spec, setups[0]))
    run = choose_setup(runs, refused)
    peak = run.plan.chosen.peak_memory_bytes
    activations = (peak - run.need.total_bytes, "this plan's configuration") if peak else None
    run.plan.notes.extend(unmeasured_bases(spec, run.method, run.cal, run.placement.device.hardware, activations))
    return run


def with_smaller_bases(message: str, spec: Any, setup: Any) -> str:
    """A plan that fits nowhere, and what the bases the calibration did not measure would hold,
    with the activations of the smallest step (`setup`: train.recipes.plan_setup.FittedSetup)."""
    from train.recipes.variant_choice import GIB, fit_verdict, smallest_activations, unmeasured_bases

    cal, method, need, hardware = setup.cal, setup.method, setup.need, setup.device.hardware
    activations = smallest_activations(cal, need.total_bytes)
    others = unmeasured_bases(spec, method, cal, hardware, activations)
    if not others or activations is None:
        return message + ("; " + "; ".join(others) if others else "")
    peak = need.total_bytes + activations[0]
    mine = f"this run's base: ≈{peak / GIB:.1f} GiB peak at {activations[1]}: {fit_verdict(peak, float(hardware['memory_bytes']), cal.memory_margin)}"
    return "; ".join([message, mine, *others])


def planned_setup(setup: Any, context: Any, run: tuple[Path | None, dict[str, Any] | None, Any], layout: tuple[int, str]) -> PlannedRun:
    """The plan of one fitted setup (train.recipes.plan_setup.plan_fitted), as this command's run:
    `run` is (the run folder, the run.json it resumes, the loaded data)."""
    out_dir, previous, loaded = run
    placed = plan_fitted(setup, context, layout)
    return PlannedRun(
        setup.config, context.spec, setup.method, out_dir, previous, setup.cal, placed.placement, setup.need, loaded,
        context.completed, placed.communication, placed.request, placed.plan,
    )


def choose_setup(runs: list[PlannedRun], refused: list[tuple[Any, str]]) -> PlannedRun:
    """The best plan (train.recipes.variant_choice.best_first), its notes saying what the other
    setups would have cost."""
    from train.recipes.variant_choice import best_first, compare_setups

    if len(runs) + len(refused) == 1:
        return runs[0]
    ranked = [runs[index] for index in best_first([run.plan for run in runs])]
    best = ranked[0]
    best.plan.notes.extend(compare_setups((best.cal, best.plan), [(run.cal, run.plan) for run in ranked[1:]], refused))
    return best


def fitted_for(config: TrainConfig, cal: Any, spec: Any, method: Any, layout: tuple[int, str], quiet: bool = False) -> Any:
    """The setup on the device the plan is for (train.recipes.plan_setup.fit_setup), said: the
    calibration's device when a dry run plans for another, and what --force let through. `quiet`:
    say nothing (a calibration's second setup: the first said it)."""
    from train.step.hardware import detect_hardware

    here = detect_hardware()
    setup = fit_setup(config, cal, spec, method, layout, here)
    if setup.device.foreign and not quiet:
        say(
            f"planning for {cal.hardware['name']}, the device calibration {cal.id} measured (this machine: {here['name']}); "
            "training on it needs that device, or --force"
        )
    for warning in setup.warnings if not quiet else ():
        say(f"warning: {warning}")
    return setup


def print_plan(run: PlannedRun) -> None:
    """The plan as the console shows it (rank 0)."""
    from calibration.comm import describe_communication
    from train.planning.memory_check import describe_needs
    from train.planning.plan_text import describe_compute, describe_plan
    from train.workload.tokenizer import is_byte_tokenizer

    plan, rate, placement = run.plan, run.rate, run.placement
    hardware = placement.device.hardware
    if run.previous:
        total = run_total_steps(run.previous)
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
    needs = describe_needs(run.spec, run.method, hardware, placement.sharding, placement.world_size, placement.device.foreign)
    print(f"  training {run.method.describe()}: {run.need.trainable_parameters:,} of {run.need.total_parameters:,} parameters trainable; {needs}", flush=True)
    for warning in plan.warnings:
        say(f"warning: {warning}")


def train_planned(run: PlannedRun, command_line: list[str] | None, started: float, write_report: Callable[[Path], Path]) -> int:
    """Train to the plan: the run folder locked and checked for room, run.json written before and
    after, the report, and the resume command when the run stopped early."""
    from train.running.record import write_run

    config, method, spec, plan = run.config, run.method, run.spec, run.plan
    run = with_exact_data(run, started)
    plan = run.plan
    out_dir, record = open_record(config, run.cal, spec, plan, run.loaded, run.previous, run.out_dir, run.request.elapsed_seconds)
    record["config"] = config.to_json()  # the whole validated configuration of this command
    record["plan"]["method"] = method.method
    record["plan"]["optimizer"] = method.optimizer
    record["plan"].update(run.rate)
    record["plan"]["communication"] = run.communication
    record["plan"]["sharding"] = run.placement.sharding  # none | ddp | fsdp (train/step/sharding.py)
    # Written before training, so that a run killed at any moment can be resumed with its method.
    record["plan"]["lora"] = method.settings()
    # The run's steps, fixed at its first plan: its learning-rate schedule's horizon, and what a resume finishes.
    record["plan"]["total_steps"] = run_total_steps(record)
    with contextlib.ExitStack() as held:
        if is_main_process():
            # One train per run folder; then room for what it will write, before any work.
            held.enter_context(RunLock(out_dir))
            existing = len(list_checkpoints(out_dir / "checkpoints"))
            merge = bool(config.merge_lora and method.is_lora)
            device_type = run.placement.device.hardware["device_type"]
            space = disk_need(run.need, method.is_lora, not spec.has_weights, merge, device_type, config.keep_checkpoints, existing)
            check_space(out_dir, space, config.keep_checkpoints)
            write_run(out_dir, record)
        outcome = train_with_record(config, run.cal, plan, run.loaded.data, spec, run.tokenizer, out_dir, record, started, method, run.loaded.eval_data)
        if is_main_process():
            report_path = finish_record(config, run.cal, plan, record, outcome, out_dir, started, run.request.elapsed_seconds, write_report)
            from train.planning.plan_text import describe_outcome

            resume = resume_command(command_line, out_dir, run.placement.world_size)
            print("\n".join(describe_outcome(record, out_dir, report_path, resume)), flush=True)
    from train.step.runtime import finish_together

    # Every rank waits until rank 0 has written everything: none exits while another still works.
    finish_together()
    return EXIT_INTERRUPTED if outcome["loop"].status == "interrupted" else EXIT_OK


def with_exact_data(run: PlannedRun, started: float) -> PlannedRun:
    """Every record tokenized (the cache built where it is cold, by one process per machine) and,
    when the plan came from a sample, the chosen configuration planned again on the exact profile:
    the steps, their estimate and the deadline check are the exact data's."""
    from dataclasses import replace

    from train.recipes.plan_setup import plan_again
    from train.workload.data import length_profile

    loaded = run.loaded
    data, eval_data = loaded.exact(run.config)
    exact = replace(loaded, data=data, eval_data=eval_data, profile={**length_profile(data.lengths), "sampled": False})
    if not loaded.sampled:
        return replace(run, loaded=exact)
    chosen = run.plan.chosen
    configuration = run.request.configuration or {
        "micro_batch_size": chosen.micro_batch_size,
        "grad_accum": chosen.grad_accum,
        "num_workers": chosen.num_workers,
        "max_length": chosen.max_length,
        "gradient_checkpointing": chosen.gradient_checkpointing,
    }
    request = replace(run.request, configuration=configuration, elapsed_seconds=time.monotonic() - started, data_prep_seconds=0.0, data_uncertainty=0.0)
    plan = plan_again(run.cal, request, data, eval_data)
    if is_main_process():
        from train.planning.plan_text import describe_exact_profile

        print("\n".join(describe_exact_profile(loaded.prepared, run.plan, plan)), flush=True)
    if not plan.meets_deadline:
        say(f"warning: with the exact profile {plan_deadline_message(plan, run.previous)}; the deadline guard stops the run in time")
    return replace(run, loaded=exact, request=request, plan=plan)


def hub_weights(spec: Any, dry_run: bool) -> Any:
    """The spec that loads a hub model's weights, fetched into the hub cache if missing (said first,
    with the size); a dry run only says what a run would fetch, and plans without them."""
    from train.workload.model import with_hub_weights

    if not dry_run:
        return with_hub_weights(spec, say)
    try:
        return with_hub_weights(spec, say, fetch=False)
    except BenchtrainError as error:
        say(f"warning: {error}")
        return spec


def open_record(
    config: TrainConfig,
    cal: Any,
    spec: Any,
    plan: Any,
    loaded: Any,
    previous: dict[str, Any] | None,
    out_dir: Path | None,
    elapsed_before_plan: float,
) -> tuple[Path, dict[str, Any]]:
    """The run folder and its run.json record: new, or the interrupted run's when resuming."""
    from common.home import writable_subdir
    from train.running.record import new_run_record
    from train.workload.data import truncation
    from train.workload.model import model_identity

    # A hub id's ORG/NAME as the hub cache writes it (ORG--NAME): one folder, not two.
    run_id = previous["run_id"] if previous else f"{spec.name.replace('/', '--')}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if out_dir is None:
        out_dir = writable_subdir("runs") / run_id
    if is_main_process():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BenchtrainError(f"cannot create run folder {out_dir}: {error.strerror or error}") from None
    data = loaded.data
    data_record = {
        "source": loaded.data_path,
        "format": data.format,
        "packing": data.packing,
        "loss_on": data.loss_on,
        "profile": loaded.profile,
        "fingerprint": data_fingerprint(data),
        # The cache key, where the tokens are, and the sampled estimate against the exact total.
        "preparation": loaded.prepared.record(),
    }
    if not data.packing:
        data_record["truncation"] = truncation(data.lengths, plan.chosen.max_length)
    # The model section is completed with parameter counts once the model is built.
    fresh = new_run_record(run_id, plan, cal, model_identity(spec), data_record, elapsed_before_plan)
    if not previous:
        return out_dir, fresh
    previous["resumed"] = previous.get("resumed", 0) + 1
    previous["plan"]["total_steps"] = run_total_steps(previous)  # before this command's steps replace the plan's
    # What this command planned: the steps left, its own deadline, time and step limit.
    previous["deadline_seconds"] = plan.deadline_seconds
    previous["elapsed_before_plan"] = elapsed_before_plan
    previous["estimate"] = fresh["estimate"]
    previous["chosen"] = fresh["chosen"]
    for key in ("optimizer_steps", "step_limit", "max_length"):
        previous["plan"][key] = fresh["plan"][key]
    previous["data"] = data_record  # the same data (check_same_data), or what --force continued on
    return out_dir, previous


def finish_record(
    config: TrainConfig,
    cal: Any,
    plan: Any,
    record: dict[str, Any],
    outcome: dict[str, Any],
    out_dir: Path,
    started: float,
    elapsed_before_plan: float,
    write_report: Callable[[Path], Path],
) -> Path | None:
    """What happened, in run.json; the measured speed back into the calibration; the report."""
    from train.running.record import actual_section, feed_back, write_run

    loop = outcome["loop"]
    record["final"] = outcome["final"]
    record["model"] = outcome["model"]
    record["plan"]["lora"] = outcome["training"]["lora"]
    record["training"] = outcome["training"]
    record["status"] = loop.status
    record["losses"], record["timeline"] = loop.losses, loop.timeline
    record["evals"] = loop.evals
    record["events"] = outcome["earlier_events"] + loop.events
    elapsed = time.monotonic() - started
    # The span the estimate check compares: from the plan to the end of the export. The report
    # comes after it (it is written from these figures) and is timed on its own.
    record["actual"] = actual_section(loop, elapsed - elapsed_before_plan, plan.price_per_hour, plan.chosen.world_size)
    record["actual"]["command_seconds"] = elapsed
    planned_report = plan.chosen.overheads.report_seconds if plan.chosen.overheads else 0.0
    record["met_deadline"] = elapsed + planned_report <= plan.deadline_seconds
    check = check_estimate(record)
    record["estimate_check"] = check.to_json() if check else None
    record["estimate_error_pct"] = check.error_pct if check else None
    write_run(out_dir, record)
    feed_back(cal, record)
    report_path = None if config.no_report else write_report(out_dir)
    # The deadline covers the whole command, the report included.
    finished = time.monotonic() - started
    record["actual"]["report_seconds"] = finished - elapsed if report_path else None
    record["actual"]["command_seconds"] = finished
    record["met_deadline"] = finished <= plan.deadline_seconds
    write_run(out_dir, record)
    return report_path


def train_with_record(
    config: TrainConfig,
    cal: Any,
    plan: Any,
    data: Any,
    spec: Any,
    tokenizer: Any,
    out_dir: Path,
    record: dict[str, Any],
    started: float,
    method: Any,
    eval_data: Any = None,
) -> dict[str, Any]:
    from train.running.loop import LoopSettings, TrainingRun
    from train.running.record import write_run
    from train.workload.method import method_record
    from train.workload.model import model_record, model_shape

    settings = LoopSettings(
        started_at=started,
        **asdict(plan.budget),
        on_overrun=config.on_overrun,
        checkpoint_interval_seconds=config.checkpoint_interval_seconds,
        keep_checkpoints=config.keep_checkpoints,
        learning_rate=record["plan"]["learning_rate"],  # scaled once, in run_training
        seed=config.seed,
        epochs=plan.epochs,
        step_limit=plan.step_limit,
        schedule_steps=record["plan"]["total_steps"],
        resume=config.resume,
        report_to=config.trackers,
    )

    earlier_events = list(record.get("events", []))  # from the run this one resumes

    def on_update(position: Any, events: list[str]) -> None:
        record["status"] = "running"
        record["timeline"] = position.timeline
        record["losses"] = position.losses
        record["evals"] = position.evals
        record["events"] = earlier_events + events
        write_run(out_dir, record)

    run = TrainingRun(
        calibration=cal,
        chosen=plan.chosen,
        data=data,
        spec=spec,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        out_dir=out_dir,
        settings=settings,
        on_update=on_update,
        method=method,
        step_options=config.step_options,
        eval_data=eval_data,
        eval_schedule=config.eval_schedule,
        tracker_record=record,
    )
    try:
        outcome = run.run()
        final = export_final_model(run, out_dir, tokenizer, spec, method, config.merge_lora, outcome.status)
    except Exception as error:
        from train.step.runtime import is_out_of_memory

        if not is_out_of_memory(error):
            raise
        chosen = plan.chosen
        raise BenchtrainError(
            f"out of memory training batch {chosen.micro_batch_size} at length {chosen.max_length}, which the calibration "
            f"predicted would fit: re-run `bench run` on this device, or use --priority memory_efficient or a shorter --max-length"
        ) from None
    return {
        "loop": outcome,
        "final": final,
        "model": model_record(spec, model_shape(run.model)),
        "training": {**method_record(method, run.model), **run.engine.record()},
        "earlier_events": earlier_events,
    }


# Runs that stopped before their planned end leave a final/ of their last state, marked partial.
PARTIAL_STATUSES = ("stopped_for_deadline", "interrupted")


def export_final_model(run: Any, out_dir: Path, tokenizer: Any, spec: Any, method: Any, merge_lora: bool, status: str) -> dict[str, Any] | None:
    """final/ (and final-base/, final-merged/) from the trained model, written by the main process
    (under FSDP every process first joins in gathering the full weights)."""
    if run.model is None:
        return None
    from train.step.sharding import gather_full_state, is_sharded

    full_weights = gather_full_state(run.model, None)[0] if is_sharded(run.model) else None
    if not is_main_process():
        return None
    from train.export import export_final

    model = run.accelerator.unwrap_model(run.model)
    final = export_final(out_dir, model, tokenizer, spec, method, merge_lora, full_weights)
    final["partial"] = status in PARTIAL_STATUSES
    return final
