"""How long a checkpoint takes to write. One small enough (MAX_WRITE_BYTES and half the free space)
is saved for real; a bigger one (a 12B model's state is ~150 GB) is extrapolated by bytes from a
bounded write with fsync: bench must not fill the disk it measures.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.common.disk_space import free_bytes
from benchtrain.train.running.checkpoint import checkpoint_bytes, save_checkpoint

if TYPE_CHECKING:
    from benchtrain.bench.probe import Workload

MAX_WRITE_BYTES = 2 * 2**30
CHUNK_BYTES = 64 * 2**20


def disk_bandwidth(folder: Path) -> float:
    """A quick first figure (bytes/s, fsync included: a 32 MiB write) that prices the checkpoint timing."""
    return write_bandwidth(folder, min(32 * 2**20, max(1, free_bytes(folder) // 4)))


def write_bandwidth(folder: Path, size: int) -> float:
    """Bytes per second writing `size` bytes to a file in `folder`, fsync included."""
    chunk = os.urandom(min(CHUNK_BYTES, max(size, 1)))
    descriptor, name = tempfile.mkstemp(dir=folder, prefix=".bench-write-")
    started = time.perf_counter()
    try:
        with os.fdopen(descriptor, "wb") as handle:
            written = 0
            while written < size:
                piece = chunk[: size - written]
                handle.write(piece)
                written += len(piece)
            handle.flush()
            os.fsync(handle.fileno())
        return written / max(time.perf_counter() - started, 1e-9)
    finally:
        os.unlink(name)


def _sizes(workload: Workload, folder: Path, max_bytes: int = MAX_WRITE_BYTES) -> tuple[int, int]:
    """(bytes a checkpoint of this workload writes, the most bench will really write to `folder`:
    MAX_WRITE_BYTES, half the free space and `max_bytes` (what the budget has time for) at most)."""
    states = workload.engine.optimizer.state_dict()["state"].values()
    optimizer_bytes = sum(
        value.numel() * value.element_size() for state in states for value in state.values() if hasattr(value, "numel")
    )
    return checkpoint_bytes(workload.engine.model, optimizer_bytes), min(
        MAX_WRITE_BYTES, free_bytes(folder) // 2, max_bytes
    )


def real_save_fits(workload: Workload, folder: Path, max_bytes: int = MAX_WRITE_BYTES) -> bool:
    """Whether a real checkpoint of this workload fits the bounded write."""
    size, limit = _sizes(workload, folder, max_bytes)
    return size <= limit


def measure_checkpoint(
    workload: Workload, folder: Path, real_save: bool | None = None, max_bytes: int = MAX_WRITE_BYTES
) -> dict[str, float]:
    """The `overheads` entries for checkpoints: seconds, bytes, write bandwidth, and whether the seconds
    were extrapolated (1) or timed on a real save (0: under FSDP every rank takes part, as rank 0 decides)."""
    size, limit = _sizes(workload, folder, max_bytes)
    if real_save if real_save is not None else size <= limit:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            engine = workload.engine
            seconds = save_checkpoint(
                Path(scratch) / "step-0000000", engine.model, engine.optimizer, engine.scheduler, {"step": 0}
            )
        bandwidth, extrapolated = size / max(seconds, 1e-9), 0
    else:
        bandwidth = write_bandwidth(folder, limit)
        seconds, extrapolated = size / bandwidth, 1
    return {
        "checkpoint_save_seconds": round(seconds, 4),
        "checkpoint_bytes": size,
        "disk_write_bytes_per_second": round(bandwidth),
        "checkpoint_extrapolated": extrapolated,
    }
