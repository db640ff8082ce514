"""Choose the configuration that finishes before the deadline, from measured throughput.

Every number here comes from the calibration (step-time model, its held-out error, measured
model-build / warm-up / checkpoint / report seconds) or from the data (real tokens per batch:
padding to each batch's longest sample, or packing). The naive `samples × mean tokens /
throughput` estimate is computed for comparison only.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from calibration.model import Calibration
from calibration.step_config import StepConfig
from common.durations import format_duration
from common.errors import BenchtrainError, DeadlineError, DoesNotFitError
from train.planning.deadline import DeadlineBudget
from train.planning.overheads import Overheads, plan_overheads
from train.planning.prices import run_cost
from train.step.compile import compile_seconds
from train.step.evaluation import EvalSchedule
from train.workload.batching import (
    DataView,
    batch_shapes,
    epoch_share,
    packed_epoch_shape_counts,
    packed_row_count,
    packed_shapes,
    padded_batch_count,
    padded_epoch_shape_counts,
    padded_shape_counts,
    real_tokens,
    run_batches,
)
from train.workload.data import covering_length, truncation

PRIORITIES = ("fast", "balanced", "quality", "memory_efficient")
# Share of samples each priority keeps whole (1 - the share it may truncate).
COVERAGE = {"quality": 1.0}
DEFAULT_COVERAGE = 0.995
# A length chosen beyond the calibrated ones is rounded up to a multiple of this.
LENGTH_GRANULE = 64
MIN_MEASURED_LENGTH = 16  # bench's shortest length when halving towards short data
BALANCED_MEMORY_HEADROOM = 0.80  # balanced keeps predicted peak under 80% of device memory
MEMORY_EFFICIENT_SLACK = 0.10  # memory_efficient accepts up to 10% more time than the fastest
DEFAULT_EFFECTIVE_BATCH = 16
# A max length that leaves less than this share of the trainable tokens is refused, not planned.
MIN_TRAINABLE_SHARE = 0.01


@dataclass(frozen=True)
class PlanRequest:
    epochs: float
    deadline_seconds: float
    elapsed_seconds: float = 0.0  # already spent by this command (loading, tokenizing)
    priority: str = "balanced"
    effective_batch: int | None = None
    max_length: int | str | None = "auto"
    world_size: int = 1
    num_workers: int | None = None
    margin_fraction: float = 0.05
    checkpoint_interval_seconds: float = 600.0
    price_per_hour: float | None = None
    max_steps: int | None = None
    fit_deadline: bool = False
    seed: int = 0
    max_positions: int | None = None  # the model's position table: no length beyond it
    completed_steps: int = 0  # --resume: optimizer steps the interrupted run already did
    # --resume: the interrupted run's micro_batch_size, grad_accum, num_workers, max_length, gradient_checkpointing.
    configuration: dict[str, int] | None = None
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
    # Bytes of final/ (and final-base/, final-merged/): their write time is planned and kept in reserve.
    export_bytes: int = 0
    # A step time predicted for another world size than the calibration measured (train.recipes.compare):
    # the upper bound (and what the deadline is checked against) widens by the largest error such
    # predictions showed (docs/benchmarks.md, "Multi-process").
    prediction_error: float = 0.0
    # Tokenizing the data before training (a cold cache), predicted at the rate measured on the
    # sample (train.workload.prepare): an overhead of the run.
    data_prep_seconds: float = 0.0
    # The relative 95% half-width of the token total when lengths come from a sample: the bounds widen by it.
    data_uncertainty: float = 0.0

    @property
    def budget(self) -> DeadlineBudget:
        return DeadlineBudget.with_margin_share(self.deadline_seconds, self.margin_fraction)

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
    comm_seconds_per_step: float = 0.0  # predicted all-reduce added to each optimizer step
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
    budget: DeadlineBudget
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
        return self.budget.deadline_seconds

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


def choose_lengths(calibration: Calibration, data: DataView, request: PlanRequest) -> tuple[list[int], list[str], list[str]]:
    """Candidate max lengths, notes, and warnings. Padded data honours the priority's truncation
    limit on the real token profile: the smallest calibrated length that covers it, else a longer
    one (extrapolated, and said so); only the model's position table can stop that, loudly."""
    calibrated = calibration.measured_values("seq_len")
    notes: list[str] = []
    warnings: list[str] = []
    coverage = COVERAGE.get(request.priority, DEFAULT_COVERAGE)
    if isinstance(request.max_length, int):
        if request.max_length < 1:
            raise BenchtrainError(f"--max-length must be positive or auto, got {request.max_length}")
        if not calibrated or request.max_length > calibrated[-1] or request.max_length < calibrated[0]:
            measure = f"`bench run --seq-lens {calibrated[-1]},{request.max_length}` measures it" if calibrated else "`bench run` measures it"
            notes.append(f"max length {request.max_length} is outside the calibrated lengths {calibrated}: the estimate extrapolates; {measure}")
        if not data.packing:
            cut = truncation(data.lengths, request.max_length)
            if cut["share_truncated"] > 1 - coverage + 1e-12:
                warnings.append(
                    f"--max-length {request.max_length} truncates {cut['share_truncated']:.1%} of samples, more than {request.priority} allows "
                    f"({1 - coverage:.1%}); --max-length auto keeps them"
                )
        return [request.max_length], notes, warnings
    if data.packing:
        # Packing truncates nothing: every calibrated length is a candidate; quality takes the longest.
        return ([calibrated[-1]] if request.priority == "quality" else calibrated), notes, warnings
    needed = covering_length(data.lengths, coverage)
    covering = [length for length in calibrated if length >= needed]
    if covering:
        return [covering[0]], notes, warnings
    limit = request.max_positions or math.inf
    length = min(-(-needed // LENGTH_GRANULE) * LENGTH_GRANULE, limit)
    if length >= needed:
        notes.append(
            f"max length {length} covers {coverage:.1%} of samples ({needed} tokens) but is longer than any calibrated length "
            f"({calibrated[-1]}): the estimate extrapolates; `bench run --seq-lens {calibrated[-1]},{length}` measures it"
        )
        return [int(length)], notes, warnings
    cut = truncation(data.lengths, int(length))
    warnings.append(
        f"the model accepts at most {int(limit)} tokens, so {cut['share_truncated']:.1%} of samples are truncated "
        f"({request.priority} allows {1 - coverage:.1%}; {coverage:.1%} of samples need {needed})"
    )
    return [int(length)], notes, warnings


def lengths_to_measure(data: DataView, defaults: tuple[int, ...], max_positions: int) -> tuple[int, ...]:
    """The sequence lengths `bench run --data` measures. Padded data: the lengths the planner will
    choose for it (what covers each priority's share of samples, rounded up to LENGTH_GRANULE: a
    longest sample of 1481 tokens gives 1536) and, below them, the longest default lengths (halves
    of the shortest for short data), as many lengths in all as the default grid has, so that the
    fit still sees a spread. Packed data fills any length, so it keeps the defaults."""
    if data.packing:
        return defaults
    coverages = {*COVERAGE.values(), DEFAULT_COVERAGE}
    needed = sorted({min(-(-covering_length(data.lengths, share) // LENGTH_GRANULE) * LENGTH_GRANULE, max_positions) for share in coverages})
    room = max(0, len(defaults) - len(needed))
    shorter = [length for length in defaults if length < needed[0]][-room:] if room else []
    while len(shorter) < room and (shorter or needed)[0] // 2 >= MIN_MEASURED_LENGTH:
        shorter.insert(0, (shorter or needed)[0] // 2)
    return tuple(sorted({*shorter, *needed}))


def check_trainable_tokens(data: DataView, max_length: int, request: PlanRequest) -> None:
    """Refuse a max length that truncates (nearly) every trainable token away: a run that computes
    loss on nothing would train nothing and still exit 0."""
    if data.packing:
        return  # packing truncates nothing
    whole = real_tokens(data, max(data.lengths))
    kept = real_tokens(data, max_length)
    if whole and kept >= MIN_TRAINABLE_SHARE * whole:
        return
    what = f"--max-length {max_length}" if isinstance(request.max_length, int) else f"max length {max_length} (the model's limit)"
    cut = truncation(data.lengths, max_length)
    needed = min(covering_length(data.lengths, DEFAULT_COVERAGE), request.max_positions or math.inf)
    keeps = real_tokens(data, int(needed)) / whole if whole else 0.0
    raise BenchtrainError(
        f"{what} leaves {kept:,} of {whole:,} trainable tokens ({kept / whole if whole else 0:.1%}; the loss is on {data.loss_on}): "
        f"{cut['share_truncated']:.1%} of samples are truncated; --max-length {int(needed)} keeps {keeps:.1%} of them"
    )


def batch_sizes_for(calibration: Calibration, effective_batch: int, world_size: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs that keep samples per optimizer step = effective_batch."""
    calibrated = calibration.measured_values("micro_batch_size")
    pairs = []
    for micro in range(1, calibrated[-1] + 1):
        per_step = micro * world_size
        if effective_batch % per_step == 0 and micro >= calibrated[0]:
            pairs.append((micro, effective_batch // per_step))
    return pairs


ShapeCache = dict[tuple[int, int, int], Counter]


def shape_counts(data: DataView, request: PlanRequest, micro: int, length: int, epoch: int, cache: ShapeCache | None) -> Counter:
    """How many micro-batches of each (rows, length) one process runs in `epoch` (cached: the
    batches do not depend on accumulation or workers)."""
    key = (micro, length, epoch)
    if cache is not None and key in cache:
        return cache[key]
    if request.world_size == 1:
        # One process: the shapes straight from the batch layout, without building the batches.
        if data.packing:
            rows = packed_row_count(data.stream_length, length)
            counts = Counter(packed_epoch_shape_counts(rows, micro, length, epoch_share(-(-rows // micro), epoch, request.epochs)))
        else:
            total = padded_batch_count(len(data.lengths), micro)
            taken = epoch_share(total, epoch, request.epochs)
            counts = Counter(padded_epoch_shape_counts(data.lengths, micro, length, request.seed, epoch, taken, request.shape_bucket))
        if cache is not None:
            cache[key] = counts
        return counts
    # Each process runs every world_size-th batch (rank 0 stands for all of them).
    batches = run_batches(data, micro, length, request.seed, epoch, request.epochs, request.world_size)
    if data.packing:
        counts = Counter((shape.rows, shape.length) for shape in packed_shapes(batches, length))
    else:
        counts = Counter(padded_shape_counts(data.lengths, batches, length, request.shape_bucket))
    if cache is not None:
        cache[key] = counts
    return counts


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
    step_seconds += steps * request.comm_seconds_per_step + micro_batches * request.comm_seconds_per_micro_step
    candidate.comm_seconds_per_step = request.comm_seconds_per_step + accum * request.comm_seconds_per_micro_step
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
    candidate.total_seconds_low = candidate.step_seconds / (1 + bound) / sampled + candidate.overhead_seconds
    widened = (1 + request.prediction_error) * sampled
    candidate.total_seconds_high = candidate.step_seconds * (1 + bound) * widened + candidate.overhead_seconds
    candidate.total_seconds_promised = candidate.step_seconds * (1 + calibration.promised_bound_for(config)) * widened + candidate.overhead_seconds
    prediction = calibration.predict_for(config, request.memory_offset_bytes)
    candidate.peak_memory_bytes = prediction.peak_memory_bytes
    candidate.peak_memory_bytes_high = prediction.peak_memory_bytes_high
    candidate.fits_in_memory = prediction.fits_in_memory
    candidate.extrapolated = not prediction.within_measured_range
    if not data.packing:
        candidate.truncation = truncation(data.lengths, length)
    return candidate


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
    overheads = plan_overheads(
        calibration.overheads,
        candidate.step_seconds,
        request.checkpoint_interval_seconds,
        request.with_report,
        eval_pass,
        eval_count,
        compile_cost,
        compile_shapes,
        request.export_bytes,
        request.data_prep_seconds,
    )
    return overheads, eval_pass


def eval_pass_seconds(calibration: Calibration, eval_data: DataView, micro: int, length: int, seed: int) -> float:
    """One pass over the eval set's fixed batches, from bench's forward-only eval measurements."""
    from train.step.evaluation import eval_batches

    total = 0.0
    for shape in batch_shapes(eval_data, eval_batches(eval_data, micro, length, seed), length):
        seconds = calibration.eval_batch_seconds(shape.rows, shape.length)
        if seconds is None:
            return 0.0
        total += seconds
    return total


def naive_seconds(calibration: Calibration, data: DataView, epochs: float, candidate: Candidate) -> float:
    """What people do today: samples × mean tokens / one throughput figure. Shown, never used."""
    mean_tokens = sum(data.lengths) / len(data.lengths)
    rows = [row for row in calibration.ok_rows()]
    best = max(row["tokens_per_second"] for row in rows) if rows else candidate.tokens_per_second
    return len(data.lengths) * mean_tokens * epochs / best


def make_plan(calibration: Calibration, data: DataView, request: PlanRequest, eval_data: DataView | None = None) -> Plan:
    # Samples per step (packed data: rows at the longest calibrated length), a quarter of them at most.
    units = data.stream_length // max(1, calibration.measured_values("seq_len")[-1]) if data.packing else len(data.lengths)
    effective_batch = request.effective_batch or min(DEFAULT_EFFECTIVE_BATCH, max(1, units // 4))
    warnings = noise_warnings(calibration)
    if eval_data is not None and calibration.eval_batch_seconds(1, 1) is None:
        warnings.append(f"calibration {calibration.id} did not measure evaluation: its time is not in the estimate; re-run `bench run` to measure it")
    if request.configuration is not None:
        # Resuming: the interrupted run's configuration (same batches, same data order), estimated anew.
        fixed = request.configuration
        lengths, notes = [fixed["max_length"]], list[str]()
        options = [(fixed["micro_batch_size"], fixed["grad_accum"], fixed["num_workers"], bool(fixed.get("gradient_checkpointing", False)))]
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
    available = request.budget.seconds_left(request.elapsed_seconds)
    step_limit = request.max_steps
    alternatives = ranked[1:4]
    if chosen.total_seconds_promised > available and request.fit_deadline:
        chosen, step_limit = shrink_to_deadline(calibration, data, request, chosen, available, eval_data, cache)
        notes.append(
            f"--fit-deadline: limited to {step_limit:,} of {ranked[0].optimizer_steps:,} optimizer steps so the run ends in time "
            f"(their own overheads: {format_duration(chosen.overhead_seconds)})"
        )
        alternatives = shortened_alternatives(calibration, data, request, ranked[1:], available, eval_data, cache)
    meets = chosen.total_seconds_promised <= available
    warning = error_decides_deadline(chosen, available)
    if warning:
        warnings.append(warning)
    cost = run_cost(chosen.total_seconds, request.price_per_hour, request.world_size)
    return Plan(
        chosen=chosen,
        alternatives=alternatives,
        naive_seconds=naive_seconds(calibration, data, request.epochs, chosen),
        budget=request.budget,
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


EXTRAPOLATION_ADVICE = "the plan extrapolates past what bench measured; `bench run --data PATH` measures the lengths this data needs"


def error_decides_deadline(chosen: Candidate, available: float) -> str | None:
    """Said when the calibration's error is what decides the deadline: the central estimate fits
    and its upper bound does not (refused, or promised on the central estimate when too noisy)."""
    if not chosen.total_seconds <= available < chosen.total_seconds_high:
        return None
    return (
        f"the calibration's error decides this deadline: the estimate {format_duration(chosen.total_seconds)} fits the "
        f"{format_duration(available)} usable, its upper bound {format_duration(chosen.total_seconds_high)} (±{chosen.bound_fraction:.0%}) "
        + (f"does not; {EXTRAPOLATION_ADVICE}" if chosen.extrapolated else "does not; a longer `bench run --budget` narrows it")
    )


def shortened_alternatives(
    calibration: Calibration,
    data: DataView,
    request: PlanRequest,
    ranked: list[Candidate],
    available: float,
    eval_data: DataView | None,
    cache: ShapeCache,
    shown: int = 3,
) -> list[Candidate]:
    """With --fit-deadline, the alternatives as they would run: each cut to the steps that fit
    (those of which not one step fits are left out)."""
    alternatives: list[Candidate] = []
    for candidate in ranked:
        if len(alternatives) == shown:
            break
        if candidate.total_seconds_promised > available:
            try:
                candidate = shrink_to_deadline(calibration, data, request, candidate, available, eval_data, cache)[0]
            except DeadlineError:
                continue
        alternatives.append(candidate)
    return alternatives


def checkpointing_modes(calibration: Calibration, requested: str) -> list[bool]:
    """Gradient checkpointing modes to plan with: those the calibration measured, as asked."""
    measured = [bool(value) for value in calibration.measured_values("gradient_checkpointing")]
    wanted = {"auto": measured, "on": [True], "off": [False]}[requested]
    modes = [mode for mode in wanted if mode in measured]
    if not modes:
        raise BenchtrainError(
            f"--gradient-checkpointing {requested}: calibration {calibration.id} did not measure it; "
            f"run `bench run --checkpointing off,on`, or use --gradient-checkpointing auto"
        )
    return modes


def noise_warnings(calibration: Calibration) -> list[str]:
    """What the calibration's own error says about this plan, out loud."""
    warnings = []
    noise = calibration.data.get("noise") or {}
    if noise.get("message"):
        warnings.append(f"calibration {calibration.id}: {noise['message']}")
    if calibration.too_noisy_to_bound:
        warnings.append(
            f"the calibration's 90th-percentile error ({calibration.relative_bound:.0%}) is too large to promise a finish time: the deadline "
            "is checked against the central estimate, not an upper bound; the deadline guard still stops the run in time if it is slower"
        )
    return warnings


def rank(candidates: list[Candidate], priority: str, memory_limit: float) -> list[Candidate]:
    by_time = sorted(candidates, key=lambda c: (c.total_seconds, c.extrapolated, c.micro_batch_size))
    if priority in ("fast", "quality"):
        return by_time
    if priority == "balanced":
        roomy = [c for c in by_time if (c.peak_memory_bytes_high or 0) <= BALANCED_MEMORY_HEADROOM * memory_limit]
        return roomy + [c for c in by_time if c not in roomy]
    fastest = by_time[0].total_seconds
    near = [c for c in by_time if c.total_seconds <= fastest * (1 + MEMORY_EFFICIENT_SLACK)]
    near.sort(key=lambda c: (c.peak_memory_bytes or 0, c.total_seconds))
    return near + [c for c in by_time if c not in near]


def shrink_to_deadline(
    calibration: Calibration,
    data: DataView,
    request: PlanRequest,
    chosen: Candidate,
    available: float,
    eval_data: DataView | None = None,
    cache: ShapeCache | None = None,
) -> tuple[Candidate, int]:
    """The same configuration with as many steps as fit: each count planned as the run it would be
    (its own checkpoints, evaluations and export, not the whole plan's), the largest whose promised
    total fits found by bisection (the total grows with the steps). Counted after the steps a
    resumed run already did, so the limit is the run's total."""

    def limited(steps: int) -> Candidate:
        return evaluate(calibration, data, replace(request, max_steps=request.completed_steps + steps), chosen.config, cache, eval_data)

    fits, low, high = None, 0, chosen.remaining_steps - 1  # all the steps do not fit
    while low < high:
        middle = (low + high + 1) // 2
        candidate = limited(middle)
        if candidate.total_seconds_promised <= available:
            fits, low = candidate, middle
        else:
            high = middle - 1
    if fits is None:
        one = limited(1)
        if one.total_seconds_promised > available:
            wide = f" (its bound ±{one.bound_fraction:.0%}: {EXTRAPOLATION_ADVICE})" if one.extrapolated else ""
            raise DeadlineError(
                f"--fit-deadline: not even one optimizer step fits before the deadline: one step ({chosen.label()}) "
                f"needs up to {format_duration(one.total_seconds_promised)} with its overheads{wide}, {format_duration(max(0.0, available))} are left"
            )
        fits, low = one, 1
    return fits, request.completed_steps + low


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
