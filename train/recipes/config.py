"""One validated configuration for a `train` command, from which everything else is derived.

Built once from the command line (`TrainConfig.from_args`), checked in `__post_init__` (every bad
value is a one-line `BenchtrainError`), written whole into run.json, and read by the recipe (train.recipes.recipe) in
place of the raw argparse namespace. The command's deadline (`run_deadline`) is built here, once.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from common.durations import parse_duration
from common.errors import BenchtrainError
from common.sizes import parse_memory_size
from train.planning.deadline import Deadline
from train.planning.prices import Prices, parse_prices
from train.running.trackers import parse_report_to
from train.step.engine import StepOptions, step_options_from_args
from train.step.evaluation import EvalSchedule, parse_eval_every
from train.step.hyperparameters import SETTING_NAMES, OptimizerSettings, settings_from
from train.step.runtime import DEFAULT_LEARNING_RATE
from train.workload.formats import DataSchema, schema_from_args
from train.workload.method import MethodConfig, method_from_args

if TYPE_CHECKING:
    from train.recipes.hub_push import PushTarget


def parse_max_length(value: Any) -> int | str:
    if str(value).lower() == "auto":
        return "auto"
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise BenchtrainError(f"--max-length must be a positive integer or auto, got {value!r}") from None
    if number < 1:
        raise BenchtrainError(f"--max-length must be a positive integer or auto, got {value!r}")
    return number


def is_comparison(use_calibration: str | None) -> bool:
    """--use-calibration names several calibrations (A,B,C), `all`, or every one a hub repository
    shares (`hub:ORG/NAME`, not `hub:ORG/NAME/ID`: calibration.hub): a comparison (train.recipes.compare)."""
    if use_calibration is None:
        return False
    text = use_calibration.strip()
    return "," in text or text == "all" or (text.startswith("hub:") and text.count("/") == 1)


@dataclass(frozen=True)
class TrainConfig:
    data: str
    deadline: str
    use_calibration: str | None = None
    consider: str | None = None  # --consider: machines to plan (train.recipes.consider); a dry run
    model: str = "tiny"
    tokenizer: str | None = None
    epochs: float = 1.0
    priority: str = "balanced"
    effective_batch: int | None = None
    max_length: int | str = "auto"
    workers: int | None = None
    out: str | None = None
    dry_run: bool = False
    device_memory: str | None = None  # as written; device_memory_bytes once parsed
    resume: bool = False
    on_overrun: str = "stop"
    fit_deadline: bool = False
    max_steps: int | None = None
    checkpoint_interval: str = "10m"
    keep_checkpoints: int = 2
    margin: float = 0.05
    price_per_hour: str | float | None = None  # as given: a number, KEY=USD pairs or a file (train.planning.prices)
    json: bool = False
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
    seed: int = 0
    force: bool = False
    no_report: bool = False
    train_on: str = "assistant"
    exact_profile: bool = False  # tokenize every record before planning (else a cold cache plans from a sample)
    data_split: str = "train"
    eval_data: str | None = None
    eval_split: float | None = None
    eval_every: str | None = None
    report_to: str = "none"
    merge_lora: bool = False
    push_to_hub: str | None = None  # ORG/NAME: final/ and a model card uploaded after training (train.recipes.hub_push)
    hub_private: bool = False
    hub_revision: str | None = None  # a branch of the hub repository (created if missing)
    push_only: bool = False  # push an existing run's final/ (the retry a failed push prints)
    gradient_checkpointing: str = "auto"
    method: MethodConfig = field(default_factory=MethodConfig)
    quantize: str = "auto"  # as asked: auto = the calibration's setups (train.recipes.variant_choice)
    optimizer: str = "auto"
    step_options: StepOptions = field(default_factory=StepOptions)
    data_schema: DataSchema = field(default_factory=DataSchema)
    # time.monotonic() when the command started: its deadline counts from there.
    started_at: float = field(default_factory=time.monotonic)
    # Derived from the above in __post_init__:
    deadline_seconds: float = field(init=False)
    # The start, --deadline and --margin: built here once, handed whole to the planner, the loop and the guard.
    run_deadline: Deadline = field(init=False)
    checkpoint_interval_seconds: float = field(init=False)
    eval_schedule: EvalSchedule = field(init=False)
    trackers: tuple[str, ...] = field(init=False)
    prices: Prices = field(init=False)
    device_memory_bytes: int | None = field(init=False)
    hyperparameters: OptimizerSettings = field(init=False)

    def __post_init__(self) -> None:
        derived: dict[str, Any] = {
            "deadline_seconds": parse_duration(self.deadline, "--deadline"),
            "checkpoint_interval_seconds": parse_duration(self.checkpoint_interval, "--checkpoint-interval"),
            "max_length": parse_max_length(self.max_length),
            "eval_schedule": parse_eval_every(self.eval_every),
            "trackers": parse_report_to(self.report_to),
            "prices": parse_prices(self.price_per_hour),
            "device_memory_bytes": parse_memory_size(self.device_memory, "--device-memory") if self.device_memory else None,
            "hyperparameters": settings_from({name: getattr(self, name) for name in SETTING_NAMES}),
        }
        derived["run_deadline"] = Deadline.with_margin_share(derived["deadline_seconds"], self.margin, self.started_at)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise BenchtrainError(f"--epochs must be positive, got {self.epochs}")
        if self.workers is not None and self.workers < 0:
            raise BenchtrainError(f"--workers must be non-negative, got {self.workers}")
        if self.keep_checkpoints < 1:
            raise BenchtrainError("--keep-checkpoints must be at least 1")
        if not 0 <= self.margin < 0.5:
            raise BenchtrainError(f"--margin must be a fraction between 0 and 0.5, got {self.margin}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise BenchtrainError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.lr_scaling not in ("none", "linear", "sqrt"):
            raise BenchtrainError(f"--lr-scaling must be none, linear or sqrt, got {self.lr_scaling!r}")
        if self.base_batch is not None and self.base_batch < 1:
            raise BenchtrainError(f"--base-batch must be a positive integer, got {self.base_batch}")
        if self.resume and not self.out:
            raise BenchtrainError("--resume needs --out DIR: the run folder to continue")
        if self.eval_data and self.eval_split is not None:
            raise BenchtrainError("--eval-data and --eval-split are two ways to choose the eval set: pass one")
        if self.eval_every and not (self.eval_data or self.eval_split is not None):
            raise BenchtrainError("--eval-every needs an eval set: --eval-data PATH or --eval-split FRACTION")
        if self.eval_split is not None and not 0 < self.eval_split < 1:
            raise BenchtrainError(f"--eval-split must be a fraction between 0 and 1, got {self.eval_split}")
        self._check_push()
        if self.json and not self.dry_run:
            raise BenchtrainError("--json prints a dry run's plan as JSON: add --dry-run")
        if self.consider and not self.dry_run:
            raise BenchtrainError(f"--consider {self.consider} plans machines you have not rented, which is a dry run: add --dry-run")
        if self.comparing and not self.dry_run:
            raise BenchtrainError(
                f"--use-calibration {self.use_calibration} compares calibrations, which is a dry run: add --dry-run, then train with the one chosen"
            )
        if self.comparing and self.resume:
            raise BenchtrainError("--resume plans with the run's own calibration: pass one --use-calibration, not a comparison")

    def named_hyperparameters(self) -> dict[str, Any]:
        """The hyper-parameters this command names (a resume keeps the run's others), its learning
        rate among them when --learning-rate was given."""
        named = {name: getattr(self, name) for name in SETTING_NAMES if getattr(self, name) is not None}
        return {**named, "learning_rate": self.learning_rate} if self.learning_rate_named else named

    @property
    def comparing(self) -> bool:
        return is_comparison(self.use_calibration) or bool(self.consider)

    def _check_push(self) -> None:
        if (self.hub_private or self.hub_revision or self.push_only) and not self.push_to_hub:
            raise BenchtrainError("--hub-private, --hub-revision and --push-only go with --push-to-hub ORG/NAME")
        if self.push_to_hub:
            from train.recipes.hub_push import valid_repo_id

            valid_repo_id(self.push_to_hub)
        if self.push_only and not self.out:
            raise BenchtrainError("--push-only pushes an existing run: name its folder with --out DIR")

    @property
    def push_target(self) -> PushTarget | None:
        """Where --push-to-hub sends the model (not checked against the hub yet: hub_push.check_push)."""
        from train.recipes.hub_push import PushTarget

        return PushTarget(self.push_to_hub, self.hub_private, self.hub_revision) if self.push_to_hub else None

    @classmethod
    def from_args(cls, args: argparse.Namespace, started_at: float | None = None) -> TrainConfig:
        """`started_at`: when the command started (time.monotonic(); default: now)."""
        names = {f.name for f in fields(cls) if f.init and f.name not in ("method", "step_options", "data_schema")}
        values = {name: value for name, value in vars(args).items() if name in names}
        if values.get("learning_rate", 0) is None:  # not given: the default, or with --resume the run's
            values.pop("learning_rate")
            values["learning_rate_named"] = False
        if started_at is not None:
            values["started_at"] = started_at
        return cls(**values, method=method_from_args(args), step_options=step_options_from_args(args), data_schema=schema_from_args(args))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["eval_schedule"] = asdict(self.eval_schedule)
        data["trackers"] = list(self.trackers)
        data.pop("prices")  # price_per_hour holds what was given
        data.pop("run_deadline")  # deadline_seconds and margin hold it
        data.pop("started_at")  # a reading of this machine's monotonic clock: nothing to keep
        data.pop("learning_rate_named")  # learning_rate holds the rate trained with
        return data
