"""One variant (one --quantize × --optimizer value, calibration.setup.Variant) measured: described
before anything is built, its probes planned and budget settled, the model built, then the probes,
the timings after them and the fit, run by every process as rank 0 decides (bench.probe_tasks).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil

from benchtrain.bench.calibrate import BenchRun, BenchTask, after_probes_seconds, calibrate, nothing_fitted, plan_probes
from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.fresh_process import measure_in_fresh_processes
from benchtrain.bench.outlook import expected_error, minimum_from_scratch, outlook, refuse_if_too_small, settle_budget
from benchtrain.bench.probe import Workload, machine_load
from benchtrain.bench.probe_tasks import checkpoint_task, probe_coordinator
from benchtrain.bench.runner import Budget, OptunaStudy, study_name
from benchtrain.bench.space import SearchSpace, Shape, default_space, within_positions
from benchtrain.bench.step_split import record_step_split
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration.hardware import Hardware
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.heap import frozen_heap
from benchtrain.common.home import benchtrain_home, writable_subdir
from benchtrain.common.json_types import JsonDict
from benchtrain.common.progress import Bar
from benchtrain.train.planning.memory_check import check_fits
from benchtrain.train.planning.planner import lengths_to_measure
from benchtrain.train.step.engine import StepOptions, process_layout
from benchtrain.train.step.hardware import detect_hardware, detect_software, device_label, requested_mismatch
from benchtrain.train.step.loss import PLAIN_HEAD_MODEL_TYPES
from benchtrain.train.step.peak_memory import HOST_BASELINE_KEY, resident_bytes_before_model
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.model import ModelSpec, model_record
from benchtrain.train.workload.prepare import DataSpec, prepare_data
from benchtrain.train.workload.tokenizer import load_tokenizer
from benchtrain.train.workload.tokens import TokenizedData

if TYPE_CHECKING:
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.planning.memory_check import MemoryNeed
    from benchtrain.train.workload.method import MethodConfig

# (probes, budget seconds or None): a progress bar for the probes (tqdm-like: update, close), or None.
ProgressBar = Callable[[int, float | None], Bar | None]


@dataclass(frozen=True)
class BenchRequest:
    """What `bench run` was asked to measure, its options parsed."""

    options: StepOptions
    # the grid's lists given, by axis (the device's defaults for the others)
    space_asked: dict[str, tuple[int, ...]] = field(default_factory=dict)
    requested_device: str | None = None  # --gpu
    data: DataSpec | None = None  # --data and its format options (None: synthetic tokens)
    tokenizer: str | None = None  # for --data (None: the model folder's, or the byte tokenizer)
    search: str = "grid"  # grid | optuna
    trials: int | None = None  # optuna's probes (None: a third of the space)
    max_probe_seconds: float | None = None  # seconds each probe may time steps (None: from the budget)


@dataclass
class Carry:
    """What one layer slice's bench leaves the next in the same process (bench.layer_slices)."""

    shapes: set[Shape] = field(default_factory=set)  # (rows, length, switches on) compiled so far
    one_off: bool = False  # this depth makes the one-off timings (checkpoint write, compile cache): the last one
    compile_seconds: float | None = None  # a new shape's compilation, as the earlier depths measured it

    def prepare(self, task: BenchTask, planner: ProbePlanner) -> BenchTask:
        """This depth's task (one-off timings only at the last depth); its planner learns the shapes already compiled."""
        planner.seen_shapes |= self.shapes
        if self.compile_seconds is not None:
            planner.cost.compile_prior_seconds = self.compile_seconds
        return replace(task, one_off_timings=self.one_off)

    def seed(self, seen: set[Shape]) -> None:
        """A workload's (or a simulated device's) shapes run: the compiled ones added."""
        seen |= self.shapes

    def done(self, planner: ProbePlanner) -> None:
        self.shapes |= planner.seen_shapes
        if planner.cost.compiled:
            self.compile_seconds = planner.cost.first_step_extra(new_shape=True)


def measure_variant(
    request: BenchRequest,
    spec: ModelSpec,
    method: MethodConfig,
    budget_asked: float | str | None,
    progress: ProgressBar,
    carry: Carry | None = None,
) -> JsonDict | None:
    """One variant's probes and fit (rank 0's record; None on the other processes). `carry`: a layer
    slice after others in this process (`Carry`: shapes compiled, timings made)."""
    started = time.monotonic()
    task, need, tokenized = describe_task(request, spec, method, budget_asked)
    planner, prices = plan_probes(task, spec, method, need, request.options, scratch=writable_subdir("scratch"))
    task = replace(task, prices=prices)
    if carry is not None:
        task = carry.prepare(task, planner)
    # What the budget buys, within seconds, before the model is built; refused if too small.
    budget_seconds = settle_budget(
        planner,
        budget_asked,
        time.monotonic() - started,
        after_probes_seconds(task, planner),
        say,
        lambda probes: expected_error(task.hardware["name"], spec.fingerprint, probes),
    )
    workload, task = build_workload(request, task, spec, tokenized, method)
    if carry is not None:
        carry.seed(workload.seen_shapes)
    coordinator = probe_coordinator(workload, task.hardware.get("peak_bf16_flops"))
    # The libraries and the model frozen for the collector: each probe's collections walk only
    # what the probes made (common.heap).
    with frozen_heap():
        if not coordinator.leads:
            coordinator.follow()  # rank 0 decides every probe; this process runs each with it
            return None
        try:
            return measure(
                BenchRun(task, coordinator, planner, Budget(budget_seconds, started), keep_rows=True),
                workload,
                progress,
            )
        finally:
            coordinator.finish()
            workload.release()  # the next variant builds its own model
            if carry is not None:
                carry.done(planner)


def describe_task(
    request: BenchRequest, spec: ModelSpec, method: MethodConfig, budget_asked: float | str | None
) -> tuple[BenchTask, MemoryNeed, TokenizedData | None]:
    """What to measure, on what, before anything is built: (the BenchTask, the memory need, the
    tokenized --data or None). A model too big for the device is one line here."""
    hardware = detect_hardware()
    layout = process_layout(request.options, method)
    world_size, sharding = layout.world_size, layout.sharding
    need = check_fits(spec, method, Hardware.from_record(hardware), sharding, world_size)
    warnings: list[str] = []
    mismatch = requested_mismatch(request.requested_device, hardware)
    if mismatch:
        warnings.append(mismatch)
        say(f"warning: {mismatch}")
    space = default_space(hardware["device_type"], hardware["memory_bytes"]).with_axes(**request.space_asked)
    space = within_positions(space, spec.max_positions, asked="seq_lens" in request.space_asked)
    space, tokenized, data_record = measured_data(request, spec, space)
    settings = ProbeSettings.for_device(hardware["device_type"])
    if request.max_probe_seconds:
        settings = replace(settings, max_seconds=request.max_probe_seconds)
    elif isinstance(budget_asked, (int, float)):
        settings = settings.for_budget(budget_asked)
    task = BenchTask(
        space=space,
        settings=settings,
        hardware=hardware,
        software=detect_software(),
        model={},
        training={},
        device_label=device_label(hardware),
        requested_device=request.requested_device,
        data=data_record,
        warnings=tuple(warnings),
        search=request.search,
        trials=request.trials or max(4, space.size // 3),
        sharding=sharding,
        world_size=world_size,
        load_before=machine_load(),
        budget_auto=budget_asked == "auto",
    )
    return task, need, tokenized


def measured_data(
    request: BenchRequest, spec: ModelSpec, space: SearchSpace
) -> tuple[SearchSpace, TokenizedData | None, JsonDict | None]:
    """With --data: its tokens, its record, and (unless --seq-lens) the lengths train will plan for it."""
    if request.data is None:
        return space, None, None

    # The cache's exact tokens when train (or an earlier bench) made them, else a sample: the
    # probes read a few batches of real tokens, and the lengths to measure are its quantiles.
    prepared = prepare_data(request.data, load_tokenizer(spec.directory, request.tokenizer), say)
    view = prepared.view
    tokenized = view if isinstance(view, TokenizedData) else view.sample  # isinstance: prepared.exact, as mypy reads it
    data_record = {
        "source": request.data.path,
        "format": view.format,
        "profile": {**length_profile(view.lengths), "sampled": not prepared.exact},
    }
    if "seq_lens" not in request.space_asked:  # the lengths train will plan for this data
        space = space.with_axes(seq_lens=lengths_to_measure(view, space.axis("seq_lens"), spec.max_positions))
    return space, tokenized, data_record


def build_workload(
    request: BenchRequest, task: BenchTask, spec: ModelSpec, tokenized: TokenizedData | None, method: MethodConfig
) -> tuple[Workload, BenchTask]:
    """The model, step and DataLoader the probes run (train's own), and the task as building them completes it."""
    say(f"building {spec.name} on {task.hardware['name']} …")
    # imports and setup: what a fresh process pays before its build
    started_seconds = max(0.0, time.time() - psutil.Process().create_time())

    # train.step.peak_memory.host_excess_bytes
    task = replace(task, hardware={**task.hardware, HOST_BASELINE_KEY: resident_bytes_before_model()})
    workload = Workload(spec, tokenized, method, request.options)
    model = model_record(spec, workload.shape)
    study = None
    if request.search == "optuna":
        data = request.data.path if request.data is not None else None
        study = OptunaStudy(
            benchtrain_home() / "studies" / "bench.db",
            study_name(task.hardware, model, task.space, data, method.describe()),
        )
    task = replace(
        task,
        model=model,
        training={**workload.training, "flops_terms": workload.shape.flops_terms(method.is_lora)},
        compiled=workload.engine.setup.compiled,
        losses=losses_to_compare(request.options.loss, workload),
        checkpoint_payload=lambda max_bytes: checkpoint_task(workload, writable_subdir("scratch"), max_bytes),
        study=study,
        fresh_processes=fresh_processes(workload, request, task),
        fresh_process_seconds=started_seconds + workload.build_seconds,
    )
    say(
        f"training {method.describe()}: {workload.training['trainable_parameters']:,} of {workload.training['total_parameters']:,} parameters trainable"
    )
    return workload, task


def fresh_processes(
    workload: Workload, request: BenchRequest, task: BenchTask
) -> Callable[[list[StepConfig], float], list[JsonDict]] | None:
    """On a CPU and in one process: the check in fresh processes (bench.fresh_process), freeing this
    process's model first. On a GPU the bench holds the device (and a 7B model builds for minutes):
    plans there take the spread between processes from runs. BENCHTRAIN_FRESH_PROCESSES=0 turns it off."""
    if (
        task.hardware.get("device_type") != "cpu"
        or task.world_size > 1
        or os.environ.get("BENCHTRAIN_FRESH_PROCESSES") == "0"
    ):
        return None

    def check(configs: list[StepConfig], timeout_seconds: float) -> list[JsonDict]:
        options = replace(request.options, loss=workload.engine.setup.loss)
        workload.release()
        return measure_in_fresh_processes(
            workload.spec, workload.method, options, configs, task.settings, timeout_seconds
        )

    return check


def losses_to_compare(asked: str, workload: Workload) -> tuple[str, ...]:
    """`--loss auto` on an architecture whose head the fused losses support: the one auto picked and the plain-torch ones."""
    if asked != "auto" or workload.spec.config_dict.get("model_type") not in PLAIN_HEAD_MODEL_TYPES:
        return ()
    return tuple(dict.fromkeys((workload.engine.setup.loss, "chunked", "plain")))


def measure(run: BenchRun, workload: Workload, progress: ProgressBar) -> JsonDict:
    """Rank 0: the probes within the budget and the fit, as a calibration record."""
    task, planner, budget = run.task, run.planner, run.budget
    budget_seconds = budget.seconds
    # The build is measured now: a budget it left too small for a minimum is refused here.
    refuse_if_too_small(outlook(planner, budget_seconds, budget.elapsed(), after_probes_seconds(task, planner)))
    before_probes = budget.elapsed()
    space = task.space
    total = space.size if task.search == "grid" else min(task.trials, space.size)
    say(
        f"probing up to {total} of {space.size} configurations ({task.search})"
        + (f" within {format_duration(budget_seconds)}" if budget_seconds else "")
    )
    bar = progress(total, budget_seconds)
    try:
        record, result = calibrate(run, workload.build_seconds, bar)
    finally:
        if bar is not None:
            bar.close()
    if record["fit"] is None:
        raise nothing_fitted(
            record, budget_seconds, minimum_from_scratch(planner, before_probes, after_probes_seconds(task, planner))
        )

    # what a translation to another GPU scales (calibration.translate)
    record["step_split"] = record_step_split(run, record, workload)
    record["left_out_configs"] = result.left_out  # for the summary; not stored
    return record
