"""Which calibration a run plans with, and which of its variants on which device (each fitted before any data is
read, the best kept once planned). docs/design.md#which-calibration-and-which-variant."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import benchtrain.calibration as calibration_api
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.setup import (
    Setup,
    Variant,
    describe_setup,
    setup_difference,
    variant_name,
)
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.topology import same_interconnect
from benchtrain.calibration.training import quantize_value
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.planning.memory_check import GIB, check_fits, gib_text, memory_need, quantization_available
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.recipes.run_plan import FittedVariant, PlanContext, RunPlan, plan_run
from benchtrain.train.running.resume import Continuation, PlannedCalibration
from benchtrain.train.step.engine import MeasuredStep, ProcessLayout, process_layout, resolve_step
from benchtrain.train.step.hardware import this_device
from benchtrain.train.step.runtime import run_precision
from benchtrain.train.workload.method import METHODS

if TYPE_CHECKING:
    from benchtrain.calibration.hardware import Hardware
    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.store import Preferences
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import ModelSpec

AUTO = "auto"
LARGEST_MICRO_BATCH = 1024


@dataclass(frozen=True)
class Refused:
    """A variant the calibration measured that the run cannot take, and why (one line)."""

    method: MethodConfig
    reason: str


@dataclass(frozen=True)
class Weighed:
    """What a `train` command may train with: its calibration's suitable variants, fitted to the device; those refused."""

    fitted: list[FittedVariant]
    refused: list[Refused]


# -- the calibration ---------------------------------------------------------------------------


def load_calibration(
    config: TrainConfig,
    planned: PlannedCalibration | None,
    spec: ModelSpec,
    method: MethodConfig,
    processes: tuple[int, str],
    interconnect: str | None = None,
    device: Hardware | None = None,
) -> Calibration:
    """The calibration to plan with: --use-calibration (default latest); a resumed run's, as its continuation names it
    (`planned`; another refused unless --force, or unless the run was planned on another card and the other was measured
    on this `device`: a task's fallback took over). `latest` prefers `calibration_preferences`' order, and says why when
    it passes over a newer one. A calibration of a user's own Trainer step plans only `--dry-run --for-trainer`."""
    chosen = chosen_calibration(config, planned, spec, method, processes, interconnect, device)
    refuse_trainer_step(chosen, config)
    return chosen


def refuse_trainer_step(calibration: Calibration, config: TrainConfig) -> None:
    """A calibration of a user's own Trainer (`benchtrain.calibrate`) timed their step, not ours: one line, pointing at
    what plans with it; `--dry-run --for-trainer` prints its plan as that Trainer's arguments."""
    trainer = calibration.training.trainer
    if trainer is None or (config.output.dry_run and config.output.for_trainer):
        return
    raise BenchtrainError(
        f"calibration {calibration.id} measured a {trainer.class_name}'s own step (loss: {trainer.loss}, collator "
        f"{trainer.collator}), not train's: plan that Trainer with benchtrain.fit_to_deadline(trainer, calibration=...), "
        "print its arguments with --dry-run --for-trainer, or name a `bench run` calibration with --use-calibration"
    )


def chosen_calibration(
    config: TrainConfig,
    planned: PlannedCalibration | None,
    spec: ModelSpec,
    method: MethodConfig,
    processes: tuple[int, str],
    interconnect: str | None = None,
    device: Hardware | None = None,
) -> Calibration:
    on_skip = lambda message: say(f"warning: {message}")  # noqa: E731
    if planned is None:
        reference = config.plan.use_calibration or "latest"
        if reference != "latest":
            return calibration_api.load(reference, on_skip=on_skip)
        passed_over: list[Path] = []
        preferences = calibration_preferences(spec, method, processes, interconnect, device.name if device else None)
        chosen = calibration_api.load("latest", on_skip, preferences, passed_over.append)
        if passed_over:
            say(f"calibration: {why_chosen(chosen, passed_over[0], spec, method, processes)}")
        return chosen
    if config.plan.use_calibration is None:
        return planned.load()
    chosen = calibration_api.load(config.plan.use_calibration, on_skip=on_skip)
    if chosen.id != planned.id and not config.force and device is not None and took_over(planned, chosen, device):
        say(
            f"--resume: this run was planned with calibration {planned.id}, measured on another card; "
            f"this is {device.name}: replanning with {chosen.id}, measured here (the steps done are kept)"
        )
        return chosen
    if chosen.id != planned.id and not config.force:
        raise BenchtrainError(
            f"--resume: this run was planned with calibration {planned.id}, not {chosen.id}; drop --use-calibration, or pass --force"
        )
    return chosen


def took_over(planned: PlannedCalibration, chosen: Calibration, device: Hardware) -> bool:
    """Whether a resume runs on another card than its plan's calibration measured (one a task's fallbacks rent under the
    same name, say) and `chosen` was measured on this one."""
    if not chosen.hardware.same_device(device):
        return False
    try:
        return not planned.load().hardware.same_device(device)
    except BenchtrainError:  # its calibration stayed with the machine it ran on
        return True


def why_chosen(
    chosen: Calibration, newer: Path, spec: ModelSpec, method: MethodConfig, processes: tuple[int, str]
) -> str:
    """`latest` took `chosen` over the newer file: what it measured, and the difference that decided."""
    run = Setup(
        spec.name,
        spec.fingerprint,
        method.method,
        method.lora_rank if method.is_lora else None,
        quantize_value(method.quantize),
        *processes,
    )
    return f"{chosen.id} ({describe_setup(chosen.data)}) suits this run better than {setup_difference(chosen.data, read_calibration_file(newer), run)}"


def calibration_preferences(
    spec: ModelSpec,
    method: MethodConfig,
    processes: tuple[int, str],
    interconnect: str | None = None,
    device: str | None = None,
) -> Preferences:
    """What `latest` prefers for this run, best first (calibration.store): this model and method measured with this run's
    (processes, sharding) over this machine's `interconnect`, then over another, then of one process (communication
    predicted); each first on this `device` (the one train accepts: a task's fallbacks keep each card's calibration
    beside the run); else the newest."""
    mine = (spec.fingerprint, method.method, quantize_value(method.quantize))

    def this_run(measured: Setup, processes: tuple[int, str] = processes) -> bool:
        return (
            measured.model_fingerprint,
            measured.method,
            measured.quantization,
            measured.world_size,
            measured.sharding,
        ) == (
            *mine,
            *processes,
        )

    in_order = (
        lambda measured: this_run(measured) and same_interconnect(measured.interconnect, interconnect),
        this_run,
        lambda measured: this_run(measured, (1, measured.sharding)),
    )
    if device is None:
        return in_order
    on_device = tuple(
        lambda measured, accepts=accepts: measured.device == device and accepts(measured) for accepts in in_order
    )
    return (*on_device, *in_order)


def check_compatible(
    calibration: Calibration,
    spec: ModelSpec,
    hardware: Hardware,
    force: bool,
    method: MethodConfig,
    compiled: bool = False,
    loss: str | None = None,
) -> list[str]:
    """Another model, device, method, base, optimizer, precision or compile setting than measured: refused unless --force
    (then returned, to warn); other LoRA settings or loss: only warned about."""
    problems = []
    measured = calibration.training
    if measured.compiled != compiled:
        states = {True: "a compiled step", False: "an eager step"}
        problems.append(
            f"calibration {calibration.id} measured {states[measured.compiled]}, this run would use {states[compiled]}: "
            f"pass --compile {'on' if measured.compiled else 'off'}, or run `bench run --compile {'on' if compiled else 'off'}` here, or pass --force"
        )
    if measured.method != method.method:
        names = {name: entry.phrase for name, entry in METHODS.items()}
        rerun = {"full": "bench run", "lora": "bench run --lora"}.get(
            method.method, f"bench run --method {method.method}"
        )
        measured_name = names.get(measured.method, measured.method)
        problems.append(
            f"calibration {calibration.id} measured {measured_name}, not {names[method.method]}: run `{rerun}` here, or pass --force"
        )
    measured_quantize = measured.quantization
    if measured_quantize != method.quantize:
        problems.append(
            f"calibration {calibration.id} measured a {measured_quantize} base, this run asks for --quantize {method.quantize}: "
            f"run `bench run --lora --quantize {method.quantize}` here, or pass --force"
        )
    measured_optimizer = measured.optimizer
    if measured_optimizer != method.optimizer:
        problems.append(
            f"calibration {calibration.id} measured the {measured_optimizer} optimizer, this run asks for --optimizer {method.optimizer}: "
            f"run `bench run --optimizer {measured_optimizer},{method.optimizer}` here to measure both, or pass --force"
        )
    measured_precision = measured.precision  # absent: not recorded (the bundled H100 calibration): not checked
    if measured_precision and measured_precision != run_precision(hardware.device_type):
        problems.append(
            f"calibration {calibration.id} measured a {measured_precision} step, this run would train in {run_precision(hardware.device_type)} "
            f"(BENCHTRAIN_CPU_BF16): run `bench run` with the same setting here, or pass --force"
        )
    if calibration.model["fingerprint"] != spec.fingerprint:
        problems.append(
            f"calibration {calibration.id} was measured for model {calibration.model['name']}, not {spec.name}"
        )
    if not calibration.hardware.same_device(hardware):
        problems.append(
            f"calibration {calibration.id} was measured on {calibration.hardware.name}, this is {hardware.name}"
        )
    if problems and not force:
        first = problems[0]
        raise BenchtrainError(
            first if "--force" in first else f"{first}: run `bench run` here with this model, or pass --force"
        )
    notes = list(problems)
    if loss and measured.loss and measured.loss != loss:  # calibrations before --loss did not record it
        notes.append(
            f"calibration {calibration.id} measured the {measured.loss} loss, this run uses {loss}: speed and memory may differ"
        )
    if method.is_lora and measured.lora_rank is not None and measured.lora_rank != method.lora_rank:
        notes.append(
            f"calibration {calibration.id} measured LoRA rank {measured.lora_rank}, this run uses rank {method.lora_rank}"
        )
    return notes


# -- its variants ------------------------------------------------------------------------------


def asked_variant(quantize: str, optimizer: str) -> tuple[str | None, str | None]:
    """train's --quantize/--optimizer as a filter: None where `auto`."""
    return (None if quantize == AUTO else quantize, None if optimizer == AUTO else optimizer)


def with_run_variant(
    method: MethodConfig, run_method: MethodConfig, asked: tuple[str | None, str | None]
) -> MethodConfig:
    """A resumed run keeps its base's quantization and its optimizer where this command says `auto`."""
    quantize, optimizer = asked
    return method.with_variant(Variant(quantize or run_method.quantize, optimizer or run_method.optimizer))


def variants_to_plan(
    calibration: Calibration, method: MethodConfig, asked: tuple[str | None, str | None]
) -> list[tuple[Calibration, MethodConfig]]:
    """(variant, method trained with it) for each measured variant matching what was asked (full fine-tuning: unquantized
    bases only); none matching: the one asked for on the first variant, for `check_compatible` to refuse."""
    quantize, optimizer = asked

    def wanted(measured: Variant) -> bool:
        return (
            quantize in (None, measured.quantize)
            and optimizer in (None, measured.optimizer)
            and (method.is_lora or measured.quantize == "none")
        )

    matching = [variant for variant in calibration.variants() if wanted(variant.variant)]
    if not matching:
        first = calibration.variant
        fallback_quantize = quantize or (first.quantize if method.is_lora else "none")
        return [(calibration, method.with_variant(Variant(fallback_quantize, optimizer or first.optimizer)))]
    return [(variant, method.with_variant(variant.variant)) for variant in matching]


# -- each variant on the device ----------------------------------------------------------------


def plan_hardware(config: TrainConfig, cal: Calibration, here: Hardware) -> Hardware:
    """The device a plan is for: this machine, or in a dry run for another the device the calibration measured."""
    return cal.hardware if config.output.dry_run and not cal.hardware.same_device(here) else here


def measured_step(cal: Calibration, foreign: bool) -> MeasuredStep:
    """Where the calibration decides `auto`: on its own device its compile setting; its loss there or where bench compared losses."""
    measured = cal.training
    return MeasuredStep(
        compiled=measured.compiled if foreign else None,
        loss=measured.loss if foreign or cal.compared_losses else None,
    )


def fit_variant(
    config: TrainConfig,
    cal: Calibration,
    spec: ModelSpec,
    method: MethodConfig,
    layout: ProcessLayout,
    here: Hardware,
) -> FittedVariant:
    """One variant on the device (`here`, or in a dry run the calibration's; `--device-memory`): THE step there, its price,
    the calibration's fitness (one line unless --force) and the memory check (one line when the model does not fit)."""
    hardware = plan_hardware(config, cal, here)
    foreign = hardware is not here
    step = resolve_step(
        config.step,
        hardware.device_type,
        spec.config_dict.get("model_type"),
        method,
        layout,
        measured_step(cal, foreign),
    )
    if config.plan.device_memory_bytes:
        hardware = hardware.with_memory(config.plan.device_memory_bytes, "--device-memory")
    price = config.plan.prices.for_device(cal.id, hardware)
    warnings = check_compatible(cal, spec, hardware, config.force, method, step.compiled, step.loss)
    need = check_fits(spec, method, hardware, step.sharding, step.world_size)
    return FittedVariant(cal, method, hardware, foreign, step, need, price, tuple(warnings))


def said_fit(
    config: TrainConfig,
    cal: Calibration,
    spec: ModelSpec,
    method: MethodConfig,
    layout: ProcessLayout,
    quiet: bool = False,
) -> FittedVariant:
    """`fit_variant` on this machine, said: the calibration's device when a dry run plans for it, and what --force let through
    (`quiet`: nothing, the first variant said it)."""
    here = this_device()
    fitted = fit_variant(config, cal, spec, method, layout, here)
    if fitted.foreign and not quiet:
        say(
            f"planning for {cal.hardware.name}, the device calibration {cal.id} measured (this machine: {here.name}); "
            "training on it needs that device, or --force"
        )
    for warning in fitted.warnings if not quiet else ():
        say(f"warning: {warning}")
    return fitted


def weigh_variants(config: TrainConfig, spec: ModelSpec, method: MethodConfig, continuation: Continuation) -> Weighed:
    """The calibration to plan with and its variants, each fitted for the processes and sharding the plan is for (a resumed run
    keeps its sharding and its variant: `continuation`); those refused are kept to say why."""
    layout = process_layout(config.step, method)
    here = this_device()
    cal = load_calibration(
        config,
        continuation.calibration,
        spec,
        method,
        (layout.world_size, layout.sharding),
        here.interconnect,
        None if config.output.dry_run else here,  # a dry run plans for the calibration's device, not this one
    )
    if not cal.ok_rows():
        raise BenchtrainError(f"calibration {cal.id} has no successful probes: re-run `bench run`")
    if config.output.dry_run and layout.world_size == 1 and cal.world_size > 1:
        # Like its device, a dry run plans the processes the calibration measured (train.recipes.machines too).
        layout = ProcessLayout(cal.world_size, cal.sharding)
        say(f"planning for the {layout.world_size} processes ({layout.sharding}) calibration {cal.id} measured")
    if config.plan.device_memory_bytes:
        cal = cal.with_device_memory(config.plan.device_memory_bytes)
    resumed = continuation.run
    # FSDP checkpoints key the optimizer state by name: a resume keeps the run's sharding.
    if resumed is not None and (resumed.sharding == "fsdp") != (layout.sharding == "fsdp"):
        raise BenchtrainError(
            f"--resume: {continuation.out_dir} was trained with sharding {resumed.sharding}; resume it with the same (now: {layout.sharding})"
        )
    candidates = variants_to_plan(
        cal,
        method,
        method.variant if continuation.resuming else asked_variant(config.tuning.quantize, config.tuning.optimizer),
    )
    fitted: list[FittedVariant] = []
    refused: list[Refused] = []
    for index, (variant, variant_method) in enumerate(candidates):
        try:
            fitted.append(said_fit(config, variant, spec, variant_method, layout, quiet=index > 0))
        except BenchtrainError as error:
            if len(candidates) == 1:
                raise
            refused.append(Refused(variant_method, str(error)))
    if not fitted:
        raise BenchtrainError(f"no setup the calibration measured fits: {refused[0].reason}")
    return Weighed(fitted, refused)


# -- the best, once planned ----------------------------------------------------------------------


def choose_plan(weighed: Weighed, context: PlanContext) -> RunPlan:
    """Each fitted variant planned, the best kept, its notes saying what the others would have cost."""
    plans: list[RunPlan] = []
    refused = list(weighed.refused)
    for fitted in weighed.fitted:
        try:
            plans.append(plan_run(fitted, context))
        except DoesNotFitError as error:
            if len(weighed.fitted) + len(weighed.refused) == 1:
                raise DoesNotFitError(with_smaller_bases(str(error), context.spec, fitted)) from None
            refused.append(Refused(fitted.method, str(error)))
    if not plans:
        message = f"no setup the calibration measured fits: {refused[0].reason}"
        raise DoesNotFitError(with_smaller_bases(message, context.spec, weighed.fitted[0]))
    if len(plans) + len(refused) == 1:
        return plans[0]
    ranked = [plans[index] for index in best_first(plans)]
    best = ranked[0]
    best.plan.notes.extend(compare_variants(best, ranked[1:], refused))
    return best


def best_first(plans: list[RunPlan]) -> list[int]:
    """The plans' indices, best first: meeting the deadline, then the shortest run (where --fit-deadline cut steps, a shorter
    run may train less: the most tokens first)."""
    cut = any(run.plan.step_limit for run in plans)

    def order(index: int) -> tuple[bool, int, float]:
        plan = plans[index].plan
        return (not plan.meets_deadline, -plan.chosen.tokens if cut else 0, plan.chosen.total_seconds)

    return sorted(range(len(plans)), key=order)


def largest_fitting_micro_batch(calibration: Calibration, config: StepConfig) -> int:
    """The largest power-of-two micro-batch the memory model fits at `config`'s length and checkpointing (0: none)."""
    largest, size = 0, 1
    while size <= LARGEST_MICRO_BATCH and calibration.fits_in_memory(config.with_shape(size, config.seq_len)):
        largest, size = size, size * 2
    return largest


def compare_variants(chosen: RunPlan, others: list[RunPlan], refused: list[Refused]) -> list[str]:
    """Plan notes: each other variant's cost at the chosen configuration and its best plan; why those refused were not."""
    config: StepConfig = chosen.plan.chosen.config
    mine = chosen.fitted.cal.predict(config)
    if not chosen.plan.meets_deadline:
        why = "the shortest plan that fits memory (none meets the deadline)"
    elif chosen.plan.step_limit:
        why = "the most tokens trained before the deadline (--fit-deadline)"
    else:
        why = "the fastest that fits memory and the deadline"
    lines = [
        f"setups measured: {len(others) + len(refused) + 1}; chosen: {variant_name(*chosen.fitted.cal.variant)}, {why}"
    ]
    for other in others:
        theirs = other.fitted.cal.predict(config)
        parts = [f"step ×{theirs.step_seconds / mine.step_seconds:.2f}"]
        if theirs.peak_memory_bytes is not None and mine.peak_memory_bytes is not None:
            difference = (mine.peak_memory_bytes - theirs.peak_memory_bytes) / GIB
            parts.append(f"{abs(difference):.2f} GiB {'less' if difference >= 0 else 'more'} peak memory")
        largest = largest_fitting_micro_batch(other.fitted.cal, config)
        more = " and more" if largest == LARGEST_MICRO_BATCH else ""
        parts.append(f"fits micro-batch {largest}{more}" if largest else "does not fit even micro-batch 1")
        own = other.plan.chosen
        verdict = "meets the deadline" if other.plan.meets_deadline else "misses the deadline"
        best = f"its best plan {own.optimizer_steps:,} steps of {own.config.phrase}, {own.tokens:,} tokens"
        parts.append(f"{best}: {format_duration(own.total_seconds)} ({verdict})")
        lines.append(f"{variant_name(*other.fitted.cal.variant)}: " + ", ".join(parts))
    lines.extend(
        f"{variant_name(one.method.quantize, one.method.optimizer)}: not planned ({one.reason})" for one in refused
    )
    return lines


# -- what the bases the calibration did not measure would hold ------------------------------------


def smallest_activations(calibration: Calibration, need_bytes: float) -> tuple[float, str] | None:
    """What the predicted peak holds beyond `need_bytes` at the smallest step (micro-batch 1, the shortest measured
    length, checkpointing where measured), and at what."""
    if calibration.memory is None:
        return None
    length = min(calibration.measured_values("seq_len"))
    checkpointing = bool(max(calibration.measured_values("gradient_checkpointing")))
    peak = calibration.predict(
        StepConfig(1, 0, 1, length).switched(gradient_checkpointing=checkpointing)
    ).peak_memory_bytes
    return (max(0.0, peak - need_bytes), f"micro-batch 1 × length {length}") if peak is not None else None


def fit_verdict(peak: float, limit: float, margin: float) -> str:
    """ "fits the 24 GiB", "fits the 16 GiB only without the 10% margin plans keep", "does not fit the 16 GiB"."""
    device = f"the {gib_text(limit)} GiB"
    if peak * (1 + margin) <= limit:
        return f"fits {device}"
    return (
        f"fits {device} only without the {margin:.0%} margin plans keep" if peak <= limit else f"does not fit {device}"
    )


def unmeasured_bases(
    spec: ModelSpec,
    method: MethodConfig,
    calibration: Calibration,
    hardware: Hardware,
    activations: tuple[float, str] | None,
) -> list[str]:
    """For LoRA: each base (none/8bit/4bit) the calibration did not measure, what it holds before activations (computed)
    against this run's, and given `activations` (bytes, at what), whether it would fit the device."""
    if not method.is_lora or not quantization_available():
        return []
    measured = {variant.variant.quantize for variant in calibration.variants()}
    device_type, limit = hardware.device_type, float(hardware.memory_bytes)
    mine = memory_need(spec, method, device_type).total_bytes
    lines = []
    for kind in ("none", "8bit", "4bit"):
        if kind in measured:
            continue
        need = memory_need(spec, replace(method, quantize=kind), device_type).total_bytes
        change = f"{abs(mine - need) / GIB:.2f} GiB {'less' if need <= mine else 'more'} than this run's"
        fit = ""
        if activations is not None:
            peak = need + activations[0]
            fit = f"; ≈{peak / GIB:.1f} GiB peak at {activations[1]}: {fit_verdict(peak, limit, calibration.memory_margin)}"
        lines.append(
            f"{variant_name(kind, method.optimizer)} (not measured): {need / GIB:.2f} GiB before activations, {change} (computed){fit}; "
            f"its speed is unmeasured: `bench run --lora --quantize {','.join(sorted(measured | {kind}, key=('none', '8bit', '4bit').index))}`"
        )
    return lines


def with_smaller_bases(message: str, spec: ModelSpec, fitted: FittedVariant) -> str:
    """A plan that fits nowhere, and what the bases the calibration did not measure would hold at the smallest step."""
    cal, hardware = fitted.cal, fitted.hardware
    activations = smallest_activations(cal, fitted.need.total_bytes)
    others = unmeasured_bases(spec, fitted.method, cal, hardware, activations)
    if not others or activations is None:
        return message + ("; " + "; ".join(others) if others else "")
    peak = fitted.need.total_bytes + activations[0]
    mine = f"this run's base: ≈{peak / GIB:.1f} GiB peak at {activations[1]}: {fit_verdict(peak, float(hardware.memory_bytes), cal.memory_margin)}"
    return "; ".join([message, mine, *others])
