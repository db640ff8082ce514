"""Communication between processes: measured collectives as lines, and NCCL's own device memory.
The model and why: docs/design.md#interconnects-and-collectives, docs/design.md#nccls-memory"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from benchtrain.calibration.hardware import Hardware
from benchtrain.common.json_types import JsonDict

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
GRADIENT_BYTES_PER_PARAMETER = 4  # trainable parameters keep fp32 gradients (full fine-tuning and LoRA adapters)


@dataclass(frozen=True)
class CommModel:
    world_size: int
    backend: str
    latency_seconds: float
    seconds_per_byte: float

    @property
    def bandwidth_bytes_per_second(self) -> float:
        return 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    def all_reduce_seconds(self, gradient_bytes: float) -> float:
        """One optimizer step's gradient all-reduce, in DDP's buckets."""
        return self.collective_seconds(gradient_bytes, max(1, math.ceil(gradient_bytes / BUCKET_BYTES)))

    def collective_seconds(self, message_bytes: float, messages: int) -> float:
        """`messages` collectives carrying `message_bytes` in all."""
        if self.world_size < 2 or message_bytes <= 0:
            return 0.0
        return messages * self.latency_seconds + message_bytes * self.seconds_per_byte

    def to_json(self) -> JsonDict:
        return {**asdict(self), "bandwidth_bytes_per_second": self.bandwidth_bytes_per_second}

    @classmethod
    def from_json(cls, data: JsonDict) -> CommModel:
        return cls(
            int(data["world_size"]),
            str(data["backend"]),
            float(data["latency_seconds"]),
            float(data["seconds_per_byte"]),
        )


def fit_comm(measurements: list[dict[str, float]], world_size: int, backend: str) -> CommModel:
    """Latency and seconds per byte from (bytes, seconds) all-reduce timings; both kept ≥ 0."""
    sizes = np.array([float(m["bytes"]) for m in measurements])
    seconds = np.array([float(m["seconds"]) for m in measurements])
    if len(sizes) == 0:
        raise ValueError("no all-reduce measurements")
    if len(sizes) == 1:
        return CommModel(world_size, backend, 0.0, float(seconds[0] / sizes[0]))
    slope = max(float(np.polyfit(sizes, seconds, 1)[0]), 0.0) if np.ptp(sizes) > 0 else 0.0
    latency = max(0.0, float(seconds.mean() - slope * sizes.mean()))
    return CommModel(world_size, backend, latency, slope)


def fsdp_micro_step_seconds(
    all_gather: CommModel, reduce_scatter: CommModel, parameter_bytes: float, gradient_bytes: float, units: int
) -> float:
    """FSDP's traffic on one micro-step: every unit gathered for forward and for backward, its gradients reduce-scattered."""
    gathers = 2 * all_gather.collective_seconds(parameter_bytes, units)
    return gathers + reduce_scatter.collective_seconds(gradient_bytes, units)


def gradient_bytes(trainable_parameters: int) -> int:
    return int(trainable_parameters) * GRADIENT_BYTES_PER_PARAMETER


def describe_collectives(record: JsonDict) -> str:
    """ "all-reduce 1.20 GB/s, 0.10 ms latency, …" for a record with `collectives`, or only the all-reduce's `comm` (DDP)."""
    collectives = record.get("collectives") or {"all_reduce": {"fit": record["comm"]}}
    return ", ".join(
        f"{kind.replace('_', '-')} {entry['fit']['bandwidth_bytes_per_second'] / 1e9:.2f} GB/s, {entry['fit']['latency_seconds'] * 1e3:.2f} ms latency"
        for kind, entry in collectives.items()
    )


def describe_communication(record: JsonDict) -> str | None:
    """One line for the plan (and the run report): which step times a multi-process plan rests on."""
    if record["world_size"] < 2:
        return None
    sharding = record.get("sharding", "ddp")
    if record["source"] == "calibration":
        return f"communication: measured in the calibration's {record['world_size']}-process {sharding} step times"
    measured = describe_collectives(record)
    if sharding == "fsdp":
        added = (
            f"{record['parameter_bytes'] / 2**20:.0f} MiB of parameters gathered twice and {record['gradient_bytes'] / 2**20:.0f} MiB "
            f"of gradients reduce-scattered, +{record['seconds_per_micro_step'] * 1e3:.1f} ms per micro-step"
        )
    else:
        added = f"{record['gradient_bytes'] / 2**20:.0f} MiB of gradients, +{record['seconds_per_step'] * 1e3:.1f} ms per optimizer step"
    analytic = any(entry.get("source") == "analytic" for entry in (record.get("collectives") or {}).values())
    if record.get("collectives_from"):
        timed = f"measured by calibration {record['collectives_from']}"
    elif analytic:
        timed = f"priced from {record.get('interconnect') or 'the interconnect'}'s link figures, not measured,"
    else:
        timed = "measured now"
    hidden = (
        "; at most that: the estimate counts half of what backward can hide"
        if record.get("overlap") == "bracketed"
        else ""
    )
    return (
        f"communication: predicted — {record['calibration_world_size']}-process calibration + {sharding} collectives {timed} "
        f"among {record['world_size']} processes ({measured}): {added}{hidden}"
    )


# NCCL's own device memory per GPU (docs/design.md#nccls-memory), from NCCL's source: an estimate.
SIMPLE_BUFFER_BYTES = 4 * 2**20  # DEFAULT_BUFFSIZE
LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD × NCCL_LL128_MAX_NTHREADS × NCCL_STEPS × 8 B
LL_BUFFER_BYTES = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD × NCCL_LL_MAX_NTHREADS × NCCL_STEPS × 16 B
CONNECTION_BYTES = SIMPLE_BUFFER_BYTES + LL128_BUFFER_BYTES + LL_BUFFER_BYTES
CHANNELS = 16
RING_PEERS = 2
NVLS_CHANNELS = 16  # NVLS_NCHANNELS_SM90
NVLS_BYTES_PER_GPU_OF_NODE = NVLS_CHANNELS * 2 * 128 * 1024 * 8  # × 2 × NCCL_NVLS_CHUNKSIZE × NCCL_STEPS
NVLS_MIN_COMPUTE_CAPABILITY = 9.0


def nvls_binds(hardware: Hardware) -> bool:
    """Whether NCCL binds NVLS memory: an NVSwitch (or links not recorded: the larger figure) on compute capability 9.0+."""
    if hardware.interconnect not in ("nvswitch", None):
        return False
    try:
        return float(hardware.compute_capability or 0.0) >= NVLS_MIN_COMPUTE_CAPABILITY
    except ValueError:
        return False


def communicator_bytes(hardware: Hardware, processes: int) -> float:
    """NCCL's device memory on each GPU of a `processes`-GPU job on `hardware`; 0 for one process or a device not CUDA."""
    if processes < 2 or hardware.device_type != "cuda":
        return 0.0
    buffers = CHANNELS * RING_PEERS * CONNECTION_BYTES
    nvls = NVLS_BYTES_PER_GPU_OF_NODE * processes if nvls_binds(hardware) else 0
    return float(buffers + nvls)
