"""Which setup a run trains with, decided once: the calibration (train.recipes.calibration_choice),
the processes and their sharding, each setup it measured that the run may take
(train.recipes.variant_choice), on the device the plan is for, with the loss and the compile
setting THE step runs with, the price, the memory need and what --force let through.

Each setup is a `ChosenSetup`; the plan takes it (train.recipes.plan_setup.plan_fitted) and the
training loop builds THE step as its `step` says (train.step.engine.build_engine): nothing decides
the loss, compilation or the process layout again, and nothing rewrites the command's options."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import calibration as calibration_api
from common.console import say
from common.errors import BenchtrainError
from train.planning.memory_check import MemoryNeed, check_fits
from train.recipes.calibration_choice import check_compatible, load_calibration
from train.recipes.config import TrainConfig
from train.recipes.variant_choice import Refused, asked_variant, setups_to_plan
from train.step.engine import MeasuredStep, ProcessLayout, StepOptions, StepSetup, process_layout, resolve_step
from train.step.hardware import detect_hardware

if TYPE_CHECKING:
    from calibration.model import Calibration
    from calibration.run_file import ResumedRun
    from train.workload.method import MethodConfig
    from train.workload.model import ModelSpec


def same_device(measured: dict[str, Any], here: dict[str, Any]) -> bool:
    return measured["name"] == here["name"] and measured["device_type"] == here["device_type"]


@dataclass(frozen=True)
class ChosenSetup:
    """A calibration (or one of its setups) and the method it measured, on the device the plan is
    for — this machine's, or in a dry run the calibration's (its memory, peak FLOP/s, compile and
    loss), so that a user plans the GPU they will rent from a machine without one — checked before
    any data is read: it suits the run (or --force) and the model fits."""

    cal: Calibration
    method: MethodConfig
    hardware: dict[str, Any]  # the device the plan is for (train.step.hardware.detect_hardware's keys)
    foreign: bool  # a dry run for the calibration's device, not this machine's
    step: StepSetup  # the loss, compiled or not, the processes and their sharding
    need: MemoryNeed
    price_per_hour: float | None
    warnings: tuple[str, ...] = ()

    @property
    def compiled(self) -> bool:
        return self.step.compiled

    @property
    def loss(self) -> str:
        return self.step.loss

    @property
    def world_size(self) -> int:
        return self.step.world_size

    @property
    def sharding(self) -> str:
        return self.step.sharding

    @property
    def device_type(self) -> str:
        return str(self.hardware["device_type"])

    def recorded_options(self, options: StepOptions) -> StepOptions:
        """The command's step options as run.json's `config` records them: with --loss auto where
        bench compared the losses on this device, the loss it measured best (what runs)."""
        if options.loss == "auto" and not self.foreign and self.cal.data.get("loss_choice"):
            return replace(options, loss=self.step.loss)
        return options


@dataclass(frozen=True)
class Setups:
    """What a `train` command may train with: the calibration, the processes and their sharding,
    each setup weighed (`weighed`: how many), those that suit the run and those refused."""

    cal: Calibration
    layout: ProcessLayout
    weighed: int
    setups: list[ChosenSetup]
    refused: list[Refused]


def plans_elsewhere(config: TrainConfig, cal: Calibration, here: dict[str, Any]) -> bool:
    """Whether the plan is for another device than this machine: a dry run plans for the device
    the calibration measured."""
    return config.output.dry_run and not same_device(cal.hardware, here)


def plan_hardware(config: TrainConfig, cal: Calibration, here: dict[str, Any]) -> dict[str, Any]:
    """The device a plan is for: this machine, or in a dry run the calibration's (`plans_elsewhere`)."""
    return cal.hardware if plans_elsewhere(config, cal, here) else here


def measured_step(cal: Calibration, foreign: bool) -> MeasuredStep:
    """Where the calibration decides `auto`: on its own device its compile setting; its loss where
    bench compared the losses (the one it kept) or the plan is for its device."""
    measured = cal.training
    return MeasuredStep(
        compiled=bool(measured.get("compile")) if foreign else None,
        loss=measured.get("loss") if foreign or cal.data.get("loss_choice") else None,
    )


def setup_for(config: TrainConfig, cal: Calibration, spec: ModelSpec, method: MethodConfig, layout: ProcessLayout, here: dict[str, Any]) -> ChosenSetup:
    """One setup (a `train` command's, each of its calibration's setups, each row of a comparison):
    the device (`here`, or in a dry run the calibration's; `--device-memory`), THE step there
    (train.step.engine.resolve_step), its price, the calibration's fitness for the run (refused in
    one line unless --force), and the memory check (train.planning.memory_check.check_fits, one
    line when the model does not fit)."""
    foreign = plans_elsewhere(config, cal, here)
    hardware = cal.hardware if foreign else here
    step = resolve_step(config.step, hardware["device_type"], spec.config_dict.get("model_type"), method, layout, measured_step(cal, foreign))
    if config.plan.device_memory_bytes:
        hardware = {**hardware, "memory_bytes": config.plan.device_memory_bytes, "memory_from": "--device-memory"}
    price = config.plan.prices.for_device(cal.id, hardware)
    warnings = check_compatible(cal, spec, hardware, config.force, method, step.compiled, step.loss)
    need = check_fits(spec, method, hardware, step.sharding, step.world_size)
    return ChosenSetup(cal, method, hardware, foreign, step, need, price, tuple(warnings))


def said_setup(config: TrainConfig, cal: Calibration, spec: ModelSpec, method: MethodConfig, layout: ProcessLayout, quiet: bool = False) -> ChosenSetup:
    """`setup_for` on this machine, said: the calibration's device when a dry run plans for
    another, and what --force let through. `quiet`: say nothing (a calibration's second setup:
    the first said it)."""
    here = detect_hardware()
    setup = setup_for(config, cal, spec, method, layout, here)
    if setup.foreign and not quiet:
        say(
            f"planning for {cal.hardware['name']}, the device calibration {cal.id} measured (this machine: {here['name']}); "
            "training on it needs that device, or --force"
        )
    for warning in setup.warnings if not quiet else ():
        say(f"warning: {warning}")
    return setup


def calibration_for(config: TrainConfig, spec: ModelSpec, method: MethodConfig, resumed: ResumedRun | None) -> tuple[Calibration, ProcessLayout]:
    """The calibration to plan with (train.recipes.calibration_choice.load_calibration), and the
    processes and sharding the plan is for."""
    layout = process_layout(config.step, method)
    processes = (layout.world_size, layout.sharding)
    cal = load_calibration(config, resumed, calibration_api, spec, method, processes, detect_hardware().get("interconnect"))
    if not cal.ok_rows():
        raise BenchtrainError(f"calibration {cal.id} has no successful probes: re-run `bench run`")
    if config.output.dry_run and layout.world_size == 1 and cal.world_size > 1:
        # Like its device, a dry run plans the processes the calibration measured (train.recipes.compare too).
        layout = ProcessLayout(cal.world_size, cal.sharding)
        say(f"planning for the {layout.world_size} processes ({layout.sharding}) calibration {cal.id} measured")
    return cal, layout


def choose_setups(config: TrainConfig, spec: ModelSpec, method: MethodConfig, resumed: ResumedRun | None, out_dir: Path | None) -> Setups:
    """The calibration, the processes and their sharding, and the setups to plan: each fitted
    (`said_setup`); those refused are kept to say why. A resumed run keeps its sharding."""
    cal, layout = calibration_for(config, spec, method, resumed)
    if config.plan.device_memory_bytes:
        cal = cal.with_device_memory(config.plan.device_memory_bytes)
    before = resumed.sharding if resumed else layout.sharding
    if (before == "fsdp") != (layout.sharding == "fsdp"):  # FSDP checkpoints key the optimizer state by name
        raise BenchtrainError(f"--resume: {out_dir} was trained with sharding {before}; resume it with the same (now: {layout.sharding})")
    candidates = setups_to_plan(cal, method, method.variant if resumed else asked_variant(config.tuning.quantize, config.tuning.optimizer))
    setups: list[ChosenSetup] = []
    refused: list[Refused] = []
    for index, (variant, variant_method) in enumerate(candidates):
        try:
            setups.append(said_setup(config, variant, spec, variant_method, layout, quiet=index > 0))
        except BenchtrainError as error:
            if len(candidates) == 1:
                raise
            refused.append(Refused(variant_method, str(error)))
    if not setups:
        raise BenchtrainError(f"no setup the calibration measured fits: {refused[0].reason}")
    return Setups(cal, layout, len(candidates), setups, refused)
