"""What THE step costs besides its kernels, seen through `torch.profiler`.

- Host synchronisations: `aten::_local_scalar_dense` (`.item()`, `int(tensor)`, `if tensor:`) and
  CUDA stream/device synchronise calls. Each one drains the GPU's queue: the host cannot run
  ahead and the next kernels start late. THE step has one per optimizer step (its timer, then
  the loss read), none per micro-step.
- Host time per micro-step: the CPU time of the Python and dispatcher work that issues the
  kernels. When it exceeds the kernels' own time the step is launch-bound (small micro-batches).
- Fixed cost per micro-step: from step times at micro-batch 1 and 2 (same length), the time a
  micro-step takes beyond its tokens: 2·t(1) − t(2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass(frozen=True)
class StepProfile:
    optimizer_steps: int
    micro_steps: int
    syncs: dict[str, int]  # event name → count over the profiled steps
    host_seconds: float  # CPU time inside the profiled steps
    device_seconds: float  # kernel time (0 on CPU)
    top_host_ops: list[tuple[str, float]]  # (name, self CPU seconds)

    @property
    def syncs_per_optimizer_step(self) -> float:
        return sum(self.syncs.values()) / max(1, self.optimizer_steps)

    @property
    def host_seconds_per_micro_step(self) -> float:
        return self.host_seconds / max(1, self.micro_steps)


def profile_step(
    step: Any, batches: Iterator[dict[str, Any]], grad_accum: int, optimizer_steps: int = 3
) -> StepProfile:
    """Profile `optimizer_steps` runs of `step` (a warmed-up train.step.step.TrainingStep)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        with torch.profiler.record_function("benchtrain_steps"):
            for _ in range(optimizer_steps):
                step.run(batches, grad_accum)
    events = profiler.key_averages()
    syncs = {event.key: int(event.count) for event in events if event.key in SYNC_EVENTS and event.count}
    total = next((event for event in events if event.key == "benchtrain_steps"), None)
    host = total.cpu_time_total / 1e6 if total is not None else 0.0
    device = sum(getattr(event, "self_device_time_total", 0.0) for event in events) / 1e6
    top = sorted(
        ((event.key, event.self_cpu_time_total / 1e6) for event in events if event.key != "benchtrain_steps"),
        key=lambda item: -item[1],
    )[:8]
    return StepProfile(optimizer_steps, optimizer_steps * grad_accum, syncs, host, device, top)


def fixed_micro_step_seconds(step_seconds_at_1: float, step_seconds_at_2: float) -> float:
    """Per micro-step time not explained by tokens, from micro-batch 1 and 2 at one length."""
    return max(0.0, 2 * step_seconds_at_1 - step_seconds_at_2)
