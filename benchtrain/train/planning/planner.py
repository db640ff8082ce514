"""Choose the configuration that finishes before the deadline, from measured throughput: the
candidates, their lengths, each priced shape by shape, ranked by priority, cut to the deadline.
The model and why: docs/design.md#planner."""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.slices import slices_plan_note
from benchtrain.calibration.step_config import Mode, StepConfig
from benchtrain.calibration.topology import bracket_estimate, overlap_bracket
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError, DeadlineError, DoesNotFitError
from benchtrain.train.planning.memory_check import memory_basis_note
from benchtrain.train.planning.prices import run_cost
from benchtrain.train.planning.types import Candidate, Overheads, Plan, PlanRequest
from benchtrain.train.step.compile import compile_seconds
from benchtrain.train.step.evaluation import eval_batches
from benchtrain.train.workload.batching import (
    BatchLayout,
    BatchShape,
    DataView,
    batch_shape_counts,
    batch_shapes,
    epoch_share,
    packed_epoch_shape_counts,
    packed_row_count,
    padded_batch_count,
    padded_epoch_shape_counts,
    run_batches,
)
from benchtrain.train.workload.data import covering_length, truncation

DEFAULT_EFFECTIVE_BATCH = 16
BALANCED_MEMORY_HEADROOM = 0.80  # balanced keeps predicted peak under 80% of device memory
MEMORY_EFFICIENT_SLACK = 0.10  # memory_efficient accepts up to 10% more time than the fastest
ALTERNATIVES_SHOWN = 3
EXTRAPOLATION_ADVICE = (
    "the plan extrapolates past what bench measured; `bench run --data PATH` measures the lengths this data needs"
)

# Share of samples each priority keeps whole (1 - the share it may truncate).
COVERAGE = {"quality": 1.0}
DEFAULT_COVERAGE = 0.995
# A length chosen beyond the calibrated ones is rounded up to a multiple of this.
LENGTH_GRANULE = 64
MIN_MEASURED_LENGTH = 16  # bench's shortest length when halving towards short data
# A max length that leaves less than this share of the trainable tokens is refused, not planned.
MIN_TRAINABLE_SHARE = 0.01

ShapeCache = dict[tuple[int, int, int], Counter[BatchShape]]


def batch_sizes_for(calibration: Calibration, effective_batch: int, world_size: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs that keep samples per optimizer step = effective_batch."""
    calibrated = calibration.measured_values("micro_batch_size")
    micros = [
        micro for micro in range(calibrated[0], calibrated[-1] + 1) if effective_batch % (micro * world_size) == 0
    ]
    return [(micro, effective_batch // (micro * world_size)) for micro in micros]


def switch_modes(calibration: Calibration, requested: Mapping[str, str]) -> list[Mode]:
    """The combinations of switches (calibration.dimensions) to plan with: each switch's values the
    calibration measured, as asked (auto, on or off; absent: auto)."""
    choices = []
    for dimension in switches():
        measured = [bool(value) for value in calibration.measured_values(dimension.name)] or [False]
        asked = requested.get(dimension.name, "auto")
        values = [value for value in {"auto": measured, "on": [True], "off": [False]}[asked] if value in measured]
        if not values:
            raise BenchtrainError(
                f"{dimension.plan_flag} {asked}: calibration {calibration.id} did not measure it; "
                f"run `bench run {dimension.flag} off,on`, or use {dimension.plan_flag} auto"
            )
        choices.append([(dimension.name,) if value else () for value in values])
    return [sum(combo, ()) for combo in itertools.product(*choices)]


def choose_lengths(
    calibration: Calibration, data: DataView, request: PlanRequest
) -> tuple[list[int], list[str], list[str]]:
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
            measure = (
                f"`bench run --seq-lens {calibrated[-1]},{request.max_length}` measures it"
                if calibrated
                else "`bench run` measures it"
            )
            notes.append(
                f"max length {request.max_length} is outside the calibrated lengths {calibrated}: the estimate extrapolates; {measure}"
            )
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
    """The sequence lengths `bench run --data` measures: those the planner will choose for this data, and shorter ones for a spread (docs/design.md#planner)."""
    if data.packing:
        return defaults
    coverages = {*COVERAGE.values(), DEFAULT_COVERAGE}
    needed = sorted(
        {
            min(-(-covering_length(data.lengths, share) // LENGTH_GRANULE) * LENGTH_GRANULE, max_positions)
            for share in coverages
        }
    )
    room = max(0, len(defaults) - len(needed))
    shorter = [length for length in defaults if length < needed[0]][-room:] if room else []
    while len(shorter) < room and (shorter or needed)[0] // 2 >= MIN_MEASURED_LENGTH:
        shorter.insert(0, (shorter or needed)[0] // 2)
    return tuple(sorted({*shorter, *needed}))


def check_trainable_tokens(data: DataView, max_length: int, request: PlanRequest) -> None:
    """Refuse a max length that truncates (nearly) every trainable token away: a run that computes loss on nothing would train nothing and still exit 0."""
    if data.packing:
        return  # packing truncates nothing
    whole = data.real_tokens(max(data.lengths))
    kept = data.real_tokens(max_length)
    if whole and kept >= MIN_TRAINABLE_SHARE * whole:
        return
    what = (
        f"--max-length {max_length}"
        if isinstance(request.max_length, int)
        else f"max length {max_length} (the model's limit)"
    )
    cut = truncation(data.lengths, max_length)
    needed = min(covering_length(data.lengths, DEFAULT_COVERAGE), request.max_positions or math.inf)
    keeps = data.real_tokens(int(needed)) / whole if whole else 0.0
    raise BenchtrainError(
        f"{what} leaves {kept:,} of {whole:,} trainable tokens ({kept / whole if whole else 0:.1%}; the loss is on {data.loss_on}): "
        f"{cut['share_truncated']:.1%} of samples are truncated; --max-length {int(needed)} keeps {keeps:.1%} of them"
    )


def noise_warnings(calibration: Calibration) -> list[str]:
    """What the calibration's own error says about this plan, out loud."""
    message = calibration.noise_message
    warnings = [f"calibration {calibration.id}: {message}"] if message else []
    if calibration.too_noisy_to_bound:
        warnings.append(
            f"the calibration's 90th-percentile error ({calibration.relative_bound:.0%}) is too large to promise a finish time: the deadline "
            "is checked against the central estimate, not an upper bound; the deadline guard still stops the run in time if it is slower"
        )
    return warnings


def shape_counts(
    data: DataView, request: PlanRequest, micro: int, length: int, epoch: int, cache: ShapeCache
) -> Counter[BatchShape]:
    """How many micro-batches of each (rows, length) one process runs in `epoch`: the calibration
    prices each shape. Cached: the batches do not depend on accumulation or workers."""
    key = (micro, length, epoch)
    if key in cache:
        return cache[key]
    if not request.length_grouping and not data.packing:
        # A Trainer's random batches: each process runs its 1/world_size of the samples in batches of `micro`, of
        # the same shapes as random batches of the whole set (a window of one batch groups nothing).
        per_process = padded_batch_count(-(-len(data.lengths) // request.world_size), micro)
        taken = epoch_share(per_process, epoch, request.epochs)
        counts = Counter(
            padded_epoch_shape_counts(
                data.lengths, micro, length, request.seed, epoch, taken, request.shape_bucket, window_batches=1
            )
        )
    elif request.world_size == 1:
        # One process: the shapes straight from the batch layout, without building the batches.
        if data.packing:
            rows = packed_row_count(data.stream_length, length)
            counts = Counter(
                packed_epoch_shape_counts(rows, micro, length, epoch_share(-(-rows // micro), epoch, request.epochs))
            )
        else:
            taken = epoch_share(padded_batch_count(len(data.lengths), micro), epoch, request.epochs)
            counts = Counter(
                padded_epoch_shape_counts(data.lengths, micro, length, request.seed, epoch, taken, request.shape_bucket)
            )
    else:
        # Each process runs every world_size-th batch (rank 0 stands for all of them).
        batches = run_batches(data, BatchLayout(micro, length, request.seed), epoch, request.epochs, request.world_size)
        counts = Counter(batch_shape_counts(data, batches, length, request.shape_bucket))
    cache[key] = counts
    return counts


def eval_pass_seconds(calibration: Calibration, eval_data: DataView, micro: int, length: int, seed: int) -> float:
    """One pass over the eval set's fixed batches, from bench's forward-only eval measurements (none: 0)."""
    shapes = batch_shapes(eval_data, eval_batches(eval_data, micro, length, seed), length)
    seconds = [calibration.eval_batch_seconds(shape.rows, shape.length) for shape in shapes]
    return 0.0 if None in seconds else sum(filter(None, seconds))


def evaluate(
    calibration: Calibration,
    data: DataView,
    request: PlanRequest,
    config: StepConfig,
    cache: ShapeCache | None = None,
    eval_data: DataView | None = None,
) -> Candidate:
    """`config` planned for `request`: its steps priced shape by shape, the overheads, the bounds, the peak memory."""
    micro, accum, length = config.micro_batch_size, config.grad_accum, config.seq_len
    step_seconds, micro_batches, padded, steps = 0.0, 0, 0, 0
    shapes: set[BatchShape] = set()
    for epoch in range(math.ceil(request.epochs)):
        counts = shape_counts(data, request, micro, length, epoch, {} if cache is None else cache)
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
    low, high = (
        floor_step + accum * floor_micro,
        request.comm_seconds_per_step + accum * request.comm_seconds_per_micro_step,
    )
    # The work this command runs: up to --max-steps, less what a resumed run already did. Batches
    # are shuffled, so a share of the steps is that share of every batch shape.
    target = min(steps, request.max_steps) if request.max_steps is not None else steps
    remaining = target - request.completed_steps
    # None left of a resumed run that did them all: what came after them (its evaluation, export, report) is planned.
    if remaining < 0 or (remaining == 0 and not request.completed_steps):
        raise BenchtrainError(
            f"nothing left to run: the run already did {request.completed_steps} of its {target} optimizer steps"
        )
    fraction_run = remaining / steps
    step_seconds, compute_seconds = step_seconds * fraction_run, compute_seconds * fraction_run
    comm_low, comm_high = comm_low * fraction_run, comm_high * fraction_run
    overheads = candidate_overheads(calibration, request, config, remaining, step_seconds, shapes, eval_data)
    spent = overheads.total_seconds
    # Wider where the plan extrapolates past what bench measured (Calibration.relative_bound_for).
    bound = calibration.relative_bound_for(config)
    # Lengths from a sample: the steps' tokens are known within the sample's interval.
    sampled = 1 + request.data_uncertainty
    # The collectives are absolute seconds beside the calibration's compute: its bound does not widen them.
    # A translated calibration's bracket reaches further one way than the other (Calibration.bounds_for).
    lower = calibration.bounds_for(config)[0]
    promised = compute_seconds * (1 + calibration.promised_bound_for(config)) * sampled
    prediction = calibration.predict(config, request.memory_offset_bytes)
    return Candidate(
        config,
        request.world_size,
        overheads,
        optimizer_steps=target,
        remaining_steps=remaining,
        micro_batches=round(micro_batches * fraction_run),
        step_seconds=step_seconds,
        comm_seconds_per_step=bracket_estimate(low, high),
        comm_seconds_per_step_low=low,
        comm_seconds_per_step_high=high,
        total_seconds=step_seconds + spent,
        total_seconds_low=compute_seconds / (1 + lower) / sampled + comm_low + spent,
        total_seconds_high=compute_seconds * (1 + bound) * sampled + comm_high + spent,
        total_seconds_promised=promised + comm_high + spent,
        bound_fraction=bound,
        tokens=round(data.real_tokens(length) * request.epochs * fraction_run),
        padded_tokens=round(padded * fraction_run),
        peak_memory_bytes=prediction.peak_memory_bytes,
        peak_memory_bytes_high=prediction.peak_memory_bytes_high,
        fits_in_memory=prediction.fits_in_memory,
        extrapolated=not prediction.within_measured_range,
        truncation={} if data.packing else truncation(data.lengths, length),
    )


def exposed_floor(request: PlanRequest, micro_seconds: float) -> tuple[float, float]:
    """The least the collectives of an optimizer step and of a micro-step can add: all of them, or
    (request.comm_overlap) what backward cannot hide (docs/design.md#communication)."""
    if not request.comm_overlap:
        return request.comm_seconds_per_step, request.comm_seconds_per_micro_step
    return overlap_bracket(request.comm_seconds_per_step, micro_seconds)[0], overlap_bracket(
        request.comm_seconds_per_micro_step, micro_seconds
    )[0]


def candidate_overheads(
    calibration: Calibration,
    request: PlanRequest,
    config: StepConfig,
    steps: int,
    step_seconds: float,
    shapes: set[BatchShape],
    eval_data: DataView | None,
) -> Overheads:
    """What a run of `steps` optimizer steps taking `step_seconds` spends besides them (evaluations,
    compiling its batch shapes, checkpoints, the export, the report), priced by bench's
    measurements; an export of unknown bytes (0) as one checkpoint save."""
    eval_pass, eval_count = 0.0, 0
    if eval_data is not None and request.eval_schedule is not None:
        eval_micro = request.eval_micro_batch_size or config.micro_batch_size
        eval_pass = eval_pass_seconds(calibration, eval_data, eval_micro, config.seq_len, request.seed)
        eval_count = request.eval_schedule.count(steps, step_seconds)
    compile_cost, compile_shapes = 0.0, 0
    if request.compiled:
        rows = [row for row in calibration.ok_rows() if StepConfig.from_row(row).switches == config.switches]
        probed = {BatchShape(row["micro_batch_size"], row["seq_len"]) for row in rows}
        compile_cost, compile_shapes = (
            compile_seconds(calibration.overheads, shapes, probed, calibration.training.compile_cache),
            len(shapes),
        )
    measured, interval = calibration.overheads, request.checkpoint_interval_seconds
    save = checkpoint_save_seconds(measured)
    return Overheads(
        model_build_seconds=float(measured.get("model_build_seconds", 0.0)),
        warmup_seconds=float(measured.get("warmup_extra_seconds", 0.0)),
        checkpoint_seconds=save,
        checkpoint_count=(
            steps // request.checkpoint_every_steps
            if request.checkpoint_every_steps
            else math.floor(step_seconds / interval)
            if interval > 0
            else 0
        )
        + 1,
        export_seconds=write_seconds(measured, request.export_bytes) if request.export_bytes else save,
        eval_pass_seconds=eval_pass,
        eval_count=eval_count,
        report_seconds=float(measured.get("report_seconds", 0.0)) if request.with_report else 0.0,
        compile_seconds=compile_cost,
        compile_shapes=compile_shapes,
        export_bytes=request.export_bytes,
        data_prep_seconds=request.data_prep_seconds,
        upload_seconds=request.upload_seconds,
    )


def checkpoint_save_seconds(measured: dict[str, float]) -> float:
    """One save: the checkpoint's bytes at the measured write bandwidth, or the timed save."""
    return write_seconds(measured, measured.get("checkpoint_bytes"))


def write_seconds(measured: dict[str, float], size_bytes: float | None) -> float:
    """Seconds to write `size_bytes` into the run folder: at bench's measured write bandwidth, or
    (older calibrations) the timed checkpoint save scaled by bytes, or that save itself."""
    bandwidth, timed = measured.get("disk_write_bytes_per_second"), float(measured.get("checkpoint_save_seconds", 0.0))
    if size_bytes and bandwidth:
        return float(size_bytes) / float(bandwidth)
    checkpoint = measured.get("checkpoint_bytes")
    if size_bytes and checkpoint:
        return timed * float(size_bytes) / float(checkpoint)
    return timed


def naive_seconds(calibration: Calibration, data: DataView, epochs: float, candidate: Candidate) -> float:
    """What people do today: samples × mean tokens / one throughput figure. Shown, never used."""
    mean_tokens: float = sum(data.lengths) / len(data.lengths)  # lengths may be a numpy array: its sum is untyped
    best = max((row["tokens_per_second"] for row in calibration.ok_rows()), default=candidate.tokens_per_second)
    return len(data.lengths) * mean_tokens * epochs / best


def rank(candidates: list[Candidate], priority: str, memory_limit: float) -> list[Candidate]:
    """The candidates in the order `priority` puts them: fast and quality by time alone, balanced
    keeping the predicted peak memory clear of the limit first, memory_efficient taking the
    smallest peak among those nearly as fast as the fastest."""
    by_time = sorted(candidates, key=lambda c: (c.total_seconds, c.extrapolated, c.config.micro_batch_size))
    if priority in ("fast", "quality"):
        return by_time
    if priority == "balanced":
        roomy = [c for c in by_time if (c.peak_memory_bytes_high or 0) <= BALANCED_MEMORY_HEADROOM * memory_limit]
        return roomy + [c for c in by_time if c not in roomy]
    fastest = by_time[0].total_seconds
    near = [c for c in by_time if c.total_seconds <= fastest * (1 + MEMORY_EFFICIENT_SLACK)]
    near.sort(key=lambda c: (c.peak_memory_bytes or 0, c.total_seconds))
    return near + [c for c in by_time if c not in near]


def make_plan(
    calibration: Calibration, data: DataView, request: PlanRequest, eval_data: DataView | None = None
) -> Plan:
    if request.gradient_shards > 1 and calibration.memory is not None:
        # An FSDP process of N planned from one process: its memory model accumulates its shard of the gradients.
        memory = calibration.memory.with_gradient_shards(request.gradient_shards)
        calibration = copy.copy(calibration)
        calibration.memory = memory
    # Samples per step (packed data: rows at the longest calibrated length), a quarter of them at most.
    units = (
        data.stream_length // max(1, calibration.measured_values("seq_len")[-1]) if data.packing else len(data.lengths)
    )
    effective_batch = request.effective_batch or min(DEFAULT_EFFECTIVE_BATCH, max(1, units // 4))
    warnings = noise_warnings(calibration)
    if eval_data is not None and calibration.eval_batch_seconds(1, 1) is None:
        warnings.append(
            f"calibration {calibration.id} did not measure evaluation: its time is not in the estimate; re-run `bench run` to measure it"
        )
    if request.configuration is not None:
        # Resuming: the interrupted run's configuration (same batches, same data order), estimated anew.
        lengths, notes, options = [request.configuration.seq_len], list[str](), [request.configuration]
    else:
        lengths, notes, length_warnings = choose_lengths(calibration, data, request)
        warnings += length_warnings
        pairs = batch_sizes_for(calibration, effective_batch, request.world_size)
        if not pairs:
            raise BenchtrainError(
                f"no calibrated micro batch size divides --effective-batch {effective_batch} "
                f"(calibrated: {calibration.measured_values('micro_batch_size')}, world size {request.world_size})"
            )
        workers = (
            [request.num_workers] if request.num_workers is not None else calibration.measured_values("num_workers")
        )
        modes = switch_modes(calibration, request.switches)
        options = [
            StepConfig(micro, worker_count, accum, 0, mode)
            for micro, accum in pairs
            for worker_count in workers
            for mode in modes
        ]
    for length in lengths:
        check_trainable_tokens(data, length, request)
    cache: ShapeCache = {}
    configs = [option.with_shape(option.micro_batch_size, length) for length in lengths for option in options]
    candidates = [evaluate(calibration, data, request, config, cache, eval_data) for config in configs]
    feasible = [c for c in candidates if c.fits_in_memory or request.configuration is not None]
    if not feasible:
        raise DoesNotFitError(
            "no configuration fits in memory according to the calibration: try a shorter --max-length or a smaller --effective-batch"
        )
    ranked = rank(feasible, request.priority, calibration.memory_limit_bytes)
    chosen = ranked[0]
    available = request.deadline.seconds_left(request.elapsed_seconds)
    step_limit = request.max_steps
    alternatives = ranked[1 : 1 + ALTERNATIVES_SHOWN]
    if chosen.total_seconds_promised > available and request.fit_deadline:

        def limited(candidate: Candidate, max_steps: int) -> Candidate:
            return evaluate(
                calibration, data, replace(request, max_steps=max_steps), candidate.config, cache, eval_data
            )

        chosen, step_limit = shrink_to_deadline(chosen, available, limited)
        notes.append(
            f"--fit-deadline: limited to {step_limit:,} of {ranked[0].optimizer_steps:,} optimizer steps so the run ends in time "
            f"(their own overheads: {format_duration(chosen.overheads.total_seconds)})"
        )
        alternatives = shortened_alternatives(ranked[1:], available, limited)
    # What the peak memory stands on (GPU), and what a calibration measured on layer slices rests on.
    notes += [note for note in (memory_basis_note(calibration), slices_plan_note(calibration.data)) if note]
    warnings += [warning for warning in [error_decides_deadline(chosen, available)] if warning]
    return Plan(
        request=request,
        chosen=chosen,
        alternatives=alternatives,
        naive_seconds=naive_seconds(calibration, data, request.epochs, chosen),
        available_seconds=available,
        meets_deadline=chosen.total_seconds_promised <= available,
        effective_batch=effective_batch,
        packing=data.packing,
        step_limit=step_limit,
        notes=notes,
        cost=run_cost(chosen.total_seconds, request.price_per_hour, request.world_size),
        warnings=warnings,
    )


def error_decides_deadline(chosen: Candidate, available: float) -> str | None:
    """Said when the calibration's error is what decides the deadline: the central estimate fits
    and its upper bound does not (refused, or promised on the central estimate when too noisy)."""
    if not chosen.total_seconds <= available < chosen.total_seconds_high:
        return None
    return (
        f"the calibration's error decides this deadline: the estimate {format_duration(chosen.total_seconds)} fits the "
        f"{format_duration(available)} usable, its upper bound {format_duration(chosen.total_seconds_high)} (±{chosen.bound_fraction:.0%}) "
        + (
            f"does not; {EXTRAPOLATION_ADVICE}"
            if chosen.extrapolated
            else "does not; a longer `bench run --budget` narrows it"
        )
    )


def shortened_alternatives(
    ranked: list[Candidate], available: float, limited: Callable[[Candidate, int], Candidate]
) -> list[Candidate]:
    """With --fit-deadline, the alternatives as they would run: each cut to the steps that fit (those of which not one step fits are left out)."""
    alternatives: list[Candidate] = []
    for candidate in ranked:
        if len(alternatives) == ALTERNATIVES_SHOWN:
            break
        if candidate.total_seconds_promised > available:
            try:
                candidate = shrink_to_deadline(candidate, available, limited)[0]
            except DeadlineError:
                continue
        alternatives.append(candidate)
    return alternatives


def shrink_to_deadline(
    chosen: Candidate, available: float, limited: Callable[[Candidate, int], Candidate]
) -> tuple[Candidate, int]:
    """The same configuration with as many optimizer steps as fit (each count planned by
    `limited(chosen, max_steps)`), and that step limit, a resumed run's steps included (docs/design.md#fit-deadline)."""
    done = chosen.optimizer_steps - chosen.remaining_steps  # what a resumed run already did
    fits, low, high = None, 0, chosen.remaining_steps - 1  # all the steps do not fit
    while low < high:
        middle = (low + high + 1) // 2
        candidate = limited(chosen, done + middle)
        if candidate.total_seconds_promised <= available:
            fits, low = candidate, middle
        else:
            high = middle - 1
    if fits is None:
        one = limited(chosen, done + 1)
        if one.total_seconds_promised > available:
            wide = f" (its bound ±{one.bound_fraction:.0%}: {EXTRAPOLATION_ADVICE})" if one.extrapolated else ""
            raise DeadlineError(
                f"--fit-deadline: not even one optimizer step fits before the deadline: one step ({chosen.config.phrase}) "
                f"needs up to {format_duration(one.total_seconds_promised)} with its overheads{wide}, {format_duration(max(0.0, available))} are left"
            )
        fits, low = one, 1
    return fits, done + low


@dataclass(frozen=True)
class DeadlineRoom:
    """What would fit a plan that misses its deadline: the epochs and the optimizer steps whose promised time,
    with the plan's overheads, ends before it (None: not even the overheads fit)."""

    epochs: float | None
    max_steps: int | None


def deadline_room(plan: Plan) -> DeadlineRoom:
    """The epochs and steps that fit before the deadline, at the plan's promised (upper) step time."""
    chosen = plan.chosen
    promised_steps = chosen.total_seconds_promised - chosen.overheads.total_seconds
    per_epoch = promised_steps / plan.request.epochs
    room = plan.available_seconds - chosen.overheads.total_seconds
    if not (per_epoch > 0 and room > 0):
        return DeadlineRoom(None, None)
    per_step = promised_steps / max(1, chosen.remaining_steps)
    done = chosen.optimizer_steps - chosen.remaining_steps
    return DeadlineRoom(max(0.01, math.floor(room / per_epoch * 100) / 100), done + max(1, math.floor(room / per_step)))


def deadline_options(plan: Plan, resuming: bool = False) -> str:
    """What the user can do when nothing fits: fewer epochs, a step limit, a shorter length (a
    resumed run keeps its epochs and max length: only the steps can change)."""
    room = deadline_room(plan)
    options = []
    if room.epochs is not None and not resuming:
        options.append(f"--epochs {room.epochs:g}")
    if room.max_steps is not None:
        options.append(f"--max-steps {room.max_steps}")
    options.append("a later --deadline" if resuming else "a shorter --max-length")
    options.append("--fit-deadline to cut the steps automatically")
    return ", ".join(options)
