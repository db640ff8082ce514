"""The Trainer run's benchtrain folder: run.json through the typed run file (calibration.run_file),
the same sections our own runs write, so `report RUN_DIR` draws the same estimate-vs-actual
report, and the measured speed goes back into the calibration it planned with (as `train`'s does:
train.running.record.feed_back). Only the main process writes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchtrain.calibration.accuracy import check_estimate
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import RUN_SCHEMA_VERSION, JsonObject, JsonValue, RunFile
from benchtrain.common.atomic import read_json_file
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.reports.run_report import write_run_report
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.running.record import feed_back
from benchtrain.trainer.estimate import RunEstimate
from benchtrain.trainer.step_watch import StepWatch


@dataclass
class RunOutcome:
    """How the run ended, as the callback saw it."""

    status: str  # a word of calibration.run_file
    steps: int  # the Trainer's global step at the end
    exit_signal: int | None = None
    shrunk_to: int | None = None  # on_overrun="fit": the steps the run was cut to
    last_checkpoint: str | None = None
    events: list[str] = field(default_factory=list)


def earlier_steps(run_dir: Path, before_step: int) -> list[JsonDict]:
    """A resumed run's steps from its earlier command (up to its checkpoint), from its run.json."""
    path = run_dir / "run.json"
    if not path.is_file():
        return []
    try:
        losses = read_json_file(path).get("losses") or []
        return [entry for entry in losses if isinstance(entry, dict) and int(entry.get("step", 0)) <= before_step]
    except (BenchtrainError, TypeError, ValueError):
        # An unreadable earlier record costs the earlier curve, not the run.
        return []


@dataclass
class RunFolder:
    run_dir: Path
    run_id: str
    model: JsonDict  # name, fingerprint, method
    hardware: JsonDict
    calibration: Calibration | None
    earlier: list[JsonDict] = field(default_factory=list)  # a resumed run's steps before this command
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def document(
        self, estimate: RunEstimate, watch: StepWatch, deadline: Deadline, outcome: RunOutcome | None
    ) -> RunFile:
        calibration = self.calibration
        events: list[JsonValue] = list(outcome.events) if outcome else []
        sections: JsonObject = {
            "schema_version": RUN_SCHEMA_VERSION,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "status": outcome.status if outcome else "running",
            "source": "benchtrain.DeadlineCallback in a transformers Trainer",
            "calibration_id": calibration.id if calibration else None,
            "calibration_path": str(calibration.path) if calibration and calibration.path else None,
            "hardware": self.hardware,
            "model": self.model,
            "data": {"source": "the Trainer's train dataset, as its collator batched it"},
            "plan": {
                "method": self.model.get("method", "full"),
                "optimizer_steps": estimate.total_steps,
                "total_steps": estimate.total_steps,
                "micro_batches": estimate.total_steps * estimate.config.grad_accum,
                "step_limit": outcome.shrunk_to if outcome else None,
                "epochs": None,
                "estimate_basis": estimate.basis,
                "notes": [f"step time from {estimate.source}"],
            },
            "estimate": estimate.to_json(),
            "actual": self.actual(watch, estimate, outcome) if outcome else None,
            "deadline_seconds": deadline.deadline_seconds,
            "elapsed_before_plan": watch.steps[0].elapsed - watch.steps[0].seconds if watch.steps else 0.0,
            "met_deadline": watch.elapsed() <= deadline.deadline_seconds if outcome else None,
            "losses": [*self.earlier, *(record.to_json() for record in watch.steps)],
            "evals": [],
            "events": events,
            "chosen": {"source": estimate.source},
        }
        return RunFile(self.run_id, estimate.config, estimate.world_size, sections)

    def actual(self, watch: StepWatch, estimate: RunEstimate, outcome: RunOutcome) -> JsonDict:
        train = sum(record.seconds for record in watch.steps)
        tokens = sum(record.tokens for record in watch.steps)
        first = watch.steps[0] if watch.steps else None
        command_start = first.elapsed - first.seconds if first else watch.elapsed()
        logged = [record.loss for record in watch.steps if record.loss is not None]
        return {
            "total_seconds": watch.elapsed() - command_start,
            "train_seconds": train,
            "tokens": tokens,
            "padded_tokens": sum(record.padded_tokens for record in watch.steps),
            "tokens_per_second": tokens / train if train else 0.0,
            "steps": outcome.steps,
            "micro_batches": sum(record.micro_steps for record in watch.steps),
            "checkpoint_seconds": list(watch.save_seconds),
            "eval_seconds": sum(watch.eval_seconds),
            "eval_pass_seconds": list(watch.eval_seconds),
            "final_loss": logged[-1] if logged else None,
            "status": outcome.status,
            "start_step": estimate.start_step,
            "exit_signal": outcome.exit_signal,
            "shrunk_to": outcome.shrunk_to,
            "last_checkpoint": outcome.last_checkpoint,
        }

    def write(self, document: RunFile) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return document.write(self.run_dir)

    def finish(self, document: RunFile) -> Path:
        """run.json with its estimate check."""
        check = check_estimate(document.to_json())
        document.update(estimate_check=check.to_json() if check else None)
        return self.write(document)

    def feed(self, document: RunFile) -> None:
        """The measured speed into the calibration's history (a run without a calibration feeds none)."""
        if self.calibration is not None:
            record = document.to_json()
            feed_back(self.calibration, record, check_estimate(record))

    def report(self) -> Path:
        return write_run_report(self.run_dir)
