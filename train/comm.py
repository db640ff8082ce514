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


def plan_communication(calibration: Any, world_size: int, trainable_parameters: int, force: bool) -> tuple[float, dict[str, Any]]:
    """What a run of `world_size` processes adds to each optimizer step for gradient all-reduce,
    and where that figure comes from (for run.json and the plan text):

    - a calibration measured with as many processes holds it in its step times: nothing to add;
    - a 1-process calibration: all-reduces are timed now, among this run's processes, and the
      trainable gradients' bytes per optimizer step priced with them (calibration.comm);
    - a calibration of another world size is refused unless --force (then used as if it were one)."""
    from calibration.comm import fit_comm, gradient_bytes
    from calibration.errors import BenchtrainError

    measured = calibration.world_size
    if measured == world_size:
        source = "calibration" if world_size > 1 else "single process"
        return 0.0, {"source": source, "world_size": world_size, "seconds_per_step": 0.0}
    if measured != 1 and not force:
        raise BenchtrainError(
            f"calibration {calibration.id} was measured with {measured} processes, this run has {world_size}: "
            f"run `accelerate launch --num_processes {world_size} -m bench run` or use a 1-process calibration, or pass --force"
        )
    if world_size == 1:
        return 0.0, {"source": "single process", "world_size": 1, "seconds_per_step": 0.0}
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # the process group train.runtime.make_accelerator joins
    rows = measure_all_reduce(state.device)
    size, backend = world()
    model = fit_comm(rows, size, backend or "none")
    gradients = gradient_bytes(trainable_parameters)
    seconds = model.all_reduce_seconds(gradients)
    return seconds, {
        "source": "predicted",
        "world_size": world_size,
        "calibration_world_size": measured,
        "gradient_bytes": gradients,
        "seconds_per_step": seconds,
        "comm": model.to_json(),
        "all_reduce": rows,
    }


def describe_communication(record: dict[str, Any]) -> str | None:
    """One line for the plan: which step times a multi-process plan rests on."""
    if record["world_size"] < 2:
        return None
    if record["source"] == "calibration":
        return f"communication: measured in the calibration's {record['world_size']}-process step times"
    comm = record["comm"]
    return (
        f"communication: predicted — {record['calibration_world_size']}-process calibration + all-reduce measured now among "
        f"{record['world_size']} processes ({comm['bandwidth_bytes_per_second'] / 1e9:.2f} GB/s, {comm['latency_seconds'] * 1e3:.2f} ms latency): "
        f"{record['gradient_bytes'] / 2**20:.0f} MiB of gradients, +{record['seconds_per_step'] * 1e3:.1f} ms per optimizer step"
    )
