"""`run.json`: the plan, the estimate with bounds, what actually happened, and the measured
throughput fed back into the calibration's history. `RunRecord` owns one command's file (a
calibration.run_file.RunFile) from its plan to its end."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchtrain.calibration.accuracy import EstimateCheck, check_estimate
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import PUSH, REPORT, RUN_SCHEMA_VERSION, JsonIn, JsonObject, RunFile, flat_keys
from benchtrain.calibration.schema import variant_history
from benchtrain.calibration.store import is_read_only, update_calibration
from benchtrain.common.json_types import JsonDict
from benchtrain.common.run_paths import FINAL_PATH_KEYS, stored_path, stored_paths
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.prices import run_cost
from benchtrain.train.planning.types import Plan
from benchtrain.train.running.loop import LoopOutcome, Position


def new_run_file(
    run_id: str, plan: Plan, calibration: Calibration, model: JsonDict, data: JsonDict, elapsed_before_plan: float
) -> RunFile:
    """A new run's run.json (its step configuration held once, written out by RunFile)."""
    chosen = plan.chosen
    # The plan but its step configuration, which RunFile writes before these keys.
    plan_keys: JsonDict = {
        "effective_batch": plan.effective_batch,
        "optimizer_steps": chosen.optimizer_steps,
        "micro_batches": chosen.micro_batches,
    }
    plan_keys.update(
        packing=plan.packing,
        epochs=plan.request.epochs,
        priority=plan.request.priority,
        step_limit=plan.step_limit,
        notes=plan.notes,
    )
    # The calibration's held-out errors (time and peak memory): what the bounds stand on, for the report.
    held_out = {
        "time": calibration.fit.get("held_out_error"),
        "memory": (calibration.fit.get("memory") or {}).get("held_out_error"),
    }
    sections: JsonObject = {
        "schema_version": RUN_SCHEMA_VERSION,
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "planned",
        "calibration_id": calibration.id,
        "calibration_path": str(calibration.path) if calibration.path else None,
        "hardware": calibration.hardware.to_record(),
        "model": model,
        "data": data,
        "plan": plan_keys,
        "estimate": {
            **estimate_section(plan),
            "held_out_error": held_out,
            "bound_parts": asdict(calibration.bound_parts),
        },
        "actual": None,
        "deadline_seconds": plan.request.deadline.deadline_seconds,
        "elapsed_before_plan": elapsed_before_plan,
        # When the deadline started counting (time.time()): `--resume auto` holds a restarted run to it.
        "deadline_started_at": time.time() - elapsed_before_plan,
        "met_deadline": None,
        "timeline": [],
        "losses": [],
        "events": [],
        "alternatives": [candidate.to_json() for candidate in plan.alternatives],
        # The step configuration is the plan's (RunFile writes it there, once).
        "chosen": {key: value for key, value in chosen.to_json().items() if key not in flat_keys()},
    }
    return RunFile(run_id, chosen.config, chosen.world_size, sections)


def estimate_section(plan: Plan) -> JsonDict:
    chosen, bound = plan.chosen, plan.chosen.bound_fraction
    return {
        "total_seconds": chosen.total_seconds,
        "total_seconds_low": chosen.total_seconds_low,
        "total_seconds_high": chosen.total_seconds_high,
        "train_seconds": chosen.step_seconds,
        "overhead_seconds": chosen.overheads.total_seconds,
        # The steps this estimate covers: a resumed run's are those left after start_step.
        "steps": chosen.remaining_steps,
        "start_step": chosen.optimizer_steps - chosen.remaining_steps,
        "tokens": chosen.tokens,
        "padded_tokens": chosen.padded_tokens,
        "tokens_per_second": chosen.tokens_per_second,
        "tokens_per_second_low": chosen.tokens_per_second / (1 + bound),
        "tokens_per_second_high": chosen.tokens_per_second * (1 + bound),
        "peak_memory_bytes": chosen.peak_memory_bytes,
        "peak_memory_bytes_high": chosen.peak_memory_bytes_high,
        "bound_fraction": chosen.bound_fraction,  # the time bound of this configuration (wider when extrapolating)
        "extrapolated": chosen.extrapolated,
        "eval_seconds": chosen.overheads.evaluation_seconds,
        "overheads": chosen.overheads.to_json(),
        "naive_seconds": plan.naive_seconds,
        "projected_finish_seconds": chosen.total_seconds,
        "cost": plan.cost,
    }


def actual_section(
    outcome: LoopOutcome, total_seconds: float, price_per_hour: float | None, processes: int = 1
) -> JsonDict:
    """What happened. `total_seconds`: from the plan to the end of the export (the span the
    estimate check compares); steps, tokens and train seconds count a resumed run's earlier ones too."""
    ended = outcome.position
    return {
        "total_seconds": total_seconds,
        "train_seconds": ended.step_seconds,
        "tokens": ended.tokens,
        "padded_tokens": ended.padded_tokens,
        "tokens_per_second": ended.tokens / ended.step_seconds if ended.step_seconds else 0.0,
        "steps": ended.step,
        "micro_batches": ended.micro_batches,
        "batch_shapes": outcome.batch_shapes,
        **outcome.figures,  # computed tokens/s, TFLOP/s, MFU, data-wait share, peak memory (train.step.metrics)
        "checkpoint_seconds": outcome.checkpoint_seconds,
        "final_loss": ended.losses[-1]["loss"] if ended.losses else None,
        "final_eval_loss": ended.evals[-1]["eval_loss"] if ended.evals else None,
        "final_perplexity": ended.evals[-1]["perplexity"] if ended.evals else None,
        "eval_seconds": sum(entry["seconds"] for entry in ended.evals),
        "status": outcome.status,
        "start_step": outcome.start_step,
        "exit_signal": outcome.exit_signal,
        "shrunk_to": outcome.shrunk_to,
        "last_checkpoint": outcome.last_checkpoint,
        "cost": run_cost(total_seconds, price_per_hour, processes),
    }


def feed_back(calibration: Calibration, record: JsonDict, check: EstimateCheck | None = None) -> None:
    """Append the measured speed to the calibration's history so the next plan uses it: the steps
    this command ran against their own prediction (`check`: check_estimate of the record, where
    the caller has it), so a run that stopped early or was resumed counts like a completed one."""
    check = check if check is not None else check_estimate(record)
    if (
        check is None
        or not check.steps_run
        or calibration.path is None
        or is_read_only(calibration.path)
        or not check.predicted_tokens_per_second
    ):
        return  # a bundled or hub-shared calibration is the measurement as shared: runs elsewhere do not change it
    entry = {
        "run_id": record["run_id"],
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": record["plan"],
        # The history factor already in the prediction is divided out, so ratios don't compound.
        "predicted_tokens_per_second": check.predicted_tokens_per_second / calibration.history_factor,
        "actual_tokens_per_second": check.actual_tokens_per_second,
        "predicted_total_seconds": check.estimated_seconds,
        "actual_total_seconds": check.actual_seconds,
        "time_error_pct": check.error_pct,
        "steps": check.steps_run,
        "status": check.status,
    }
    update_calibration(calibration.path, lambda data: variant_history(data, calibration.variant_index).append(entry))


@dataclass(frozen=True)
class TrainedRun:
    """What training left: the loop's outcome, final/ as exported, the model's and the method's records."""

    loop: LoopOutcome
    final: JsonDict | None
    model: JsonDict
    training: JsonDict


@dataclass
class RunRecord:
    """run.json of one command: opened (a new run's, or the resumed run's brought up to this
    command's plan), written whenever the loop reports, finished with what happened."""

    out_dir: Path
    file: RunFile
    earlier_events: list[str] = field(default_factory=list)  # the resumed run's, before this command

    @classmethod
    def open(cls, out_dir: Path, fresh: RunFile, earlier: RunFile | None) -> RunRecord:
        """`fresh` (new_run_file of this command's plan), or with --resume the run's own file
        (`earlier`) taking this command's plan, estimate and data from it."""
        if earlier is None:
            return cls(out_dir, fresh)
        resumed = earlier.get("resumed")
        earlier.update(resumed=(resumed if isinstance(resumed, int) else 0) + 1)
        earlier.update_plan(total_steps=earlier.total_steps)  # before this command's steps replace the plan's
        # What this command planned: the steps left, its own deadline, time and step limit.
        for key in ("deadline_seconds", "elapsed_before_plan", "deadline_started_at", "estimate", "chosen", "data"):
            earlier.update(**{key: fresh.get(key)})  # data: the same (check_same_data), or what --force continued on
        plan = fresh.plan
        earlier.update_plan(optimizer_steps=plan["optimizer_steps"], step_limit=plan["step_limit"])
        # The configuration this command trains (the run's: ResumedRun.configuration, at --force's length).
        earlier.configuration, earlier.world_size = fresh.configuration, fresh.world_size
        return cls(out_dir, earlier, earlier.events)

    @property
    def plan(self) -> JsonDict:
        """run.json's plan section as written (a copy)."""
        return self.file.plan

    @property
    def data(self) -> JsonDict:
        """run.json as written (a copy, for readers of the whole record: the outcome's text, trackers)."""
        return self.file.to_json()

    def write(self) -> Path:
        return self.file.write(self.out_dir)

    def end_phase(self, phase: str, **sections: JsonIn) -> None:
        """`phase` (calibration.run_file.PHASES) ended: run.json says so, with the sections it wrote."""
        self.file.update(**sections)
        self.file.end_phase(phase)
        self.write()

    def progress(self, position: Position, events: list[str]) -> None:
        """The loop's report (LoopHooks.on_update): where it is, written."""
        self.file.update(status="running", timeline=position.timeline, losses=position.losses, evals=position.evals)
        self.file.update(events=self.earlier_events + events)
        self.write()

    def finish(
        self,
        trained: TrainedRun,
        calibration: Calibration,
        plan: Plan,
        deadline: Deadline,
        write_report: Callable[[Path], Path] | None,
        before_report: Callable[[JsonDict], JsonDict] | None = None,
    ) -> Path | None:
        """What happened, in run.json; the measured speed back into the calibration; the report
        (`write_report`, None: --no-report), whose time the deadline also covers.
        `before_report(record)`: work the report shows (the hub push), returning its `push` section."""
        record, loop = self.file, trained.loop
        # Paths inside the run folder are kept relative to it, so the folder can move (common.run_paths).
        final = stored_paths(trained.final, self.out_dir, FINAL_PATH_KEYS)
        record.update(final=final, model=trained.model, training=trained.training, status=loop.status)
        record.update_plan(lora=trained.training["lora"])
        ended = loop.position
        record.update(
            losses=ended.losses, timeline=ended.timeline, evals=ended.evals, events=self.earlier_events + loop.events
        )
        elapsed = deadline.elapsed()
        # The span the estimate check compares: from the plan to the end of the export. The report
        # comes after it (it is written from these figures) and is timed on its own.
        actual = actual_section(
            loop, elapsed - record.elapsed_before_plan, plan.request.price_per_hour, plan.chosen.world_size
        )
        actual.update(last_checkpoint=stored_path(loop.last_checkpoint, self.out_dir), command_seconds=elapsed)
        overheads = plan.chosen.overheads
        planned_report = overheads.report_seconds + overheads.upload_seconds
        record.update(actual=actual, met_deadline=elapsed + planned_report <= plan.request.deadline.deadline_seconds)
        check = check_estimate(record.to_json())
        # Its error is written a second time, as estimate_error_pct, by RunFile (from this one value).
        record.update(estimate_check=check.to_json() if check else None)
        self.write()
        feed_back(calibration, record.to_json(), check)
        if before_report is not None:
            self.end_phase(PUSH, push=before_report(record.to_json()))  # pushed or not: `--push-only` pushes again
        report_started = deadline.elapsed()
        report_path = write_report(self.out_dir) if write_report else None
        finished = deadline.elapsed()
        actual.update(report_seconds=finished - report_started if report_path else None, command_seconds=finished)
        record.update(actual=actual, met_deadline=finished <= plan.request.deadline.deadline_seconds)
        if report_path is not None:
            record.end_phase(REPORT)
        self.write()
        return report_path
