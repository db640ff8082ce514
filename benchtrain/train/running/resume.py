"""A resumed run: what a command continues (`what_to_continue`, the one place that decides it: the run folder, its
run.json and plan, the calibration it was planned with, the checkpoint, the deadline's budget used), what this command may change of it (every resume
check), and the command that resumes a stopped one."""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import benchtrain.calibration as calibration_api
from benchtrain.calibration.run_file import COMPLETED, STEP_LIMIT, STEPS, ResumedRun, RunFile, RunMethod, phases_of
from benchtrain.common.atomic import read_json_file
from benchtrain.common.console import say
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.running.checkpoint import (
    CheckpointReadError,
    checkpoints_to_resume,
    list_checkpoints,
    read_progress,
)
from benchtrain.train.step.hyperparameters import SETTING_NAMES, option_name, settings_from
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, resolve_model, weights_identity

if TYPE_CHECKING:
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.workload.batching import DataView
    from benchtrain.train.workload.prepare import PreparedData


def resumed_spec(spec: ModelSpec, resumed: ResumedRun) -> ModelSpec:
    """A resumed run trains the hub commit it started from, wherever the branch has moved since."""
    pinned = resumed.model_revision
    if spec.hub is None or not pinned or pinned == spec.hub.revision:
        return spec
    return resolve_model(f"{spec.hub.repo_id}@{pinned}")


def resumed_method(recorded: RunMethod) -> MethodConfig:
    """The interrupted run's method as a MethodConfig: a resumed run trains what it trained."""
    if not recorded.adapters:
        return MethodConfig(optimizer=recorded.optimizer)
    return MethodConfig(**asdict(recorded))  # the same fields, by the same names


def check_same_run(
    resumed: ResumedRun,
    earlier: MethodConfig,
    spec: ModelSpec,
    method: MethodConfig,
    max_length: int | str | None,
    force: bool,
) -> list[str]:
    """Another model, method (`earlier`: the run's) or max length than the run's is refused in one
    line unless --force; returns what --force let through, to warn about (data: check_same_data)."""
    run = f"--resume: run {resumed.run_id}"
    problems = []
    if resumed.model_fingerprint and resumed.model_fingerprint != spec.fingerprint:
        problems.append(
            f"{run} trained model {resumed.model_name}, this command names {spec.name}: pass --model as the run did"
        )
    weights = weights_identity(spec)
    if earlier.is_lora and resumed.model_weights and weights != resumed.model_weights:
        problems.append(
            f"{run} trained adapters on the base weights {resumed.model_weights}, this command's base is {weights or 'built from its config'} "
            "(the same architecture, other weights): pass --model as the run did"
        )
    if not same_method(earlier, method):
        problems.append(
            f"{run} trained {earlier.describe()}, this command asks for {method.describe()}: repeat the run's method options"
        )
    if isinstance(max_length, int) and max_length != resumed.max_length:
        problems.append(
            f"{run} trained with max length {resumed.max_length}, this command asks for --max-length {max_length}: drop it"
        )
    if problems and not force:
        raise BenchtrainError(f"{problems[0]}, or pass --force to continue with this command's")
    return problems


# What a resume compares of the hyper-parameters: the schedule the run's steps follow and what the
# optimizer is given (the warm-up as the steps it has, however it was asked for).
COMPARED_HYPERPARAMETERS = tuple(name for name in SETTING_NAMES if name != "warmup_ratio")


def resumed_hyperparameters(resumed: ResumedRun, named: JsonDict, force: bool) -> JsonDict:
    """The hyper-parameters a resume trains with, by their TrainConfig names: the run's. One this
    command `named` differently (its --learning-rate included) is refused in one line unless
    --force, which then trains with this command's, with a warning."""
    theirs = settings_from(resumed.hyperparameters or {})  # a run from before the section: the defaults
    asked = {**named, "warmup_steps": named.get("warmup_steps")} if "warmup_ratio" in named else named
    values = {**asdict(theirs), **asked}
    total = resumed.total_steps
    before, now = theirs.record(0.0, "", total), settings_from(values).record(0.0, "", total)
    run = f"--resume: run {resumed.run_id}"
    problems = [
        (
            f"{run} trained with {option_name(key)} {before[key]}, this command asks for {now[key]}",
            "drop it (a resume keeps the run's)",
        )
        for key in COMPARED_HYPERPARAMETERS
        if before[key] != now[key]
    ]
    rate, earlier_rate = named.get("learning_rate"), resumed.base_learning_rate
    if rate is not None and earlier_rate is not None and not math.isclose(rate, earlier_rate, rel_tol=1e-9):
        problems.insert(
            0,
            (
                f"{run} trained with --learning-rate {earlier_rate:g}, this command asks for {rate:g}",
                "repeat the run's --learning-rate",
            ),
        )
    if problems and not force:
        raise BenchtrainError(f"{problems[0][0]}: {problems[0][1]}, or pass --force to continue with this command's")
    for problem, _ in problems:
        say(f"warning: {problem} (--force: continuing with this command's)")
    kept = values if problems else asdict(theirs)
    # --learning-rate not given: the run's own rate (its plan's base rate), not the default.
    return {**kept, "learning_rate": float(earlier_rate)} if rate is None and earlier_rate is not None else kept


def same_method(earlier: MethodConfig, method: MethodConfig) -> bool:
    """The same method and adapter settings; LoRA's targets (run.json keeps them resolved) only when this command names them."""
    if earlier.method != method.method or earlier.optimizer != method.optimizer:
        return False
    if not method.is_lora:
        return True
    settings = operator.attrgetter("lora_rank", "alpha", "lora_dropout", "quantize")
    named = method.lora_targets is None or set(method.lora_targets) == set(earlier.lora_targets or ())
    return settings(earlier) == settings(method) and named


def data_fingerprint(data: DataView) -> str:
    """The tokenized data's identity: its format and every sample's length, in order (runs recorded before the data cache; newer ones keep the cache key)."""
    digest = hashlib.sha256(data.format.encode())
    digest.update(np.asarray(data.lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def check_same_data(
    resumed: ResumedRun, prepared: PreparedData, data: DataView, data_path: str, profile: JsonDict, force: bool
) -> str | None:
    """A resume trains on the run's data (the same batches in the same order): other data is refused unless --force. Returns the warning --force let through."""
    before = resumed.data
    known_key, known = before.preparation_key, before.fingerprint
    if known_key is not None:
        same = known_key == prepared.key
    elif known is not None and prepared.exact:
        same = known == data_fingerprint(data)
    elif not prepared.exact:
        same = True  # an older run, and data profiled from a sample: checked once tokenized (train.recipes.recipe: TrainRecipe._with_exact_data)
    else:  # a run recorded before the fingerprint: its length profile
        same = (before.count, before.total_tokens) == (profile["count"], profile["total_tokens"])
    if same:
        return None
    problem = (
        f"--resume: run {resumed.run_id} trained on {before.source} ({_count(before.count)} samples, "
        f"{_count(before.total_tokens)} tokens), not {data_path} ({profile['count']:,} samples, {profile['total_tokens']:,} tokens)"
    )
    if not force:
        raise BenchtrainError(f"{problem}: pass the run's --data, or --force to continue on this data")
    return problem


def _count(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def resumed_step_limit(resumed: ResumedRun, max_steps: int | None) -> int:
    """Where a resume stops: the run's own end, or earlier (--max-steps below it, or --fit-deadline
    later). A resume never extends a run (one that did all its steps: what_to_continue)."""
    total, run = resumed.total_steps, f"--resume: run {resumed.run_id}"
    if max_steps is not None and max_steps > total:
        raise BenchtrainError(
            f"{run} has {total:,} optimizer steps; --max-steps {max_steps} would extend it, which a resume never does: "
            "drop --max-steps, or train more in a new run"
        )
    return min(total, max_steps or total)


def without_options(command_line: list[str], flags: tuple[str, ...], with_value: tuple[str, ...]) -> list[str]:
    """`command_line` without `flags` (--resume with its optional `auto`) and the options `with_value` with their value (also as --name=value)."""
    kept: list[str] = []
    skip = False
    for index, token in enumerate(command_line):
        name, equals, _ = token.partition("=")
        if skip:
            skip = False
        elif name in with_value:
            skip = not equals
        elif name in flags:
            skip = name == "--resume" and command_line[index + 1 : index + 2] == ["auto"]
        else:
            kept.append(token)
    return kept


def resume_command(command_line: list[str] | None, out_dir: Path, world_size: int) -> str | None:
    """This command again, continuing the run in `out_dir` (--help promises it after Ctrl-C)."""
    if command_line is None:
        return None
    kept = without_options(command_line, ("--resume", "--dry-run"), ("--out",))
    auto = any(token == "--resume" and after == "auto" for token, after in itertools.pairwise(command_line))
    resume = ["--resume", "auto"] if auto else ["--resume"]  # the same command continues the run as it did
    return train_command_line(world_size, [*kept, *resume, "--out", str(out_dir)])


def train_command_line(processes: int, arguments: list[str]) -> str:
    """`train` with `arguments`, under accelerate launch for several processes."""
    launcher = (
        ["accelerate", "launch", "--num_processes", str(processes), "-m", "benchtrain.train"]
        if processes > 1
        else ["train"]
    )
    return shlex.join([*launcher, *arguments])


def readable_checkpoints(checkpoints: tuple[Path, ...]) -> tuple[Path, ...]:
    """`checkpoints` up to the newest whose progress can be read, saying which were passed over; none readable: the newest's error."""
    for index in range(len(checkpoints) - 1, -1, -1):
        try:
            read_progress(checkpoints[index])
        except CheckpointReadError as error:
            if index == 0:
                raise
            say(f"warning: {error}; resuming from the one before, {checkpoints[index - 1].name}")
            continue
        return checkpoints[: index + 1]
    return checkpoints


@dataclass(frozen=True)
class PlannedCalibration:
    """The calibration a resumed run was planned with, which the resume plans with again: its `id` (what another
    --use-calibration is compared with) and where it is loaded from, decided when the run is read."""

    id: str | None
    path: str | None  # as run.json recorded it: the line that says the calibration is gone names it
    # Its file while that is still there, then its id in the store (a path that is gone is not looked up as an id).
    references: tuple[str, ...]

    @classmethod
    def of(cls, run: ResumedRun) -> PlannedCalibration:
        stored = (run.calibration_path, run.calibration_id)
        found = tuple(one for one in stored if one and (Path(one).is_file() or "/" not in one))
        return cls(run.calibration_id, run.calibration_path, found)

    def load(self) -> Calibration:
        """The calibration itself: the first reference that loads; none is one line."""
        for reference in self.references:
            try:
                return calibration_api.load(reference)
            except BenchtrainError:
                continue
        raise BenchtrainError(
            f"--resume: the run's calibration {self.id} is gone ({self.path}); pass --use-calibration ID --force to plan with another"
        )


@dataclass(frozen=True)
class Continuation:
    """What one `train` command continues, decided once by `what_to_continue` and read by every other stage: the run
    folder, the run's run.json and what its plan fixed, the checkpoint the loop restores, and the deadline's budget
    already used. A new run continues nothing (`run` None). docs/design.md#what-a-resume-continues."""

    out_dir: Path | None = None  # the run folder (--out; None: a new one under runs/, named when it opens)
    earlier: RunFile | None = None  # the run's run.json as read: RunRecord.open brings it up to this command's plan
    run: ResumedRun | None = None  # what its plan fixed: configuration, epochs, steps, sharding
    calibration: PlannedCalibration | None = None  # the calibration it was planned with, which it plans with again
    checkpoints: tuple[Path, ...] = ()  # its complete checkpoints, oldest first: the loop restores the last
    completed: int = 0  # the optimizer steps it already did (its last checkpoint's)
    # Seconds of the deadline gone before this command: --resume auto counts from the run's first start (what a
    # preemption lost counts); a plain --resume, or a new run, from this command's start.
    budget_used: float = 0.0
    finished: str | None = None  # --resume auto of a run that already ended at its planned end: its status
    # --resume auto (unattended): a newest checkpoint that cannot be loaded gives way to the one before, with a warning.
    fall_back: bool = False
    # A run that did all its steps but not all that comes after (a kill during its final evaluation, export, push or
    # report): the phases (calibration.run_file.PHASES) that already ended, which this command does not do again.
    phases_done: tuple[str, ...] = ()

    @property
    def resuming(self) -> bool:
        return self.run is not None

    @property
    def steps_done(self) -> bool:
        """Every step of the run already ran: this command does what came after them (its final evaluation, export,
        push and report) from its last checkpoint."""
        return self.run is not None and self.completed >= self.run.total_steps


def what_to_continue(resume: bool | str | None, out: str | None, dry_run: bool, started_at: float) -> Continuation:
    """What this command continues: `resume` as --resume gives it (None/False: a new run; True; "auto": the run in
    --out if it has a complete checkpoint, else a new one, its deadline counted from the run's first start either way).
    `started_at`: the command's start (time.monotonic()). A resume with nothing to continue is one line."""
    out_dir = Path(out).expanduser() if out else None
    if not resume:
        return Continuation(out_dir)
    if out_dir is None:
        if resume == "auto":
            raise BenchtrainError("--resume auto needs --out DIR: the run folder to continue, or to start")
        raise BenchtrainError("--resume needs --out DIR: the run folder to continue")
    path = out_dir / "run.json"
    budget_used = 0.0
    if resume == "auto":
        if not path.is_file():
            return Continuation(out_dir)
        record = read_json_file(path)
        started, status = record.get("deadline_started_at"), record.get("status")
        if isinstance(started, (int, float)):
            budget_used = max(0.0, time.time() - float(started) - (time.monotonic() - started_at))
        at_end = status in (COMPLETED, STEP_LIMIT)
        if at_end and not phases_of(record, str(path)).left and not dry_run:
            return Continuation(out_dir, budget_used=budget_used, finished=str(status))
        if not at_end and not list_checkpoints(out_dir / "checkpoints"):
            return Continuation(out_dir, budget_used=budget_used)
    elif not path.is_file():
        raise BenchtrainError(f"--resume: {out_dir} has no run.json to continue")
    earlier = RunFile.read(path)
    run = earlier.resumed()
    checkpoints = tuple(checkpoints_to_resume(out_dir, run.run_id))
    if (
        resume == "auto"
    ):  # unattended (an engine's restart): a newest checkpoint that cannot be read gives way to the one before
        checkpoints = readable_checkpoints(checkpoints)
    completed = int(read_progress(checkpoints[-1])["step"])
    # A run that ended at its planned end and did all that came after: nothing to continue. One that did all its steps
    # and was stopped after them continues with what is left; what ended is not done again, unless the steps it
    # follows were not all done then (a stop during the last step: its final/ is partial).
    done = earlier.phases_done
    ended = run.status in (COMPLETED, STEP_LIMIT) and not phases_of(earlier.sections).left
    if ended and (run.status == COMPLETED or completed >= run.total_steps):
        raise BenchtrainError(
            f"--resume: run {run.run_id} already did all {run.total_steps:,} of its optimizer steps (its model is in final/): "
            "nothing to resume; train more in a new run"
        )
    return Continuation(
        out_dir,
        earlier,
        run,
        calibration=PlannedCalibration.of(run),
        checkpoints=checkpoints,
        completed=completed,
        budget_used=budget_used,
        fall_back=resume == "auto",
        phases_done=done if STEPS in done and completed >= run.total_steps else (),
    )
