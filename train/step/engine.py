"""Model, loss, compilation, optimizer and step, built in one place for `bench` probes and `train`.

Order matters: the model (with its method: full or LoRA) → gradient checkpointing → the loss
(train/step/loss.py) → compiled blocks (train/step/compile.py) → FSDP shards (train/step/sharding.py, with
`--sharding fsdp` under several processes) → optimizer and scheduler → accelerate's `prepare`
(devices, precision, DDP; the optimizer only when sharded) → THE step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.step.compile import COMPILE_CHOICES, compile_blocks, compile_enabled
from train.step.hyperparameters import OptimizerSettings
from train.step.loss import LOSS_CHOICES, choose_loss, install_loss
from train.step.runtime import DEFAULT_LEARNING_RATE, job_world_size, make_optimizer
from train.step.sharding import SHARDING_CHOICES, check_quantized_sharding, shard_model, sharding_in_use
from train.step.step import TrainingStep
from train.workload.method import MethodConfig, set_gradient_checkpointing
from train.workload.model import ModelSpec, build_model
from train.workload.optimizers import check_optimizer_sharding

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR


@dataclass(frozen=True)
class Optimization:
    """What the optimizer and its schedule are given: the peak learning rate, the hyper-parameters
    (schedule, warm-up, weight decay, clipping, betas, epsilon), and the schedule's horizon in
    optimizer steps (None: a constant rate, as bench probes use)."""

    learning_rate: float = DEFAULT_LEARNING_RATE
    settings: OptimizerSettings = field(default_factory=OptimizerSettings)
    total_steps: int | None = None


@dataclass(frozen=True)
class StepOptions:
    """How THE step runs: compiled or eager, and which loss. Same options on bench and train."""

    compile: str = "auto"  # auto | on | off (auto: on for CUDA)
    loss: str = "auto"  # auto | chunked | liger | plain
    sharding: str = "ddp"  # ddp | fsdp, under several processes (train/step/sharding.py)

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_CHOICES:
            raise BenchtrainError(f"--sharding must be one of {', '.join(SHARDING_CHOICES)}, got {self.sharding!r}")

        if self.compile not in COMPILE_CHOICES:
            raise BenchtrainError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")
        if self.loss not in LOSS_CHOICES:
            raise BenchtrainError(f"--loss must be one of {', '.join(LOSS_CHOICES)}, got {self.loss!r}")


def step_options_from_args(args: argparse.Namespace) -> StepOptions:
    return StepOptions(compile=getattr(args, "compile", "auto"), loss=getattr(args, "loss", "auto"), sharding=getattr(args, "sharding", "ddp"))


def check_sharding(method: MethodConfig, sharding: str) -> None:
    """What `sharding` ("none", "ddp", "fsdp") can train of `method`: FSDP shards full fine-tuning
    and LoRA (its frozen base with its adapters, a 4-bit one too: train.step.sharding); an 8-bit
    base or an optimizer whose state cannot be sharded is one line."""
    if sharding == "fsdp" and method.quantized:
        check_quantized_sharding(method.quantize)
    check_optimizer_sharding(method.optimizer, sharding)


@dataclass(frozen=True)
class ProcessLayout:
    """The processes of a job and how they share the model."""

    world_size: int = 1
    sharding: str = "none"  # none (one process) | ddp | fsdp (train/step/sharding.py)


def process_layout(options: StepOptions, method: MethodConfig, processes: int | None = None) -> ProcessLayout:
    """The processes and the sharding of this job — the launcher's processes (`processes` where already
    known), and none, DDP or FSDP as asked and possible — the one place bench, train and a
    comparison settle it; a method and sharding that do not go together are one line."""
    world_size = job_world_size() if processes is None else processes
    layout = ProcessLayout(world_size, sharding_in_use(options.sharding, world_size))
    check_sharding(method, layout.sharding)
    return layout


@dataclass(frozen=True)
class StepSetup:
    """How THE step runs, decided (no `auto` left): the loss implementation, compiled or eager, the
    processes and their sharding. Decided once (`resolve_step`) and built as decided (`build_engine`)."""

    loss: str  # chunked | liger | plain
    compiled: bool
    sharding: str = "none"  # none (one process) | ddp | fsdp
    world_size: int = 1


@dataclass(frozen=True)
class MeasuredStep:
    """What a calibration's step used, where it decides an `auto` choice: its compile setting when
    the plan is for its device (a dry run for another), its loss when bench compared the losses or
    the plan is for its device. None: the rule decides."""

    compiled: bool | None = None
    loss: str | None = None


def resolve_step(
    options: StepOptions,
    device_type: str,
    model_type: str | None,
    method: MethodConfig,
    layout: ProcessLayout | None = None,
    measured: MeasuredStep | None = None,
) -> StepSetup:
    """The one place `--loss`, `--compile` and `--sharding` become what the step runs (bench's
    probes, a plan, the training loop): `auto` is the calibration's measurement where it decides
    (`measured`), else the rule (train.step.loss.choose_loss, train.step.compile.compile_enabled).
    `layout`: the processes and their sharding already settled (a dry run planning the calibration's
    processes, a comparison's row); None: this job's (`process_layout`)."""
    loss, compiled = _loss_and_compile(options, device_type, model_type, measured or MeasuredStep())
    layout = process_layout(options, method) if layout is None else layout
    return StepSetup(loss, compiled, layout.sharding, layout.world_size)


def _loss_and_compile(options: StepOptions, device_type: str, model_type: str | None, measured: MeasuredStep) -> tuple[str, bool]:
    if options.compile == "auto" and measured.compiled is not None:
        compiled = measured.compiled
    else:
        compiled = compile_enabled(options.compile, device_type)
    try:
        loss = measured.loss if options.loss == "auto" and measured.loss else choose_loss(options.loss, device_type, model_type)
    except ValueError as error:
        raise BenchtrainError(str(error)) from None
    return loss, compiled


def step_setup_for(options: StepOptions, spec: ModelSpec, method: MethodConfig, accelerator: Accelerator) -> StepSetup:
    """`resolve_step` for a step built on `accelerator` from the options alone (bench's probes,
    tests): its device and its processes."""
    loss, compiled = _loss_and_compile(options, accelerator.device.type, spec.config_dict.get("model_type"), MeasuredStep())
    layout = process_layout(options, method, accelerator.num_processes)
    return StepSetup(loss, compiled, layout.sharding, layout.world_size)


@dataclass
class Engine:
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    step: TrainingStep
    compiled: bool
    loss: str  # the loss implementation in use
    sharding: str = "none"  # none (one process) | ddp | fsdp

    @property
    def precision(self) -> str:
        """bf16 (autocast: CUDA, or CPU with BENCHTRAIN_CPU_BF16=1) or fp32."""
        return "bf16" if self.accelerator.mixed_precision == "bf16" else "fp32"

    def record(self) -> JsonDict:
        """How the step ran, for the calibration's and run.json's `training` section."""
        return {"compile": self.compiled, "loss": self.loss, "sharding": self.sharding, "precision": self.precision}

    def with_loss(self, kind: str) -> Engine:
        """This engine computing the loss with `kind` (bench compares the losses on one model):
        the same `install_loss` that built it, so the step keeps accelerate's precision wrapper."""
        if kind == self.loss:
            return self
        install_loss(self.model, kind, compiled=self.compiled)
        return replace(self, loss=kind)


def build_engine(
    spec: ModelSpec,
    method: MethodConfig,
    accelerator: Accelerator,
    setup: StepSetup,
    checkpointing: bool = False,
    optimization: Optimization | None = None,
) -> Engine:
    """Everything THE step needs, built as `setup` decided (`resolve_step`). `optimization`: the
    learning rate, the hyper-parameters and the schedule's horizon (None: the defaults at a
    constant rate, as bench probes use)."""
    import torch

    loss_kind, compiled, sharding = setup.loss, setup.compiled, setup.sharding
    # FSDP: built on `meta`, sharded, then each rank materialises its shards (train/step/sharding.py).
    # A 4-bit base is built whole on each rank (bitsandbytes quantizes real tensors), stored in
    # its compute dtype so that FSDP shards it, then checked as sharded (train.step.sharding).
    on_meta = sharding == "fsdp" and not method.quantized
    model = build_model(spec, "meta" if on_meta else accelerator.device, method, shardable=sharding == "fsdp", weights_on=accelerator.device)
    if checkpointing:
        set_gradient_checkpointing(model, True)
    install_loss(model, loss_kind, compiled=compiled)
    if compiled:
        compile_blocks(model)
    if sharding == "fsdp":
        shard_model(model, accelerator.device, bf16=accelerator.mixed_precision == "bf16", spec=spec)
    optimization = optimization or Optimization()
    settings = optimization.settings
    optimizer = make_optimizer(model, optimization.learning_rate, method.optimizer if method is not None else "adamw", settings)
    if optimization.total_steps is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    else:
        scheduler = settings.scheduler(optimization.total_steps)(optimizer)
    # The scheduler stays out of accelerate's `prepare`: its AcceleratedScheduler steps the schedule
    # once per process at every optimizer step (split_batches=False: a schedule counted in
    # per-process batches), while ours counts the run's optimizer steps, so under N processes it
    # would decay N times too fast and climb back. TrainingStep steps it once per optimizer step.
    if sharding == "fsdp":
        # The model is FSDP's already: accelerate must not wrap it in DDP (or autocast it: FSDP's
        # mixed-precision policy casts the shards).
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    step = TrainingStep(accelerator, model, optimizer, scheduler, settings.max_grad_norm)
    return Engine(accelerator, model, optimizer, scheduler, step, compiled, loss_kind, sharding)


def engine_from_options(
    spec: ModelSpec, method: MethodConfig, accelerator: Accelerator, options: StepOptions, checkpointing: bool = False, optimization: Optimization | None = None
) -> Engine:
    """`build_engine` for a step set up from the options alone (`step_setup_for`: bench's probes,
    benchmarks, tests), not from a plan."""
    return build_engine(spec, method, accelerator, step_setup_for(options, spec, method, accelerator), checkpointing, optimization)
