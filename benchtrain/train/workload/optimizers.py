"""The optimizers, in one table: `OPTIMIZERS`, an entry per `--optimizer` value (its build, state
bytes, HF Trainer's name, help phrase, needs). Adding one is adding an entry. docs/design.md#optimizers"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, cast

from benchtrain.common.console import say
from benchtrain.common.errors import BenchtrainError

if TYPE_CHECKING:
    import torch


class ParameterGroup(TypedDict):
    """Trainable parameters that share a weight decay (parameter_groups: matrices, and the rest)."""

    params: list[torch.nn.Parameter]
    weight_decay: float


def torch_groups(groups: list[ParameterGroup]) -> list[dict[str, Any]]:
    """The groups as torch's and bitsandbytes' optimizers take them (any keys: a dict of str)."""
    return cast("list[dict[str, Any]]", groups)


class Betas(NamedTuple):
    """Adam's decay rates: of the running mean of gradients, and of their squares."""

    beta1: float
    beta2: float


FP32_BYTES = 4
BLOCKSIZE_8BIT = 256  # values per absmax in bitsandbytes' 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # tensors smaller than this keep fp32 moments
QUANTIZATION_MAP_VALUES = 256
SGD_MOMENTUM = 0.9
DEFAULT_OPTIMIZER = "adamw"

# An optimizer over parameter groups (each with its weight decay): (groups, learning rate, betas, epsilon).
Build = Callable[[list[ParameterGroup], float, Betas, float], "torch.optim.Optimizer"]


@dataclass(frozen=True)
class StateBytes:
    """The bytes of an optimizer's state for trainable tensors of these sizes (values each): `buffers` tensors the
    size of each parameter (AdamW's two moments, SGD's momentum), in fp32, or with `eight_bit` as bitsandbytes keeps
    them. Equal ones share a line of the dry run's "optimizer state"."""

    buffers: int
    eight_bit: bool = False

    def __call__(self, trainable_sizes: list[int]) -> int:
        if not self.eight_bit:
            return sum(trainable_sizes) * self.buffers * FP32_BYTES
        small = sum(size for size in trainable_sizes if size < MIN_8BIT_SIZE)
        quantized = [size for size in trainable_sizes if size >= MIN_8BIT_SIZE]
        blocks = sum(size + math.ceil(size / BLOCKSIZE_8BIT) * FP32_BYTES for size in quantized)
        return self.buffers * (small * FP32_BYTES + blocks) + (
            2 * QUANTIZATION_MAP_VALUES * FP32_BYTES if quantized else 0
        )


@dataclass(frozen=True)
class Optimizer:
    """One `--optimizer` value. `state_bytes` may be any function of the trainable tensors' sizes
    (a StateBytes for the usual ones); `hf_optim` is run.json's `optim`, as HF Trainer names it."""

    name: str
    build: Build
    state_bytes: Callable[[list[int]], int]
    hf_optim: str
    help: str
    needs_bitsandbytes: bool = False
    shards_parameters: bool = True  # steps FSDP2's sharded (DTensor) parameters


def fused_devices() -> list[str]:
    """The device types torch has a fused AdamW kernel for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def torch_adamw(
    groups: list[ParameterGroup], learning_rate: float, betas: Betas, eps: float, refuse_unfused: bool = False
) -> torch.optim.Optimizer:
    """Fused AdamW (one kernel per step, no host sync of the step count) when every parameter is a floating-point one
    on a device with the kernel; else the foreach one with a warning (adamw), or (`refuse_unfused`: adamw-fused, HF's
    `adamw_torch_fused`) a one-line error."""
    import torch

    devices = fused_devices()
    fused = all(p.device.type in devices and p.is_floating_point() for group in groups for p in group["params"])
    if not fused and refuse_unfused:
        device = next((p.device.type for group in groups for p in group["params"]), "?")
        raise BenchtrainError(
            f"--optimizer adamw-fused: torch {torch.__version__} has no fused AdamW for {device}; use --optimizer adamw"
        )
    if not fused:
        say("warning: torch has no fused AdamW for this device: adamw runs its foreach kernel")
    return torch.optim.AdamW(torch_groups(groups), lr=learning_rate, betas=betas, eps=eps, fused=fused or None)


def torch_sgd(groups: list[ParameterGroup], learning_rate: float, betas: Betas, eps: float) -> torch.optim.Optimizer:
    """SGD with momentum SGD_MOMENTUM (not Nesterov; betas and epsilon are Adam's: unused): one fp32 momentum buffer per trainable value, half AdamW's state."""
    import torch

    return torch.optim.SGD(torch_groups(groups), lr=learning_rate, momentum=SGD_MOMENTUM)


def bitsandbytes_adamw(paged: bool) -> Build:
    """bitsandbytes' 8-bit AdamW, paged or not, with the same betas and epsilon as torch's."""

    def build(groups: list[ParameterGroup], learning_rate: float, betas: Betas, eps: float) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        # "Paged optimizers are not supported on CPU": on CPU the paged one is the plain one, as said above.
        warnings.filterwarnings("ignore", message=r"Paged optimizers are not supported on CPU.*", category=UserWarning)
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return cls(torch_groups(groups), lr=learning_rate, betas=betas, eps=eps)

    return build


ADAM_STATE = StateBytes(buffers=2)  # exp_avg and exp_avg_sq
ADAM_8BIT_STATE = StateBytes(buffers=2, eight_bit=True)
# The order is the choices' order (`--optimizer must be one of ...`, --help), the default first.
# Each entry: name, build, state bytes, HF Trainer's `optim`, --help phrase, needs bitsandbytes, steps FSDP's shards.
OPTIMIZERS: dict[str, Optimizer] = {
    entry.name: entry
    for entry in (
        Optimizer(
            "adamw", torch_adamw, ADAM_STATE, "adamw_torch_fused", "fp32 moments, fused where the device has the kernel"
        ),
        Optimizer(
            "adamw-8bit",
            bitsandbytes_adamw(paged=False),
            ADAM_8BIT_STATE,
            "adamw_bnb_8bit",
            "bitsandbytes' 8-bit moments",
            True,
            False,
        ),
        Optimizer(
            "paged-adamw-8bit",
            bitsandbytes_adamw(paged=True),
            ADAM_8BIT_STATE,
            "paged_adamw_8bit",
            "the same in CUDA unified memory, paged to the host under pressure",
            True,
            False,
        ),
        Optimizer(
            "adamw-fused",
            partial(torch_adamw, refuse_unfused=True),
            ADAM_STATE,
            "adamw_torch_fused",
            "fused or refused",
        ),
        Optimizer("sgd", torch_sgd, StateBytes(buffers=1), "sgd", "momentum 0.9: one fp32 buffer"),
    )
}


def optimizer_named(name: str) -> Optimizer:
    if name not in OPTIMIZERS:
        raise BenchtrainError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


def check_optimizer_sharding(name: str, sharding: str) -> None:
    """One line where `name` cannot step the parameters `sharding` ("none", "ddp", "fsdp") gives it."""
    if sharding == "fsdp" and not optimizer_named(name).shards_parameters:
        usable = ", ".join(entry.name for entry in OPTIMIZERS.values() if entry.shards_parameters)
        raise BenchtrainError(
            f"--optimizer {name} cannot step FSDP's sharded parameters (bitsandbytes sizes its state from the whole tensor): "
            f"use --sharding ddp, or one of {usable} with --sharding fsdp"
        )


def optimizer_state_bytes(name: str, trainable_sizes: list[int]) -> int:
    """The bytes of the optimizer's state for trainable tensors of these sizes (values each)."""
    return optimizer_named(name).state_bytes(trainable_sizes)


def hf_optim(name: str) -> str:
    """HF Trainer's `optim` for `name` (a name not in the table, from an older run.json: itself)."""
    return OPTIMIZERS[name].hf_optim if name in OPTIMIZERS else name


def optimizer_help() -> str:
    """--optimizer's help: each choice with its phrase."""
    return ", ".join(f"{entry.name} ({entry.help})" for entry in OPTIMIZERS.values())


def same_state_groups(entries: Iterable[Optimizer]) -> list[list[Optimizer]]:
    """`entries` grouped by equal state bytes, in their order ("adamw or adamw-fused": one size said once)."""
    groups: dict[Callable[[list[int]], int], list[Optimizer]] = {}
    for entry in entries:
        groups.setdefault(entry.state_bytes, []).append(entry)
    return list(groups.values())


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[ParameterGroup]:
    """The trainable parameters in two groups: matrices with `weight_decay`, the rest (biases, norms) without, as HF Trainer and nanoGPT do."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
