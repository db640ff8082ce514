"""Which measured setup a run trains with: a calibration may hold several for one model and method
(`bench run --quantize none,4bit --optimizer adamw,adamw-8bit`: calibration.schema.variant_data).
`--quantize`/`--optimizer auto` (the default) plans each and keeps the fastest that fits memory and
the deadline; a value named picks the setups that measured it. The plan says what the others would
cost at the chosen configuration: step time, peak memory, the largest micro-batch that fits.

Pure over plans and calibrations: the recipe (train.recipes.recipe) plans each setup and
train.recipes.setup_choice.choose_setup keeps the best."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from calibration.setup import variant_name
from calibration.step_config import StepConfig
from common.durations import format_duration
from train.planning.memory_check import gib_text, memory_need, quantization_available

if TYPE_CHECKING:
    from train.workload.method import MethodConfig

AUTO = "auto"
GIB = 2**30
LARGEST_MICRO_BATCH = 1024


@dataclass(frozen=True)
class Refused:
    """A setup the calibration measured that the run cannot take, and why (one line)."""

    method: MethodConfig
    reason: str


def asked_variant(quantize: str, optimizer: str) -> tuple[str | None, str | None]:
    """train's --quantize/--optimizer as a filter: None where `auto`."""
    return (None if quantize == AUTO else quantize, None if optimizer == AUTO else optimizer)


def with_run_variant(method: Any, run_method: Any, asked: tuple[str | None, str | None]) -> Any:
    """A resumed run keeps its base's quantization and its optimizer where this command says `auto`."""
    quantize, optimizer = asked
    return replace(method, quantize=quantize or run_method.quantize, optimizer=optimizer or run_method.optimizer)


def setups_to_plan(calibration: Any, method: Any, asked: tuple[str | None, str | None]) -> list[tuple[Any, Any]]:
    """(the calibration's variant, the method trained with it) for every setup the run may choose:
    those the calibration measured that match what was asked (full fine-tuning: unquantized bases
    only). None matching: the one asked for, planned with the calibration's first setup, which
    `check_compatible` then refuses (or lets through with --force)."""
    quantize, optimizer = asked
    matching = [
        variant
        for variant in calibration.variants()
        if quantize in (None, variant.variant_key[0]) and optimizer in (None, variant.variant_key[1]) and (method.is_lora or variant.variant_key[0] == "none")
    ]
    if not matching:
        first_quantize, first_optimizer = calibration.variant_key
        fallback_quantize = quantize or (first_quantize if method.is_lora else "none")
        return [(calibration, replace(method, quantize=fallback_quantize, optimizer=optimizer or first_optimizer))]
    return [(variant, replace(method, quantize=variant.variant_key[0], optimizer=variant.variant_key[1])) for variant in matching]


def smallest_activations(calibration: Any, need_bytes: float) -> tuple[float, str] | None:
    """The activations (and what else the measured peak holds beyond the fixed bytes) the memory
    model predicts at the smallest step: micro-batch 1 at the shortest measured length, with
    checkpointing where it was measured."""
    if calibration.memory is None:
        return None
    length = min(calibration.measured_values("seq_len"))
    checkpointing = bool(max(calibration.measured_values("gradient_checkpointing")))
    peak = calibration.predict(StepConfig(1, 0, 1, length).switched(gradient_checkpointing=checkpointing)).peak_memory_bytes
    return (max(0.0, peak - need_bytes), f"micro-batch 1 × length {length}") if peak is not None else None


def best_first(plans: list[Any]) -> list[int]:
    """The plans' indices, best first: those that meet the deadline, then the shortest run. Where
    --fit-deadline cut a plan's steps, a shorter run may train less: then the most tokens trained
    before the deadline come first."""
    cut = any(plan.step_limit for plan in plans)
    order = lambda index: (not plans[index].meets_deadline, -plans[index].chosen.tokens if cut else 0, plans[index].chosen.total_seconds)  # noqa: E731
    return sorted(range(len(plans)), key=order)


def largest_fitting_micro_batch(calibration: Any, config: StepConfig) -> int:
    """The largest power-of-two micro-batch the calibration's memory model fits at `config`'s
    length and checkpointing (0: not even one)."""
    largest, size = 0, 1
    while size <= LARGEST_MICRO_BATCH and calibration.fits_in_memory(config.with_shape(size, config.seq_len)):
        largest, size = size, size * 2
    return largest


def compare_setups(chosen: tuple[Any, Any], others: list[tuple[Any, Any]], refused: list[Refused]) -> list[str]:
    """Plan notes: what each other setup would cost at the chosen configuration, and its own best plan.
    `chosen`/`others`: (calibration variant, plan); `refused`: (method, why it was not planned)."""
    chosen_cal, chosen_plan = chosen
    config: StepConfig = chosen_plan.chosen.config
    mine = chosen_cal.predict(config)
    if not chosen_plan.meets_deadline:
        why = "the shortest plan that fits memory (none meets the deadline)"
    elif chosen_plan.step_limit:
        why = "the most tokens trained before the deadline (--fit-deadline)"
    else:
        why = "the fastest that fits memory and the deadline"
    lines = [f"setups measured: {len(others) + len(refused) + 1}; chosen: {variant_name(*chosen_cal.variant_key)}, {why}"]
    for cal, plan in others:
        theirs = cal.predict(config)
        parts = [f"step ×{theirs.step_seconds / mine.step_seconds:.2f}"]
        if theirs.peak_memory_bytes is not None and mine.peak_memory_bytes is not None:
            difference = (mine.peak_memory_bytes - theirs.peak_memory_bytes) / GIB
            parts.append(f"{abs(difference):.2f} GiB {'less' if difference >= 0 else 'more'} peak memory")
        largest = largest_fitting_micro_batch(cal, config)
        more = " and more" if largest == LARGEST_MICRO_BATCH else ""
        parts.append(f"fits micro-batch {largest}{more}" if largest else "does not fit even micro-batch 1")
        own = plan.chosen
        verdict = "meets the deadline" if plan.meets_deadline else "misses the deadline"
        shape = f"{own.optimizer_steps:,} steps of {own.label()}"
        parts.append(f"its best plan {shape}, {own.tokens:,} tokens: {_duration(own.total_seconds)} ({verdict})")
        lines.append(f"{variant_name(*cal.variant_key)}: " + ", ".join(parts))
    lines.extend(f"{variant_name(setup.method.quantize, setup.method.optimizer)}: not planned ({setup.reason})" for setup in refused)
    return lines


def _duration(seconds: float) -> str:
    return format_duration(seconds)


def fit_verdict(peak: float, limit: float, margin: float) -> str:
    """ "fits the 24 GiB", "fits the 16 GiB only without the 10% margin plans keep", "does not fit the 16 GiB"."""
    device = f"the {gib_text(limit)} GiB"
    if peak * (1 + margin) <= limit:
        return f"fits {device}"
    return f"fits {device} only without the {margin:.0%} margin plans keep" if peak <= limit else f"does not fit {device}"


def unmeasured_bases(spec: Any, method: Any, calibration: Any, hardware: dict[str, Any], activations: tuple[float, str] | None) -> list[str]:
    """For LoRA: each base (none/8bit/4bit) the calibration did not measure, what it would hold
    before activations (computed from the model's shapes, train.planning.memory_check) against
    this run's, and, given predicted activations (bytes, and at what: "this plan's configuration"),
    whether it would fit the device. Its speed is not known until bench measures it."""
    if not method.is_lora or not quantization_available():
        return []
    measured = {variant.variant_key[0] for variant in calibration.variants()}
    device_type, limit = hardware["device_type"], float(hardware["memory_bytes"])
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
