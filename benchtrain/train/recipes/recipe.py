"""One `train` command as a recipe: `setup`, `plan`, `train`, `finish` (state on the recipe); train/cli.py calls
`run_training`. The stages: docs/design.md#the-train-recipe."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from benchtrain.calibration.run_file import (
    COMPLETED,
    EVALUATION,
    EXPORT,
    INTERRUPTED,
    PHASES,
    PUSH,
    REPORT,
    STEP_LIMIT,
    STEPS,
    STOPPED_EARLY,
    JsonObject,
)
from benchtrain.common.atomic import json_text
from benchtrain.common.console import is_main_process, say
from benchtrain.common.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PUSH_FAILED, BenchtrainError, DeadlineError
from benchtrain.common.home import writable_subdir
from benchtrain.common.json_types import JsonDict
from benchtrain.common.run_paths import FINAL_PATH_KEYS, stored_path, stored_paths
from benchtrain.train.export import FINAL, export_final
from benchtrain.train.planning.disk import check_space, disk_need, run_lock
from benchtrain.train.planning.plan_text import describe_exact_profile, describe_outcome
from benchtrain.train.planning.trainer_fields import trainer_fields
from benchtrain.train.planning.types import Plan
from benchtrain.train.recipes.choice import (
    asked_variant,
    choose_plan,
    unmeasured_bases,
    weigh_variants,
    with_run_variant,
)
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.recipes.hub_push import check_push, describe_push, folder_to_push, push_run
from benchtrain.train.recipes.launch_task import LaunchTask, plan_task
from benchtrain.train.recipes.measure_missing import measure_what_the_plan_lacks
from benchtrain.train.recipes.run_data import hub_weights, load_data
from benchtrain.train.recipes.run_plan import (
    PlanContext,
    RunPlan,
    deadline_message,
    learning_rate_record,
    plan_exact,
    planned_compute,
    print_plan,
    push_note,
)
from benchtrain.train.running.checkpoint import list_checkpoints
from benchtrain.train.running.loop import LoopHooks, LoopSettings, ModelToTrain, TrainingData, TrainingRun
from benchtrain.train.running.record import RunRecord, TrainedRun, new_run_file
from benchtrain.train.running.resume import (
    Continuation,
    check_same_data,
    check_same_run,
    data_fingerprint,
    resume_command,
    resumed_hyperparameters,
    resumed_method,
    resumed_spec,
    resumed_step_limit,
    same_method,
)
from benchtrain.train.step.engine import StepOptions
from benchtrain.train.step.runtime import (
    finish_together,
    finish_wait_seconds,
    is_out_of_memory,
    job_world_size,
    run_precision,
)
from benchtrain.train.step.sharding import gather_full_state, is_sharded
from benchtrain.train.workload.data import length_profile, truncation
from benchtrain.train.workload.method import MethodConfig, method_record
from benchtrain.train.workload.model import (
    ModelSpec,
    model_identity,
    model_record,
    model_shape,
    resolve_model,
    weights_identity,
)


def run_training(
    args: argparse.Namespace,
    started: float,
    continuation: Continuation,
    write_report: Callable[[Path], Path],
    emit_task: Callable[[str, LaunchTask], None] | None = None,
) -> int:
    """`started`: time.monotonic() at the command's start (the deadline counts from there); `continuation`: what the
    command continues (train.running.resume.what_to_continue); `write_report` and `emit_task`: the command layer's
    writers of the run's report and a dry run's launch task."""
    config = TrainConfig.from_args(args, started_at=started, continuation=continuation)
    recipe = TrainRecipe(config, continuation, write_report, getattr(args, "command_line", None))
    recipe.setup()
    recipe.plan()
    if not recipe.show_plan():
        if recipe.config.output.emit and emit_task is not None and is_main_process():
            emit_task(
                recipe.config.output.emit,
                plan_task(recipe.run, recipe.config, recipe.spec, getattr(args, "command_line", None) or []),
            )
        return EXIT_OK
    try:
        recipe.train()
        status = recipe.finish()
    finally:
        recipe.cleanup()

    # Every rank waits until rank 0 has written everything: none exits while another still works. As long as rank 0's export, report and push are planned to
    # take (and more): a fixed wait ended rank 0 in the middle of a long push.
    finish_together(finish_wait_seconds(recipe.run.plan.chosen.overheads.after_training_seconds))
    return status


class TrainRecipe:
    def __init__(
        self,
        config: TrainConfig,
        continuation: Continuation,
        write_report: Callable[[Path], Path],
        command_line: list[str] | None = None,
    ) -> None:
        self.config = config
        # What this command continues of a run (nothing: a new run), decided once; every stage reads it.
        self.continuation = continuation
        self.write_report = write_report
        self.command_line = command_line  # for the resume command a stopped run prints
        self._held = contextlib.ExitStack()  # the run folder's lock, from opening run.json to the end

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        """--push-to-hub checked; the model, the method and the run to resume; the calibration's variants fitted to the device
        (one line before any data or model work when none suits); the hub weights; the data."""
        target = self.config.output.push_target
        self.push = check_push(target) if target is not None else None
        self.spec, self.method = self._resume_target()
        resumed = self.continuation.run
        if resumed:
            # The run's steps, not what this command's deadline would make of them (an earlier stop at most).
            config = self.config
            self.config = replace(
                config, plan=replace(config.plan, max_steps=resumed_step_limit(resumed, config.plan.max_steps))
            )
            tuning = replace(
                self.config.tuning,
                **resumed_hyperparameters(resumed, self.config.tuning.named_hyperparameters(), self.config.force),
            )
            self.config = replace(self.config, tuning=tuning)
        self.weighed = weigh_variants(self.config, self.spec, self.method, self.continuation)
        self.spec = hub_weights(self.spec, self.config.output.dry_run)
        self.loaded = load_data(self.config.data, self.spec, self.config.seed)
        if resumed:
            loaded, force = self.loaded, self.config.force
            problem = check_same_data(resumed, loaded.prepared, loaded.data, loaded.data_path, loaded.profile, force)
            if problem:
                say(f"warning: {problem} (--force: continuing on this data)")

    def _resume_target(self) -> tuple[ModelSpec, MethodConfig]:
        """The model spec and the method: a resumed run's model and adapters kept, other differing options refused unless
        --force (then warned of), and --force's --max-length set on the run's configuration."""
        config, resumed = self.config, self.continuation.run
        spec, method = resolve_model(config.model), config.tuning.method
        if resumed is None:
            return spec, method
        # --force with --max-length N trains the run's configuration at length N (check_same_run).
        forced_length = config.plan.max_length if config.force and isinstance(config.plan.max_length, int) else None
        resumed = resumed.with_length(forced_length)
        self.continuation = replace(self.continuation, run=resumed)
        run_method = resumed_method(resumed.method)  # once: the run's method as run.json holds it
        method = with_run_variant(method, run_method, asked_variant(config.tuning.quantize, config.tuning.optimizer))
        spec = resumed_spec(spec, resumed)
        for problem in check_same_run(resumed, run_method, spec, method, config.plan.max_length, config.force):
            say(f"warning: {problem} (--force: continuing with this command's)")
        if same_method(run_method, method):
            method = run_method  # the run's adapters exactly (its targets as resolved)
        return spec, method

    # -- plan -------------------------------------------------------------------------------
    def plan(self) -> RunPlan:
        """Each fitted variant planned; the fastest that fits kept, its notes saying what the others and unmeasured bases would hold."""
        config, loaded = self.config, self.loaded
        elapsed = config.run_deadline.elapsed()
        context = PlanContext(
            config,
            self.spec,
            loaded.data,
            loaded.eval_data,
            elapsed,
            loaded.prep_seconds,
            loaded.uncertainty,
            self.continuation,
        )
        self.context = context
        # Every rank plans (a 1-process calibration's collectives are timed among all of them);
        # rank 0's plan is what every rank trains (rank0_decides).
        run = self.run = rank0_decides(
            lambda: choose_plan(self.weighed, context),
            lambda chosen: replace(chosen, plan=self._with_own_clock(chosen.plan)),
        )
        extended = measure_what_the_plan_lacks(
            run, config.model, config.plan.measure_seconds, self.continuation.resuming
        )
        if extended is not None:
            run = self._plan_with(extended, run.fitted.cal.id)
        fitted = run.fitted
        peak = run.plan.chosen.peak_memory_bytes
        activations = (peak - fitted.need.total_bytes, "this plan's configuration") if peak else None
        run.plan.notes.extend(unmeasured_bases(self.spec, fitted.method, fitted.cal, fitted.hardware, activations))
        if self.push is not None:
            merge = bool(config.output.merge_lora and fitted.method.is_lora)
            run.plan.notes.append(push_note(self.push, fitted, merge))
        return run

    def _plan_with(self, calibration_id: str, extended: str) -> RunPlan:
        """The plan again, with the new calibration `calibration_id` that extends the one it had (`extended`); one process:
        measure_missing runs in no other."""
        config = self.config = replace(self.config, plan=replace(self.config.plan, use_calibration=calibration_id))
        self.weighed = weigh_variants(config, self.spec, self.method, self.continuation)
        self.context = replace(self.context, config=config, elapsed_seconds=config.run_deadline.elapsed())
        run = self.run = choose_plan(self.weighed, self.context)
        run.plan.notes.append(
            f"planned with calibration {calibration_id}: {extended}'s probes and those measured just now for this data"
        )
        return run

    def _with_own_clock(self, plan: Plan) -> Plan:
        """Rank 0's plan on another rank, its deadline counted from this process's start (another's monotonic clock means nothing here)."""
        return replace(plan, request=replace(plan.request, deadline=self.config.run_deadline))

    def show_plan(self) -> bool:
        """The plan on the console or as JSON (rank 0); a plan that misses the deadline ends the command, a dry run too, so
        a script can tell. Returns whether to train (not after --json or --dry-run)."""
        run, config = self.run, self.config
        if is_main_process() and config.output.for_trainer:
            precision = run.fitted.cal.training.precision or run_precision(run.fitted.device_type)
            fields = trainer_fields(run.plan, run.fitted.cal, precision)
            print(json_text(fields.to_json()) if config.output.json else fields.describe())
        elif is_main_process() and config.output.json:
            print(json_text(run.to_json(planned_compute(self.spec, run.fitted, run.plan.chosen))))
            for warning in run.plan.warnings:
                say(f"warning: {warning}")
        elif is_main_process():
            print_plan(run, self.context, self.loaded)
        if not run.plan.meets_deadline:
            if not self.continuation.steps_done:
                raise DeadlineError(deadline_message(run.plan, self.continuation.resuming))
            # Its steps all ran: what is left makes its model usable, however late (a stop now would leave no final/).
            say(f"warning: {deadline_message(run.plan, True)}; finishing the run anyway")
        return not (config.output.json or config.output.dry_run)

    # -- train ------------------------------------------------------------------------------
    def train(self) -> TrainedRun:
        """Train to the plan: the exact data; the run folder locked and checked for room, run.json written (a run killed at
        any moment resumes with its method); the loop."""
        self._with_exact_data()
        run, config = self.run, self.config
        self.record = self._open_record()
        # Before any step: every rank trains rank 0's configuration, steps and learning-rate horizon.
        check_same_training(training_summary(self.record.plan, self.record.file.run_id))
        if is_main_process():
            # One train per run folder; then room for what it will write, before any work.
            out_dir = self.record.out_dir
            self._held.enter_context(run_lock(out_dir))
            existing = len(list_checkpoints(out_dir / "checkpoints"))
            fitted = run.fitted
            merge = bool(config.output.merge_lora and fitted.method.is_lora)
            space = disk_need(
                fitted.need,
                fitted.method.is_lora,
                not self.spec.has_weights,
                merge,
                fitted.device_type,
                config.guard.keep_checkpoints,
                existing,
            )
            check_space(out_dir, space, config.guard.keep_checkpoints)
            self.record.write()
        self.trained = self._train_loop()
        return self.trained

    def _with_exact_data(self) -> None:
        """Every record tokenized (a cold cache built by one process per machine) and, for a plan made from a sample, the
        chosen configuration planned again on the exact profile."""
        run, loaded = self.run, self.loaded
        data, eval_data = loaded.exact(self.config.data, self.config.seed)
        self.loaded = replace(
            loaded, data=data, eval_data=eval_data, profile={**length_profile(data.lengths), "sampled": False}
        )
        if not loaded.sampled:
            # The run's span starts here, after the plan was shown (its text imports peft and bitsandbytes to size every method: ≈1.2 s, not a cost of the
            # planned work): that time is named in run.json's `elapsed_before_plan` with the rest spent before the steps.
            request = replace(run.plan.request, elapsed_seconds=self.config.run_deadline.elapsed())
            self.run = replace(run, plan=replace(run.plan, request=request))
            return
        # Rank 0's plan again (its elapsed time): every rank trains the same steps.
        elapsed = self.config.run_deadline.elapsed()
        plan = rank0_decides(lambda: plan_exact(run, elapsed, data, eval_data), self._with_own_clock)
        if is_main_process():
            print("\n".join(describe_exact_profile(loaded.prepared, run.plan, plan)), flush=True)
        self.run = replace(run, plan=plan)
        if not plan.meets_deadline:
            say(
                f"warning: with the exact profile {deadline_message(plan, self.continuation.resuming)}; the deadline guard stops the run in time"
            )

    def _open_record(self) -> RunRecord:
        """The run folder and its run.json (new, or the resumed run's) with the configuration, the method and the plan."""
        run = self.run
        # A hub id's ORG/NAME as the hub cache writes it (ORG--NAME): one folder, not two.
        # Rank 0's clock names a new run: two ranks a second apart would name two run folders.
        resumed = self.continuation.run
        run_id = (
            resumed.run_id
            if resumed
            else from_rank0(f"{self.spec.name.replace('/', '--')}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
        )
        out_dir = self.continuation.out_dir or writable_subdir("runs") / run_id
        if is_main_process():
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise BenchtrainError(f"cannot create run folder {out_dir}: {error.strerror or error}") from None
        # The model section is completed with parameter counts once the model is built.
        fresh = new_run_file(
            run_id,
            run.plan,
            run.fitted.cal,
            {**model_identity(self.spec), "weights": weights_identity(self.spec)},
            self._data_section(),
            run.plan.request.elapsed_seconds,
        )
        record = RunRecord.open(out_dir, fresh, self.continuation.earlier)
        file = record.file
        # The whole validated configuration of this command (--loss auto: the loss bench measured best, as it runs).
        command = replace(self.config, step=recorded_options(run, self.config.step)).to_json()
        command["out"] = stored_path(self.config.output.out, out_dir)  # ".": the run folder itself, wherever it moves
        file.update(config=command)
        method = run.fitted.method
        file.update_plan(
            method=method.method, optimizer=method.optimizer, **learning_rate_record(self.config, run.plan)
        )
        file.update_plan(communication=run.communication, sharding=run.fitted.step.sharding, lora=method.settings())
        # The run's steps, fixed at its first plan: its learning-rate schedule's horizon, and what a resume finishes.
        file.update_plan(total_steps=file.total_steps)
        # The hyper-parameters under HF TrainingArguments' names (train.step.hyperparameters.HF_KEYS).
        file.update(
            hyperparameters=self.config.tuning.hyperparameters.record(
                file.learning_rate, method.optimizer, file.total_steps
            )
        )
        file.plan_phases(self._phases(), self.continuation.phases_done)
        return record

    def _phases(self) -> list[str]:
        """What this command does (calibration.run_file.PHASES): the evaluation where there is held-out data, the push
        with --push-to-hub, the report unless --no-report."""
        left_out = {
            EVALUATION: self.loaded.eval_data is None,
            PUSH: self.push is None,
            REPORT: self.config.output.no_report,
        }
        return [phase for phase in PHASES if not left_out.get(phase, False)]

    def _data_section(self) -> JsonDict:
        """run.json's data: the source, its format, the profile, the fingerprint, the cache."""
        loaded = self.loaded
        data = loaded.data
        section = {
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
            section["truncation"] = truncation(data.lengths, self.run.plan.chosen.config.seq_len)
        return section

    def _train_loop(self) -> TrainedRun:
        """The training loop (train.running.loop.TrainingRun) on the plan, then final/."""
        run, config, record = self.run, self.config, self.record
        settings = LoopSettings(
            deadline=config.run_deadline,
            guard=config.guard,  # the guard's section whole: --on-overrun, checkpoint interval, checkpoints kept
            learning_rate=record.file.learning_rate,  # scaled once, in the plan (train.recipes.run_plan.learning_rate_record)
            seed=config.seed,
            epochs=run.plan.request.epochs,
            step_limit=run.plan.step_limit,
            schedule_steps=record.file.total_steps,
            checkpoints=self.continuation.checkpoints,  # the last one restored (none: a new run)
            fall_back=self.continuation.fall_back,
            run_id=record.file.run_id,
            final_evaluation=self._final_evaluation(),
            report_to=config.output.trackers,
            hyperparameters=config.tuning.hyperparameters,
        )
        tokenizer = self.loaded.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        loop = TrainingRun(
            calibration=run.fitted.cal,
            chosen=run.plan.chosen,
            model=ModelToTrain(
                self.spec, run.fitted.method, run.fitted.step
            ),  # THE step as the variant's fit decided it
            data=TrainingData(self.loaded.data, pad_id, self.loaded.eval_data, config.data.eval_schedule),
            out_dir=record.out_dir,
            settings=settings,
            hooks=LoopHooks(on_update=record.progress, tracker_record=record.data),
        )
        try:
            outcome = loop.run()
            if is_main_process() and outcome.status in (COMPLETED, STEP_LIMIT):
                # The steps end with the last checkpoint; the final evaluation is in it, or was done after it: written here.
                ended = outcome.position
                record.file.end_phase(STEPS)
                record.end_phase(EVALUATION, losses=ended.losses, timeline=ended.timeline, evals=ended.evals)
            final = self._export(loop, tokenizer, outcome.status)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            chosen = run.plan.chosen
            raise BenchtrainError(
                f"out of memory training batch {chosen.config.micro_batch_size} at length {chosen.config.seq_len}, which the calibration "
                f"predicted would fit: re-run `bench run` on this device, or use --priority memory_efficient or a shorter --max-length"
            ) from None
        model = loop.engine.model
        training = {**method_record(run.fitted.method, model), **loop.engine.record()}
        model_section = {**model_record(self.spec, model_shape(model)), "weights": weights_identity(self.spec)}
        return TrainedRun(outcome, final, model_section, training)

    def _final_evaluation(self) -> dict[str, float] | None:
        """The final evaluation of a resumed run whose evaluation phase had ended (its last in run.json), else None."""
        earlier = self.continuation.earlier
        evaluations = earlier.get("evals") if earlier is not None else None
        if EVALUATION not in self.continuation.phases_done or not isinstance(evaluations, list) or not evaluations:
            return None
        last = evaluations[-1]
        if not isinstance(last, dict):
            return None
        return {key: value for key, value in last.items() if isinstance(value, (int, float))}

    def _export(self, loop: TrainingRun, tokenizer: Any, status: str) -> JsonDict | None:
        """final/ written, and said in run.json (rank 0); a resumed run whose export had ended keeps the final/ it wrote."""
        out_dir = self.record.out_dir
        earlier = self.record.file.get("final")
        if EXPORT in self.continuation.phases_done and isinstance(earlier, dict) and (out_dir / FINAL).is_dir():
            return earlier
        final = export_final_model(loop, out_dir, tokenizer, self.config.output.merge_lora, status)
        if is_main_process():
            self.record.end_phase(EXPORT, final=stored_paths(final, out_dir, FINAL_PATH_KEYS))
        return final

    # -- finish -----------------------------------------------------------------------------
    def finish(self) -> int:
        """run.json completed, the measured speed fed back, the report, what to do next (rank 0); returns the exit status."""
        if is_main_process():
            run, config, record = self.run, self.config, self.record
            write_report = None if config.output.no_report else self.write_report
            pushed = PUSH in self.continuation.phases_done  # before a kill: its section is in run.json
            push = self._push if self.push is not None and self.trained.final and not pushed else None
            report_path = record.finish(self.trained, run.fitted.cal, run.plan, config.run_deadline, write_report, push)
            resume = resume_command(self.command_line, record.out_dir, run.fitted.step.world_size)
            print("\n".join(describe_outcome(record.data, record.out_dir, report_path, resume)), flush=True)
        if self.trained.loop.status == INTERRUPTED:
            return EXIT_INTERRUPTED
        return EXIT_PUSH_FAILED if self.record.file.push_status == "failed" else EXIT_OK

    def _push(self, record: JsonObject) -> JsonObject:
        """final/ and its model card to the hub (train.recipes.hub_push): run.json's `push` section."""
        assert self.push is not None
        say(f"pushing {folder_to_push(self.record.out_dir, record).name}/ to {self.push.repo_id} …")
        section: JsonObject = push_run(self.record.out_dir, record, self.push)
        say(describe_push(section, self.record.out_dir))
        return section

    def cleanup(self) -> None:
        """The run folder's lock released (whether the run finished or failed)."""
        self._held.close()


def recorded_options(run: RunPlan, options: StepOptions) -> StepOptions:
    """The step options as run.json records them: --loss auto as the loss bench measured best on this device, where it did."""
    fitted = run.fitted
    if options.loss == "auto" and not fitted.foreign and fitted.cal.compared_losses:
        return replace(options, loss=fitted.step.loss)
    return options


def export_final_model(loop: Any, out_dir: Path, tokenizer: Any, merge_lora: bool, status: str) -> JsonDict | None:
    """final/ (and final-merged/), written by the main process (under FSDP every process first gathers the full weights)."""
    trained = loop.engine.model
    if trained is None:
        return None
    full_weights = gather_full_state(trained, None)[0] if is_sharded(trained) else None
    if not is_main_process():
        return None
    model = loop.accelerator.unwrap_model(trained)
    final = export_final(out_dir, model, tokenizer, loop.to_train.spec, loop.to_train.method, merge_lora, full_weights)
    final["partial"] = status in STOPPED_EARLY  # stopped before the planned end: final/ is its last state
    return final


# -- what the processes of a multi-process `train` decide once, on rank 0, for all (docs/design.md#decided-on-rank-0) --

T = TypeVar("T")


def _join_process_group() -> Any:
    """torch.distributed, joined to the launcher's process group (accelerate's PartialState, once per process)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState(cpu=not torch.cuda.is_available())
    return dist


def from_rank0(value: T) -> T:
    """`value` as rank 0 has it, on every rank (one process: `value`)."""
    if job_world_size() == 1:
        return value
    dist = _join_process_group()
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_decides(decide: Callable[[], T], adopt: Callable[[T], T] = lambda value: value) -> T:
    """`decide()` on every rank (each joins its collectives), then rank 0's outcome on all: its value (through `adopt` on the
    others, to put their own clocks back in), or its BenchtrainError raised on every rank, so no rank is left waiting."""
    if job_world_size() == 1:
        return decide()
    try:
        outcome: tuple[Any, BenchtrainError | None] = (decide(), None)
    except BenchtrainError as refusal:
        outcome = (None, refusal)
    value, refused = from_rank0(outcome)
    if refused is not None:
        raise refused
    dist = _join_process_group()
    return value if dist.get_rank() == 0 else adopt(value)


def check_same_training(training: JsonDict) -> None:
    """Every rank trains what rank 0 trains (`training_summary`): else one line on every rank before any step, not a hang."""
    if job_world_size() == 1:
        return
    dist = _join_process_group()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, training)
    lead = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        differing = [key for key in sorted(set(lead) | set(theirs)) if lead.get(key) != theirs.get(key)]
        if differing:
            key = differing[0]
            raise BenchtrainError(
                f"the processes disagree on what to train: rank {rank}'s {key} is {theirs.get(key)!r}, rank 0's {lead.get(key)!r} "
                f"({', '.join(differing)} differ); every rank must plan from rank 0's plan (report this as a bug)"
            )


# What every rank must train alike, as run.json's plan section holds it (calibration.run_file.RunFile writes it).
COMPARED_PLAN_KEYS = (
    "configuration",
    "world_size",
    "epochs",
    "optimizer_steps",
    "step_limit",
    "total_steps",
    "learning_rate",
)


def training_summary(record_plan: JsonDict, run_id: str) -> JsonDict:
    """What `check_same_training` compares: run.json's plan section's COMPARED_PLAN_KEYS, and the run."""
    return {**{key: record_plan.get(key) for key in COMPARED_PLAN_KEYS}, "run_id": run_id}
