"""The step's split into compute, memory, communication and host time, at two probes.
How and why: docs/design.md#bench-step-split
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from benchtrain.bench.probe import Workload, error_text, recover_after_failure
from benchtrain.calibration.split import flops_split, split_rows
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.batching import make_loader

if TYPE_CHECKING:
    import torch
    from torch.autograd.profiler_util import FunctionEvent
    from torch.profiler import profile


# Parts of a kernel's name that make it compute-bound (lower case): cuBLAS's and CUTLASS's GEMMs
# (`sm90_xmma_gemm_…`, `ampere_bf16_s16816gemm_…`, `cutlass::Kernel2<…>`, `nvjet_…`: cuBLAS's newer
# Hopper GEMMs), tensor-core MMA (`xmma`, `wgmma`, `hmma`: not bare "mma", which is in
# "FusedAdamMathFunctor"), flash and memory-efficient attention (`flash_fwd_kernel`,
# `fmha_cutlassF_…`), and inductor's matmul templates (`triton_tem_fused_mm_…`).
COMPUTE_KERNEL_WORDS = (
    "gemm",
    "cutlass",
    "sm90",
    "sm80",
    "xmma",
    "wgmma",
    "hmma",
    "flash",
    "attention",
    "attn",
    "fmha",
    "nvjet",
    "triton_tem",
)
PROFILED_STEPS = 2  # optimizer steps under the profiler per probe, after one unprofiled warm-up step
# NCCL's kernels: `ncclDevKernel_AllReduce_Sum_f32_RING_LL`, `ncclKernel_…` (before NCCL 2.19).
COMMUNICATION_KERNEL_PREFIX = "nccl"


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name: communication (NCCL), compute (a matmul or attention) or memory (the rest)."""
    lowered = name.lower()
    if lowered.removeprefix("void ").startswith(COMMUNICATION_KERNEL_PREFIX):
        return "communication"
    return "compute" if any(word in lowered for word in COMPUTE_KERNEL_WORDS) else "memory"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in µs: kernels on several streams overlap, and the device was busy once, not twice."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


def split_from_events(events: Iterable[FunctionEvent], wall_seconds: float, steps: int) -> dict[str, float]:
    """Compute, memory, exposed communication and exposed host seconds per optimizer step, from the
    profiler's FunctionEvents over `steps` steps that took `wall_seconds`."""
    from torch.autograd import DeviceType

    totals = {"compute": 0.0, "memory": 0.0, "communication": 0.0}
    step_kernels, every_kernel = [], []
    for event in events:
        if getattr(event, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue  # a host-side op, not a kernel, copy or memset on the device
        start, end = float(event.time_range.start), float(event.time_range.end)
        kind = kernel_kind(event.name)
        totals[kind] += end - start
        every_kernel.append((start, end))
        if kind != "communication":
            step_kernels.append((start, end))
    busy = busy_seconds(step_kernels)
    anything = busy_seconds(every_kernel)
    kernels = totals["compute"] + totals["memory"]
    compute = busy * totals["compute"] / kernels if kernels else 0.0
    return {
        "compute_seconds": compute / steps,
        "memory_seconds": (busy - compute) / steps,
        "comm_seconds": (anything - busy) / steps,  # NCCL alone on the device: communication the step waited for
        "host_seconds": max(0.0, wall_seconds - anything) / steps,
    }


def profile_split(
    workload: Workload,
    config: StepConfig,
    steps: int = PROFILED_STEPS,
    profiler: Callable[[], AbstractContextManager[profile]] | None = None,
) -> JsonDict:
    """Run THE step at `config` (no workers) once unprofiled, then `steps` times under the profiler
    (torch.profiler.profile, or a test's stand-in), and split what the device did."""
    config = replace(config, num_workers=0)
    workload.engine.switch(config.switches)
    loader = make_loader(workload.batches(config, (steps + 1) * config.grad_accum), 0, workload.pin_memory)
    batches = iter(loader)
    workload.engine.step.run(batches, config.grad_accum)  # warm-up: the allocator, the kernels' choice
    synchronize(workload.device)
    if profiler is None:
        from torch.profiler import ProfilerActivity, profile

        # Kernels only on a GPU: tracing the host's ops would slow the host, whose idle gaps are measured.
        activity = ProfilerActivity.CUDA if workload.device.type == "cuda" else ProfilerActivity.CPU
        profiler = partial(profile, activities=[activity])
    with profiler() as session:
        started = time.perf_counter()
        for _ in range(steps):
            workload.engine.step.run(batches, config.grad_accum)
        synchronize(workload.device)
        wall = time.perf_counter() - started
    split = split_from_events(session.events(), wall, steps)
    return {
        **config.to_row(),
        **split,
        "method": "profiler",
        "profiled_steps": steps,
        "profiled_seconds": round(wall, 4),
    }


def profile_task(workload: Workload, task: JsonDict) -> JsonDict:
    """The coordinator's "step_split" task, on every process (the step's collectives need them all):
    the split, or the error that stopped it (rank 0 then falls back to the FLOP count)."""
    try:
        return profile_split(workload, StepConfig.from_row(task["config"]))
    except Exception as error:  # the record is a refinement: a failure costs it, not the calibration
        recover_after_failure(workload)
        return {"error": error_text(error)}


def record_step_split(run: Any, record: JsonDict, workload: Workload | None) -> list[JsonDict]:
    """Rank 0, after the fit: the calibration's `step_split` entries. On a GPU every process profiles
    its step (the coordinator's "step_split" task) while this one still holds its model, decided
    here so no process starts a step the others do not; else, or when profiling failed, from the
    FLOP count and the fit's terms."""
    coordinator = run.coordinator
    holds_model = getattr(workload, "engine", None) is not None  # None once released (Workload.release)
    profiled = (
        record["hardware"].get("device_type") == "cuda"
        and holds_model
        and "step_split" in (getattr(coordinator, "handlers", None) or {})
    )
    entries = []
    for row in split_rows(record["measurements"]):
        entry = coordinator.run("step_split", {"config": StepConfig.from_row(row).to_row()}) if profiled else {}
        if "compute_seconds" not in entry:
            failed = entry.get("error")
            entry = {**flops_split(record["fit"], row), **({"profiler_error": failed} if failed else {})}
        entries.append(entry)
    return entries


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
