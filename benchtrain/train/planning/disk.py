"""The run folder's disk: room for what the run will write (checkpoints, final/, final-merged/),
and one `train` at a time in it. What it holds: docs/design.md#disk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchtrain.common.atomic import file_lock
from benchtrain.common.disk_space import GB, free_bytes
from benchtrain.common.errors import BenchtrainError, DiskSpaceError
from benchtrain.common.shared_lock import shared_lock
from benchtrain.train.planning.memory_check import FP32_BYTES, MemoryNeed, compute_bytes

LOCK_FILE = ".train.lock"
HOLDER_FILE = (
    ".train.holder"  # the lock across machines (common.shared_lock): a run folder on a bucket every node mounts
)


@dataclass(frozen=True)
class DiskNeed:
    checkpoint_bytes: int
    export_bytes: int
    checkpoints_written: int  # the kept ones plus the one written before pruning

    @property
    def total_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints_written + self.export_bytes


def export_bytes(need: MemoryNeed, lora: bool, preset_base: bool, merge: bool, device_type: str) -> int:
    """Bytes of the model folders written at the end: final/ (the fp32 model, or the adapters), and
    for LoRA the frozen base of a preset (in final/, beside the adapters) and with `--merge-lora` the merged model."""
    if not lora:
        return need.total_parameters * FP32_BYTES
    frozen = (need.total_parameters - need.trainable_parameters) * compute_bytes(device_type)
    return need.trainable_parameters * FP32_BYTES + (frozen if preset_base else 0) + (frozen if merge else 0)


def upload_bytes(need: MemoryNeed, lora: bool, merge: bool, device_type: str) -> int:
    """Bytes --push-to-hub uploads: final/ (the fp32 model, or the adapters), or with --merge-lora
    the merged model (final-merged/, in the frozen base's precision)."""
    if not lora:
        return need.total_parameters * FP32_BYTES
    if merge:
        return need.total_parameters * compute_bytes(device_type)
    return need.trainable_parameters * FP32_BYTES


def disk_need(
    need: MemoryNeed, lora: bool, preset_base: bool, merge: bool, device_type: str, keep: int, existing: int = 0
) -> DiskNeed:
    """Bytes the run will write into its folder (checkpoints already there count as written)."""
    checkpoint = need.trainable_parameters * FP32_BYTES + need.optimizer_bytes
    return DiskNeed(checkpoint, export_bytes(need, lora, preset_base, merge, device_type), max(0, keep + 1 - existing))


def check_space(folder: Path, need: DiskNeed, keep: int) -> None:
    free = free_bytes(folder)
    if need.total_bytes <= free:
        return
    raise DiskSpaceError(
        f"the run needs {need.total_bytes / GB:.2f} GB in {folder} for {keep} checkpoint{'s' if keep != 1 else ''} and the final model, "
        f"{free / GB:.2f} GB free; free space, lower --keep-checkpoints, or use --out elsewhere"
    )


@contextmanager
def run_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on a run folder while `train` works in it: flock, which the kernel releases
    when the process ends however it ends (a crashed run's lock is free). The file holds the
    holder's pid, to name it when the folder is busy. flock holds on one machine only: a holder file created with O_EXCL
    (common.shared_lock) refuses a train on another machine reaching the same folder on shared storage."""
    path = Path(folder) / LOCK_FILE
    with ExitStack() as held:
        try:
            handle = held.enter_context(file_lock(path, wait=False))
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise BenchtrainError(
                f"{path.parent} is in use by another train (pid {holder}): wait for it, or use another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        held.enter_context(shared_lock(Path(folder) / HOLDER_FILE))
        yield
