"""The optimizer that trains the weights: AdamW in fp32 (torch's fused kernel), or bitsandbytes'
8-bit AdamW, plain or paged, and the bytes of its state.

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

OPTIMIZER_CHOICES = ("adamw", "adamw-8bit", "paged-adamw-8bit")
FP32_BYTES = 4
BLOCKSIZE_8BIT = 256  # values per absmax in bitsandbytes' 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # tensors smaller than this keep fp32 moments
QUANTIZATION_MAP_VALUES = 256
BETAS = (0.9, 0.95)


def check_optimizer(name: str) -> None:
    if name not in OPTIMIZER_CHOICES:
        raise BenchtrainError(f"--optimizer must be one of {', '.join(OPTIMIZER_CHOICES)}, got {name!r}")
    if name != "adamw":
        from train.workload.quantize import require_bitsandbytes

        require_bitsandbytes(f"--optimizer {name}")


def is_8bit(name: str) -> bool:
    return name.endswith("8bit")


def optimizer_state_bytes(name: str, trainable_sizes: list[int]) -> int:
    """The bytes of the optimizer's state for trainable tensors of these sizes (values each)."""
    if not is_8bit(name):
        return sum(trainable_sizes) * 2 * FP32_BYTES
    total = 0
    quantized_any = False
    for size in trainable_sizes:
        if size < MIN_8BIT_SIZE:
            total += size * 2 * FP32_BYTES
        else:
            quantized_any = True
            total += 2 * (size + math.ceil(size / BLOCKSIZE_8BIT) * FP32_BYTES)
    return total + (2 * QUANTIZATION_MAP_VALUES * FP32_BYTES if quantized_any else 0)


def make_optimizer(name: str, groups: list[dict[str, Any]], learning_rate: float) -> Any:
    """`name`'s optimizer over parameter `groups`: fused AdamW (one kernel per step, no host sync of
    the step count), or bitsandbytes' 8-bit AdamW (paged or not) with the same betas."""
    if name == "adamw":
        import torch

        return torch.optim.AdamW(groups, lr=learning_rate, betas=BETAS, fused=True)
    import warnings

    import bitsandbytes as bnb

    # "Paged optimizers are not supported on CPU": on CPU the paged one is the plain one, as said above.
    warnings.filterwarnings("ignore", message=r"Paged optimizers are not supported on CPU.*", category=UserWarning)
    cls = bnb.optim.PagedAdamW8bit if name.startswith("paged") else bnb.optim.AdamW8bit
    return cls(groups, lr=learning_rate, betas=BETAS)
