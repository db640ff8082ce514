"""One validated configuration for a `train` command, in the sections its consumers take whole (data, tuning,
step, plan, guard, output), each checked in its `__post_init__`, written flat into run.json.
The sections: docs/design.md#the-train-configuration."""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

from benchtrain.calibration.dimensions import switches
from benchtrain.common.durations import parse_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.hub_access import valid_repo_id
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.prices import Prices, parse_prices
from benchtrain.train.recipes.hub_push import PushTarget
from benchtrain.train.running.guard import GuardSection
from benchtrain.train.running.resume import Continuation
from benchtrain.train.running.trackers import parse_report_to
from benchtrain.train.step.engine import StepOptions, step_options_from_args
from benchtrain.train.step.evaluation import EvalSchedule, parse_eval_every
from benchtrain.train.step.hyperparameters import DEFAULT_LEARNING_RATE, SETTING_NAMES, OptimizerSettings, settings_from
from benchtrain.train.workload.formats import DataSchema, schema_from_args
from benchtrain.train.workload.method import MethodConfig, method_from_args


def parse_max_length(value: Any) -> int | str:
    if str(value).lower() == "auto":
        return "auto"
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise BenchtrainError(f"--max-length must be a positive integer or auto, got {value!r}")
    return number


# Memory sizes as people write them: `24GiB`, `24G`, `80GB`, `512MiB`, or plain GiB (`24`).
_UNITS = {
    **{"": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12},
    **{"k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40},
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


def parse_memory_size(text: str, what: str = "size") -> int:
    """Bytes in `text` (a bare number is GiB, as device memory is quoted; G and GiB are 2^30, GB
    10^9); a one-line error for anything else, zero and negatives included."""
    match = _SIZE.fullmatch(str(text).strip().lower())
    if not match or match.group(2) not in _UNITS:
        raise BenchtrainError(f"{what} {text!r} is not a memory size: write e.g. 24GiB, 80GB, 512MiB or plain GiB (24)")
    size = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(size) or size <= 0:
        raise BenchtrainError(f"{what} must be positive, got {text!r}")
    return int(size)


def is_comparison(use_calibration: str | None) -> bool:
    """--use-calibration names a comparison: several calibrations (A,B,C), `all`, or a hub repository's (`hub:ORG/NAME`)."""
    if use_calibration is None:
        return False
    text = use_calibration.strip()
    return "," in text or text == "all" or (text.startswith("hub:") and text.count("/") == 1)


def _derive(section: object, **values: Any) -> None:
    """Set a frozen section's derived fields (computed once, in its __post_init__)."""
    for name, value in values.items():
        object.__setattr__(section, name, value)


@dataclass(frozen=True)
class DataSection:
    """What is trained on and how it is read, and the eval set (train.recipes.run_data.load_data)."""

    data: str
    tokenizer: str | None = None
    train_on: str = "assistant"
    exact_profile: bool = False  # tokenize every record before planning (else a cold cache plans from a sample)
    data_split: str = "train"
    eval_data: str | None = None
    eval_split: float | None = None
    eval_every: str | None = None
    schema: DataSchema = field(default_factory=DataSchema)
    eval_schedule: EvalSchedule = field(init=False)

    def __post_init__(self) -> None:
        _derive(self, eval_schedule=parse_eval_every(self.eval_every))
        if self.eval_data and self.eval_split is not None:
            raise BenchtrainError("--eval-data and --eval-split are two ways to choose the eval set: pass one")
        if self.eval_every and not (self.eval_data or self.eval_split is not None):
            raise BenchtrainError("--eval-every needs an eval set: --eval-data PATH or --eval-split FRACTION")
        if self.eval_split is not None and not 0 < self.eval_split < 1:
            raise BenchtrainError(f"--eval-split must be a fraction between 0 and 1, got {self.eval_split}")


@dataclass(frozen=True)
class TuningSection:
    """The method, the base's quantization and the optimizer as asked, and the optimizer's and schedule's hyper-parameters."""

    method: MethodConfig = field(default_factory=MethodConfig)
    quantize: str = "auto"
    optimizer: str = "auto"
    learning_rate: float = DEFAULT_LEARNING_RATE
    learning_rate_named: bool = True  # False: --learning-rate not given (a resume then keeps the run's)
    # The schedule's and the optimizer's hyper-parameters as named (None: not named: the default, or
    # a resumed run's own); `hyperparameters` holds them validated (train.step.hyperparameters).
    lr_scheduler_type: str | None = None
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_epsilon: float | None = None
    lr_scaling: str = "none"
    base_batch: int | None = None
    hyperparameters: OptimizerSettings = field(init=False)

    def __post_init__(self) -> None:
        _derive(self, hyperparameters=settings_from({name: getattr(self, name) for name in SETTING_NAMES}))
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise BenchtrainError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.lr_scaling not in ("none", "linear", "sqrt"):
            raise BenchtrainError(f"--lr-scaling must be none, linear or sqrt, got {self.lr_scaling!r}")
        if self.base_batch is not None and self.base_batch < 1:
            raise BenchtrainError(f"--base-batch must be a positive integer, got {self.base_batch}")

    def named_hyperparameters(self) -> JsonDict:
        """The hyper-parameters this command names (a resume keeps the run's others), --learning-rate among them if given."""
        named = {name: getattr(self, name) for name in SETTING_NAMES if getattr(self, name) is not None}
        return {**named, "learning_rate": self.learning_rate} if self.learning_rate_named else named


@dataclass(frozen=True)
class PlanSection:
    """What the planner is asked: the deadline, the calibration (or --consider's machines), the run's shape where fixed."""

    deadline: str
    use_calibration: str | None = None
    consider: str | None = None  # --consider: machines to plan (train.recipes.machines); a dry run
    epochs: float = 1.0
    priority: str = "balanced"
    effective_batch: int | None = None
    max_length: int | str = "auto"
    workers: int | None = None
    # Each switch of the step (calibration.dimensions: gradient checkpointing) as asked: auto, on or off.
    switches: dict[str, str] = field(default_factory=dict)
    device_memory: str | None = None  # as written; device_memory_bytes once parsed
    fit_deadline: bool = False
    # What the plan lacks of the calibration (lengths it never measured) is measured first, within this (train.recipes.measure_missing).
    measure_budget: str = "60s"
    no_measure: bool = False
    max_steps: int | None = None
    margin: float = 0.05
    price_per_hour: str | float | None = None  # as given: a number, KEY=USD pairs or a file (train.planning.prices)
    # time.monotonic() when the command started: its deadline counts from there.
    started_at: float = field(default_factory=time.monotonic)
    deadline_seconds: float = field(init=False)
    # The start, --deadline and --margin: built here once, handed whole to the planner, the loop and the guard.
    run_deadline: Deadline = field(init=False)
    prices: Prices = field(init=False)
    device_memory_bytes: int | None = field(init=False)

    def __post_init__(self) -> None:
        deadline_seconds = parse_duration(self.deadline, "--deadline")
        _derive(
            self,
            switches={dimension.name: self.switches.get(dimension.name, "auto") for dimension in switches()},
            deadline_seconds=deadline_seconds,
            max_length=parse_max_length(self.max_length),
            prices=parse_prices(self.price_per_hour),
            device_memory_bytes=parse_memory_size(self.device_memory, "--device-memory")
            if self.device_memory
            else None,
        )
        if not 0 <= self.margin < 0.5:
            raise BenchtrainError(f"--margin must be a fraction between 0 and 0.5, got {self.margin}")
        _derive(self, run_deadline=Deadline.with_margin_share(deadline_seconds, self.margin, self.started_at))
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise BenchtrainError(f"--epochs must be positive, got {self.epochs}")
        if self.workers is not None and self.workers < 0:
            raise BenchtrainError(f"--workers must be non-negative, got {self.workers}")
        self.measure_seconds  # noqa: B018 (a bad --measure-budget is one line before any work)

    @property
    def measure_seconds(self) -> float | None:
        """Seconds `train` may spend measuring what the plan lacks first; None: --no-measure."""
        seconds = parse_duration(self.measure_budget, "--measure-budget")
        return None if self.no_measure else seconds


ENGINES = ("skypilot", "dstack", "slurm")  # what --emit writes a task for (train.launch_command)


@dataclass(frozen=True)
class EmitRequest:
    """`--emit ENGINE:FILE`, parsed."""

    engine: str
    path: Path


def parse_emit(text: str) -> EmitRequest:
    """`skypilot:task.yaml` or `dstack:.dstack.yml`; one line for anything else."""
    engine, _, path = text.partition(":")
    if engine.lower() not in ENGINES or not path:
        raise BenchtrainError(
            f"--emit {text!r}: ENGINE:FILE with ENGINE one of {', '.join(ENGINES)}, e.g. --emit skypilot:task.yaml"
        )
    return EmitRequest(engine.lower(), Path(path).expanduser())


@dataclass(frozen=True)
class OutputSection:
    """Where the run goes and what leaves it: the run folder, a dry run's output, the report, trackers, the merge, the hub."""

    out: str | None = None
    resume: bool = False
    dry_run: bool = False
    emit: str | None = None  # --emit ENGINE:FILE: the launch task of a dry run (train.recipes.launch_task)
    json: bool = False
    for_trainer: bool = False  # the plan as a Trainer's TrainingArguments fields (train.planning.trainer_fields)
    no_report: bool = False
    report_to: str = "none"
    merge_lora: bool = False
    push_to_hub: str | None = None  # ORG/NAME: final/ and a model card uploaded after training (train.recipes.hub_push)
    hub_private: bool = False
    hub_revision: str | None = None  # a branch of the hub repository (created if missing)
    push_only: bool = False  # push an existing run's final/ (the retry a failed push prints)
    trackers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        _derive(self, trackers=parse_report_to(self.report_to))
        if self.resume and not self.out:
            raise BenchtrainError("--resume needs --out DIR: the run folder to continue")
        if (self.hub_private or self.hub_revision or self.push_only) and not self.push_to_hub:
            raise BenchtrainError("--hub-private, --hub-revision and --push-only go with --push-to-hub ORG/NAME")
        if self.push_to_hub:
            valid_repo_id(self.push_to_hub, "--push-to-hub")
        if self.push_only and not self.out:
            raise BenchtrainError("--push-only pushes an existing run: name its folder with --out DIR")
        if self.json and not self.dry_run:
            raise BenchtrainError("--json prints a dry run's plan as JSON: add --dry-run")
        if self.emit is not None:
            parse_emit(self.emit)  # an unknown engine is one line before any work
            if not self.dry_run:
                raise BenchtrainError(
                    f"--emit {self.emit} writes the task that runs a plan on a machine not rented yet, which is a dry run: add --dry-run"
                )
        if self.for_trainer and not self.dry_run:
            raise BenchtrainError("--for-trainer prints a dry run's plan as your Trainer's arguments: add --dry-run")

    @property
    def push_target(self) -> PushTarget | None:
        """Where --push-to-hub sends the model (not checked against the hub yet: hub_push.check_push)."""
        return PushTarget(self.push_to_hub, self.hub_private, self.hub_revision) if self.push_to_hub else None


# run.json's `config`: every option under its command-line name, flat, in this order (people's scripts, the report and the model card read it), the derived
# values after them; `switches`: each switch of the step under its own name (gradient_checkpointing).
FLAT_ORDER = (
    "data deadline use_calibration consider model tokenizer epochs priority effective_batch max_length workers out dry_run "
    "device_memory resume emit on_overrun fit_deadline measure_budget no_measure max_steps checkpoint_interval keep_checkpoints "
    "margin price_per_hour json for_trainer "
    "learning_rate lr_scheduler_type warmup_ratio warmup_steps weight_decay max_grad_norm adam_beta1 adam_beta2 adam_epsilon "
    "lr_scaling base_batch seed force no_report train_on exact_profile data_split eval_data eval_split eval_every report_to "
    "merge_lora push_to_hub hub_private hub_revision push_only switches method quantize optimizer step_options "
    "data_schema deadline_seconds checkpoint_interval_seconds eval_schedule trackers device_memory_bytes hyperparameters"
).split()
# A section's field under another name in run.json (and on the command line).
FLAT_NAMES = {"schema": "data_schema"}
SECTIONS = {
    "data": DataSection,
    "tuning": TuningSection,
    "plan": PlanSection,
    "guard": GuardSection,
    "output": OutputSection,
}


@dataclass(frozen=True)
class TrainConfig:
    data: DataSection
    plan: PlanSection
    tuning: TuningSection = field(default_factory=TuningSection)
    step: StepOptions = field(default_factory=StepOptions)
    guard: GuardSection = field(default_factory=GuardSection)
    output: OutputSection = field(default_factory=OutputSection)
    model: str = "tiny"
    seed: int = 0
    force: bool = False

    def __post_init__(self) -> None:
        # The checks that span sections (each section checked its own values).
        plan, output = self.plan, self.output
        if plan.consider and not output.dry_run:
            raise BenchtrainError(
                f"--consider {plan.consider} plans machines you have not rented, which is a dry run: add --dry-run"
            )
        if is_comparison(plan.use_calibration) and not output.dry_run:
            raise BenchtrainError(
                f"--use-calibration {plan.use_calibration} compares calibrations, which is a dry run: add --dry-run, then train with the one chosen"
            )
        if (plan.consider or is_comparison(plan.use_calibration)) and output.resume:
            raise BenchtrainError(
                "--resume plans with the run's own calibration: pass one --use-calibration, not a comparison"
            )

    @property
    def run_deadline(self) -> Deadline:
        return self.plan.run_deadline

    @classmethod
    def of(cls, **given: object) -> TrainConfig:
        """A configuration from options under their command-line names (`data_schema`, `step_options`, `method`: built)."""
        # Each value goes to the dataclass field of its name, whose type it must have: the fields hold the types, this mapping only routes them.
        options: JsonDict = dict(given)
        sections: JsonDict = {}
        for name, section in SECTIONS.items():
            names = {f.name for f in fields(section) if f.init}
            values = {
                own: options.pop(FLAT_NAMES.get(own, own)) for own in names if FLAT_NAMES.get(own, own) in options
            }
            sections[name] = section(**values)
        step = options.pop("step_options", StepOptions())
        return cls(**sections, step=step, **options)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, started_at: float | None = None, continuation: Continuation | None = None
    ) -> TrainConfig:
        """`started_at`: when the command started (time.monotonic(); default: now); `continuation`: what it continues
        (train.running.resume.what_to_continue; default: a new run): whether it resumes, and the deadline's budget
        already used, which moves the deadline's start back."""
        flat = {f.name for section in SECTIONS.values() for f in fields(section) if f.init} | {"model", "seed", "force"}
        flat -= {"method", "schema", "learning_rate_named", "started_at", "switches"}
        values = {name: value for name, value in vars(args).items() if name in flat}
        values["switches"] = {dimension.name: getattr(args, dimension.name, "auto") for dimension in switches()}
        if values.get("learning_rate", 0) is None:  # not given: the default, or with --resume the run's
            values.pop("learning_rate")
            values["learning_rate_named"] = False
        if continuation is not None:
            own_start = time.monotonic() if started_at is None else started_at
            values["resume"], values["started_at"] = continuation.resuming, own_start - continuation.budget_used
        elif started_at is not None:
            values["started_at"] = started_at
        return cls.of(
            **values,
            method=method_from_args(args),
            step_options=step_options_from_args(args),
            data_schema=schema_from_args(args),
        )

    def to_json(self) -> JsonDict:
        """run.json's `config`: flat, under the command-line names (FLAT_ORDER)."""
        flat: JsonDict = {
            "model": self.model,
            "seed": self.seed,
            "force": self.force,
            "step_options": asdict(self.step),
        }
        for name in SECTIONS:
            section = getattr(self, name)
            for f in fields(section):
                value = getattr(section, f.name)
                flat[FLAT_NAMES.get(f.name, f.name)] = (
                    asdict(value) if hasattr(value, "__dataclass_fields__") else value
                )
        flat["trackers"] = list(self.output.trackers)
        flat.update(self.plan.switches)
        # prices: price_per_hour holds what was given; run_deadline: deadline_seconds and margin hold it; started_at: a reading of this machine's monotonic
        # clock; learning_rate_named: learning_rate holds the rate trained with.
        return {key: flat[key] for name in FLAT_ORDER for key in (self.plan.switches if name == "switches" else [name])}


# What an option's default may be (a word, a count, a fraction).
Default = str | int | float | None


def option_default(name: str) -> Default:
    """The default of the option whose field is `name`: written once, in the dataclass that holds it (TrainConfig, its
    sections, StepOptions, MethodConfig), and read by the command line's parser and its help."""
    for holder in (TrainConfig, *SECTIONS.values(), StepOptions, MethodConfig):
        for each in fields(holder):
            if each.name == name and each.init and each.default is not MISSING:
                return cast(Default, each.default)
    raise KeyError(f"no configuration field {name!r} has a default")
