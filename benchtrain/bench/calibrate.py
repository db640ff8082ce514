"""From a built workload to a calibration record, every second inside the budget; the rows so far kept
on disk after every probe (`KeptRows`). Why: docs/design.md#bench-calibrate
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, MemoryPrior, device_speed
from benchtrain.bench.disk_write import MAX_WRITE_BYTES, disk_bandwidth
from benchtrain.bench.fresh_process import CHILD_TIMEOUT, COMPILE_STEPS, check_configs, check_price
from benchtrain.bench.probe import EVAL_STEPS, error_text
from benchtrain.bench.probe_tasks import probe_timeout_seconds
from benchtrain.bench.record import fit_record, fragmentation_warning
from benchtrain.bench.runner import BenchResult, Budget, OptunaStudy, run_grid, run_optuna
from benchtrain.bench.space import SearchSpace, mode_words
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration.dimensions import DIMENSIONS
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT, fit_eval
from benchtrain.calibration.schema import SCHEMA_VERSION
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import UNFINISHED_KEY, keep_unfinished, list_unfinished, new_id, save_failed
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import EXIT_INTERNAL, BenchtrainError, MeasurementError
from benchtrain.common.json_types import JsonDict
from benchtrain.common.pause import pause_at
from benchtrain.common.progress import Bar
from benchtrain.train.planning.comm import world
from benchtrain.train.planning.memory_check import compute_bytes, meta_model
from benchtrain.train.step.compile import compile_cache_record, compile_enabled
from benchtrain.train.workload.model import model_shape

if TYPE_CHECKING:
    from benchtrain.train.planning.memory_check import MemoryNeed
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import ModelSpec

# What a checkpoint holds per trainable parameter: its fp32 weight and AdamW's two moments.
CHECKPOINT_BYTES_PER_TRAINABLE = 12


@dataclass(frozen=True)
class AfterProbePrices:
    """What prices the work after the probes (evaluation, the checkpoint write), from `plan_probes`."""

    forward_share: float = 1 / 3  # forward FLOPs ÷ training FLOPs per token (prices evaluation)
    checkpoint_bytes: int = 0  # what a checkpoint holds (CHECKPOINT_BYTES_PER_TRAINABLE)
    disk_bytes_per_second: float | None = None  # the scratch folder's write speed (None: not timed)


@dataclass(frozen=True)
class BenchTask:
    """What this benchmark is, known before the first probe (completed with `dataclasses.replace`)."""

    space: SearchSpace
    settings: ProbeSettings
    hardware: JsonDict
    software: JsonDict
    model: JsonDict
    training: JsonDict
    device_label: str
    requested_device: str | None = None
    data: JsonDict | None = None
    warnings: tuple[str, ...] = ()  # known before the first probe (those found later go to the record)
    search: str = "grid"
    trials: int = 0
    study: OptunaStudy | None = None  # where --search optuna keeps its trials
    compiled: bool = False
    sharding: str = "ddp"
    world_size: int = 1
    prices: AfterProbePrices = AfterProbePrices()
    load_before: float | None = None
    budget_auto: bool = False
    losses: tuple[str, ...] = ()  # loss implementations to compare (`--loss auto`, a fusable head)
    # Rank 0's decision for the checkpoint timing (the same payload reaches every rank).
    checkpoint_payload: Callable[[int], JsonDict] = lambda max_bytes: {"max_bytes": max_bytes}
    one_off_timings: bool = True  # checkpoint write, compile cache: False at a layer slice but one (bench.layer_slices)
    # On a CPU, one process: the step measured again in fresh processes (bench.fresh_process), given
    # the configurations and the seconds they may take; None where that does not apply.
    fresh_processes: Callable[[list[StepConfig], float], list[JsonDict]] | None = None
    fresh_process_seconds: float = (
        0.0  # what one fresh process costs before its probes (measured: this one's start and build)
    )


class TaskRunner(Protocol):
    """What runs a named measurement task and returns its row: bench.probe_tasks.Coordinator, or a
    simulated device."""

    def run(self, task: str, payload: JsonDict) -> JsonDict: ...


@dataclass(frozen=True)
class BenchRun:
    """A benchmark under way: what it measures, the coordinator that runs each measurement
    (bench.probe_tasks, or a simulated device), the probe planner and the time left."""

    task: BenchTask
    coordinator: TaskRunner
    planner: ProbePlanner
    budget: Budget
    keep_rows: bool = False  # write the rows so far after every probe (KeptRows); not for simulations


@dataclass(frozen=True)
class LossComparison:
    """`--loss auto`'s comparison as the record keeps it (None: not compared), or the warning why not."""

    record: JsonDict | None = None
    warning: str | None = None


def after_probes_seconds(task: BenchTask, planner: ProbePlanner) -> float:
    """What the probes keep for the work after them: the two cheapest evaluation corners (a fit
    needs two), the checkpoint timing and the check in fresh processes. The compile-cache process
    runs only with what the probes leave (without it train prices a fresh compilation per shape)."""
    corners = evaluation_corners(planner)
    evaluation = sum(sorted(eval_price(task, planner, config) for config in corners)[:2])
    return evaluation + checkpoint_price(task) + fresh_processes_price(task, planner)


def fresh_processes_price(task: BenchTask, planner: ProbePlanner) -> float:
    """The check in fresh processes at the configurations it would choose now; reserved only once the probes have a minimum viable fit (which comes first)."""
    if task.fresh_processes is None or not planner.viable():
        return 0.0
    configs = check_configs(planner.ok_rows())
    if not configs:
        return 0.0
    return check_price(configs, task.fresh_process_seconds, planner.price)


def eval_price(task: BenchTask, planner: ProbePlanner, config: StepConfig) -> float:
    return (EVAL_STEPS + 1) * planner.cost.step_seconds_high(config) * task.prices.forward_share


def checkpoint_price(task: BenchTask) -> float:
    prices = task.prices
    if not prices.disk_bytes_per_second or not task.one_off_timings:
        return 0.0
    return min(prices.checkpoint_bytes, MAX_WRITE_BYTES) / prices.disk_bytes_per_second


def compile_cache_price(task: BenchTask, planner: ProbePlanner, build_seconds: float) -> float:
    """A fresh process: its build, one compilation (priced as uncached) and its steps at the smallest shape."""
    if not task.compiled:
        return 0.0
    smallest = min(planner.space.all_configs(), key=lambda c: c.micro_batch_size * c.seq_len)
    return (
        build_seconds
        + planner.cost.first_step_extra(new_shape=True)
        + COMPILE_STEPS * planner.cost.step_seconds_high(smallest)
    )


def evaluation_corners(planner: ProbePlanner) -> list[StepConfig]:
    """Where evaluation (forward only) is timed: the corners (batch, length) of what trained fine with checkpointing off, or of the grid before any probe."""
    ok = [row for row in planner.ok_rows() if not StepConfig.from_row(row).switches] or [
        c.to_row() for c in planner.space.all_configs()
    ]
    batches = sorted({row["micro_batch_size"] for row in ok})
    lengths = sorted({row["seq_len"] for row in ok})
    corners = sorted({(b, s) for b in (batches[0], batches[-1]) for s in (lengths[0], lengths[-1])})
    return [StepConfig(micro_batch_size=b, num_workers=0, grad_accum=1, seq_len=s) for b, s in corners]


def plan_probes(
    task: BenchTask,
    spec: ModelSpec,
    method: MethodConfig,
    need: MemoryNeed,
    options: StepOptions,
    scratch: Path | None = None,
) -> tuple[ProbePlanner, AfterProbePrices]:
    """The probe planner for this model on this device (FLOPs and exact parameter bytes from the
    `meta` device, the device's speed), and the prices of the work after the probes (the disk's
    speed timed when given a folder), which the caller puts in the task."""
    hardware = task.hardware
    shape = model_shape(meta_model(spec, method))
    lora = method.is_lora

    def flops_per_token(config: StepConfig) -> float:
        return shape.flops_per_token(config.seq_len, lora=lora, switches=config.switches)

    lengths = task.space.axis("seq_lens")
    middle = lengths[len(lengths) // 2]
    one_sequence = StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=middle)
    forward_share = shape.forward_flops_per_token(middle, lora) / flops_per_token(one_sequence)
    disk_bytes_per_second = disk_bandwidth(scratch) if scratch is not None else None
    prices = AfterProbePrices(
        forward_share, need.trainable_parameters * CHECKPOINT_BYTES_PER_TRAINABLE, disk_bytes_per_second
    )
    compiled = compile_enabled(options.compile, hardware["device_type"])
    cost = CostModel(flops_per_token, device_speed(hardware), task.settings, compiled=compiled)
    hidden = int(spec.config_dict.get("hidden_size") or spec.config_dict.get("n_embd") or shape.heads * shape.head_dim)
    memory = MemoryPrior(
        static_bytes=need.per_process_bytes(task.sharding, task.world_size, hardware["device_type"]),
        accumulated_gradient_bytes=need.gradient_bytes,
        layers=shape.layers,
        hidden=hidden,
        compute_bytes=compute_bytes(hardware["device_type"]),
    )
    limit = float(hardware["memory_bytes"]) if hardware["device_type"] == "cuda" else None
    return ProbePlanner(task.space, cost, memory, limit, host_cores=hardware.get("cpu_cores")), prices


def calibrate(run: BenchRun, build_seconds: float, progress: Bar | None = None) -> tuple[JsonDict, BenchResult]:
    """Probe, time what follows, and assemble the calibration record (fitted when it can be). With
    `run.keep_rows` the rows so far are on disk after every probe, and a failure says where."""
    kept = KeptRows(run.task) if run.keep_rows else None
    try:
        return measure_and_record(run, build_seconds, progress, kept)
    except Exception as error:
        if kept is None or kept.path is None:
            raise
        raise kept.stopped(error) from error


def probe_payload(run: BenchRun, config: StepConfig, remaining: float | None) -> JsonDict:
    """A probe task for the coordinator: the probe may spend `remaining` seconds (None: unbounded)."""
    settings = run.task.settings.with_limit(remaining, run.planner.cost.step_seconds_high(config))
    return {
        "config": config.to_row(),
        "settings": asdict(settings),
        "timeout_seconds": probe_timeout_seconds(run.planner.price(config)),
    }


def measure_and_record(
    run: BenchRun, build_seconds: float, progress: Bar | None, kept: KeptRows | None
) -> tuple[JsonDict, BenchResult]:
    task, coordinator, planner, budget = run.task, run.coordinator, run.planner, run.budget
    budget.reserved = lambda: after_probes_seconds(task, planner)
    losses = compare_losses(run)
    warnings = [*task.warnings, *([losses.warning] if losses.warning else [])]

    def probe(config: StepConfig, remaining: float | None) -> JsonDict:
        price, peak = planner.price(config), planner.predicted_peak(config)
        pause_at("bench")
        row = coordinator.run("probe", probe_payload(run, config, remaining))
        # What was predicted when the probe was chosen, beside what it measured.
        row["predicted"] = {
            "probe_seconds": round(price, 3),
            "peak_memory_bytes": None if peak is None else round(peak),
            "prices": planner.cost.source,
        }
        if kept is not None:
            kept.add(row)
        return row

    if task.search == "grid":
        result = run_grid(task.space, probe, budget, progress, planner=planner)
    else:
        assert task.study is not None
        result = run_optuna(task.space, probe, budget, task.trials, task.study, progress, planner=planner)
    budget.reserved = lambda: 0.0
    for mode in result.dropped_modes:
        warnings.append(
            f"{mode_words(mode)} was not measured: the budget could not pay for its first probe "
            "(a compilation) after the others; this calibration plans the other mode only (a larger --budget measures both)"
        )

    skipped: list[str] = []
    eval_rows = measure_evaluation(run, skipped)
    overheads: JsonDict = {
        "model_build_seconds": round(build_seconds, 4),
        **measure_checkpoint_write(run, skipped),
    }
    overheads.update(warmup_costs(result.rows, task.settings.warmup_steps, task.compiled))
    overheads["warmup_steps"] = task.settings.warmup_steps
    if task.world_size > 1:
        collectives = coordinator.run("comm", {})
    # The loss compared is the one every probe ran, and the one `train --loss auto` runs.
    training = {**task.training, **({"loss": losses.record["chosen"]} if losses.record else {})}
    if task.compiled:
        overheads.update(
            measure_compile_cache(run, build_seconds, result.rows, overheads["warmup_extra_seconds"], skipped)
        )
        training["compile_cache"] = compile_cache_record()
    fresh_rows = check_in_fresh_processes(run, result.rows, skipped)
    search = {
        "method": task.search,
        "space": task.space.as_dict(),
        "trials": task.trials if task.search == "optuna" else None,
        "budget_seconds": budget.seconds,
        "budget_auto": task.budget_auto,
        "settings": asdict(task.settings),
        "load_average_before": task.load_before,
        "prices": planner.cost.speed.source,
        "skipped_after_probes": skipped,
    }
    record = build_calibration(task, training, result, search, overheads, warnings, fresh_rows)
    if kept is not None:
        kept.name_in(record)  # storing the record (or keeping it as failed) removes the kept rows

    record["eval"] = {"measurements": eval_rows, "fit": fit_eval(eval_rows)}
    if losses.record is not None:
        record["loss_choice"] = losses.record
    if task.world_size > 1:
        # Every collective's (bytes, seconds) rows and latency + bandwidth fit (train.planning.comm);
        # `comm` is the all-reduce's, which predicts DDP at other world sizes.
        world_size, backend = world()
        all_reduce = collectives["all_reduce"]
        record["distributed"] = {
            "world_size": world_size,
            "backend": backend,
            "sharding": task.sharding,
            "all_reduce": all_reduce["measurements"],
            "comm": all_reduce["fit"],
            "collectives": collectives,
        }
    record["overheads"]["benchmark_seconds"] = round(budget.elapsed(), 2)
    return record, result


def build_calibration(
    task: BenchTask,
    training: JsonDict,
    result: BenchResult,
    search: JsonDict,
    overheads: dict[str, float],
    warnings: list[str],
    fresh_rows: list[JsonDict],
) -> JsonDict:
    """The record of what `task` measured (`training`: how the model was trained, the loss chosen included), fitted when enough probes succeeded."""
    created = datetime.now(timezone.utc)
    model = task.model
    record: JsonDict = {
        "schema_version": SCHEMA_VERSION,
        "id": new_id(task.device_label, model["name"], created),
        "created_at": created.isoformat(timespec="seconds"),
        "hardware": task.hardware,
        "software": task.software,
        "model": model,
        "training": training or {"method": "full", "lora": None, "trainable_parameters": model.get("parameter_count")},
        "requested_device": task.requested_device,
        "data": task.data,
        "search": {
            **search,
            "stopped_by_budget": result.stopped_by_budget,
            "left_out": result.left_out,
            "reused_rows": result.reused,
            "remeasured": result.remeasured,
            "drift": result.drift,
        },
        "overheads": overheads,
        "warnings": list(warnings),
        "measurements": result.rows,
        "fit": None,
        "history": [],
    }
    if sum(1 for row in result.rows if row["status"] == "ok") >= MIN_ROWS_FOR_FIT:
        fit_record(record, fresh_rows)
    fragmented = fragmentation_warning(result.rows)
    if fragmented:
        record["warnings"].append(fragmented)
    return record


# The loss whose logits would cost more than this share of the device's memory at the grid's
# largest micro-batch is not chosen for speed: memory decides there (what it is for).
LOSS_MEMORY_AT_STAKE = 0.10
# Step times closer than this are a tie, won by the loss that holds less memory.
LOSS_TIE = 0.02


def loss_comparison_config(planner: ProbePlanner) -> StepConfig | None:
    """Where the losses are compared: the cheapest configuration of the first accumulation, worker
    count and checkpointing mode (a loss's cost is per token: a small micro-batch tells them apart)."""
    space = planner.space
    pool = [
        c
        for c in planner.candidates()
        if c.grad_accum == space.axis("accums")[0]
        and c.num_workers == space.axis("workers")[0]
        and c.switches == space.modes()[0]
    ]
    return min(pool, key=lambda c: (planner.price(c), c)) if pool else None


def compare_losses(run: BenchRun) -> LossComparison:
    """`--loss auto`: each loss that applies, twice in alternation at one configuration, while the
    budget still pays for a minimum viable fit afterwards; every probe after it runs the one chosen."""
    task, coordinator, planner, budget = run.task, run.coordinator, run.planner, run.budget
    if len(task.losses) < 2:
        return LossComparison()
    config = loss_comparison_config(planner)
    if config is None:
        return LossComparison()
    price = 2 * len(task.losses) * planner.price(config)
    remaining = budget.remaining()
    if remaining is not None and (price > remaining or not planner.viable_within(remaining - price)):
        return LossComparison(
            warning=f"the losses ({', '.join(task.losses)}) were not compared: the budget could not pay for it; probes ran {task.training.get('loss')}"
        )
    rows = []
    for _ in range(2):
        for loss in task.losses:
            row = coordinator.run("loss_probe", {"loss": loss, **probe_payload(run, config, budget.remaining())})
            planner.cost.observe(row)
            rows.append({**row, "loss": loss})
    chosen, reason = choose_measured_loss(rows, task, planner)
    coordinator.run("set_loss", {"loss": chosen})
    return LossComparison({"config": config.to_row(), "measurements": rows, "chosen": chosen, "reason": reason})


def choose_measured_loss(rows: list[JsonDict], task: BenchTask, planner: ProbePlanner) -> tuple[str, str]:
    """The loss bench keeps, and why, in words: the fastest (ties to the leaner) whose extra logits
    memory, scaled to the grid's largest micro-batch, stays under LOSS_MEMORY_AT_STAKE of the device."""
    ok = {loss: [row for row in rows if row["loss"] == loss and row["status"] == "ok"] for loss in task.losses}
    measured = {loss: found for loss, found in ok.items() if found}
    if not measured:
        return str(task.training.get("loss")), "no loss probe succeeded; kept the default"
    step = {loss: statistics.median(row["step_seconds"] for row in found) for loss, found in measured.items()}
    peak = {loss: max(row["peak_memory_bytes"] for row in found) for loss, found in measured.items()}
    config = StepConfig.from_row(rows[0])
    largest = max(c.micro_batch_size * c.seq_len for c in planner.space.all_configs())
    leanest = min(peak.values())
    extra = {loss: (peak[loss] - leanest) / (config.micro_batch_size * config.seq_len) * largest for loss in measured}
    allowed = [
        loss for loss in measured if extra[loss] <= LOSS_MEMORY_AT_STAKE * float(task.hardware["memory_bytes"])
    ] or [min(peak, key=peak.__getitem__)]
    fastest = min(step[loss] for loss in allowed)
    near = [loss for loss in allowed if step[loss] <= fastest * (1 + LOSS_TIE)]
    chosen = min(near, key=lambda loss: (peak[loss], step[loss]))
    described = ", ".join(
        f"{loss} {step[loss] * 1000:.0f} ms/step, peak {peak[loss] / 2**20:,.0f} MiB" for loss in measured
    )
    rule = f"fastest within {LOSS_TIE:.0%} whose extra logits memory at the largest micro-batch stays under {LOSS_MEMORY_AT_STAKE:.0%} of the device"
    return chosen, f"{chosen}: {rule} ({described})"


def measure_evaluation(run: BenchRun, skipped: list[str]) -> list[JsonDict]:
    """The corners, cheapest first, while the budget pays (two at least, or none: a fit needs two)."""
    task, planner, budget = run.task, run.planner, run.budget
    corners = sorted(evaluation_corners(planner), key=lambda config: eval_price(task, planner, config))
    prices = [eval_price(task, planner, config) for config in corners]
    if len(corners) >= 2 and not budget.allows(prices[0] + prices[1]):
        skipped.append("evaluation probes: the budget could not pay for two")
        return []
    rows = []
    for config, price in zip(corners, prices, strict=True):
        if not budget.allows(price):
            skipped.append(f"evaluation probe B{config.micro_batch_size}/S{config.seq_len}: beyond the budget")
            continue
        rows.append(run.coordinator.run("eval", config.to_row()))
    return rows


def measure_checkpoint_write(run: BenchRun, skipped: list[str]) -> JsonDict:
    """A real checkpoint when it is small enough, else a bounded write extrapolated by bytes (the bound keeps it inside the budget)."""
    prices = run.task.prices
    if not run.task.one_off_timings:
        return {}
    left = run.budget.left()
    limit = MAX_WRITE_BYTES
    if left is not None and prices.disk_bytes_per_second:
        limit = int(max(0.0, left) * prices.disk_bytes_per_second / 2)
        if limit < min(MAX_WRITE_BYTES, prices.checkpoint_bytes):
            skipped.append(
                f"checkpoint timing: a write of {limit / 2**20:,.0f} MiB instead of {MAX_WRITE_BYTES / 2**20:,.0f} MiB (the budget left)"
            )
    return run.coordinator.run("checkpoint", run.task.checkpoint_payload(max(limit, 1 << 20)))


def measure_compile_cache(
    run: BenchRun, build_seconds: float, rows: list[JsonDict], warmup_extra: float, skipped: list[str]
) -> JsonDict:
    """What a later `train` process pays to compile from inductor's cache: a fresh process
    (bench.fresh_process) at the first probed shape, its first step less its steady one and the
    warm-up every run pays anyway (this process's model is freed first)."""
    ok = [row for row in rows if row["status"] == "ok"]
    if not ok or not run.task.one_off_timings:
        return {}
    if not run.budget.allows(compile_cache_price(run.task, run.planner, build_seconds)):
        skipped.append("compile-cache timing: beyond the budget (train prices a compilation per shape instead)")
        return {}
    shape = {
        key: value for key, value in ok[0].items() if key in DIMENSIONS and key not in ("num_workers", "grad_accum")
    }
    measured = run.coordinator.run("compile_cache", {"row": shape, "timeout_seconds": run.budget.left()})
    if not measured:
        return {}
    cached = max(0.0, measured["first_step_seconds"] - measured["step_seconds"] - warmup_extra)
    return {"compile_cached_seconds_per_shape": round(cached, 4)}


def check_in_fresh_processes(run: BenchRun, rows: list[JsonDict], skipped: list[str]) -> list[JsonDict]:
    """The check in fresh processes (bench.fresh_process), last: it releases this process's model."""
    task = run.task
    if task.fresh_processes is None:
        return []
    configs = check_configs(rows)
    if not configs:
        skipped.append("the check in fresh processes: no probe's steps were long enough to time well")
        return []
    measured = {
        StepConfig.from_row(row): float(row.get("probe_seconds") or 0.0) for row in rows if row["status"] == "ok"
    }
    if not run.budget.allows(
        check_price(configs, task.fresh_process_seconds, lambda config: measured.get(config, 0.0))
    ):
        skipped.append(
            "the check in fresh processes: beyond the budget (plans hold no spread between processes until runs measure it)"
        )
        return []
    return task.fresh_processes(configs, run.budget.left() or CHILD_TIMEOUT)


def warmup_costs(rows: list[JsonDict], warmup_steps: int, compiled: bool) -> dict[str, float]:
    """How much longer the first steps take than steady ones: `warmup_extra_seconds` (DataLoader
    start, allocator, kernel selection) from the probes that compiled nothing, and for a compiled
    step `compile_seconds_per_shape`, what the first probe of each new shape paid beyond that."""

    def extras(selected: list[JsonDict]) -> list[float]:
        return [
            max(0.0, row["warmup_seconds"] - int(row.get("warmup_steps") or warmup_steps) * row["step_seconds"])
            for row in selected
            if row.get("warmup_seconds") is not None
        ]

    ok = [row for row in rows if row["status"] == "ok"]
    if not compiled:
        found = extras(ok)
        return {"warmup_extra_seconds": statistics.median(found) if found else 0.0}
    repeated = extras([row for row in ok if not row.get("new_shape")])
    warmup = statistics.median(repeated) if repeated else 0.0
    new = extras([row for row in ok if row.get("new_shape")])
    compile_seconds = max(0.0, statistics.median(new) - warmup) if new else 0.0
    return {
        "warmup_extra_seconds": warmup,
        "compile_seconds_per_shape": compile_seconds,
        "compile_shapes_measured": len(new),
    }


def nothing_fitted(
    record: JsonDict, budget_seconds: float | None, needed_seconds: float | None = None
) -> MeasurementError:
    """Too few probes to fit: keep the measurements aside (never where `latest` would pick them) and say what a fit needs."""
    rows = record["measurements"]
    ok = sum(1 for row in rows if row["status"] == "ok")
    kept = save_failed(record)
    took = format_duration(record["overheads"]["benchmark_seconds"])
    if budget_seconds and needed_seconds and needed_seconds > budget_seconds:
        needed = format_duration(needed_seconds)
        advice = f"at the prices measured, a minimum calibration needs ≈ {needed}: use --budget {format_duration(math.ceil(needed_seconds))}"
    elif budget_seconds:
        advice = "raise --budget or narrow the grid (--batch-sizes, --seq-lens)"
    else:
        advice = "widen the grid or check the failed probes"
    return MeasurementError(
        f"only {ok} of {len(rows)} probes succeeded in {took}; a fit needs at least {MIN_ROWS_FOR_FIT}: {advice}. "
        f"Nothing was stored as a calibration; the measurements are in {kept}"
    )


WHAT_IT_IS = "the measurements of a bench that had not finished: not a calibration (no fit); `bench run` measures again"


class BenchStopped(BenchtrainError):
    """A bench that failed after some probes: what failed, and where the rows measured are."""

    exit_code = EXIT_INTERNAL


class KeptRows:
    """Rank 0's measurements so far, rewritten whole (atomically) after every probe."""

    # This process's files (one per setup of `bench run --quantize/--optimizer …`): not earlier benches'.
    written_here: ClassVar[set[Path]] = set()

    def __init__(self, task: BenchTask, started: datetime | None = None) -> None:
        started = started or datetime.now(timezone.utc)
        self.path: Path | None = None
        self.rows: list[JsonDict] = []
        self.head = {
            "id": new_id(task.device_label, task.model.get("name", "model"), started),
            "created_at": started.isoformat(timespec="seconds"),
            "unfinished": WHAT_IT_IS,
            "hardware": task.hardware,
            "software": task.software,
            "model": task.model,
            "training": task.training,
            "requested_device": task.requested_device,
            "data": task.data,
            "processes": {"world_size": task.world_size, "sharding": task.sharding},
            "search": {"method": task.search, "space": task.space.as_dict()},
        }

    def add(self, row: JsonDict) -> None:
        self.rows.append(row)
        first = self.path is None
        self.path = keep_unfinished({**self.head, "measurements": self.rows}, self.path)
        if first:
            KeptRows.written_here.add(self.path)
            others = [path for path, _, _ in list_unfinished() if path not in KeptRows.written_here]
            earlier = (
                f"; earlier benches that did not finish left theirs in {', '.join(map(str, others))}" if others else ""
            )
            say(f"measurements so far are kept in {self.path} until the calibration is stored{earlier}")

    def name_in(self, record: JsonDict) -> None:
        """Let `record` name the file, which storing it (or keeping it as failed) removes."""
        if self.path is not None:
            record[UNFINISHED_KEY] = str(self.path)

    def stopped(self, error: BaseException) -> BenchStopped:
        """What to raise (from `error`, which --debug shows) for a bench that failed with `error`
        after some rows were kept: one line that says where they are."""
        ok = sum(1 for row in self.rows if row.get("status") == "ok")
        stopped = BenchStopped(
            f"the bench stopped after {len(self.rows)} probes ({ok} ok), on {error_text(error)}; "
            f"the measurements so far are kept in {self.path} (not a calibration; `bench list` names it)"
        )
        stopped.exit_code = getattr(error, "exit_code", EXIT_INTERNAL)  # a problem the user can fix keeps its code
        return stopped
