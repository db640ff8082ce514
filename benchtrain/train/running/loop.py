"""The training loop: the measured step, live speed against the estimate, the deadline guard,
checkpoints, resume and clean stops on SIGINT/SIGTERM. Its order: docs/design.md#loop."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import numpy as np

from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import COMPLETED, STEP_LIMIT
from benchtrain.common.console import say
from benchtrain.common.json_types import JsonDict
from benchtrain.common.pause import pause_at
from benchtrain.common.progress import Bar, progress_bar
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.types import Candidate
from benchtrain.train.running import trackers
from benchtrain.train.running.checkpoint import (
    CheckpointReadError,
    checkpoint_name,
    load_checkpoint,
    save_checkpoint,
)
from benchtrain.train.running.guard import DeadlineGuard, GuardSection, GuardSettings, Move, Verdict
from benchtrain.train.step import metrics
from benchtrain.train.step.compile import SHAPE_BUCKET
from benchtrain.train.step.engine import Optimization, StepOptions, StepSetup, build_engine, step_setup_for
from benchtrain.train.step.evaluation import EvalSchedule, evaluate_loss
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.train.step.hyperparameters import DEFAULT_LEARNING_RATE, OptimizerSettings
from benchtrain.train.step.peak_memory import PeakMemory
from benchtrain.train.step.runtime import agree, make_accelerator, pin_memory
from benchtrain.train.workload.batching import (
    Batch,
    BatchLayout,
    MicroBatch,
    PackedBatches,
    PaddedBatches,
    batch_rows_and_lengths,
    make_loader,
    run_batches,
)
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, model_shape
from benchtrain.train.workload.tokens import TokenizedData

if TYPE_CHECKING:
    from benchtrain.train.step.step import StepResult

# What signal.signal returns and takes: a handler, or SIG_DFL / SIG_IGN / None.
SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


@dataclass
class LoopSettings:
    deadline: Deadline  # the command's, as it built it: the start, the deadline and the margin
    guard: GuardSection = field(default_factory=GuardSection)
    log_interval_seconds: float = 10.0
    learning_rate: float = DEFAULT_LEARNING_RATE
    seed: int = 0
    epochs: float = 1.0
    step_limit: int | None = None
    # The run's optimizer steps as first planned: the learning-rate schedule's horizon (warm-up and
    # decay), kept by every resume whatever this command's step limit (None: this plan's steps).
    schedule_steps: int | None = None
    # The run's complete checkpoints, oldest first (train.running.resume.Continuation): the last is restored; none: a new run.
    checkpoints: tuple[Path, ...] = ()
    fall_back: bool = False  # a newest checkpoint that cannot be loaded gives way to the one before (--resume auto)
    run_id: str | None = (
        None  # written into each checkpoint: another run's in a reused --out are never pruned nor resumed
    )
    # A run resumed after all its steps whose final evaluation had ended (run.json's): kept, not done again.
    final_evaluation: dict[str, float] | None = None
    report_to: tuple[str, ...] = ()  # experiment trackers (train.running.trackers)
    warmup_steps: int = 1  # first steps of this process that the guard leaves out of the live speed
    hyperparameters: OptimizerSettings = field(default_factory=OptimizerSettings)


@dataclass
class LoopOutcome:
    status: str  # a word of calibration.run_file: completed | step_limit | stopped_for_deadline | interrupted
    position: Position  # where the run ended: its steps, tokens, step seconds, losses, evaluations, timeline
    checkpoint_seconds: list[float]
    events: list[str]
    last_checkpoint: str | None
    resumed_from: str | None = None
    exit_signal: int | None = None
    batch_shapes: int = 0  # distinct (rows, length) micro-batches met: each compiled once
    # train.step.metrics.step_figures over the run, peak memory
    figures: dict[str, float | None] = field(default_factory=dict)
    start_step: int = 0  # optimizer steps done before this command (restored from a checkpoint)
    shrunk_to: int | None = None  # the step limit the deadline guard cut the run to (--on-overrun shrink)


@dataclass
class Position:
    """Where the loop is: resumable from a checkpoint's meta."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    micro_batches: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    step_seconds: float = 0.0
    predicted_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    losses: list[dict[str, float]] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    flops: float = 0.0  # this process's, each micro-batch at its own length (train.step.metrics.batch_flops)

    def count(
        self, result: StepResult, micro_count: int, processes: int, predicted_seconds: float, flops: float
    ) -> None:
        """One optimizer step of `micro_count` micro-batches done."""
        self.step += 1
        self.batch_in_epoch += micro_count
        self.micro_batches += micro_count
        self.tokens += result.target_tokens * processes
        self.padded_tokens += result.tokens * processes
        self.step_seconds += result.seconds
        self.data_wait_seconds += result.data_wait_seconds
        self.predicted_seconds += predicted_seconds
        self.flops += flops


class StopSignals:
    """SIGINT/SIGTERM ask the loop to checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, SignalHandler] = {}

    def __enter__(self) -> StopSignals:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, _frame: FrameType | None) -> None:
        self.received = number

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


@dataclass(frozen=True)
class ModelToTrain:
    """What the loop trains, and how the step runs as the plan decided (None: the default options)."""

    spec: ModelSpec
    method: MethodConfig = field(default_factory=MethodConfig)
    step: StepSetup | None = None


@dataclass(frozen=True)
class TrainingData:
    """What the loop trains on, and what it evaluates on when."""

    data: TokenizedData
    pad_id: int
    eval_data: TokenizedData | None = None
    eval_schedule: EvalSchedule | None = None


@dataclass(frozen=True)
class LoopHooks:
    """What the loop calls after each logged step (run.json) and before each step (tests slow it down), and the run record its trackers are told of."""

    on_update: Callable[[Position, list[str]], None] | None = None
    step_hook: Callable[[int], None] | None = None
    tracker_record: JsonDict | None = None


@dataclass
class Every:
    """A cadence in seconds that knows when it is due (log lines, periodic checkpoints)."""

    seconds: float
    last: float  # time.monotonic() when it was last done (or when the count started)

    def due(self, now: float) -> bool:
        return now - self.last >= self.seconds


class TrainingRun:
    def __init__(
        self,
        *,
        calibration: Calibration,
        chosen: Candidate,
        model: ModelToTrain,
        data: TrainingData,
        out_dir: Path,
        settings: LoopSettings,
        hooks: LoopHooks | None = None,
    ) -> None:
        self.calibration, self.chosen, self.out_dir, self.settings = calibration, chosen, out_dir, settings
        self.to_train, self.inputs, self.hooks = model, data, hooks or LoopHooks()
        self.events: list[str] = []
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.peak_memory: PeakMemory | None = None

    # -- setup ------------------------------------------------------------------------------
    def _build(self) -> None:
        import torch

        s = self.settings
        self.accelerator = make_accelerator(s.report_to, self.out_dir / "tensorboard")
        torch.manual_seed(s.seed)
        optimization = Optimization(s.learning_rate, s.hyperparameters, s.schedule_steps or self.total_steps())
        setup = self.to_train.step or step_setup_for(
            StepOptions(), self.to_train.spec, self.to_train.method, self.accelerator
        )
        # The model, optimizer, scheduler and step: the engine's, read there.
        self.engine = build_engine(
            self.to_train.spec, self.to_train.method, self.accelerator, setup, self.chosen.config.switches, optimization
        )
        self.pin_memory = pin_memory(self.accelerator)

        shape, lora, switches = (
            model_shape(self.engine.model),
            self.to_train.method.is_lora,
            self.chosen.config.switches,
        )
        self.flops_per_token = lambda length: shape.flops_per_token(length, lora=lora, switches=switches)
        self.peak_flops = detect_hardware().get("peak_bf16_flops")
        trackers.start(self.accelerator, self.settings.report_to, self.out_dir, self.hooks.tracker_record or {})

    def epoch_batches(self, epoch: int) -> list[MicroBatch]:
        layout = BatchLayout(self.chosen.config.micro_batch_size, self.chosen.config.seq_len, self.settings.seed)
        return run_batches(
            self.inputs.data,
            layout,
            epoch,
            self.settings.epochs,
            self.accelerator.num_processes,
            self.accelerator.process_index,
        )

    def total_steps(self) -> int:
        steps = self.chosen.optimizer_steps
        return min(steps, self.settings.step_limit) if self.settings.step_limit else steps

    def dataset(self, batches: list[MicroBatch]) -> PackedBatches | PaddedBatches:
        if self.inputs.data.packing:
            return PackedBatches(self.inputs.data, batches, self.chosen.config.seq_len)
        return PaddedBatches(
            self.inputs.data, batches, self.chosen.config.seq_len, self.inputs.pad_id, self.shape_bucket
        )

    @property
    def shape_bucket(self) -> int | None:
        """Compiled steps pad to a few widths (train.step.compile.SHAPE_BUCKET): one compile per width."""
        return SHAPE_BUCKET if self.engine.setup.compiled else None

    def predicted_step_seconds(self, batches: list[MicroBatch]) -> np.ndarray:
        """Predicted seconds of each optimizer step of an epoch, from the batch shapes (each distinct
        shape predicted once: an epoch may hold millions of batches)."""
        c, step = self.chosen, self.chosen.config
        rows, lengths = batch_rows_and_lengths(self.inputs.data, batches, step.seq_len, self.shape_bucket)
        if not len(rows):
            return np.zeros(0)
        shapes, which = np.unique(np.stack([rows, lengths], axis=1), axis=0, return_inverse=True)
        seconds = np.array([self.calibration.micro_step_seconds(step.with_shape(int(r), int(n))) for r, n in shapes])
        micro = seconds[np.asarray(which).ravel()]
        return np.add.reduceat(micro, np.arange(0, len(micro), step.grad_accum)) + c.comm_seconds_per_step

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> LoopOutcome:
        self._build()
        position, resumed_from = self._restore()
        self._start(position, resumed_from)

        try:
            with PeakMemory(self.accelerator.device) as self.peak_memory, StopSignals() as self.signals:
                while position.epoch < math.ceil(self.settings.epochs) and self.status == COMPLETED:
                    self._run_epoch(position)
                self._finish(position)
        finally:
            if self.progress is not None:
                self.progress.close()
            trackers.finish(self.accelerator)
        return self._outcome(position, resumed_from)

    def _start(self, position: Position, resumed_from: str | None) -> None:
        """The run's state before its first step: status, step limit, guard, cadences, live line."""
        s, c = self.settings, self.chosen
        self.start_step, self.status, self.last_checkpoint = position.step, COMPLETED, resumed_from
        self.checkpoint_asked = False  # the guard's Move.CHECKPOINT, agreed by every rank
        self.checkpoint_times: list[float] = []
        now = time.monotonic()
        self.log_every, self.last_eval = Every(s.log_interval_seconds, now), now  # evaluations by time: EvalSchedule
        self.checkpoint_every = Every(s.guard.checkpoint_interval_seconds, now)
        self.limit = self.planned_limit = self.total_steps()
        periodic = c.overheads.during_training_seconds / c.step_seconds if c.step_seconds else 0.0
        reserve = c.overheads.after_training_seconds
        settings = GuardSettings(
            s.deadline,
            reserve_seconds=reserve,
            on_overrun=s.guard.on_overrun,
            warmup_steps=s.warmup_steps,
            periodic_share=periodic,
        )
        self.guard = DeadlineGuard(settings, self.limit)
        self.progress: Bar | None = (
            progress_bar(self.limit, "train", "step", position.step) if self.accelerator.is_main_process else None
        )

    def _run_epoch(self, position: Position) -> None:
        """The optimizer steps of this epoch (from where the position is), until the status changes."""
        c = self.chosen
        batches = self.epoch_batches(position.epoch)
        predicted = self.predicted_step_seconds(batches)
        elapsed_predicted = np.concatenate(([0.0], np.cumsum(predicted)))  # running totals for the guard
        loader = make_loader(
            self.dataset(batches), c.config.num_workers, self.pin_memory, start=position.batch_in_epoch
        )
        iterator = iter(loader)
        while position.batch_in_epoch < len(batches) and self.status == COMPLETED:
            if position.step >= self.limit:
                self.status = STEP_LIMIT
                break
            step_index = position.batch_in_epoch // c.config.grad_accum
            step_predicted = float(predicted[step_index])
            result, now = self._step(
                iterator, position, min(c.config.grad_accum, len(batches) - position.batch_in_epoch), step_predicted
            )
            remaining_predicted = float(self._remaining_predicted(position, elapsed_predicted, step_index, self.limit))
            self._after_step(position, result, now, step_predicted, remaining_predicted)
        del iterator, loader
        if self.status == COMPLETED and position.batch_in_epoch >= len(batches):
            position.epoch += 1
            position.batch_in_epoch = 0

    def _step(
        self, iterator: Iterator[Batch], position: Position, micro_count: int, predicted_seconds: float
    ) -> tuple[StepResult, float]:
        """One optimizer step, counted into the position; the step's result and when it ended."""
        if self.hooks.step_hook:
            self.hooks.step_hook(position.step)
        pause_at("step", position.step + 1)
        result = self.engine.step.run(iterator, micro_count)
        processes = self.accelerator.num_processes
        position.count(
            result, micro_count, processes, predicted_seconds, metrics.batch_flops(result.shapes, self.flops_per_token)
        )
        now = time.monotonic()
        elapsed, tokens = self.settings.deadline.elapsed(now), result.target_tokens * processes
        entry = {
            "step": position.step,
            "loss": result.loss,
            "elapsed": elapsed,
            "seconds": result.seconds,
            "predicted_seconds": predicted_seconds,
        }
        position.losses.append({**entry, "tokens": tokens, "learning_rate": result.learning_rate})
        return result, now

    def _after_step(
        self, position: Position, result: StepResult, now: float, predicted_seconds: float, remaining_predicted: float
    ) -> None:
        """The deadline guard's verdict on this step, then what is due: live line, trackers, log, evaluation, checkpoint."""
        elapsed = self.settings.deadline.elapsed(now)
        compiled_here = self._met_new_shapes(result.shapes)
        pending_compile = self._pending_compile_seconds()
        verdict = self.guard.observe(
            position.step,
            elapsed,
            result.seconds,
            predicted_seconds,
            remaining_predicted,
            compiled_here,
            pending_compile,
        )
        self._heed(verdict)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(self._postfix(result, verdict), refresh=False)
        self._track_step(position, result, verdict.projected_finish - elapsed)
        if self.log_every.due(now) or self.status != COMPLETED:
            self.log_every.last = now
            position.timeline.append(self._timeline_point(position, now, verdict.ratio, verdict.projected_finish))
            self._log(position, now, verdict)
            if self.hooks.on_update is not None and self.accelerator.is_main_process:
                self.hooks.on_update(position, self.events)
        self._evaluate_if_due(position, now)
        self._checkpoint_if_due(position, now)

    def _heed(self, verdict: Verdict) -> None:
        """Say a change of state once; every rank agrees on the strongest move any asks (a signal outranks the guard) and on the step limit."""
        if verdict.message:
            self.events.append(verdict.message)
            if self.progress is not None:
                self.progress.write(f"deadline: {verdict.message}")
        asked = Move.INTERRUPT if self.signals.received is not None else verdict.move
        move = Move.of_strength(agree(self.accelerator, asked.strength, "max"))
        self.limit = self.guard.limit = agree(self.accelerator, verdict.limit, "min")
        self.status = move.status or self.status  # a stop's status word (calibration.run_file)
        self.checkpoint_asked = move is Move.CHECKPOINT

    def _evaluate_if_due(self, position: Position, now: float) -> None:
        # Every rank evaluates together (the loss is summed across them): agree on "due".
        schedule = self.inputs.eval_schedule or EvalSchedule()
        due = (
            self.inputs.eval_data is not None
            and self.status == COMPLETED
            and schedule.due(position.step, now - self.last_eval)
        )
        if agree(self.accelerator, int(due), "max"):
            self._evaluate(position)
            self.last_eval = time.monotonic()

    def _checkpoint_if_due(self, position: Position, now: float) -> None:
        """Periodically, when the guard asks, and when the run stops early (its last step is kept)."""
        periodic = self.checkpoint_every.due(now)
        if self.engine.setup.sharding == "fsdp":  # every rank gathers together: agree on when
            periodic = bool(agree(self.accelerator, int(periodic), "max"))
        if (periodic or self.checkpoint_asked or self.status != COMPLETED) and self._saves_here:
            self._save(position)
            self.checkpoint_every.last = time.monotonic()

    def _finish(self, position: Position) -> None:
        """After the last step: the final evaluation and checkpoint, unless this step has them."""
        if self.status == COMPLETED and position.step >= self.limit and self.settings.step_limit:
            self.status = STEP_LIMIT
        evaluated_here = bool(position.evals) and position.evals[-1]["step"] == position.step
        if self.inputs.eval_data is not None and position.step > 0 and not evaluated_here:
            self._evaluate(position)  # every run ends with an evaluation
        already_saved = self.last_checkpoint is not None and self.last_checkpoint.endswith(
            checkpoint_name(position.step)
        )
        if self._saves_here and not already_saved and position.step > 0:
            self._save(position)
        now = time.monotonic()
        position.timeline.append(self._timeline_point(position, now, 1.0, self.settings.deadline.elapsed(now)))

    def _outcome(self, position: Position, resumed_from: str | None) -> LoopOutcome:
        return LoopOutcome(
            status=self.status,
            position=position,
            checkpoint_seconds=self.checkpoint_times,
            events=self.events,
            last_checkpoint=self.last_checkpoint,
            resumed_from=resumed_from,
            exit_signal=self.signals.received,
            batch_shapes=len(self.shapes_seen),
            figures=self._run_figures(position),
            start_step=self.start_step,
            shrunk_to=self.limit if self.limit < self.planned_limit else None,
        )

    # -- helpers ----------------------------------------------------------------------------
    @property
    def _saves_here(self) -> bool:
        """Rank 0 writes checkpoints; under FSDP every rank joins in gathering the state."""
        return self.accelerator.is_main_process or self.engine.setup.sharding == "fsdp"

    def _run_figures(self, position: Position) -> dict[str, float | None]:
        """This process's figures over the run (train.step.metrics), and its peak memory."""
        per_process = position.padded_tokens / self.accelerator.num_processes
        flops_per_token = position.flops / per_process if per_process else 0.0
        figures = metrics.step_figures(
            per_process, position.step_seconds, position.data_wait_seconds, flops_per_token, self.peak_flops
        )
        memory = self.peak_memory.record() if self.peak_memory else {}  # on CUDA: reserved, used, outside PyTorch
        return {**figures, "peak_memory_bytes": self.peak_memory.peak_bytes if self.peak_memory else None, **memory}

    def _met_new_shapes(self, shapes: tuple[tuple[int, ...], ...]) -> bool:
        """Whether this step met a batch shape for the first time: compiled steps compile it then."""
        new = set(shapes) - self.shapes_seen
        self.shapes_seen.update(new)
        return self.engine.setup.compiled and bool(new)

    def _pending_compile_seconds(self) -> float:
        """Planned compilation of the shapes not met yet (the plan's per-shape average)."""
        overheads = self.chosen.overheads
        if not self.engine.setup.compiled or not overheads.compile_shapes:
            return 0.0
        left = max(0, overheads.compile_shapes - len(self.shapes_seen))
        return left * overheads.compile_seconds / overheads.compile_shapes

    @staticmethod
    def _remaining_predicted(position: Position, elapsed_predicted: np.ndarray, step_index: int, limit: int) -> float:
        """Predicted seconds of the steps still to run (this epoch's rest + later epochs), from the
        epoch's running totals so each step costs O(1), however long the epoch."""
        steps_left = max(0, limit - position.step)
        epoch_steps = len(elapsed_predicted) - 1
        last = min(epoch_steps, step_index + 1 + steps_left)
        remaining = elapsed_predicted[last] - elapsed_predicted[step_index + 1]
        steps_left -= last - (step_index + 1)
        if steps_left > 0 and epoch_steps:
            remaining += steps_left * elapsed_predicted[-1] / epoch_steps
        return float(remaining)

    def _evaluate(self, position: Position) -> None:
        """Held-out loss now; recorded with the step, logged, and sent to the trackers."""
        step = self.chosen.config
        if self.inputs.eval_data is None:
            return
        layout = BatchLayout(step.micro_batch_size, step.seq_len, self.settings.seed)
        pause_at("evaluation", position.step)
        result = evaluate_loss(
            self.accelerator,
            self.engine.model,
            self.inputs.eval_data,
            layout,
            self.inputs.pad_id,
            self.engine.setup.compiled,
        )
        entry = {"step": position.step, "elapsed": self.settings.deadline.elapsed(), **result}
        position.evals.append(entry)
        if self.progress is not None:
            self.progress.write(
                f"step {position.step}: eval loss {result['eval_loss']:.4f}, perplexity {result['perplexity']:.2f} ({result['seconds']:.1f}s)"
            )
        self._track({"eval/loss": result["eval_loss"], "eval/perplexity": result["perplexity"]}, position.step)

    def _track(self, values: dict[str, float | None], step: int) -> None:
        if self.accelerator.is_main_process:
            trackers.log(self.accelerator, values, step)

    def _track_step(self, position: Position, result: StepResult, eta_seconds: float) -> None:
        if not self.settings.report_to:
            return
        flops_per_token = metrics.batch_flops(result.shapes, self.flops_per_token) / max(1, result.tokens)
        figures = metrics.step_figures(
            result.tokens, result.seconds, result.data_wait_seconds, flops_per_token, self.peak_flops
        )
        rate = metrics.tokens_per_second(result.target_tokens * self.accelerator.num_processes, result.seconds)
        values: dict[str, float | None] = {
            "train/loss": result.loss,
            "train/learning_rate": result.learning_rate,
            "train/tokens_per_second": rate,
        }
        values.update({f"train/{name}": figures[name] for name in ("mfu", "tflops", "data_wait_share")})
        self._track({**values, "train/eta_seconds": max(0.0, eta_seconds)}, position.step)

    def _timeline_point(self, position: Position, now: float, ratio: float, projected: float) -> dict[str, float]:
        loss = position.losses[-1]["loss"] if position.losses else math.nan
        point = {
            "elapsed": self.settings.deadline.elapsed(now),
            "steps": position.step,
            "tokens": position.tokens,
            "train_seconds": position.step_seconds,
        }
        return {
            **point,
            "predicted_train_seconds": position.predicted_seconds,
            "live_ratio": ratio,
            "projected_finish": projected,
            "loss": loss,
        }

    @staticmethod
    def _postfix(result: StepResult, verdict: Verdict) -> str:
        """The live line: this step's loss and speed, and the deadline guard's state (the same the log and the guard's messages say)."""
        return (
            f"loss {result.loss:.3f}, {result.target_tokens / max(result.seconds, 1e-9):,.0f} tok/s, {verdict.summary}"
        )

    def _log(self, position: Position, now: float, verdict: Verdict) -> None:
        predicted_rate = position.tokens / max(position.predicted_seconds, 1e-9)
        actual_rate = position.tokens / max(position.step_seconds, 1e-9)
        elapsed = self.settings.deadline.elapsed(now)
        line = (
            f"step {position.step}: {actual_rate:,.0f} tok/s actual vs {predicted_rate:,.0f} predicted, "
            f"elapsed {elapsed:.0f}s, remaining {max(0.0, verdict.projected_finish - elapsed):.0f}s; {verdict.summary} "
            f"(deadline {self.settings.deadline.deadline_seconds:.0f}s)"
        )
        if self.progress is not None:
            self.progress.write(line)

    def _save(self, position: Position) -> None:
        folder = self.out_dir / "checkpoints" / checkpoint_name(position.step)
        meta, e = {**vars(position), "chosen": self.chosen.to_json(), "run_id": self.settings.run_id}, self.engine
        seconds = save_checkpoint(
            folder, e.model, e.optimizer, e.scheduler, meta, keep=self.settings.guard.keep_checkpoints
        )
        self.events.append(f"checkpoint {folder.name} saved in {seconds:.2f}s")
        self.last_checkpoint = str(folder)
        self.checkpoint_times.append(seconds)

    def _restore(self) -> tuple[Position, str | None]:
        found = self.settings.checkpoints
        if not found:
            return Position(), None
        e = self.engine
        while True:
            try:
                meta = load_checkpoint(found[-1], e.model, e.optimizer, e.scheduler)
                break
            except CheckpointReadError as error:
                if len(found) < 2:
                    raise
                if not self.settings.fall_back:
                    raise CheckpointReadError(
                        f"{error}; the previous checkpoint, {found[-2].name}, is intact: move {found[-1]} aside and resume again"
                    ) from None
                # Loading the one before restores every tensor and state again, whatever the failed load had set.
                if self.accelerator.is_main_process:
                    say(f"warning: {error}; resuming from the one before, {found[-2].name}")
                self.events.append(f"passed over {found[-1].name}: it cannot be loaded")
                found = found[:-1]
        fields = {name: meta[name] for name in Position.__dataclass_fields__ if name in meta}
        self.events.append(f"resumed from {found[-1].name}")
        position, evaluated = Position(**fields), self.settings.final_evaluation
        if evaluated is not None and evaluated.get("step") == position.step and evaluated not in position.evals:
            position.evals.append(evaluated)
        return position, str(found[-1])
