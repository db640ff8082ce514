"""Model, loss, compilation, optimizer and step, built in one place, in one order, for `bench` probes
and `train`. Design: docs/design.md#engine"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from benchtrain.calibration.step_config import Mode
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.step.compile import COMPILE_CHOICES, compile_blocks, compile_enabled
from benchtrain.train.step.hyperparameters import DEFAULT_LEARNING_RATE, OptimizerSettings, make_optimizer
from benchtrain.train.step.loss import LOSS_CHOICES, choose_loss, install_loss
from benchtrain.train.step.runtime import job_world_size
from benchtrain.train.step.sharding import SHARDING_CHOICES, check_quantized_sharding, shard_model
from benchtrain.train.step.step import TrainingStep
from benchtrain.train.step.switches import set_switches
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, build_model
from benchtrain.train.workload.optimizers import check_optimizer_sharding

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR


@dataclass(frozen=True)
class Optimization:
    """The peak learning rate, the hyper-parameters, and the schedule's horizon in optimizer steps (None: a constant rate, as bench probes use)."""

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
        checks = (
            ("--sharding", self.sharding, SHARDING_CHOICES),
            ("--compile", self.compile, COMPILE_CHOICES),
            ("--loss", self.loss, LOSS_CHOICES),
        )
        for option, value, choices in checks:
            if value not in choices:
                raise BenchtrainError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


def step_options_from_args(args: argparse.Namespace) -> StepOptions:
    return StepOptions(
        compile=getattr(args, "compile", "auto"),
        loss=getattr(args, "loss", "auto"),
        sharding=getattr(args, "sharding", "ddp"),
    )


def check_sharding(method: MethodConfig, sharding: str) -> None:
    """One line where `sharding` ("none", "ddp", "fsdp") cannot train `method`: FSDP over an 8-bit base, or an optimizer whose state cannot be sharded."""
    if sharding == "fsdp" and method.quantized:
        check_quantized_sharding(method.quantize)
    check_optimizer_sharding(method.optimizer, sharding)


@dataclass(frozen=True)
class ProcessLayout:
    """The processes of a job and how they share the model."""

    world_size: int = 1
    sharding: str = "none"  # none (one process) | ddp | fsdp (train/step/sharding.py)


def process_layout(options: StepOptions, method: MethodConfig, processes: int | None = None) -> ProcessLayout:
    """This job's processes (the launcher's, or `processes` where known) and their sharding, as
    asked and possible: the one place bench, train and a comparison settle it."""
    world_size = job_world_size() if processes is None else processes
    layout = ProcessLayout(world_size, "none" if world_size < 2 else options.sharding)
    check_sharding(method, layout.sharding)
    return layout


@dataclass(frozen=True)
class StepSetup:
    """How THE step runs, decided once (`resolve_step`, no `auto` left) and built so (`build_engine`)."""

    loss: str  # chunked | liger | plain
    compiled: bool
    sharding: str = "none"  # none (one process) | ddp | fsdp
    world_size: int = 1


@dataclass(frozen=True)
class MeasuredStep:
    """What a calibration's step used, where it decides an `auto` choice (None: the rule decides)."""

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
    """The one place `--loss`, `--compile` and `--sharding` become what the step runs: `auto` is the calibration's measurement where it decides (`measured`),
    else the rule (choose_loss, compile_enabled). `layout`: the processes already settled (a dry run, a comparison's row); None: this job's."""
    measured = measured or MeasuredStep()
    compiled = (
        measured.compiled
        if options.compile == "auto" and measured.compiled is not None
        else compile_enabled(options.compile, device_type)
    )
    loss = (
        measured.loss
        if options.loss == "auto" and measured.loss
        else choose_loss(options.loss, device_type, model_type)
    )
    layout = process_layout(options, method) if layout is None else layout
    return StepSetup(loss, compiled, layout.sharding, layout.world_size)


def step_setup_for(options: StepOptions, spec: ModelSpec, method: MethodConfig, accelerator: Accelerator) -> StepSetup:
    """`resolve_step` from the options alone for a step built on `accelerator` (bench's probes, tests)."""
    layout = process_layout(options, method, accelerator.num_processes)
    return resolve_step(options, accelerator.device.type, spec.config_dict.get("model_type"), method, layout)


@dataclass
class Engine:
    """What THE step runs on, owned here: the step, bench's probes and train's loop reach the model, optimizer and
    scheduler through their engine, never through copies of their own."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    setup: StepSetup  # how the step runs, as `resolve_step` decided (bench may change its loss: `use_loss`)
    optimization: Optimization  # what the optimizer and scheduler were built with
    switches: Mode = ()  # the switch dimensions (calibration.dimensions) the model has on now
    step: TrainingStep = field(init=False)

    def __post_init__(self) -> None:
        self.step = TrainingStep(self, self.optimization.settings.max_grad_norm)

    def record(self) -> JsonDict:
        """How the step ran, for the calibration's and run.json's `training` section."""
        # autocast: CUDA, or BENCHTRAIN_CPU_BF16=1
        precision = "bf16" if self.accelerator.mixed_precision == "bf16" else "fp32"
        setup = self.setup
        return {"compile": setup.compiled, "loss": setup.loss, "sharding": setup.sharding, "precision": precision}

    def use_loss(self, kind: str) -> None:
        """Compute the loss with `kind` from now on (bench compares the losses on one model)."""
        if kind != self.setup.loss:
            install_loss(self.model, kind, compiled=self.setup.compiled)
            self.setup = replace(self.setup, loss=kind)

    def switch(self, on: Mode) -> None:
        """The model with the switches `on` on and every other off, each turned by its applier (train.step.switches);
        bench's probes switch between modes on one model."""
        set_switches(self.model, on, self.switches)
        self.switches = on


def build_engine(
    spec: ModelSpec,
    method: MethodConfig,
    accelerator: Accelerator,
    setup: StepSetup,
    switches: Mode = (),
    optimization: Optimization | None = None,
) -> Engine:
    """Everything THE step needs, built as `setup` decided, with the switch dimensions `switches` on (a StepConfig's)
    (`optimization` None: the defaults at a constant rate, as bench probes use)."""
    import torch

    loss_kind, compiled, sharding = setup.loss, setup.compiled, setup.sharding
    # FSDP: built on `meta`, then each rank materialises its shards; not a 4-bit base (docs/design.md#sharding-ddp-and-fsdp).
    on_meta = sharding == "fsdp" and not method.quantized
    model = build_model(
        spec,
        "meta" if on_meta else accelerator.device,
        method,
        shardable=sharding == "fsdp",
        weights_on=accelerator.device,
    )
    set_switches(model, switches)  # before the loss and compilation, which see the switched model
    install_loss(model, loss_kind, compiled=compiled)
    if compiled:
        compile_blocks(model)
    if sharding == "fsdp":
        shard_model(model, accelerator.device, bf16=accelerator.mixed_precision == "bf16", spec=spec)
    optimization = optimization or Optimization()
    settings = optimization.settings
    optimizer = make_optimizer(model, optimization.learning_rate, method.optimizer, settings)
    if optimization.total_steps is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    else:
        scheduler = settings.scheduler(optimizer, optimization.total_steps)
    # The scheduler stays out of `prepare` (it would step once per process); under FSDP so does the model, FSDP's already (docs/design.md#engine).
    if sharding == "fsdp":
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return Engine(accelerator, model, optimizer, scheduler, setup, optimization, switches)


def engine_from_options(
    spec: ModelSpec,
    method: MethodConfig,
    accelerator: Accelerator,
    options: StepOptions,
    switches: Mode = (),
    optimization: Optimization | None = None,
) -> Engine:
    """`build_engine` for a step set up from the options alone (bench's probes, benchmarks, tests)."""
    return build_engine(
        spec, method, accelerator, step_setup_for(options, spec, method, accelerator), switches, optimization
    )
