"""`torch.compile` in THE step: decoder blocks compiled in place, shapes kept few, what it costs.
Design: docs/design.md#torchcompile"""

from __future__ import annotations

import socket
from collections.abc import Set
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.method import decoder_blocks, unwrap

if TYPE_CHECKING:
    import torch

    from benchtrain.train.workload.batching import BatchShape

COMPILE_CHOICES = ("auto", "on", "off")
SHAPE_BUCKET = 64
# Compiled graphs kept per block: every distinct shape, and both checkpointing states, of a
# benchmark or a run (torch's default of 8 would silently fall back to eager).
RECOMPILE_LIMIT = 256


def compile_enabled(choice: str, device_type: str) -> bool:
    """`--compile auto` compiles on CUDA only: on CPU the first step of each shape costs tens of
    seconds of C++ compilation for a small gain. `choice` is checked by StepOptions."""
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def compile_blocks(model: torch.nn.Module) -> None:
    """Compile `model`'s repeated blocks in place; the whole model when it names none."""
    import torch

    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = RECOMPILE_LIMIT * 8
    for block in decoder_blocks(model) or [unwrap(model)]:
        block.compile(dynamic=False)


def eager_region(compiled: bool) -> AbstractContextManager:
    """Run compiled modules eagerly inside this block (evaluation)."""
    if not compiled:
        return nullcontext()
    import torch

    return torch.compiler.set_stance("force_eager")


def compile_cache_record() -> dict[str, str]:
    """Where inductor keeps compiled kernels on this machine (bench records it with the training settings of its calibration)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {"dir": str(cache_dir()), "host": socket.gethostname()}


def compile_seconds(
    measured: JsonDict, shapes: Set[BatchShape], probed: Set[BatchShape], cache: dict[str, str] | None
) -> float:
    """What compiling costs a run that meets `shapes` (rows, length): one compilation each, from inductor's
    cache (measured by bench) for the shapes bench probed on this machine, from scratch for the others."""
    cold = float(measured.get("compile_seconds_per_shape", 0.0))
    cached = float(measured.get("compile_cached_seconds_per_shape", cold))
    # Bench's kernels are found only on its machine, while its cache is still there.
    cache_here = cache is not None and cache.get("host") == socket.gethostname() and Path(cache.get("dir", "")).is_dir()
    reusable: Set[BatchShape] = probed if cache_here else set()
    return sum(cached if shape in reusable else cold for shape in shapes)
