"""Timing collectives among the processes of a job (torch.distributed, any backend), and what they
add to a multi-process plan (DDP, FSDP: train/step/sharding.py). docs/design.md#communication."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from benchtrain.calibration.comm import CommModel, fit_comm, fsdp_micro_step_seconds, gradient_bytes
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.memory_check import MemoryNeed, compute_bytes

if TYPE_CHECKING:
    import torch

    from benchtrain.calibration.model import Calibration

# Message sizes in bytes: latency-bound to bandwidth-bound. On CUDA also the sizes where NVLink
# reaches its bandwidth (a 1B model's gradients are 4 GiB, sent in 25 MiB buckets; FSDP gathers a
# whole block at once), where the GPU has the memory; the CPU's stay small (tests, gloo).
COMM_SIZES = (2**16, 2**20, 2**22, 2**24)
CUDA_EXTRA_SIZES = (2**26, 2**28, 2**30)
REPEATS = 5


def comm_sizes(device: torch.device) -> tuple[int, ...]:
    """COMM_SIZES, and on CUDA the large ones whose two buffers fit in half the free memory of the
    fullest process (every process must time the same sizes, or the collectives would not pair up)."""
    if getattr(device, "type", None) != "cuda":
        return COMM_SIZES
    import torch
    import torch.distributed as dist

    free = torch.tensor([float(torch.cuda.mem_get_info(device)[0])], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return COMM_SIZES + tuple(size for size in CUDA_EXTRA_SIZES if 2 * size <= free.item() / 2)


class World(NamedTuple):
    """The initialised process group: how many processes, over which backend (None: no group)."""

    processes: int
    backend: str | None


def world() -> World:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return World(1, None)
    return World(dist.get_world_size(), str(dist.get_backend()))


# Collectives as measured and fitted, by kind: {kind: {"measurements": rows, "fit": CommModel JSON}}
# (what bench stores in a calibration's `distributed.collectives`).
Collectives: TypeAlias = dict[str, JsonDict]


class CommPlan(NamedTuple):
    """What communication adds per optimizer step (DDP) and per micro-step (FSDP), and where the figure comes from (run.json's `communication`)."""

    per_step: float
    per_micro_step: float
    record: JsonDict


# The collectives each sharding's step runs.
COLLECTIVES = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter")}


@dataclass(frozen=True)
class Traffic:
    """What a sharding sends: DDP all-reduces `gradient_bytes` once per optimizer step; FSDP
    gathers `parameter_bytes` twice and reduce-scatters `gradient_bytes` per micro-step, one
    collective per unit (blocks + root)."""

    sharding: str  # ddp | fsdp
    gradient_bytes: int
    parameter_bytes: int = 0
    units: int = 1


def traffic_of(sharding: str, need: MemoryNeed, device_type: str) -> Traffic:
    """fp32 gradients of the trainable parameters; FSDP gathers parameters in its compute dtype."""
    gradients = gradient_bytes(need.trainable_parameters)
    if sharding != "fsdp":
        return Traffic(sharding, gradients)
    return Traffic(sharding, gradients, need.total_parameters * compute_bytes(device_type), need.blocks + 1)


@contextmanager
def beside_compute(device: torch.device) -> Iterator[None]:
    """On CPU, a thread computing beside the collectives while they are timed, as the step's compute
    does (docs/design.md#communication); on CUDA nothing is added."""
    if getattr(device, "type", None) != "cpu":
        yield
        return

    import torch

    stop = threading.Event()

    def compute() -> None:
        left, right = torch.randn(256, 256), torch.randn(256, 256)
        while not stop.is_set():
            left @ right  # with the process's torch threads, as the step's matmuls

    thread = threading.Thread(target=compute, name="beside-collectives", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure_collective(device: torch.device, kind: str) -> list[dict[str, float]]:
    """(bytes, seconds) rows for one collective, `bytes` the whole message. Every process calls it
    together; each size is timed after a warm-up and the slowest process's median kept (a collective
    ends when its last member does), so every process returns the same figures."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size()
    # torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective: Callable[[torch.Tensor, torch.Tensor], object] = {
        "all_reduce": lambda whole, part: dist.all_reduce(whole),
        "all_gather": lambda whole, part: all_gather(whole, part),
        "reduce_scatter": lambda whole, part: reduce_scatter(part, whole),
    }[kind]

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    with beside_compute(device):
        for size in comm_sizes(device):
            elements = max(world_size, size // 4 // world_size * world_size)
            whole = torch.ones(elements, dtype=torch.float32, device=device)
            part = torch.ones(elements // world_size, dtype=torch.float32, device=device)
            collective(whole, part)  # warm-up: connections, buffers
            synchronize()
            seconds = []
            for _ in range(REPEATS):
                dist.barrier()
                started = time.perf_counter()
                collective(whole, part)
                synchronize()
                seconds.append(time.perf_counter() - started)
            slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append({"bytes": float(elements * 4), "seconds": float(slowest.item())})
    return rows


def measure_collectives(device: torch.device, kinds: tuple[str, ...]) -> Collectives:
    size, backend = world()
    fitted: Collectives = {}
    for kind in kinds:
        rows = measure_collective(device, kind)
        fitted[kind] = {"measurements": rows, "fit": fit_comm(rows, size, backend or "none").to_json()}
    return fitted


def plan_communication(calibration: Calibration, world_size: int, traffic: Traffic, force: bool) -> CommPlan:
    """What a run of `world_size` processes adds for communication: nothing where the calibration
    measured as many processes (and the same sharding) in its step times; from a 1-process one,
    this sharding's collectives timed now among this run's processes price its traffic; another
    world size or sharding is refused unless --force (then used as if it matched)."""
    measured = calibration.world_size
    if world_size == 1 or measured == world_size:
        if world_size > 1 and calibration.sharding != traffic.sharding and not force:
            raise BenchtrainError(
                f"calibration {calibration.id} was measured with --sharding {calibration.sharding}, this run uses {traffic.sharding}: "
                f"run `accelerate launch --num_processes {world_size} -m benchtrain.bench run --sharding {traffic.sharding}`, or pass --force"
            )
        source = "calibration" if world_size > 1 else "single process"
        sharding = traffic.sharding if world_size > 1 else "none"
        return CommPlan(
            0.0, 0.0, {"source": source, "world_size": world_size, "sharding": sharding, "seconds_per_step": 0.0}
        )
    if measured != 1 and not force:
        raise BenchtrainError(
            f"calibration {calibration.id} was measured with {measured} processes, this run has {world_size}: "
            f"run `accelerate launch --num_processes {world_size} -m benchtrain.bench run` or use a 1-process calibration, or pass --force"
        )
    import torch
    from accelerate import PartialState

    # the process group train.step.runtime.make_accelerator joins
    state = PartialState(cpu=not torch.cuda.is_available())
    collectives = measure_collectives(state.device, COLLECTIVES[traffic.sharding])
    return price_traffic(collectives, traffic, world_size, measured)


def price_traffic(
    collectives: Collectives,
    traffic: Traffic,
    world_size: int,
    calibration_world_size: int = 1,
    collectives_from: str | None = None,
) -> CommPlan:
    """What `traffic` costs with these measured collectives: timed now among this run's processes,
    or stored by the calibration `collectives_from` (train.recipes.machines)."""
    models = {kind: CommModel.from_json(entry["fit"]) for kind, entry in collectives.items()}
    per_step = per_micro_step = 0.0
    if traffic.sharding == "fsdp":
        per_micro_step = fsdp_micro_step_seconds(
            models["all_gather"],
            models["reduce_scatter"],
            traffic.parameter_bytes,
            traffic.gradient_bytes,
            traffic.units,
        )
    else:
        per_step = models["all_reduce"].all_reduce_seconds(traffic.gradient_bytes)
    record: JsonDict = {
        "source": "predicted",
        "world_size": world_size,
        **asdict(traffic),
        "calibration_world_size": calibration_world_size,
    }
    record.update(seconds_per_step=per_step, seconds_per_micro_step=per_micro_step, collectives=collectives)
    if collectives_from is not None:
        record["collectives_from"] = collectives_from
    return CommPlan(per_step, per_micro_step, record)
