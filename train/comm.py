"""Timing all-reduces among the processes of a job (torch.distributed, any backend).

Every process calls `measure_all_reduce` together; each size is timed a few times after a warm-up
and the slowest process's median is kept (a collective ends when its last member does), so every
process returns the same figures. calibration.comm fits them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# Message sizes in bytes: latency-bound to bandwidth-bound.
COMM_SIZES = (2**16, 2**20, 2**22, 2**24)
REPEATS = 5


def world() -> tuple[int, str | None]:
    """(processes, backend) of the initialised process group; (1, None) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, None
    return dist.get_world_size(), str(dist.get_backend())


def measure_all_reduce(device: Any, sizes: tuple[int, ...] = COMM_SIZES, repeats: int = REPEATS) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        synchronize()
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            synchronize()
            seconds.append(time.perf_counter() - started)
        slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rows.append({"bytes": float(tensor.numel() * 4), "seconds": float(slowest.item())})
    return rows
