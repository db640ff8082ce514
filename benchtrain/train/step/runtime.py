"""Device, precision and process agreement shared by `bench` probes and `train` runs.
Design: docs/design.md#runtime-devices-precision-and-process-agreement"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.peak_memory import physical_cpu_memory
from benchtrain.train.workload.method import quiet_library_warnings

if TYPE_CHECKING:
    from accelerate import Accelerator, PartialState
    from torch.distributed import Store


def job_world_size() -> int:
    """Processes the launcher started (accelerate launch and torchrun set WORLD_SIZE); 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# BENCHTRAIN_CPU_BF16=1: bench and train on CPU with bf16 autocast, as on a GPU.
CPU_BF16_VARIABLE = "BENCHTRAIN_CPU_BF16"


def cpu_bf16() -> bool:
    """Whether BENCHTRAIN_CPU_BF16 asks for bf16 autocast on CPU (1/true/yes/on; unset, 0/false/no/off: no)."""
    value = os.environ.get(CPU_BF16_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise BenchtrainError(f"{CPU_BF16_VARIABLE}={value!r}: use 1 (bf16 autocast on CPU) or 0 (fp32)")


def run_precision(device_type: str) -> str:
    """The precision a step on `device_type` runs in, as calibrations and run.json record it."""
    return "bf16" if device_type == "cuda" or cpu_bf16() else "fp32"


def make_accelerator(log_with: Sequence[str] = (), project_dir: Path | str | None = None) -> Accelerator:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    quiet_library_warnings()
    cuda = torch.cuda.is_available()
    if cuda:
        # TF32 for any fp32 matmul left outside autocast (nanoGPT, torchtitan do the same).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # Bench and train alike: a CPU step's peak RSS is what it holds, not how the heap fragmented.
        physical_cpu_memory()
    # DDP: no buffer broadcast before every forward (a collective per micro-step; a causal LM's
    # buffers, such as rotary frequencies, never change), and gradients bucketed in place.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True)
    return Accelerator(
        kwargs_handlers=[ddp],
        mixed_precision="bf16" if run_precision("cuda" if cuda else "cpu") == "bf16" else "no",  # one place decides
        gradient_accumulation_steps=1,  # accumulated by hand in TrainingStep: one Accelerator for every grad_accum
        cpu=not cuda and job_world_size() > 1,  # on CPU accelerate joins a launcher's process group only when told
        log_with=list(log_with) or None,
        project_dir=str(project_dir) if project_dir is not None else None,
    )


def pin_memory(accelerator: Accelerator) -> bool:
    return accelerator.device.type == "cuda"


def agree(accelerator: Accelerator | PartialState, value: int, operation: str = "max") -> int:
    """The max, min or sum of `value` over the processes: the same decision on every one (a stop on
    one rank alone would hang the next all-reduce). A PartialState is what a Trainer callback has."""
    if accelerator.num_processes == 1:
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], device=accelerator.device, dtype=torch.long)
    dist.all_reduce(tensor, op={"min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}.get(operation, dist.ReduceOp.MAX))
    return int(tensor.item())


FINISH_KEY = "benchtrain/finished"
LEFT_KEY = "benchtrain/left"
# The least the processes wait for each other at the end (a slow exit, a tracker's flush); rank 0's
# planned work after the last step comes on top, at up to FINISH_SLACK_FACTOR times its plan.
FINISH_TIMEOUT_SECONDS = 600.0
FINISH_SLACK_FACTOR = 2.0


def finish_wait_seconds(rank0_work_seconds: float) -> float:
    """How long a process waits at the end for the others: rank 0's planned work after the last
    step (train.planning.types.Overheads.after_training_seconds) with slack, plus FINISH_TIMEOUT_SECONDS."""
    return FINISH_TIMEOUT_SECONDS + FINISH_SLACK_FACTOR * max(0.0, rank0_work_seconds)


def finish_together(timeout_seconds: float = FINISH_TIMEOUT_SECONDS) -> None:
    """Wait until every process of a multi-process run gets here, through the launcher's store, not a
    barrier (docs/design.md#runtime-devices-precision-and-process-agreement); one that gives up fails."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    world_size = dist.get_world_size()
    give_up_at = time.monotonic() + timeout_seconds
    wait_for_all(store, FINISH_KEY, world_size, give_up_at)
    # Where rank 0 hosts the store (srun, mpirun) it must leave last.
    if dist.get_rank() == 0:
        wait_for_all(store, LEFT_KEY, world_size, give_up_at)
    else:
        store.add(LEFT_KEY, 1)


def wait_for_all(
    store: Store,
    key: str,
    world_size: int,
    give_up_at: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> None:
    """Count this process in at `key` of the store, then wait until all `world_size` have (or fail past `give_up_at`)."""
    store.add(key, 1)
    while store.add(key, 0) < world_size:
        if clock() > give_up_at:
            raise RuntimeError(f"other processes did not reach the end of the run in time ({key})")
        pause(0.05)


def leave(code: int) -> None:
    """Exit a command. A process of a multi-process job leaves with os._exit once everything is
    written: gloo's process-group destructors can deadlock on the GIL (see finish_together)."""
    if job_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
