"""Choose the configuration that finishes before the deadline, from measured throughput.

Every number here comes from the calibration (step-time model, its held-out error, measured
model-build / warm-up / checkpoint / report seconds) or from the data (real tokens per batch:
padding to each batch's longest sample, or packing). The naive `samples × mean tokens /
throughput` estimate is computed for comparison only.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from calibration.model import Calibration
from calibration.slices import slices_plan_note
from calibration.step_config import StepConfig
from calibration.topology import bracket_estimate, overlap_bracket
from common.durations import format_duration
from common.errors import BenchtrainError, DoesNotFitError
from train.planning.calibrated import batch_sizes_for, checkpointing_modes, noise_warnings
from train.planning.deadline import Deadline
from train.planning.fit_deadline import error_decides_deadline, shortened_alternatives, shrink_to_deadline
from train.planning.lengths import check_trainable_tokens, choose_lengths
from train.planning.memory_check import memory_basis_note
from train.planning.overheads import Overheads, PlannedWork, plan_overheads
from train.planning.prices import run_cost
from train.planning.priorities import PRIORITIES, rank
from train.planning.shapes import ShapeCache, eval_pass_seconds, shape_counts
from train.step.compile import compile_seconds
from train.step.evaluation import EvalSchedule
from train.workload.batching import DataView, real_tokens
from train.workload.data import truncation

DEFAULT_EFFECTIVE_BATCH = 16


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
    # --resume: the interrupted run's micro_batch_size, grad_accum, num_workers, max_length, gradient_checkpointing.
    configuration: StepConfig | None = None
    gradient_checkpointing: str = "auto"  # auto | on | off
    eval_schedule: EvalSchedule | None = None  # None: no evaluation
    with_report: bool = True  # --no-report: no report time in the plan
    compiled: bool = False  # a compiled step: padded batches are bucketed and each shape compiles once
    # Gradient all-reduce per optimizer step that the calibration's step times do not hold (a
    # 1-process calibration planning an N-process run: calibration.comm).
    comm_seconds_per_step: float = 0.0
    # FSDP's all-gathers and reduce-scatter per micro-step, likewise (train/planning/comm.py).
    comm_seconds_per_micro_step: float = 0.0
    # Bytes each process holds beyond the calibration's probes (negative: FSDP shards planned from
    # a 1-process calibration, train.planning.memory_check.MemoryNeed.per_process_bytes).
    memory_offset_bytes: float = 0.0
    # FSDP processes planned from a 1-process calibration: each accumulates its 1/N of the gradients.
    gradient_shards: int = 1
    # Bytes of final/ (and final-base/, final-merged/): their write time is planned and kept in reserve.
    export_bytes: int = 0
    # --push-to-hub: the upload of final/ after the export, predicted (kept in reserve like the report).
    upload_seconds: float = 0.0
    # Whether the collectives above may run behind backward (a row predicted from a 1-process step,
    # train.recipes.compare): the estimate counts the midpoint of the overlap bracket, the lower
    # bound full overlap, the upper bound (what the deadline is checked against) none: the
    # communication seconds above are that absolute upper bound (calibration.topology). False:
    # counted in full everywhere.
    comm_overlap: bool = False
    # Tokenizing the data before training (a cold cache), predicted at the rate measured on the
    # sample (train.workload.prepare): an overhead of the run.
    data_prep_seconds: float = 0.0
    # The relative 95% half-width of the token total when lengths come from a sample: the bounds widen by it.
    data_uncertainty: float = 0.0

    @property
    def shape_bucket(self) -> int | None:
        from train.step.compile import SHAPE_BUCKET

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
        if self.gradient_checkpointing not in ("auto", "on", "off"):
            raise BenchtrainError(f"--gradient-checkpointing must be auto, on or off, got {self.gradient_checkpointing!r}")
        if self.completed_steps < 0:
            raise BenchtrainError(f"completed steps must be non-negative, got {self.completed_steps}")


@dataclass
class Candidate:
    """One configuration the planner weighs, and what it predicts for it."""

    config: StepConfig  # the step it runs, at its max length (what the calibration predicts for)
    world_size: int
    optimizer_steps: int = 0  # the run's target (all of it, resumed or not)
    remaining_steps: int = 0  # what this command still runs: the estimate covers these
    micro_batches: int = 0
    step_seconds: float = 0.0  # training steps only, predicted
    comm_seconds_per_step: float = 0.0  # predicted collectives added to each optimizer step (the estimate)
    comm_seconds_per_step_low: float = 0.0  # …hidden behind backward as far as they can be
    comm_seconds_per_step_high: float = 0.0  # …none hidden
    overhead_seconds: float = 0.0  # build + warm-up + checkpoints + report, measured in bench
    total_seconds: float = 0.0
    total_seconds_low: float = 0.0
    total_seconds_high: float = 0.0
    total_seconds_promised: float = 0.0  # what the deadline is checked against (see Calibration.promised_bound)
    bound_fraction: float = 0.0  # the calibration's relative bound here (wider when extrapolating)
    eval_pass_seconds: float = 0.0  # one pass over the eval set, predicted
    eval_seconds: float = 0.0  # every evaluation of the run (part of overhead_seconds)
    overheads: Overheads | None = None  # the parts of overhead_seconds (train.planning.overheads)
    tokens: int = 0  # real tokens trained on
    padded_tokens: int = 0  # positions computed, padding included
    peak_memory_bytes: float | None = None
    peak_memory_bytes_high: float | None = None
    fits_in_memory: bool = True
    extrapolated: bool = False
    truncation: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def planned(cls, config: StepConfig, world_size: int) -> Candidate:
        """A candidate for `config` (its length the max length), its predictions still to fill in."""
        return cls(config=config, world_size=world_size)

    # The step's dimensions, as the plan and run.json name them (a plan's length is its max length).
    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def grad_accum(self) -> int:
        return self.config.grad_accum

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    @property
    def gradient_checkpointing(self) -> bool:
        return self.config.gradient_checkpointing

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds else 0.0

    def label(self) -> str:
        return self.config.phrase

    def to_json(self) -> dict[str, Any]:
        """run.json's and the plan's flat form: the step's columns (seq_len as max_length), then the predictions."""
        data = asdict(self)
        step = data.pop("config")
        columns = {"micro_batch_size": step["micro_batch_size"], "grad_accum": step["grad_accum"], "num_workers": step["num_workers"]}
        columns.update(max_length=step["seq_len"], world_size=data.pop("world_size"), gradient_checkpointing=step["gradient_checkpointing"])
        return {**columns, **data, "tokens_per_second": self.tokens_per_second}


@dataclass
class Plan:
    chosen: Candidate
    alternatives: list[Candidate]
    naive_seconds: float
    deadline: Deadline
    available_seconds: float
    meets_deadline: bool
    effective_batch: int
    packing: bool
    epochs: float
    priority: str
    step_limit: int | None
    bound_fraction: float
    notes: list[str]
    cost: float | None
    warnings: list[str] = field(default_factory=list)  # said out loud: the plan cannot keep a promise
    price_per_hour: float | None = None  # per device-hour; the cost counts one device per process

    @property
    def deadline_seconds(self) -> float:
        return self.deadline.deadline_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.to_json(),
            "alternatives": [candidate.to_json() for candidate in self.alternatives],
            "naive_seconds": self.naive_seconds,
            "deadline_seconds": self.deadline_seconds,
            "available_seconds": self.available_seconds,
            "meets_deadline": self.meets_deadline,
            "effective_batch": self.effective_batch,
            "packing": self.packing,
            "epochs": self.epochs,
            "priority": self.priority,
            "step_limit": self.step_limit,
            "bound_fraction": self.bound_fraction,
            "notes": self.notes,
            "warnings": self.warnings,
            "cost": self.cost,
            "price_per_hour": self.price_per_hour,
        }


def evaluate(
    calibration: Calibration,
    data: DataView,
    request: PlanRequest,
    config: StepConfig,
    cache: ShapeCache | None = None,
    eval_data: DataView | None = None,
) -> Candidate:
    candidate = Candidate.planned(config, request.world_size)
    micro, accum, length = config.micro_batch_size, config.grad_accum, config.seq_len
    epochs_whole = math.ceil(request.epochs)
    step_seconds = 0.0
    micro_batches = 0
    padded = 0
    steps = 0
    shapes: set[tuple[int, int]] = set()
    for epoch in range(epochs_whole):
        counts = shape_counts(data, request, micro, length, epoch, cache)
        shapes.update(counts)
        for (rows, batch_length), count in counts.items():
            step_seconds += count * calibration.micro_step_seconds(config.with_shape(rows, batch_length))
            padded += count * rows * batch_length * request.world_size
        batch_count = sum(counts.values())
        micro_batches += batch_count
        steps += math.ceil(batch_count / accum)
    compute_seconds = step_seconds
    floor_step, floor_micro = exposed_floor(request, compute_seconds / max(1, micro_batches))
    comm_low = steps * floor_step + micro_batches * floor_micro
    comm_high = steps * request.comm_seconds_per_step + micro_batches * request.comm_seconds_per_micro_step
    step_seconds += bracket_estimate(comm_low, comm_high)
    low, high = floor_step + accum * floor_micro, request.comm_seconds_per_step + accum * request.comm_seconds_per_micro_step
    candidate.comm_seconds_per_step_low, candidate.comm_seconds_per_step, candidate.comm_seconds_per_step_high = low, bracket_estimate(low, high), high
    # The work this command runs: up to --max-steps, less what a resumed run already did. Batches
    # are shuffled, so a share of the steps is that share of every batch shape.
    target = min(steps, request.max_steps) if request.max_steps is not None else steps
    remaining = target - request.completed_steps
    if remaining < 1:
        raise BenchtrainError(f"nothing left to run: the run already did {request.completed_steps} of its {target} optimizer steps")
    fraction_run = remaining / steps
    candidate.optimizer_steps = target
    candidate.remaining_steps = remaining
    candidate.micro_batches = round(micro_batches * fraction_run)
    candidate.step_seconds = step_seconds * fraction_run
    compute_seconds *= fraction_run
    comm_low, comm_high = comm_low * fraction_run, comm_high * fraction_run
    candidate.padded_tokens = round(padded * fraction_run)
    candidate.tokens = round(real_tokens(data, length) * request.epochs * fraction_run)
    candidate.overheads, eval_pass = candidate_overheads(calibration, request, candidate, shapes, eval_data)
    candidate.eval_pass_seconds, candidate.eval_seconds = eval_pass, candidate.overheads.evaluation_seconds
    candidate.overhead_seconds = candidate.overheads.total_seconds
    # Wider where the plan extrapolates past what bench measured (Calibration.relative_bound_for).
    bound = candidate.bound_fraction = calibration.relative_bound_for(config)
    candidate.total_seconds = candidate.step_seconds + candidate.overhead_seconds
    # Lengths from a sample: the steps' tokens are known within the sample's interval.
    sampled = 1 + request.data_uncertainty
    # The collectives are absolute seconds beside the calibration's compute: its bound does not widen them.
    # A translated calibration's bracket reaches further one way than the other (Calibration.bounds_for).
    lower = calibration.bounds_for(config)[0]
    candidate.total_seconds_low = compute_seconds / (1 + lower) / sampled + comm_low + candidate.overhead_seconds
    candidate.total_seconds_high = compute_seconds * (1 + bound) * sampled + comm_high + candidate.overhead_seconds
    promised = compute_seconds * (1 + calibration.promised_bound_for(config)) * sampled
    candidate.total_seconds_promised = promised + comm_high + candidate.overhead_seconds
    prediction = calibration.predict_for(config, request.memory_offset_bytes)
    candidate.peak_memory_bytes = prediction.peak_memory_bytes
    candidate.peak_memory_bytes_high = prediction.peak_memory_bytes_high
    candidate.fits_in_memory = prediction.fits_in_memory
    candidate.extrapolated = not prediction.within_measured_range
    if not data.packing:
        candidate.truncation = truncation(data.lengths, length)
    return candidate


def exposed_floor(request: PlanRequest, micro_seconds: float) -> tuple[float, float]:
    """The least the collectives of an optimizer step and of a micro-step can add: all of them, or
    (request.comm_overlap) what backward cannot hide (calibration.topology.overlap_bracket) —
    DDP's all-reduce behind its step's last micro-step, FSDP's collectives behind their own, at
    the run's mean micro-step."""
    if not request.comm_overlap:
        return request.comm_seconds_per_step, request.comm_seconds_per_micro_step
    return overlap_bracket(request.comm_seconds_per_step, micro_seconds)[0], overlap_bracket(request.comm_seconds_per_micro_step, micro_seconds)[0]


def candidate_overheads(
    calibration: Calibration, request: PlanRequest, candidate: Candidate, shapes: set[tuple[int, int]], eval_data: DataView | None
) -> tuple[Overheads, float]:
    """What the run spends besides its steps (evaluations, compiling its batch shapes, checkpoints,
    the export, the report), and one evaluation pass's seconds."""
    micro, length, checkpointing = candidate.micro_batch_size, candidate.max_length, candidate.gradient_checkpointing
    eval_pass, eval_count = 0.0, 0
    if eval_data is not None and request.eval_schedule is not None:
        eval_pass = eval_pass_seconds(calibration, eval_data, micro, length, request.seed)
        eval_count = request.eval_schedule.count(candidate.remaining_steps, candidate.step_seconds)
    compile_cost, compile_shapes = 0.0, 0
    if request.compiled:
        probed = {(row["micro_batch_size"], row["seq_len"]) for row in calibration.ok_rows() if bool(row.get("gradient_checkpointing")) == checkpointing}
        compile_cost, compile_shapes = compile_seconds(calibration.overheads, shapes, probed, calibration.training.get("compile_cache")), len(shapes)
    work = PlannedWork(eval_pass, eval_count, compile_cost, compile_shapes, request.export_bytes, request.data_prep_seconds, request.upload_seconds)
    overheads = plan_overheads(calibration.overheads, candidate.step_seconds, request.checkpoint_interval_seconds, request.with_report, work)
    return overheads, eval_pass


def naive_seconds(calibration: Calibration, data: DataView, epochs: float, candidate: Candidate) -> float:
    """What people do today: samples × mean tokens / one throughput figure. Shown, never used."""
    mean_tokens = sum(data.lengths) / len(data.lengths)
    rows = [row for row in calibration.ok_rows()]
    best = max(row["tokens_per_second"] for row in rows) if rows else candidate.tokens_per_second
    return len(data.lengths) * mean_tokens * epochs / best


def sharded_view(calibration: Calibration, gradient_shards: int) -> Calibration:
    """The calibration as an FSDP process of `gradient_shards` planned from one process sees it:
    a view whose memory model accumulates that process's shard of the gradients."""
    if gradient_shards <= 1 or calibration.memory is None:
        return calibration
    memory = calibration.memory.with_gradient_shards(gradient_shards)
    view = copy.copy(calibration)
    view.memory = memory
    return view


def make_plan(calibration: Calibration, data: DataView, request: PlanRequest, eval_data: DataView | None = None) -> Plan:
    calibration = sharded_view(calibration, request.gradient_shards)
    # Samples per step (packed data: rows at the longest calibrated length), a quarter of them at most.
    units = data.stream_length // max(1, calibration.measured_values("seq_len")[-1]) if data.packing else len(data.lengths)
    effective_batch = request.effective_batch or min(DEFAULT_EFFECTIVE_BATCH, max(1, units // 4))
    warnings = noise_warnings(calibration)
    if eval_data is not None and calibration.eval_batch_seconds(1, 1) is None:
        warnings.append(f"calibration {calibration.id} did not measure evaluation: its time is not in the estimate; re-run `bench run` to measure it")
    if request.configuration is not None:
        # Resuming: the interrupted run's configuration (same batches, same data order), estimated anew.
        fixed = request.configuration
        lengths, notes = [fixed.seq_len], list[str]()
        options = [(fixed.micro_batch_size, fixed.grad_accum, fixed.num_workers, fixed.gradient_checkpointing)]
    else:
        lengths, notes, length_warnings = choose_lengths(calibration, data, request)
        warnings += length_warnings
        pairs = batch_sizes_for(calibration, effective_batch, request.world_size)
        if not pairs:
            raise BenchtrainError(
                f"no calibrated micro batch size divides --effective-batch {effective_batch} "
                f"(calibrated: {calibration.measured_values('micro_batch_size')}, world size {request.world_size})"
            )
        workers = [request.num_workers] if request.num_workers is not None else calibration.measured_values("num_workers")
        modes = checkpointing_modes(calibration, request.gradient_checkpointing)
        options = [(micro, accum, worker_count, mode) for micro, accum in pairs for worker_count in workers for mode in modes]
    for length in lengths:
        check_trainable_tokens(data, length, request)
    cache: ShapeCache = {}
    configs = [
        StepConfig(micro_batch_size=micro, num_workers=workers, grad_accum=accum, seq_len=length, gradient_checkpointing=mode)
        for length in lengths
        for micro, accum, workers, mode in options
    ]
    candidates = [evaluate(calibration, data, request, config, cache, eval_data) for config in configs]
    feasible = [c for c in candidates if c.fits_in_memory or request.configuration is not None]
    if not feasible:
        raise DoesNotFitError("no configuration fits in memory according to the calibration: try a shorter --max-length or a smaller --effective-batch")
    ranked = rank(feasible, request.priority, calibration.memory_limit_bytes)
    chosen = ranked[0]
    available = request.deadline.seconds_left(request.elapsed_seconds)
    step_limit = request.max_steps
    alternatives = ranked[1:4]
    if chosen.total_seconds_promised > available and request.fit_deadline:

        def limited(candidate: Candidate, max_steps: int) -> Candidate:
            return evaluate(calibration, data, replace(request, max_steps=max_steps), candidate.config, cache, eval_data)

        chosen, step_limit = shrink_to_deadline(chosen, available, limited)
        notes.append(
            f"--fit-deadline: limited to {step_limit:,} of {ranked[0].optimizer_steps:,} optimizer steps so the run ends in time "
            f"(their own overheads: {format_duration(chosen.overhead_seconds)})"
        )
        alternatives = shortened_alternatives(ranked[1:], available, limited)
    notes.extend(filter(None, [memory_basis_note(calibration)]))  # what the peak memory stands on (GPU)
    notes.extend(filter(None, [slices_plan_note(calibration.data)]))  # measured on layer slices: what it rests on
    meets = chosen.total_seconds_promised <= available
    warning = error_decides_deadline(chosen, available)
    if warning:
        warnings.append(warning)
    cost = run_cost(chosen.total_seconds, request.price_per_hour, request.world_size)
    return Plan(
        chosen=chosen,
        alternatives=alternatives,
        naive_seconds=naive_seconds(calibration, data, request.epochs, chosen),
        deadline=request.deadline,
        available_seconds=available,
        meets_deadline=meets,
        effective_batch=effective_batch,
        packing=data.packing,
        epochs=request.epochs,
        priority=request.priority,
        step_limit=step_limit,
        bound_fraction=chosen.bound_fraction,
        notes=notes,
        cost=cost,
        warnings=warnings,
        price_per_hour=request.price_per_hour,
    )


def deadline_options(plan: Plan, resuming: bool = False) -> str:
    """What the user can do when nothing fits: fewer epochs, a step limit, a shorter length (a
    resumed run keeps its epochs and max length: only the steps can change)."""
    chosen = plan.chosen
    promised_steps = chosen.total_seconds_promised - chosen.overhead_seconds
    per_epoch = promised_steps / plan.epochs
    room = plan.available_seconds - chosen.overhead_seconds
    options = []
    if per_epoch > 0 and room > 0:
        if not resuming:
            options.append(f"--epochs {max(0.01, math.floor(room / per_epoch * 100) / 100):g}")
        per_step = promised_steps / max(1, chosen.remaining_steps)
        done = chosen.optimizer_steps - chosen.remaining_steps
        options.append(f"--max-steps {done + max(1, math.floor(room / per_step))}")
    options.append("a later --deadline" if resuming else "a shorter --max-length")
    options.append("--fit-deadline to cut the steps automatically")
    return ", ".join(options)
