"""What a calibration measured, in words (method, LoRA rank, quantization, checkpointing, processes),
and why `latest` preferred one calibration over a newer one. Pure functions over the JSON dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from benchtrain.calibration.adapters import trains_adapters
from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.distributed import Distributed
from benchtrain.calibration.step_config import Mode
from benchtrain.calibration.training import UNQUANTIZED, Training, base_phrase
from benchtrain.common.json_types import JsonDict


@dataclass(frozen=True)
class Setup:
    """What was measured (`measured_setup`) or what a run trains (built by `train`); `setup_difference` compares the two."""

    model_name: str
    model_fingerprint: str | None
    method: str = "full"  # "full" | "lora"
    lora_rank: int | None = None
    quantization: str = UNQUANTIZED  # as --quantize names it: "none" (the base in its own precision), "4bit", "8bit"
    world_size: int = 1
    sharding: str = "none"
    # The modes (switches on, calibration.dimensions) the probes measured; a run's is left empty:
    # the plan picks its mode, so it never makes one calibration suit a run better.
    modes: tuple[Mode, ...] = ()
    # What joined the measured devices (calibration.topology's word); None: not recorded.
    interconnect: str | None = None
    # The device it was measured on (hardware.name); None: a run's, or not recorded.
    device: str | None = None


def measured_setup(data: JsonDict) -> Setup:
    """The setup a calibration (or one of its variants, calibration.schema.variant_data) measured, read from its
    sections once; a record without a training section (a hand-made one) measured full fine-tuning."""
    training = Training.from_record(data.get("training"))
    distributed = Distributed.from_record(data.get("distributed"))
    model = data.get("model") or {}
    # Skipped probes never ran: the modes measured are those of the probes that did.
    probed = [row for row in data.get("measurements") or [] if row.get("status") != "skipped"]
    interconnect = (data.get("hardware") or {}).get("interconnect")
    return Setup(
        model_name=str(model.get("name", "?")),
        model_fingerprint=model.get("fingerprint"),
        method=training.method,
        lora_rank=training.lora_rank if trains_adapters(training.method) else None,
        quantization=training.quantization,
        world_size=distributed.world_size,
        sharding=distributed.sharding,
        modes=tuple(sorted({tuple(d.name for d in switches() if row.get(d.name) or 0) for row in probed})),
        interconnect=str(interconnect) if interconnect else None,
        device=str((data.get("hardware") or {}).get("name") or "") or None,
    )


class Variant(NamedTuple):
    """What one calibration may measure several of (`bench run --quantize none,4bit --optimizer adamw,adamw-8bit`), as
    --quantize/--optimizer name them; stored as each entry's `training` keys."""

    quantize: str
    optimizer: str


def variant_of(data: JsonDict) -> Variant:
    """The variant a calibration (or one of its variants' entries) measured."""
    training = Training.from_record(data.get("training"))
    return Variant(training.quantization, training.optimizer)


def variant_name(quantize: str, optimizer: str) -> str:
    """ "a 4-bit base", "an unquantized base with adamw-8bit": one of a calibration's variants."""
    base = base_phrase(quantize)
    return base if optimizer == "adamw" else f"{base} with {optimizer}"


def describe_setup(data: JsonDict) -> str:
    """One phrase: "LoRA r16 on a 4-bit base, checkpointing off+on, 2 processes (ddp)"."""
    setup = measured_setup(data)
    quantized = setup.quantization != UNQUANTIZED
    parts = [_method_phrase(setup) + (f" on {base_phrase(setup.quantization)}" if quantized else "")]
    if data.get("variants"):
        measured = [data, *data["variants"]]
        parts.append("measured " + " and ".join(variant_name(*variant_of(entry)) for entry in measured))
    if setup.modes:
        for dimension in switches():  # "checkpointing off+on"
            measured_on = sorted({dimension.name in mode for mode in setup.modes})
            parts.append(f"{dimension.axis} " + "+".join("on" if on else "off" for on in measured_on))
    parts.append(_processes_phrase(setup))
    return ", ".join(parts)


def setup_difference(chosen: JsonDict, passed_over: JsonDict, run: Setup) -> str:
    """Why `chosen` suits `run` better than the newer `passed_over`: "the newer cpu-gpt2-… measured full fine-tuning
    (this run: LoRA r16)". An aspect is named only where the newer one differs from the run and from `chosen` too."""
    mine, newer = measured_setup(chosen), measured_setup(passed_over)
    reasons = []
    if newer.model_fingerprint != run.model_fingerprint and newer.model_fingerprint != mine.model_fingerprint:
        reasons.append(f"model {_model_phrase(newer, run)} (this run: {_model_phrase(run, newer)})")
    if not _same_method(newer, run) and not _same_method(newer, mine):
        reasons.append(f"{_method_phrase(newer)} (this run: {_method_phrase(run)})")
    if newer.quantization != run.quantization and newer.quantization != mine.quantization:
        reasons.append(f"{base_phrase(newer.quantization)} (this run: {base_phrase(run.quantization)})")
    if (newer.world_size, newer.sharding) != (run.world_size, run.sharding) and (newer.world_size, newer.sharding) != (
        mine.world_size,
        mine.sharding,
    ):
        reasons.append(f"{_processes_phrase(newer)} (this run: {_processes_phrase(run)})")
    name = passed_over.get("id", "calibration")
    if not reasons:  # preferences other than these aspects chose: say what the newer one measured
        return f"the newer {name} ({describe_setup(passed_over)})"
    return f"the newer {name} measured " + ", ".join(reasons)


def _same_method(one: Setup, other: Setup) -> bool:
    """The same method, and the same LoRA rank where both know it (a run may leave it out)."""
    ranks = {one.lora_rank, other.lora_rank} - {None}
    return one.method == other.method and len(ranks) < 2


def _method_phrase(setup: Setup) -> str:
    if not trains_adapters(setup.method):
        return "full fine-tuning"
    name = "LoRA" if setup.method == "lora" else setup.method  # another adapter method by its name (DoRA: "dora")
    return f"{name} r{setup.lora_rank}" if setup.lora_rank is not None else name


def _processes_phrase(setup: Setup) -> str:
    count = f"{setup.world_size} process" + ("" if setup.world_size == 1 else "es")
    return count if setup.sharding == "none" else f"{count} ({setup.sharding})"


def _model_phrase(setup: Setup, other: Setup) -> str:
    """The model's name; its fingerprint too when both share the name (another revision or config)."""
    if setup.model_name != other.model_name or setup.model_fingerprint is None:
        return setup.model_name
    return f"{setup.model_name} [{setup.model_fingerprint}]"
