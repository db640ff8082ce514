"""`benchtrain.calibrate(trainer, budget="3m")`: the user's own Trainer step measured over per-device batch ×
accumulation × DataLoader workers × gradient checkpointing × the lengths their data holds (cut where their trainer
truncates), with `bench run`'s probe planner, budget, prices, drift handling, held-out error and fits
(bench.calibrate), stored as a calibration marked as their Trainer's step (calibration.training.TrainerStep). Every
process of a job measures; rank 0 stores; every process returns the stored calibration; the Trainer is left as found
(trainer.as_found). Why: docs/design.md#calibrate-a-trainer"""

from __future__ import annotations

import time
from typing import Any

import benchtrain.common.console as console
from benchtrain.bench.given_step import GivenBench, GivenStep, one_sequence
from benchtrain.bench.probe_tasks import Coordinator
from benchtrain.bench.runner import Budget
from benchtrain.calibration import load
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.training import TrainerStep
from benchtrain.common.durations import parse_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import world
from benchtrain.train.step.hardware import detect_hardware, detect_software
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.method import trainable_parameter_count
from benchtrain.train.workload.model import logical_numel, model_record
from benchtrain.trainer.as_found import AsFound
from benchtrain.trainer.estimate import model_setup, trainer_precision
from benchtrain.trainer.trainer_step import TrainerWorkload, probe_lengths

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
    say = (lambda message: None) if quiet else console.say
    found = AsFound.take(trainer)
    try:
        workload = TrainerWorkload(trainer)
        bench = GivenBench(given_step(trainer, workload), seconds)
        bench.refuse_small_budget(time.monotonic() - started)
        coordinator = Coordinator(workload.handlers(bench.peak_flops))
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
                bar = not quiet and console.is_main_process()
                path = bench.measure(coordinator, Budget(seconds, started), say, bar)
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


def given_step(trainer: Any, workload: TrainerWorkload) -> GivenStep:
    """What bench needs of the Trainer's step (bench.given_step): its records and the model's facts."""
    hardware = detect_hardware()
    spec, _ = model_setup(trainer.model)
    lengths = list(probe_lengths(workload.lengths, truncation_length(trainer)))
    training = training_record(trainer, workload)
    shape = workload.shape
    one = one_sequence(lengths)
    model = trainer.model
    trainable = int(training["trainable_parameters"])
    parameter_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    config = getattr(model, "config", None)
    args = trainer.args
    return GivenStep(
        who=type(trainer).__name__,
        hardware=hardware,
        software=detect_software(),
        model=model_record(spec, shape),
        training=training,
        data={
            "source": f"{type(trainer).__name__}.train_dataset",
            "format": "tokenized",
            "profile": {
                **length_profile(workload.lengths),
                "sampled": len(workload.lengths) < len(trainer.train_dataset),
            },
        },
        batch_size=int(args.per_device_train_batch_size),
        workers=int(args.dataloader_num_workers),
        accumulation=int(args.gradient_accumulation_steps),
        lengths=lengths,
        world_size=workload.accelerator.num_processes,
        flops_per_token=workload.flops_per_token,
        forward_share=shape.forward_flops_per_token(one.seq_len, workload.lora) / workload.flops_per_token(one),
        static_bytes=parameter_bytes + trainable * (GRADIENT_BYTES + ADAM_STATE_BYTES),
        gradient_bytes=trainable * GRADIENT_BYTES,
        layers=shape.layers,
        hidden=int(getattr(config, "hidden_size", 0) or shape.heads * shape.head_dim),
    )


def share(outcome: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
    """Rank 0's (stored path, one-line error) on every process of a job; as it is for one process."""
    if world().processes == 1:
        return outcome
    import torch.distributed as dist

    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    return box[0]
