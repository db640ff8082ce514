"""What the training loop is given and what it keeps: its settings (the command's deadline among
them, whole), what it trains and on what, the hooks it calls, where it is (resumable from a
checkpoint), and what it returns."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

from common.json_types import JsonDict
from train.planning.deadline import Deadline
from train.running.guard import GuardSection
from train.step.engine import StepSetup
from train.step.evaluation import EvalSchedule
from train.step.hyperparameters import OptimizerSettings
from train.step.runtime import DEFAULT_LEARNING_RATE
from train.workload.method import MethodConfig
from train.workload.model import ModelSpec
from train.workload.tokens import TokenizedData

if TYPE_CHECKING:
    from train.step.step import StepResult

# What signal.signal returns and takes: a handler, or SIG_DFL / SIG_IGN / None.
SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


@dataclass
class LoopSettings:
    deadline: Deadline  # the command's, as it built it: the start, the deadline and the margin
    # The command's guard section whole: --on-overrun, the checkpoint interval, the checkpoints kept.
    guard: GuardSection = field(default_factory=GuardSection)
    log_interval_seconds: float = 10.0
    learning_rate: float = DEFAULT_LEARNING_RATE
    seed: int = 0
    epochs: float = 1.0
    step_limit: int | None = None
    # The run's optimizer steps as first planned: the learning-rate schedule's horizon (warm-up and
    # decay), kept by every resume whatever this command's step limit (None: this plan's steps).
    schedule_steps: int | None = None
    resume: bool = False
    report_to: tuple[str, ...] = ()  # experiment trackers (train.running.trackers)
    warmup_steps: int = 1  # first steps of this process that the guard leaves out of the live speed
    # The schedule's and the optimizer's hyper-parameters (--lr-scheduler-type, --weight-decay, …).
    hyperparameters: OptimizerSettings = field(default_factory=OptimizerSettings)


@dataclass
class LoopOutcome:
    status: str  # a word of calibration.run_status: completed | step_limit | stopped_for_deadline | interrupted
    steps: int
    micro_batches: int
    tokens: int
    padded_tokens: int
    step_seconds: float  # sum of measured optimizer-step times
    checkpoint_seconds: list[float]
    losses: list[dict[str, float]]
    timeline: list[dict[str, float]]
    events: list[str]
    last_checkpoint: str | None
    resumed_from: str | None = None
    exit_signal: int | None = None
    evals: list[dict[str, float]] = field(default_factory=list)
    batch_shapes: int = 0  # distinct (rows, length) micro-batches met: each compiled once
    figures: dict[str, float | None] = field(default_factory=dict)  # train.step.metrics.step_figures over the run, peak memory
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

    def count(self, result: StepResult, micro_count: int, processes: int, predicted_seconds: float, flops: float) -> None:
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
    """What the loop trains: the model, the method, and how the step runs as the plan decided it
    (train.recipes.choice; None: the default options resolved on the loop's accelerator,
    train.step.engine.step_setup_for)."""

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
    """What the loop calls: after each logged step (run.json), before each step (tests slow it
    down), and the run record its trackers are told of."""

    on_update: Callable[[Position, list[str]], None] | None = None
    step_hook: Callable[[int], None] | None = None
    tracker_record: JsonDict | None = None
