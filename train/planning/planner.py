"""Choose the configuration that finishes before the deadline, from measured throughput.

Every number here comes from the calibration (step-time model, its held-out error, measured
model-build / warm-up / checkpoint / report seconds) or from the data (real tokens per batch:
padding to each batch's longest sample, or packing). The naive `samples × mean tokens /
throughput` estimate is computed for comparison only.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from calibration.model import Calibration
from calibration.slices import slices_plan_note
from calibration.step_config import StepConfig
from calibration.topology import bracket_estimate, overlap_bracket
from common.durations import format_duration
from common.errors import BenchtrainError, DoesNotFitError
from train.planning.calibrated import batch_sizes_for, noise_warnings, switch_modes
from train.planning.fit_deadline import error_decides_deadline, shortened_alternatives, shrink_to_deadline
from train.planning.lengths import check_trainable_tokens, choose_lengths
from train.planning.memory_check import memory_basis_note
from train.planning.overheads import Overheads, PlannedWork, plan_overheads
from train.planning.prices import run_cost
from train.planning.priorities import rank
from train.planning.shapes import ShapeCache, eval_pass_seconds, shape_counts
from train.planning.types import Candidate, Plan, PlanRequest
from train.step.compile import compile_seconds
from train.workload.batching import BatchShape, DataView
from train.workload.data import truncation

DEFAULT_EFFECTIVE_BATCH = 16


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
    shapes: set[BatchShape] = set()
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
    candidate.tokens = round(data.real_tokens(length) * request.epochs * fraction_run)
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
    prediction = calibration.predict(config, request.memory_offset_bytes)
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
    calibration: Calibration, request: PlanRequest, candidate: Candidate, shapes: set[BatchShape], eval_data: DataView | None
) -> tuple[Overheads, float]:
    """What the run spends besides its steps (evaluations, compiling its batch shapes, checkpoints,
    the export, the report), and one evaluation pass's seconds."""
    micro, length = candidate.config.micro_batch_size, candidate.config.seq_len
    eval_pass, eval_count = 0.0, 0
    if eval_data is not None and request.eval_schedule is not None:
        eval_pass = eval_pass_seconds(calibration, eval_data, micro, length, request.seed)
        eval_count = request.eval_schedule.count(candidate.remaining_steps, candidate.step_seconds)
    compile_cost, compile_shapes = 0.0, 0
    if request.compiled:
        rows = [row for row in calibration.ok_rows() if StepConfig.from_row(row).switches == candidate.config.switches]
        probed = {BatchShape(row["micro_batch_size"], row["seq_len"]) for row in rows}
        compile_cost, compile_shapes = compile_seconds(calibration.overheads, shapes, probed, calibration.training.get("compile_cache")), len(shapes)
    work = PlannedWork(eval_pass, eval_count, compile_cost, compile_shapes, request.export_bytes, request.data_prep_seconds, request.upload_seconds)
    overheads = plan_overheads(calibration.overheads, candidate.step_seconds, request.checkpoint_interval_seconds, request.with_report, work)
    return overheads, eval_pass


def naive_seconds(calibration: Calibration, data: DataView, epochs: float, candidate: Candidate) -> float:
    """What people do today: samples × mean tokens / one throughput figure. Shown, never used."""
    mean_tokens: float = sum(data.lengths) / len(data.lengths)  # lengths may be a numpy array: its sum is untyped
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
        options = [fixed]
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
        modes = switch_modes(calibration, request.switches)
        options = [StepConfig(micro, worker_count, accum, 0, mode) for micro, accum in pairs for worker_count in workers for mode in modes]
    for length in lengths:
        check_trainable_tokens(data, length, request)
    cache: ShapeCache = {}
    configs = [option.with_shape(option.micro_batch_size, length) for length in lengths for option in options]
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
