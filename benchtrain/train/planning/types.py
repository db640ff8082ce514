"""What the planner is asked, what it weighs and what it answers: the request (PlanRequest), each
configuration it predicts (Candidate) with what it spends besides its steps (Overheads), and the
plan it makes (Plan)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from benchtrain.calibration.dimensions import DIMENSIONS
from benchtrain.calibration.run_file import step_columns
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.step.compile import SHAPE_BUCKET
from benchtrain.train.step.evaluation import EvalSchedule

# The priorities a plan may be made for (train.planning.planner.rank orders candidates by each).
PRIORITIES = ("fast", "balanced", "quality", "memory_efficient")


@dataclass(frozen=True)
class PlanRequest:
    epochs: float
    deadline: Deadline  # the command's, whole (train.recipes.config.TrainConfig.run_deadline)
    elapsed_seconds: float = 0.0  # already spent by this command (loading, tokenizing)
    priority: str = "balanced"
    effective_batch: int | None = None
    max_length: int | str | None = "auto"
    world_size: int = 1
    num_workers: int | None = None
    checkpoint_interval_seconds: float = 600.0
    price_per_hour: float | None = None
    max_steps: int | None = None
    fit_deadline: bool = False
    seed: int = 0
    max_positions: int | None = None  # the model's position table: no length beyond it
    completed_steps: int = 0  # --resume: optimizer steps the interrupted run already did
    configuration: StepConfig | None = None  # --resume: the interrupted run's step
    # Each switch of calibration.dimensions asked for (--gradient-checkpointing): auto | on | off; absent: auto.
    switches: Mapping[str, str] = field(default_factory=dict)
    eval_schedule: EvalSchedule | None = None  # None: no evaluation
    with_report: bool = True  # --no-report: no report time in the plan
    compiled: bool = False  # a compiled step: padded batches are bucketed and each shape compiles once
    # Collectives the calibration's step times do not hold (a 1-process calibration planning an
    # N-process run, train/planning/comm.py): DDP's all-reduce per optimizer step, FSDP's per micro-step.
    comm_seconds_per_step: float = 0.0
    comm_seconds_per_micro_step: float = 0.0
    # Whether they may run behind backward (a row predicted from a 1-process step, train.recipes.machines):
    # the estimate counts the midpoint of the overlap bracket, the lower bound full overlap, the upper
    # bound none (calibration.topology). False: counted in full everywhere.
    comm_overlap: bool = False
    # Bytes each process holds beyond the calibration's probes (negative: FSDP shards planned from a
    # 1-process calibration), and the FSDP processes each accumulating its 1/N of the gradients.
    memory_offset_bytes: float = 0.0
    gradient_shards: int = 1
    export_bytes: int = 0  # final/ (and final-merged/): their write time is planned and kept in reserve
    upload_seconds: float = 0.0  # --push-to-hub's upload after the export, predicted (kept in reserve like the report)
    data_prep_seconds: float = 0.0  # tokenizing before training (a cold cache), at the rate measured on the sample
    data_uncertainty: float = (
        0.0  # relative 95% half-width of the token total when lengths come from a sample: the bounds widen by it
    )
    # A user's own Trainer (benchtrain.trainer.fit): its sampler's batches are random unless it groups by length (ours
    # always do), it saves every N optimizer steps (None: every checkpoint_interval_seconds), and it evaluates in
    # batches of its own size (None: the training micro-batch).
    length_grouping: bool = True
    checkpoint_every_steps: int | None = None
    eval_micro_batch_size: int | None = None

    @property
    def shape_bucket(self) -> int | None:
        return SHAPE_BUCKET if self.compiled else None

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise BenchtrainError(f"--priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if not self.epochs > 0:
            raise BenchtrainError(f"--epochs must be positive, got {self.epochs}")
        if self.effective_batch is not None and self.effective_batch < 1:
            raise BenchtrainError(f"--effective-batch must be a positive integer, got {self.effective_batch}")
        if self.max_steps is not None and self.max_steps < 1:
            raise BenchtrainError(f"--max-steps must be a positive integer, got {self.max_steps}")
        for name, asked in self.switches.items():
            if asked not in ("auto", "on", "off"):
                raise BenchtrainError(f"{DIMENSIONS[name].plan_flag} must be auto, on or off, got {asked!r}")
        if self.completed_steps < 0:
            raise BenchtrainError(f"completed steps must be non-negative, got {self.completed_steps}")


@dataclass(frozen=True)
class Overheads:
    """Everything a run spends besides its training steps: priced from bench's measurements
    (train.planning.planner.candidate_overheads) and added to the estimate; the deadline guard keeps
    what comes after the last step in reserve; run.json records it; `train --dry-run` shows it."""

    model_build_seconds: float
    warmup_seconds: float
    checkpoint_seconds: float  # one checkpoint save
    checkpoint_count: int  # periodic ones + the final one
    export_seconds: float  # final/ (and final-merged/): their bytes at the write bandwidth
    eval_pass_seconds: float  # one pass over the eval set
    eval_count: int
    report_seconds: float  # 0 with --no-report
    compile_seconds: float = 0.0  # torch.compile: every distinct batch shape once
    compile_shapes: int = 0
    export_bytes: int = 0  # 0: not known (one checkpoint save is counted)
    data_prep_seconds: float = 0.0  # tokenizing the data before training (cold cache), at the sample's measured rate
    upload_seconds: float = 0.0  # --push-to-hub: the upload's bytes at the measured (or stated default) bandwidth

    @property
    def evaluation_seconds(self) -> float:
        return self.eval_pass_seconds * self.eval_count

    @property
    def total_seconds(self) -> float:
        startup = (self.data_prep_seconds, self.model_build_seconds, self.warmup_seconds, self.compile_seconds)
        rest = (self.export_seconds, self.evaluation_seconds, self.report_seconds, self.upload_seconds)
        return sum((*startup, self.checkpoint_seconds * self.checkpoint_count, *rest))

    @property
    def after_training_seconds(self) -> float:
        """What must still fit after the last step: the final checkpoint, the export, the final
        evaluation and the report. The deadline guard keeps it in reserve."""
        return (
            self.checkpoint_seconds
            + self.export_seconds
            + self.eval_pass_seconds
            + self.report_seconds
            + self.upload_seconds
        )

    @property
    def during_training_seconds(self) -> float:
        """What the run spends between its steps: the periodic checkpoints and evaluations (the final ones come after the last step: after_training_seconds)."""
        return self.checkpoint_seconds * max(0, self.checkpoint_count - 1) + self.eval_pass_seconds * max(
            0, self.eval_count - 1
        )

    def to_json(self) -> JsonDict:
        return {**asdict(self), "evaluation_seconds": self.evaluation_seconds, "total_seconds": self.total_seconds}

    def describe(self) -> str:
        parts = [
            *(
                [f"tokenizing {format_duration(self.data_prep_seconds)} (rate measured on the sample)"]
                if self.data_prep_seconds
                else []
            ),
            f"model build {format_duration(self.model_build_seconds)}",
            f"warm-up {format_duration(self.warmup_seconds)}",
            *(
                [f"compile {format_duration(self.compile_seconds)} ({self.compile_shapes} batch shapes)"]
                if self.compile_shapes
                else []
            ),
            f"{self.checkpoint_count} checkpoint{'s' if self.checkpoint_count != 1 else ''} × {format_duration(self.checkpoint_seconds)}",
            f"final/ export {format_duration(self.export_seconds)}"
            + (f" ({self.export_bytes / 1e6:,.1f} MB)" if self.export_bytes else ""),
        ]
        if self.eval_count:
            parts.append(
                f"{self.eval_count} evaluation{'s' if self.eval_count != 1 else ''} × {format_duration(self.eval_pass_seconds)}"
            )
        if self.upload_seconds:
            parts.append(f"hub push {format_duration(self.upload_seconds)}")
        parts.append(f"report {format_duration(self.report_seconds)}" if self.report_seconds else "no report")
        return f"overheads {format_duration(self.total_seconds)} (measured by bench): " + ", ".join(parts)


# A candidate's figures in the order the dry run's JSON and run.json show them (after the step's columns).
CANDIDATE_FIGURES = (
    "optimizer_steps",
    "remaining_steps",
    "micro_batches",
    "step_seconds",
    "comm_seconds_per_step",
    "comm_seconds_per_step_low",
    "comm_seconds_per_step_high",
    "overhead_seconds",
    "total_seconds",
    "total_seconds_low",
    "total_seconds_high",
    "total_seconds_promised",
    "bound_fraction",
    "eval_pass_seconds",
    "eval_seconds",
    "overheads",
    "tokens",
    "padded_tokens",
    "peak_memory_bytes",
    "peak_memory_bytes_high",
    "fits_in_memory",
    "extrapolated",
    "truncation",
    "tokens_per_second",
)


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighs, and what it predicts for it."""

    config: StepConfig  # the step it runs, at its max length (what the calibration predicts for)
    world_size: int
    overheads: Overheads  # what it spends besides its steps, measured in bench
    optimizer_steps: int  # the run's target (all of it, resumed or not)
    remaining_steps: int  # what this command still runs: the estimate covers these
    micro_batches: int
    step_seconds: float  # training steps only, predicted
    comm_seconds_per_step: float  # predicted collectives added to each optimizer step (the estimate)
    comm_seconds_per_step_low: float  # …hidden behind backward as far as they can be
    comm_seconds_per_step_high: float  # …none hidden
    total_seconds: float
    total_seconds_low: float
    total_seconds_high: float
    total_seconds_promised: float  # what the deadline is checked against (see Calibration.promised_bound_for)
    bound_fraction: float  # the calibration's relative bound here (wider when extrapolating)
    tokens: int  # real tokens trained on
    padded_tokens: int  # positions computed, padding included
    peak_memory_bytes: float | None
    peak_memory_bytes_high: float | None
    fits_in_memory: bool
    extrapolated: bool
    truncation: JsonDict  # empty for packed data

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds else 0.0

    def to_json(self) -> JsonDict:
        """The plan's flat form (a dry run's JSON): the step's columns (calibration.run_file.step_columns), then the predictions."""
        spent = self.overheads
        shown = {
            "overheads": asdict(spent),
            "truncation": dict(self.truncation),
            "overhead_seconds": spent.total_seconds,
        }
        shown.update(eval_pass_seconds=spent.eval_pass_seconds, eval_seconds=spent.evaluation_seconds)
        return {
            **step_columns(self.config, self.world_size),
            **{name: shown[name] if name in shown else getattr(self, name) for name in CANDIDATE_FIGURES},
        }


@dataclass
class Plan:
    """The planner's answer to `request` (which it refers to: the deadline, epochs, priority and price it was asked for)."""

    request: PlanRequest
    chosen: Candidate
    alternatives: list[Candidate]
    naive_seconds: float
    available_seconds: float
    meets_deadline: bool
    effective_batch: int
    packing: bool
    step_limit: int | None
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # said out loud: the plan cannot keep a promise
    cost: float | None = None  # the price per device-hour is the request's; the cost counts one device per process

    def to_json(self) -> JsonDict:
        """The plan as the dry run and run.json show it: the candidates as their JSON, the request's deadline as its
        seconds, and what was asked (epochs, priority, price) beside what was answered, in this order."""
        request = self.request
        return {
            "chosen": self.chosen.to_json(),
            "alternatives": [candidate.to_json() for candidate in self.alternatives],
            "naive_seconds": self.naive_seconds,
            "deadline_seconds": request.deadline.deadline_seconds,
            "available_seconds": self.available_seconds,
            "meets_deadline": self.meets_deadline,
            "effective_batch": self.effective_batch,
            "packing": self.packing,
            "epochs": request.epochs,
            "priority": request.priority,
            "step_limit": self.step_limit,
            "bound_fraction": self.chosen.bound_fraction,
            "notes": self.notes,
            "warnings": self.warnings,
            "cost": self.cost,
            "price_per_hour": request.price_per_hour,
        }
