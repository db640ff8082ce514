"""`DeadlineCallback`: benchtrain's deadline guard, step measurement and estimate-vs-actual report
inside a user's own `transformers.Trainer` (TRL's SFTTrainer, axolotl and LLaMA-Factory run on it).

    trainer = Trainer(model, args, train_dataset=..., callbacks=[DeadlineCallback(deadline="11h30m")])

At the start it says what it will do (world size, real tokens per optimizer step, the expected
step time from a calibration of this device, model and method or from the first steps after the
warm-up, the finish with bounds against the deadline); while training it measures every step,
save and evaluation, puts the ETA on the Trainer's log, and before the next step plus a save plus
the margin would cross the deadline it asks the Trainer to save and stop — every process deciding
together (one small all-reduce per step), so the collective save never waits on a process that
went on. SIGTERM and SIGUSR1 (SLURM's `--signal`, a spot instance's notice) save and stop at the
next point the Trainer allows: the end of a step, or the end of an evaluation under way. Its state
rides in `TrainerState.stateful_callbacks`, so `resume_from_checkpoint` continues the same
deadline with the budget already used. At the end the main process writes a benchtrain run folder
(run.json, report.html) and feeds the measured speed back into the calibration.

The guard is train.running.guard's DeadlineGuard (the one `train` runs), fed the Trainer's steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

import benchtrain.calibration as calibration_api
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import COMPLETED, INTERRUPTED, STEP_LIMIT, STOPPED_FOR_DEADLINE
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.running.guard import NEXT_STEP_SAFETY, DeadlineGuard, GuardSettings, Move, Verdict
from benchtrain.train.step.hardware import detect_hardware, this_device
from benchtrain.train.step.runtime import agree
from benchtrain.trainer.agreement import StepAgreement, agree_step
from benchtrain.trainer.deadline_text import parse_deadline
from benchtrain.trainer.estimate import (
    CALIBRATED,
    MEASURED,
    RunEstimate,
    calibrated_save_seconds,
    calibrated_step,
    check_calibration,
    first_save_seconds,
    measured_step,
    model_setup,
    save_count,
    trainer_precision,
)
from benchtrain.trainer.log_values import LogValues
from benchtrain.trainer.run_folder import RunFolder, RunOutcome, earlier_steps
from benchtrain.trainer.signals import SignalFlag
from benchtrain.trainer.step_watch import StepWatch, TokenCounter
from benchtrain.trainer.tracker_metrics import place_before_trackers
from benchtrain.trainer.training_frame import TrainingFrame, find_caller

if TYPE_CHECKING:
    from transformers import PreTrainedModel, TrainerControl, TrainerState, TrainingArguments

ON_OVERRUN = {"stop": "stop", "fit": "shrink"}  # the callback's word → the guard's action
SAVING_STOPS = (INTERRUPTED, STOPPED_FOR_DEADLINE, STEP_LIMIT)  # the callback's stops that ask for a checkpoint
T = TypeVar("T")


class DeadlineCallback(TrainerCallback, ExportableState):
    """Keep a Trainer's run inside a deadline; measure it; report estimate vs actual.

    deadline: a duration ("11h30m", "90s", seconds: a budget of training time, kept across a resume)
        or an absolute time ("2026-11-28T18:00", "18:00" today, a datetime).
    calibration: "latest", an id, a path, "hub:ORG/NAME/ID" or a loaded Calibration: predict the step time from it
        (it must be of this device, model and method); None: from the first steps after the warm-up.
    on_overrun: "stop" (guard: save and stop at the last safe moment) or "fit" (cut the run's
        max_steps to the steps that fit, and save there).
    output_dir: the benchtrain run folder (default: <TrainingArguments.output_dir>/benchtrain).
    margin: the share of the deadline held back (as `train --margin`).
    clock: seconds since the epoch (default time.time); tests drive time with their own.
    """

    def __init__(
        self,
        deadline: str | float | datetime,
        calibration: str | Calibration | None = None,
        on_overrun: str = "stop",
        output_dir: str | None = None,
        margin: float = 0.05,
        warmup_steps: int = 2,
        report: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.clock = clock or time.time
        self.deadline_text = parse_deadline(deadline, self.clock())
        if on_overrun not in ON_OVERRUN:
            raise BenchtrainError(
                f"on_overrun={on_overrun!r}: use 'stop' (save and stop in time) or 'fit' (cut the run to the steps that fit)"
            )
        if not 0 <= margin < 0.5:
            raise BenchtrainError(f"margin={margin}: a share of the deadline between 0 and 0.5")
        if warmup_steps < 1:
            raise BenchtrainError(f"warmup_steps={warmup_steps}: at least 1 (the first step starts things up)")
        if isinstance(calibration, Calibration):  # one already loaded (fit_to_deadline's): a resume loads it by path
            self.calibration_reference: str | None = str(calibration.path) if calibration.path else calibration.id
            self.calibration: Calibration | None = calibration
        else:
            self.calibration_reference = calibration
            self.calibration = calibration_api.load(calibration) if calibration else None
        self.on_overrun, self.output_dir, self.margin, self.warmup_steps, self.report = (
            on_overrun,
            output_dir,
            margin,
            warmup_steps,
            report,
        )
        # What a resume carries (the `attributes` of state()).
        self.used_seconds = 0.0  # of the deadline's budget, at the last save
        self.run_id: str | None = None
        self.run_dir: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.watch = StepWatch(self.clock)
        self.counter = TokenCounter()
        self.guard: DeadlineGuard | None = None
        self.deadline: Deadline | None = None
        self.estimate: RunEstimate | None = None
        self.folder: RunFolder | None = None
        self.world_size, self.start_step, self.total_steps = 1, 0, 0
        self.status: str | None = None
        self.exit_signal: int | None = None
        self.shrunk_to: int | None = None
        self.verdict: Verdict | None = None  # the guard's, at the last step
        self.last_checkpoint: str | None = None
        self.events: list[str] = []
        self.signals = SignalFlag()
        self._main = True
        self._spec_and_method: tuple[Any, str] | None = None
        self._first_save = 0.0
        self.saved_step: int | None = None  # the step of this run's last checkpoint
        self.log_values: LogValues | None = None

    # -- ExportableState: the deadline and the budget used ride in the checkpoint ---------------
    def state(self) -> JsonDict:
        used = self.watch.elapsed() if self.deadline is not None else self.used_seconds
        return {
            "args": {
                "deadline": self.deadline_text.text,
                "calibration": self.calibration_reference,
                "on_overrun": self.on_overrun,
                "output_dir": self.output_dir,
                "margin": self.margin,
                "warmup_steps": self.warmup_steps,
                "report": self.report,
            },
            "attributes": {"used_seconds": used, "run_id": self.run_id, "run_dir": self.run_dir},
        }

    def _restore(self, stored: Any) -> None:
        """A resumed run's attributes, from the checkpoint's trainer_state.json."""
        stored = stored[0] if isinstance(stored, list) and stored else stored
        attributes = stored.get("attributes", {}) if isinstance(stored, dict) else {}
        self.used_seconds = float(attributes.get("used_seconds") or 0.0)
        self.run_id = attributes.get("run_id") or self.run_id
        self.run_dir = attributes.get("run_dir") or self.run_dir

    # -- the start ------------------------------------------------------------------------------
    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: PreTrainedModel | None = None,
        **kwargs: object,
    ) -> None:
        """At Trainer(...): a calibration of another model, method or device is refused here, in one line."""
        if model is None:
            return
        spec, method = model_setup(model)
        self._spec_and_method = (spec, method)
        if self.calibration is not None:
            check_calibration(self.calibration, spec, method, this_device(), trainer_precision(args))

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: PreTrainedModel | None = None,
        **kwargs: object,
    ) -> None:
        caller = find_caller(self)
        training = caller.training if caller else None
        if caller is not None:
            place_before_trackers(caller.handler, self)
        self._reset_run(args, state, model, training)
        deadline = self.deadline
        assert deadline is not None
        left = deadline.seconds_left(self.used_seconds)
        if left <= 0:
            raise BenchtrainError(
                f"the deadline {self.deadline_text.text} leaves nothing: {format_duration(self.used_seconds)} of its "
                f"{format_duration(deadline.budget_seconds)} budget were used before this resume; give a later deadline"
            )
        self.watch.start(self.used_seconds)
        self.guard = DeadlineGuard(
            GuardSettings(deadline, self._reserve_seconds(), ON_OVERRUN[self.on_overrun], self.warmup_steps),
            limit=state.max_steps,
        )
        self.signals.install(training)
        basis = (
            f"calibration {self.calibration.id}"
            if self.calibration
            else f"the steps after {self.warmup_steps} warm-up step(s)"
        )
        resumed = (
            f", resumed at step {self.start_step} with {format_duration(self.used_seconds)} used"
            if self.start_step
            else ""
        )
        self._say(
            f"deadline {self.deadline_text.text}: {format_duration(left)} of budget left{resumed} "
            f"({format_duration(deadline.margin_seconds)} margin held back); world size {self.world_size}; "
            f"{state.max_steps:,} optimizer steps ({state.num_train_epochs:g} epoch(s)); step time from {basis}; on_overrun={self.on_overrun}"
        )

    def _reset_run(
        self,
        args: TrainingArguments,
        state: TrainerState,
        model: PreTrainedModel | None,
        training: TrainingFrame | None,
    ) -> None:
        used_before = self.used_seconds if state.global_step > 0 else 0.0
        self._reset()
        # A dict by name once a checkpoint's state is loaded (transformers types it list or dict).
        saved = cast("dict[str, object]", state.stateful_callbacks or {})
        stored = saved.get(type(self).__name__) if state.global_step > 0 else None
        if stored:
            self._restore(stored)
        else:
            self.used_seconds = used_before
        if state.global_step == 0:  # a new run (this callback may have trained one before): its own folder
            self.run_id = self.run_dir = None
        self._main = bool(state.is_world_process_zero)
        self.world_size, self.start_step, self.total_steps = (
            int(args.world_size),
            int(state.global_step),
            int(state.max_steps),
        )
        now = self.clock()
        text = self.deadline_text
        started = now - self.used_seconds
        seconds = text.budget_seconds if text.budget_seconds is not None else float(text.at_epoch or 0.0) - started
        self.deadline = Deadline.with_margin_share(seconds, self.margin, started)
        if model is not None and self._spec_and_method is None:
            self._spec_and_method = model_setup(model)
        spec, method = self._spec_and_method or (None, "full")
        self.run_id = self.run_id or f"trainer-{spec.name if spec else 'model'}-{datetime.now():%Y%m%d-%H%M%S}"
        self.run_dir = self.run_dir or str(Path(self.output_dir or Path(str(args.output_dir)) / "benchtrain"))
        if model is not None:
            self.counter.attach(model, training)
            if self.calibration is None and self._main:
                run_dir = Path(self.run_dir)
                self._first_save = (
                    self._bookkeep("time a write to the run folder", lambda: first_save_seconds(model, run_dir)) or 0.0
                )
        hardware = detect_hardware()
        switches = ("gradient_checkpointing",) if args.gradient_checkpointing else ()
        self.log_values = LogValues.of(model, method == "lora", switches, hardware, self.world_size)
        model_record = (
            {"name": spec.name, "fingerprint": spec.fingerprint, "method": method} if spec else {"method": method}
        )
        earlier = earlier_steps(Path(self.run_dir), self.start_step) if self.start_step else []
        self.folder = RunFolder(Path(self.run_dir), self.run_id, model_record, hardware, self.calibration, earlier)

    # -- while training -------------------------------------------------------------------------
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.guard is None:
            return
        counted = self.counter.take()
        # This process's step first (its own time, its tokens), then ONE collective agrees all of it.
        record = self.watch.end_step(state.global_step, counted)
        move, limit = self._observe(state.global_step, record.seconds, self._predicted(record.seconds))
        if self.signals.received is not None:
            move = Move.INTERRUPT
        mine = StepAgreement(
            counted.tokens,
            counted.padded_tokens,
            move.strength,
            limit,
            self.signals.received or 0,
            not control.should_evaluate or self._evaluation_fits(),
        )
        agreed = agree_step(_state(), mine)
        record.tokens, record.padded_tokens = agreed.tokens, agreed.padded_tokens
        if self.estimate is None:
            self._estimate(args, state)
        # Until the estimate is made, a step is its own prediction: the guard still keeps the deadline.
        record.predicted_seconds = self._predicted(record.seconds)
        self._act(Move.of_strength(agreed.move_strength), agreed.limit, agreed.signal or None, state, control)
        if not control.should_training_stop and control.should_evaluate and not agreed.evaluation_fits:
            self._event(
                f"step {state.global_step}: skipped the evaluation: its {format_duration(max(self.watch.eval_seconds))} would not fit"
            )
            control.should_evaluate = False

    def _predicted(self, seconds: float) -> float:
        return self.estimate.step_seconds if self.estimate is not None else seconds

    def _observe(self, step: int, seconds: float, predicted: float) -> tuple[Move, int]:
        guard, deadline = self.guard, self.deadline
        assert guard is not None and deadline is not None
        guard.settings = replace(
            guard.settings, reserve_seconds=self._reserve_seconds(), periodic_share=self.watch.periodic_share
        )
        elapsed = self.watch.elapsed()
        verdict = guard.observe(step, elapsed, seconds, predicted, max(0, guard.limit - step) * predicted)
        self.verdict = verdict
        if verdict.message:
            self._event(verdict.message)
        move = verdict.move
        # The guard's window starts after the warm-up; until then the steps seen so far (slower, if
        # anything) say whether one more and a save still fit: a resumed run may start near its end.
        if (
            not guard.window
            and step < guard.limit
            and elapsed + self._next_step_seconds() + self._reserve_seconds() > deadline.budget_seconds
        ):
            move = Move.STOP
        return move, verdict.limit

    def _act(self, move: Move, limit: int, signal: int | None, state: TrainerState, control: TrainerControl) -> None:
        """What every process agreed: save and stop (the deadline, a signal), or the run cut to `limit`."""
        if move in (Move.STOP, Move.INTERRUPT):
            self.status = move.status
            if move is Move.INTERRUPT:
                self.exit_signal = signal
                self._event(f"step {state.global_step}: a signal asked to stop: saving and stopping")
            else:
                self._event(
                    f"step {state.global_step}: one more step and a save might not fit before the deadline: saving and stopping"
                )
            control.should_save = control.should_training_stop = True
            control.should_evaluate = False
            return
        if limit < state.max_steps and self.guard is not None:
            self.guard.limit = limit
            self.shrunk_to = state.max_steps = limit
        if self.shrunk_to is not None and state.global_step >= self.shrunk_to:
            self.status = STEP_LIMIT
            control.should_save = control.should_training_stop = True

    def _evaluation_fits(self) -> bool:
        """An evaluation now, then a step and a save, before the budget? (Measured, on this process.)"""
        deadline = self.deadline
        if deadline is None or not self.watch.eval_seconds:
            return True
        need = max(self.watch.eval_seconds) + self._next_step_seconds() + self._reserve_seconds()
        return self.watch.elapsed() + need <= deadline.budget_seconds

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        """During an evaluation: a signal makes the Trainer save and stop right after it (it reads
        `should_save` then), not one step later. Every process evaluates the same batches, so they
        agree here batch by batch. (Under save_strategy="best" the Trainer then overwrites
        `should_save` with "is this the best metric": `on_epoch_end` asks again.)"""
        if self.guard is None:
            return
        received = agree(_state(), self.signals.received or 0, "max")  # one process may have received it alone
        if received:
            if self.status != INTERRUPTED:
                self._event(f"step {state.global_step}: a signal during the evaluation: saving and stopping as it ends")
            self.status, self.exit_signal = INTERRUPTED, received
            control.should_save = control.should_training_stop = True

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.guard is not None:
            self.watch.evaluated()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        """A stop the callback asked for that got no checkpoint (save_strategy="best" replaced its
        `should_save` after an evaluation) saves here: the Trainer breaks out of the epoch, calls
        this, and then saves when `should_save` is set — under any save strategy. Every process
        has the same status and the same saved step, so all ask."""
        if self.guard is None or self.status not in SAVING_STOPS or not control.should_training_stop:
            return
        if self.saved_step != state.global_step:
            control.should_save = True
            control.should_evaluate = False

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        if self.guard is None:
            return
        seconds = self.watch.saved()
        self.saved_step = state.global_step
        self.used_seconds = self.watch.elapsed()
        self.last_checkpoint = str(Path(str(args.output_dir)) / f"checkpoint-{state.global_step}")
        self._event(f"step {state.global_step}: saved in {format_duration(seconds)}")
        self._write(None)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: JsonDict | None = None,
        **kwargs: object,
    ) -> None:
        """The loss onto the step's record; the speed and the ETA onto the Trainer's own log line (no
        second progress bar), where BeforeTrackers has not put them already."""
        if self.guard is None or logs is None:
            return
        self.watch.logged(logs)
        self.add_log_values(logs)

    def add_log_values(self, logs: JsonDict) -> None:
        """Tokens/s (real and padded) since the last log, MFU on a device with a known peak, the ETA
        with its bounds and the deadline left, onto a training log (one with a loss), once."""
        if self.guard is None or self.log_values is None or self.verdict is None or "loss" not in logs:
            return
        if "deadline_left_seconds" in logs:
            return
        bound = self.estimate.bound_fraction if self.estimate is not None else 0.0
        logs.update(self.log_values.values(self.watch, self.verdict, bound))

    # -- the end --------------------------------------------------------------------------------
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.guard is None:
            return
        self.counter.detach()
        self.signals.restore()
        self.used_seconds = self.watch.elapsed()
        status = self.status or (COMPLETED if state.global_step >= self.total_steps else STEP_LIMIT)
        outcome = RunOutcome(
            status, state.global_step, self.exit_signal, self.shrunk_to, self.last_checkpoint, self.events
        )
        deadline = self.deadline
        assert deadline is not None
        lead = self.lead_seconds()
        self._say(
            f"{status} at step {state.global_step:,} after {format_duration(self.watch.elapsed())} of the {format_duration(deadline.deadline_seconds)} "
            f"deadline; {format_duration(deadline.deadline_seconds - self.watch.elapsed())} to spare. A signal needs {math.ceil(lead)}s "
            f"of lead time (its slowest step and save): SLURM --signal=USR1@{math.ceil(lead)}"
        )
        if self.estimate is None:
            self._estimate(args, state, at_end=True)
        folder = self.folder
        if self._main and self.estimate is not None and folder is not None:
            # The run is over and the user's save_model() and push come next: a record that cannot be
            # written (a read-only or shared home) is said in one line, never raised out of train().
            document = folder.document(self.estimate, self.watch, deadline, outcome)
            written = self._bookkeep("write the run folder", lambda: folder.finish(document))
            self._bookkeep("feed the run's speed to the calibration", lambda: folder.feed(document))
            report = self._bookkeep("draw the report", lambda: folder.report()) if self.report and written else None
            if written:
                self._say(f"run folder {folder.run_dir}" + (f"; report {report}" if report else ""))
        self.guard = None

    # -- pieces ---------------------------------------------------------------------------------
    def _estimate(self, args: TrainingArguments, state: TrainerState, at_end: bool = False) -> None:
        """The estimate, once: after the first step with a calibration (its batches give the
        shape), else once `warmup_steps` steps have passed and one more was measured (`at_end`:
        the run ended before that; its record still needs one)."""
        steady = self.watch.steady(self.warmup_steps)
        if self.calibration is None and not steady:
            if not at_end or not self.watch.steps:
                return
            steady = self.watch.steps  # a run that ended inside its warm-up: its steps are all there is
        deadline = self.deadline
        assert deadline is not None
        steps = self.watch.steps
        length = max(1, round(sum(self.watch.lengths) / len(self.watch.lengths)))
        config = StepConfig(
            micro_batch_size=int(args.per_device_train_batch_size),
            num_workers=int(args.dataloader_num_workers),
            grad_accum=int(args.gradient_accumulation_steps),
            seq_len=length,
        ).switched(gradient_checkpointing=bool(args.gradient_checkpointing))
        if self.calibration is not None:
            step_seconds, bound = calibrated_step(self.calibration, config)
            source = f"calibration {self.calibration.id} (this device, model and method) at length {length}"
            if self.calibration.world_size != self.world_size:
                source += f" (measured on {self.calibration.world_size} process(es), this run has {self.world_size}: the measured steps correct it)"
            basis = CALIBRATED
        else:
            step_seconds, bound = measured_step([record.seconds for record in steady])
            source = f"steps {steady[0].step}–{steady[-1].step} measured after {self.warmup_steps} warm-up step(s)"
            basis = MEASURED
        self.estimate = RunEstimate(
            basis,
            source,
            config,
            self.world_size,
            step_seconds,
            bound,
            sum(record.tokens for record in steps) / len(steps),
            sum(record.padded_tokens for record in steps) / len(steps),
            self.start_step,
            state.global_step,
            self.watch.elapsed(),
            state.max_steps,
            self._reserve_seconds(),
            save_count(args, state.max_steps, self.start_step),
        )
        for record in steps:
            record.predicted_seconds = step_seconds
        if not at_end:
            self._announce(deadline)

    def _announce(self, deadline: Deadline) -> None:
        estimate = self.estimate
        assert estimate is not None
        self._say(estimate.describe(deadline))
        if estimate.finish_seconds > deadline.budget_seconds:
            then = (
                "cutting the run to the steps that fit at the live speed"
                if self.on_overrun == "fit"
                else "will save and stop at the last safe moment"
            )
            self._event(
                f"will not fit: {estimate.total_steps:,} steps finish at {format_duration(estimate.finish_seconds)}, past the budget; {then}"
            )
        lead = math.ceil(self.lead_seconds())
        self._say(f"lead time a signal needs now: {lead}s (slowest step and a save): SLURM --signal=USR1@{lead}")
        self._write(None)

    def _next_step_seconds(self) -> float:
        steady = self.watch.steady(self.warmup_steps) or self.watch.steps
        return NEXT_STEP_SAFETY * max((record.seconds for record in steady), default=0.0)

    def _reserve_seconds(self) -> float:
        """What must fit after the last step: a save, the slowest measured (before the first, the
        calibration's save on this device, else the checkpoint's bytes at this disk's measured speed)."""
        return max(self.watch.save_seconds, default=calibrated_save_seconds(self.calibration) or self._first_save)

    def lead_seconds(self) -> float:
        """How long before the end a signal must come for this run to save in time: its slowest
        step (or evaluation, during which a signal waits for the end) and its slowest save."""
        return max(self._next_step_seconds(), max(self.watch.eval_seconds, default=0.0)) + self._reserve_seconds()

    def _write(self, outcome: RunOutcome | None) -> None:
        folder, estimate, deadline = self.folder, self.estimate, self.deadline
        if self._main and estimate is not None and folder is not None and deadline is not None:
            document = folder.document(estimate, self.watch, deadline, outcome)
            self._bookkeep("write the run folder", lambda: folder.write(document))

    def _bookkeep(self, what: str, action: Callable[[], T]) -> T | None:
        """The callback's own records (run folder, calibration history, report): a failure costs the
        record, in one line, never the user's run."""
        try:
            return action()
        except Exception as error:  # any failure of a record: the training it records must go on
            self._say(
                f"warning: could not {what}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
            return None

    def _event(self, message: str) -> None:
        self.events.append(message)
        self._say(message)

    def _say(self, message: str) -> None:
        if self._main:
            say(f"benchtrain: {message}")


def _state() -> Any:
    """accelerate's process state (the Trainer's): the processes that agree."""
    from accelerate import PartialState

    return PartialState()
