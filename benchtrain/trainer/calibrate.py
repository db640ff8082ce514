"""`benchtrain.calibrate(trainer, budget="3m")`: the user's own Trainer step measured over per-device batch ×
accumulation × DataLoader workers × gradient checkpointing × the lengths their data holds (cut where their trainer
truncates), with `bench run`'s probe planner, budget, prices, drift handling, held-out error and fits
(bench.calibrate), stored as a calibration marked as their Trainer's step (calibration.training.TrainerStep). Every
process of a job measures; rank 0 stores; every process returns the stored calibration; the Trainer is left as found
(trainer.as_found). Why: docs/design.md#calibrate-a-trainer"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from benchtrain.bench.calibrate import AfterProbePrices, BenchRun, BenchTask, after_probes_seconds
from benchtrain.bench.calibrate import calibrate as measure
from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, MemoryPrior, device_speed
from benchtrain.bench.outlook import minimum_from_scratch, outlook
from benchtrain.bench.probe import machine_load
from benchtrain.bench.probe_tasks import Coordinator
from benchtrain.bench.runner import Budget
from benchtrain.bench.space import SearchSpace, default_space
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration import load
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.store import save_calibration, save_failed
from benchtrain.calibration.training import TrainerStep
from benchtrain.common.durations import format_duration, parse_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.memory_check import compute_bytes
from benchtrain.train.step.hardware import detect_hardware, detect_software, device_label
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.method import trainable_parameter_count
from benchtrain.train.workload.model import logical_numel, model_record
from benchtrain.trainer.as_found import AsFound
from benchtrain.trainer.estimate import model_setup, trainer_precision
from benchtrain.trainer.trainer_step import TrainerWorkload, probe_lengths

if TYPE_CHECKING:
    from benchtrain.common.progress import Bar

# Bytes an AdamW keeps per trainable parameter (two fp32 moments) and its fp32 gradient: the prior's static memory.
ADAM_STATE_BYTES = 8
GRADIENT_BYTES = 4


def calibrate(trainer: Any, budget: str | float = "3m", *, quiet: bool = False) -> Calibration:
    """Measure `trainer`'s own step within `budget` (a duration as `bench run --budget` takes it, or seconds) and store
    the calibration; returns it (on every process of a job). Bad input is one line (BenchtrainError)."""
    started = time.monotonic()
    seconds = float(budget) if isinstance(budget, (int, float)) else parse_duration(budget, "budget")
    if seconds <= 0:
        raise BenchtrainError(f"budget must be positive, got {budget!r}")
    check_dataset(trainer)
    say = (lambda message: None) if quiet else _say
    found = AsFound.take(trainer)
    try:
        workload = TrainerWorkload(trainer)
        task, planner = describe(trainer, workload, seconds)
        refuse_small_budget(task, planner, seconds, time.monotonic() - started)
        coordinator = Coordinator(workload.handlers(task.hardware.get("peak_bf16_flops")))
        workload.start()
        try:
            if not coordinator.leads:
                coordinator.follow()
                path, error = share((None, None))
                if error is not None:
                    raise BenchtrainError(error)
                assert path is not None
                return load(path)
            try:
                path = measure_and_store(task, planner, coordinator, Budget(seconds, started), quiet, say)
            except Exception as error:
                if not coordinator.failed:  # the others wait in `follow`: they end with the same line
                    coordinator.finish()
                    share((None, str(error)))
                raise
            coordinator.finish()
            share((path, None))
            return load(path)
        finally:
            workload.stop()
    finally:
        found.restore()


def _say(message: str) -> None:
    from benchtrain.common.console import say

    say(message)


def check_dataset(trainer: Any) -> None:
    """A Trainer without a train dataset, or with one whose length is unknown, is one line."""
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None:
        raise BenchtrainError(
            "calibrate: this Trainer has no train_dataset: give Trainer(..., train_dataset=...) first; its rows are what is measured"
        )
    try:
        size = len(dataset)
    except TypeError:
        raise BenchtrainError(
            f"calibrate: the Trainer's train_dataset ({type(dataset).__name__}) has no length (an iterable dataset): "
            "give a map-style dataset (datasets.Dataset, or one with __len__ and __getitem__) to calibrate"
        ) from None
    if size == 0:
        raise BenchtrainError("calibrate: the Trainer's train_dataset is empty")


def trainer_step_record(trainer: Any) -> TrainerStep:
    """Whose step this is: the Trainer's class, who computes its loss, its collator."""
    from transformers import Trainer

    own_loss = (
        type(trainer).compute_loss is Trainer.compute_loss and getattr(trainer, "compute_loss_func", None) is None
    )
    loss = "the model's own" if own_loss else type(trainer).__name__ + ".compute_loss"
    if getattr(trainer, "compute_loss_func", None) is not None:
        loss = getattr(trainer.compute_loss_func, "__name__", "compute_loss_func")
    return TrainerStep(type(trainer).__name__, loss, type(trainer.data_collator).__name__)


def optimizer_name(args: Any) -> str:
    """The Trainer's optimizer as calibrations name it: torch's AdamW as adamw, else the Trainer's own name."""
    name = str(getattr(args.optim, "value", args.optim))
    return "adamw" if name in ("adamw_torch", "adamw_torch_fused", "adamw_hf") else name


def training_record(trainer: Any, workload: TrainerWorkload) -> JsonDict:
    """The calibration's `training` section: what the probes trained, marked as the Trainer's step."""
    model = trainer.model
    _, method = model_setup(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantization = getattr(base.config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    quantization = quantization or {}
    bits = 4 if quantization.get("load_in_4bit") else 8 if quantization.get("load_in_8bit") else 0
    lora = None
    if method == "lora":
        config = next(iter(model.peft_config.values()))
        targets = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
        )
        lora = {"rank": int(config.r), "alpha": config.lora_alpha, "targets": targets}
    trainable = trainable_parameter_count(model)
    return {
        "method": method,
        "lora": lora,
        "quantization": f"{bits}bit" if bits else None,
        "optimizer": optimizer_name(trainer.args),
        "trainable_parameters": trainable,
        "total_parameters": sum(logical_numel(parameter) for parameter in model.parameters()),
        "precision": trainer_precision(trainer.args),
        "compile": bool(trainer.args.torch_compile),
        "loss": "trainer",
        "sharding": "ddp",
        "flops_terms": workload.shape.flops_terms(workload.lora),
        "trainer": trainer_step_record(trainer).to_record(),
    }


def search_space(trainer: Any, device_type: str, memory_bytes: float, lengths: tuple[int, ...]) -> SearchSpace:
    """bench's grid for this device with the Trainer's own values added, both checkpointing modes, and its data's lengths."""
    args = trainer.args
    space = default_space(device_type, memory_bytes)
    return space.with_axes(
        batch_sizes=tuple(sorted({*space.axis("batch_sizes"), int(args.per_device_train_batch_size)})),
        workers=tuple(sorted({*space.axis("workers"), int(args.dataloader_num_workers)})),
        accums=tuple(sorted({*space.axis("accums"), int(args.gradient_accumulation_steps)})),
        seq_lens=lengths,
        checkpointing=(0, 1),
    )


def truncation_length(trainer: Any) -> int | None:
    """Where the Trainer cuts a sample: TRL's `max_length` (or `max_seq_length`), else the model's positions."""
    args = trainer.args
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(trainer.model, "config", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(positions) if positions else None


def describe(trainer: Any, workload: TrainerWorkload, budget_seconds: float) -> tuple[BenchTask, ProbePlanner]:
    """What the probes measure (bench.calibrate.BenchTask) and the planner that chooses and prices them."""
    hardware = detect_hardware()
    device_type = hardware["device_type"]
    spec, _ = model_setup(trainer.model)
    lengths = probe_lengths(workload.lengths, truncation_length(trainer))
    space = search_space(trainer, device_type, hardware["memory_bytes"], lengths)
    settings = ProbeSettings.for_device(device_type).for_budget(budget_seconds)
    training = training_record(trainer, workload)
    shape = workload.shape
    one = replace(space.all_configs()[0], micro_batch_size=1, grad_accum=1, seq_len=lengths[len(lengths) // 2])
    prices = AfterProbePrices(
        forward_share=shape.forward_flops_per_token(one.seq_len, workload.lora)
        / workload.flops_per_token(one.switched(gradient_checkpointing=False)),
    )
    task = BenchTask(
        space=space,
        settings=settings,
        hardware=hardware,
        software=detect_software(),
        model=model_record(spec, shape),
        training=training,
        device_label=device_label(hardware),
        data={
            "source": f"{type(trainer).__name__}.train_dataset",
            "format": "tokenized",
            "profile": {
                **length_profile(workload.lengths),
                "sampled": len(workload.lengths) < len(trainer.train_dataset),
            },
        },
        world_size=workload.accelerator.num_processes,
        load_before=machine_load(),
        prices=prices,
        one_off_timings=False,  # no checkpoint is written: the Trainer's output_dir stays as it was
    )
    model = trainer.model
    trainable = training["trainable_parameters"]
    parameter_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    config = workload.model.config if hasattr(workload.model, "config") else None
    hidden = int(getattr(config, "hidden_size", 0) or shape.heads * shape.head_dim)
    memory = MemoryPrior(
        static_bytes=parameter_bytes + trainable * (GRADIENT_BYTES + ADAM_STATE_BYTES),
        accumulated_gradient_bytes=trainable * GRADIENT_BYTES,
        layers=shape.layers,
        hidden=hidden,
        compute_bytes=compute_bytes(device_type),
    )
    cost = CostModel(workload.flops_per_token, device_speed(hardware), settings)
    limit = float(hardware["memory_bytes"]) if device_type == "cuda" else None
    return task, ProbePlanner(space, cost, memory, limit, host_cores=hardware.get("cpu_cores"))


def refuse_small_budget(task: BenchTask, planner: ProbePlanner, budget_seconds: float, spent: float) -> None:
    """A budget that cannot pay for a minimum calibration (MIN_ROWS_FOR_FIT configurations, both checkpointing modes),
    priced by the planner before any probe, is one line."""
    view = outlook(planner, budget_seconds, spent, after_probes_seconds(task, planner))
    if view.affordable:
        return
    raise BenchtrainError(
        f"calibrate: budget {format_duration(budget_seconds)} cannot pay for {MIN_ROWS_FOR_FIT} configurations of this "
        f"Trainer's step (one of each checkpointing mode): even at the device's peak they need ≈ "
        f"{format_duration(view.least_seconds)} (≈ {format_duration(view.minimum_seconds)} at {view.prices}); "
        f'give budget="{format_duration(max(1, round(view.minimum_seconds)))}" or more'
    )


def measure_and_store(
    task: BenchTask, planner: ProbePlanner, coordinator: Coordinator, budget: Budget, quiet: bool, say: Any
) -> str:
    """Rank 0: the probes, the fit and the stored calibration's path."""
    run = BenchRun(task, coordinator, planner, budget)
    space = task.space
    say(
        f"calibrating {task.training['trainer']['class']}'s step: up to {space.size} configurations within "
        f"{format_duration(budget.seconds or 0.0)}"
    )
    bar = progress(space.size, budget.seconds, quiet)
    before_probes = budget.elapsed()
    try:
        record, _ = measure(run, 0.0, bar)
    finally:
        if bar is not None:
            bar.close()
    if record["fit"] is None:
        rows = record["measurements"]
        ok = sum(1 for row in rows if row["status"] == "ok")
        kept = save_failed(record)
        needed = minimum_from_scratch(planner, before_probes, after_probes_seconds(task, planner))
        raise BenchtrainError(
            f"calibrate: only {ok} of {len(rows)} configurations of the Trainer's step ran; a fit needs {MIN_ROWS_FOR_FIT}: "
            f'at the prices measured give budget="{format_duration(max(1, round(needed)))}" or more '
            f"(nothing stored as a calibration; the measurements are in {kept})"
        )
    path = save_calibration(record)
    say(f"calibration {record['id']} of {task.training['trainer']['class']}'s step saved to {path}")
    return str(path)


def progress(probes: int, budget_seconds: float | None, quiet: bool) -> Bar | None:
    if quiet or not budget_seconds:
        return None
    from benchtrain.common.console import is_main_process
    from benchtrain.common.progress import BudgetBar

    return BudgetBar(budget_seconds, probes) if is_main_process() else None


def share(outcome: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
    """Rank 0's (stored path, one-line error) on every process of a job; as it is for one process."""
    from benchtrain.train.planning.comm import world

    if world().processes == 1:
        return outcome
    import torch.distributed as dist

    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    return box[0]
