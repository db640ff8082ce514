"""Will the model even fit? Its fixed memory (weights, gradients, optimizer state) counted on
`meta`, checked in seconds before anything is built on the device. The bytes and why:
docs/design.md#memory-check."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.training import base_phrase
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.step.hardware import allocator_conf
from benchtrain.train.step.sharding import largest_block_parameters
from benchtrain.train.workload.method import METHODS, MethodConfig, apply_method, decoder_blocks
from benchtrain.train.workload.model import ModelSpec, make_config
from benchtrain.train.workload.optimizers import OPTIMIZERS, optimizer_state_bytes, same_state_groups
from benchtrain.train.workload.quantize import QuantizedBytes, quantized_bytes, require_bitsandbytes

if TYPE_CHECKING:
    import torch

    from benchtrain.calibration.model import Calibration

FP32_BYTES = 4
BF16_BYTES = 2
GIB = 2**30


def compute_bytes(device_type: str) -> int:
    """Bytes of a parameter as the forward uses it: bf16 on CUDA, fp32 on CPU (a frozen LoRA base is kept so; FSDP gathers shards so)."""
    return BF16_BYTES if device_type == "cuda" else FP32_BYTES


@dataclass(frozen=True)
class MemoryNeed:
    total_parameters: int
    trainable_parameters: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    blocks: int = 0  # decoder blocks (FSDP units, with the root)
    largest_block_parameters: int = 0
    built_whole: bool = False  # a 4-bit base: each FSDP process quantizes all of it before sharding it

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes

    def building_bytes(self, sharding: str) -> float:
        """What one process holds while the model is built, before sharding: the whole 4-bit base
        under FSDP (bitsandbytes quantizes real tensors, train.step.engine), else nothing beyond
        `per_process_bytes` (FSDP builds on `meta`, DDP holds it all anyway)."""
        return float(self.weights_bytes) if sharding == "fsdp" and self.built_whole else 0.0

    def per_process_bytes(self, sharding: str, world_size: int, device_type: str) -> float:
        """What one process holds before activations: everything (DDP), or its FSDP shard plus the
        two blocks gathered whole at a time (the current one and the prefetched next)."""
        if sharding != "fsdp" or world_size < 2:
            return float(self.total_bytes)
        gathered = 2 * self.largest_block_parameters * compute_bytes(device_type)
        return self.total_bytes / world_size + gathered


_META_MODELS: dict[str, torch.nn.Module] = {}


def meta_model(spec: ModelSpec, method: MethodConfig) -> torch.nn.Module:
    """The model as it will be trained, adapters included, built on `meta` (no memory, no weights):
    exact shapes; one build per architecture and adapter shape (docs/design.md#memory-check)."""
    import torch
    from transformers import AutoModelForCausalLM

    shaped = MethodConfig(method=method.method, lora_rank=method.lora_rank, lora_targets=method.lora_targets)
    key = json.dumps([spec.config_dict, repr(shaped)], sort_keys=True, default=str)
    if key not in _META_MODELS:
        with torch.device("meta"):
            # transformers leaves from_config unannotated.
            _META_MODELS[key] = apply_method(AutoModelForCausalLM.from_config(make_config(spec)), shaped)  # type: ignore[no-untyped-call]
    return _META_MODELS[key]


def trainable_sizes(spec: ModelSpec, method: MethodConfig) -> list[int]:
    """The values of each trainable tensor (what an optimizer keeps state for)."""
    return [parameter.numel() for parameter in meta_model(spec, method).parameters() if parameter.requires_grad]


def memory_need(spec: ModelSpec, method: MethodConfig, device_type: str) -> MemoryNeed:
    """The fixed memory of the model as it will be trained, counted on `meta`."""
    model = meta_model(spec, method)
    total = sum(parameter.numel() for parameter in model.parameters())
    sizes = trainable_sizes(spec, method)
    trainable = sum(sizes)
    frozen_bytes = (
        quantized_base_bytes(spec, method.quantize).total
        if method.quantized
        else (total - trainable) * compute_bytes(device_type)
    )
    blocks = decoder_blocks(model)
    return MemoryNeed(
        total_parameters=total,
        trainable_parameters=trainable,
        weights_bytes=frozen_bytes + trainable * FP32_BYTES,
        gradient_bytes=trainable * FP32_BYTES,
        optimizer_bytes=optimizer_state_bytes(method.optimizer, sizes),
        blocks=len(blocks),
        largest_block_parameters=largest_block_parameters(blocks),
        built_whole=method.quantized,
    )


def quantized_base_bytes(spec: ModelSpec, kind: str) -> QuantizedBytes:
    """The frozen base's bytes quantized as `kind` (train.workload.quantize.QuantizedBytes): the
    layers bitsandbytes converts packed, the rest in fp32, where peft's preparation for k-bit
    training puts them (train.workload.quantize.quantized_base)."""
    return quantized_bytes(meta_model(spec, MethodConfig()), kind, FP32_BYTES)


# The most processes `gpus_needed` looks at: past it, no count of this device holds the model.
MAX_PROCESSES = 4096


def gpus_needed(need: MemoryNeed, hardware: Hardware) -> int | None:
    """How many devices like `hardware` a run needs for its fixed memory (weights, gradients,
    optimizer state) to fit in each, FSDP sharding it over them (`per_process_bytes`): 1 when it
    fits whole; None when no count does (the blocks gathered whole already exceed one device)."""
    available = float(hardware.memory_bytes)
    device_type = hardware.device_type
    if need.per_process_bytes("none", 1, device_type) <= available:
        return 1
    if (
        need.per_process_bytes("fsdp", MAX_PROCESSES, device_type) > available
        or need.building_bytes("fsdp") > available
    ):
        return None
    # Fewest processes whose shard plus gathered blocks fits; bytes per process fall with the count.
    counts = range(2, MAX_PROCESSES + 1)
    return counts[
        bisect.bisect_left(
            counts, True, key=lambda count: need.per_process_bytes("fsdp", count, device_type) <= available
        )
    ]


def describe_gpus_needed(need: MemoryNeed, hardware: Hardware) -> str | None:
    """ "it needs 2 of these devices under FSDP (≈64.9 GiB per process before activations)", or None when it fits one (or no count of them)."""
    count = gpus_needed(need, hardware)
    if count is None or count == 1:
        return None
    each = need.per_process_bytes("fsdp", count, hardware.device_type)
    return f"it needs {count} of these devices under FSDP (≈{each / GIB:.1f} GiB per process before activations, the fewest whose shards fit)"


def check_fits(
    spec: ModelSpec, method: MethodConfig, hardware: Hardware, sharding: str = "none", world_size: int = 1
) -> MemoryNeed:
    """The need, or a one-line error naming it, the device's memory and what would fit."""
    need = memory_need(spec, method, hardware.device_type)
    available = float(hardware.memory_bytes)
    entry = METHODS[method.method]
    what = entry.phrase + (f" rank {method.lora_rank}" if entry.adapters else "")
    if need.building_bytes(sharding) > available:
        raise DoesNotFitError(
            f"{what} of {spec.name} under FSDP builds the whole 4-bit base on each process before sharding it (≈{need.weights_bytes / GIB:.0f} GiB); "
            f"this {hardware.name} has {gib_text(available)} GiB: a device with more memory, or a smaller model"
        )
    needed = need.per_process_bytes(sharding, world_size, hardware.device_type)
    if needed <= available:
        return need
    options = []
    if not entry.adapters:
        lora = memory_need(spec, MethodConfig(method="lora"), hardware.device_type)
        if lora.total_bytes <= available:
            options.append(f"use --lora (≈{lora.total_bytes / GIB:.0f} GiB before activations)")
    options.extend(smaller_bases(spec, method, hardware.device_type, available))
    if method.quantize != "8bit":  # an 8-bit base is not sharded (train.step.sharding)
        count = gpus_needed(need, hardware)
        processes = str(count) if count else "N"
        if sharding != "fsdp":
            options.append(
                f"shard it over several GPUs (accelerate launch --num_processes {processes} -m benchtrain.train … --sharding fsdp)"
            )
        else:
            options.append(f"shard it over more processes ({processes})")
    options.append("a smaller model or a device with more memory")
    where = f" per process ({world_size} FSDP processes)" if sharding == "fsdp" else ""
    many = None if method.quantize == "8bit" else describe_gpus_needed(need, hardware)
    raise DoesNotFitError(
        f"{what} of {spec.name} needs ≈{needed / GIB:.0f} GiB{where} for weights, gradients and optimizer state before any "
        f"activations; this {hardware.name} has {gib_text(available)} GiB{' (--device-memory)' if hardware.memory_from else ''}: "
        f"{', or '.join(options[:2])}{f'; {many}' if many else ''}"
    )


def gib_text(size_bytes: float) -> str:
    """A device's memory in GiB as people quote it: 79, 24, 0.9."""
    gib = size_bytes / GIB
    return f"{gib:.0f}" if gib >= 10 else f"{gib:.2g}"


def smaller_bases(spec: ModelSpec, method: MethodConfig, device_type: str, available: float) -> list[str]:
    """For LoRA: the bitsandbytes bases, smaller than this run's, whose fixed memory fits in
    `available` bytes, as advice ("--quantize 4bit (≈11 GiB before activations)")."""
    if not method.is_lora or not quantization_available():
        return []
    mine = memory_need(spec, method, device_type).total_bytes
    options = []
    for kind in ("8bit", "4bit"):
        need = memory_need(spec, replace(method, quantize=kind), device_type).total_bytes
        if kind != method.quantize and need < mine and need <= available:
            options.append(f"--quantize {kind} (≈{need / GIB:.0f} GiB before activations)")
    return options


def quantization_available() -> bool:
    try:
        require_bitsandbytes()
    except BenchtrainError:
        return False
    return True


def describe_needs(
    spec: ModelSpec,
    chosen: MethodConfig,
    hardware: Hardware,
    sharding: str = "none",
    world_size: int = 1,
    calibration_device: bool = False,
) -> str:
    """One line for `train --dry-run`: the fixed memory of each method on `hardware` — this device,
    or the one the calibration measured when the dry run plans for another — (and, under FSDP,
    what each process holds)."""
    parts = []
    lora = chosen if chosen.is_lora else MethodConfig(method="lora")
    bases = [
        replace(lora, quantize=kind)
        for kind in ("none", "8bit", "4bit")
        if kind == lora.quantize or quantization_available()
    ]
    for method in (MethodConfig(method="full"), *bases):
        need = memory_need(spec, method, hardware.device_type)
        entry = METHODS[method.method]
        label = entry.phrase + (f" r{method.lora_rank}" if entry.adapters else "")
        detail = ""
        if method.quantized:
            base = quantized_base_bytes(spec, method.quantize)
            label += f" on {base_phrase(method.quantize)}"
            detail = f" ({base.quantized / GIB:.2f} packed + {base.statistics / GIB:.2f} statistics + {base.unquantized / GIB:.2f} unquantized)"
        sharded = ""
        if sharding == "fsdp" and method.quantize != "8bit":
            sharded = f" (≈{need.per_process_bytes(sharding, world_size, hardware.device_type) / GIB:.2f} GiB per process, FSDP × {world_size})"
        parts.append(f"{label} ≈{need.total_bytes / GIB:.2f} GiB{detail}{sharded}")
    device = f"the calibration's {hardware.name}" if calibration_device else f"this device ({hardware.name})"
    optimizer = optimizer_states(spec, chosen)
    return f"memory before activations: {', '.join(parts)}; {optimizer}; {device} has {gib_text(hardware.memory_bytes)} GiB"


def optimizer_states(spec: ModelSpec, chosen: MethodConfig) -> str:
    """ "optimizer state: 18 MiB with adamw or adamw-fused, 4.57 MiB with adamw-8bit or paged-adamw-8bit, 9 MiB with sgd (this run: adamw)":
    each optimizer of train.workload.optimizers.OPTIMIZERS, those of the same state bytes together."""
    sizes = trainable_sizes(spec, chosen)  # the same tensors whichever optimizer keeps state for them
    groups = same_state_groups(OPTIMIZERS.values())
    texts = [
        f"{group[0].state_bytes(sizes) / 2**20:.3g} MiB with {' or '.join(entry.name for entry in group)}"
        for group in groups
    ]
    return f"optimizer state: {', '.join(texts)} (this run: {chosen.optimizer})"


def memory_basis_note(calibration: Calibration) -> str | None:
    """What the plan's peak memory stands on, for a GPU calibration (a line of the plan's notes);
    None on CPU (the peak RSS is the whole process) or without a memory fit (docs/design.md#peak-memory-basis)."""
    memory = (calibration.fit or {}).get("memory")
    if not memory or calibration.hardware.device_type != "cuda":
        return None
    if memory.get("basis") == "reserved":
        outside = float(memory.get("non_torch_bytes") or 0.0)
        measured, here = calibration.allocator_conf, allocator_conf()
        differs = (
            f"; measured with allocator settings {measured or 'default'}, this run has {here or 'default'}"
            if measured != here
            else ""
        )
        return (
            f"peak memory: the CUDA allocator's reserved peak (fragmentation included) + {outside / GIB:.2f} GiB measured outside it "
            f"(CUDA context, kernels, NCCL), as the probes measured them from an empty cache{differs}"
        )
    return (
        f"peak memory: calibration {calibration.id} measured the CUDA allocator's allocated peak only: the plan leaves out its "
        "fragmentation and the CUDA context (≈0.5 GiB or more); re-run `bench run` to measure them"
    )
