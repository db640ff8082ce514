"""The optimizer that trains the weights: AdamW in fp32 (torch's fused kernel), bitsandbytes' 8-bit
AdamW, plain or paged, or SGD with momentum, and the bytes of its state.

- `adamw` (the default, as before): torch's AdamW with its fused kernel where the device has one
  (CUDA and CPU among them), else its foreach kernel, said in a warning.
- `adamw-fused`: the same fused AdamW, HF's `adamw_torch_fused`, refused (one line) on a device
  without the kernel instead of falling back; its own setup in a calibration like any other.
- `sgd`: torch's SGD with momentum 0.9 (SGD_MOMENTUM, not Nesterov), weight decay as AdamW's
  groups have it: one fp32 momentum buffer per trainable value, half AdamW's state.

8-bit AdamW (Dettmers et al., "8-bit Optimizers via Block-wise Quantization") keeps both moments of
a tensor as one byte each, with an fp32 absmax per block of 256 values; tensors under 4,096 values
keep fp32 moments (bitsandbytes' `min_8bit_size`), and the two 256-entry fp32 quantization maps are
shared by every tensor. The paged variant holds the same bytes in CUDA unified memory, which the
driver pages out to the host under memory pressure instead of failing (on CPU it is the plain one).
Which is faster, and by how much, is measured by bench like any other choice.
"""

from __future__ import annotations

import math
from typing import Any

from common.errors import BenchtrainError

OPTIMIZER_CHOICES = ("adamw", "adamw-8bit", "paged-adamw-8bit", "adamw-fused", "sgd")
FP32_BYTES = 4
BLOCKSIZE_8BIT = 256  # values per absmax in bitsandbytes' 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # tensors smaller than this keep fp32 moments
QUANTIZATION_MAP_VALUES = 256
BETAS = (0.9, 0.95)
EPSILON = 1e-8
SGD_MOMENTUM = 0.9


def check_optimizer(name: str) -> None:
    if name not in OPTIMIZER_CHOICES:
        raise BenchtrainError(f"--optimizer must be one of {', '.join(OPTIMIZER_CHOICES)}, got {name!r}")
    if is_8bit(name):
        from train.workload.quantize import require_bitsandbytes

        require_bitsandbytes(f"--optimizer {name}")


def is_8bit(name: str) -> bool:
    return name.endswith("8bit")


def optimizer_state_bytes(name: str, trainable_sizes: list[int]) -> int:
    """The bytes of the optimizer's state for trainable tensors of these sizes (values each)."""
    if name == "sgd":
        return sum(trainable_sizes) * FP32_BYTES  # one momentum buffer
    if not is_8bit(name):
        return sum(trainable_sizes) * 2 * FP32_BYTES  # exp_avg and exp_avg_sq (the step count is a scalar)
    total = 0
    quantized_any = False
    for size in trainable_sizes:
        if size < MIN_8BIT_SIZE:
            total += size * 2 * FP32_BYTES
        else:
            quantized_any = True
            total += 2 * (size + math.ceil(size / BLOCKSIZE_8BIT) * FP32_BYTES)
    return total + (2 * QUANTIZATION_MAP_VALUES * FP32_BYTES if quantized_any else 0)


def fused_devices() -> list[str]:
    """The device types torch has a fused AdamW kernel for."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: the devices torch 2.4+ fuses on
        return ["cuda", "cpu"]


def has_fused_adamw(groups: list[dict[str, Any]]) -> bool:
    """Whether every parameter sits on a device torch fuses AdamW on, in a floating-point type."""
    devices = fused_devices()
    return all(p.device.type in devices and p.is_floating_point() for group in groups for p in group["params"])


def make_optimizer(name: str, groups: list[dict[str, Any]], learning_rate: float, betas: tuple[float, float] = BETAS, eps: float = EPSILON) -> Any:
    """`name`'s optimizer over parameter `groups` (each with its weight decay): fused AdamW (one
    kernel per step, no host sync of the step count), SGD with momentum, or bitsandbytes' 8-bit
    AdamW (paged or not) with the same betas."""
    if name in ("adamw", "adamw-fused"):
        import torch

        fused = has_fused_adamw(groups)
        if not fused and name == "adamw-fused":
            device = next((p.device.type for group in groups for p in group["params"]), "?")
            raise BenchtrainError(f"--optimizer adamw-fused: torch {torch.__version__} has no fused AdamW for {device}; use --optimizer adamw")
        if not fused:
            from common.console import say

            say("warning: torch has no fused AdamW for this device: adamw runs its foreach kernel")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused or None)
    if name == "sgd":
        import torch

        return torch.optim.SGD(groups, lr=learning_rate, momentum=SGD_MOMENTUM)
    import warnings

    import bitsandbytes as bnb

    # "Paged optimizers are not supported on CPU": on CPU the paged one is the plain one, as said above.
    warnings.filterwarnings("ignore", message=r"Paged optimizers are not supported on CPU.*", category=UserWarning)
    cls = bnb.optim.PagedAdamW8bit if name.startswith("paged") else bnb.optim.AdamW8bit
    return cls(groups, lr=learning_rate, betas=betas, eps=eps)
