"""Peak memory of a probe: the CUDA allocator's peak on GPU, the process's peak RSS on CPU.

On a GPU the allocator's allocated peak (`max_memory_allocated`) is not what the device must hold:
the caching allocator keeps whole segments (`max_memory_reserved`: allocated + fragmentation, which
grows with the many shapes of padded batches), and outside PyTorch the CUDA context, loaded kernels
and NCCL's buffers take memory too (cuBLAS/cuDNN workspaces come from the allocator: in reserved).
So a CUDA measurement records, beside the allocated peak: the reserved peak, the device's used bytes
(total − free, torch.cuda.mem_get_info: every process on the device) and the bytes used outside
PyTorch's allocator (used − reserved, read at the same moment). The memory fit plans from reserved
plus those bytes (calibration.memory_fit).

On Linux the kernel keeps the peak RSS (VmHWM) and lets a process reset it (writing 5 to
/proc/self/clear_refs), which costs nothing while the probe runs; freed heap is handed back to
the OS first (glibc `malloc_trim`) so one probe's peak does not inflate the next one's.
Elsewhere a background thread samples RSS (it competes with the probe for the CPU a little).

On CPU the process's heap is the device memory, and glibc's heap fragments: with its default,
dynamic mmap threshold every tensor up to 32 MB comes from the heap, and accumulation (gradients
allocated between two micro-batches' activations) left gpt2's peak RSS 1.8 GB above the physical
+0.5 GB of its gradients; every later step grew it again, so a probe and a run of the same
configuration peaked gigabytes apart depending on what ran before (a run measured 9.0 GiB against a
5.6 GiB plan; LoRA at batch 1, whose activations are below 1 MiB, grew 0.1 GiB a step).
`physical_cpu_memory` fixes the threshold at 8 MiB (a fixed threshold also stops glibc raising
it): every tensor that matters for the peak (logits, activations of a micro-batch, gradients of the
large matrices) is its own mapping, returned to the system when freed, and the heap holds only the
small ones, so a probe and a run of the same configuration peak alike (gpt2 8 × 256: +5.4% run vs
plan from a fresh bench; 8 × 2 × 64: the run's peak in the probe's within 1%). The threshold was
glibc's starting 128 KiB, which cost this: every mid-sized tensor mapped and
zero-filled afresh on every step halved tiny's CPU throughput (8 × 320: 8.4k → 16.3k tokens/s with
8 MiB) and made it jagged in shape (off-grid probes predicted with a median error of 6.5–21.9% and
a worst of 32–43%, against 2.0–3.0% and 6.6–16.8% with 8 MiB): `python benchmarks/heap_threshold.py`,
and CHANGELOG.md, 2026-11-25.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from common.json_types import JsonDict

if TYPE_CHECKING:
    import torch

SAMPLE_SECONDS = 0.01
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
CPU_MMAP_THRESHOLD_BYTES = 8 * 2**20  # module docstring: 128 KiB halved small steps' speed
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def physical_cpu_memory() -> bool:
    """Every allocation of CPU_MMAP_THRESHOLD_BYTES or more mapped on its own and unmapped when
    freed (glibc; a fixed threshold also stops glibc raising it). Returns whether it applied
    (False off glibc, where RSS is measured as the allocator leaves it)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _high_water_mark() -> int | None:
    try:
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_high_water_mark() -> bool:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _high_water_mark() is not None


# On CPU a process's peak is its resident set, which also holds what the process loaded before
# any model (libraries, records, tokenizer arrays): bench records its own before it builds the
# model, and `train` adds what its process holds beyond that (train.recipes.run_plan).
HOST_BASELINE_KEY = "process_rss_before_model_bytes"


def process_resident_bytes() -> int | None:
    """This process's resident set now (None where psutil cannot read it)."""
    try:
        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def resident_bytes_before_model() -> int | None:
    """This process's resident set with the libraries a model build loads imported first (peft,
    torch's compiler stack, bitsandbytes where installed): bench and `train` measure it at
    different points (before the build; at planning), so without them their difference held import
    order, not what the process holds. A train process planned before it imported peft and
    sympy ran 58 MiB above its plan, 14% of tiny's peak."""
    # bitsandbytes (peft imports it) warns on import, on a CPU with AVX-512 bf16, that an optional
    # package of faster 4-bit kernels (`kernels`) is missing: a line on every bench and train,
    # about a kernel a measurement times anyway.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import peft  # noqa: F401
    import torch._dynamo  # noqa: F401

    with contextlib.suppress(Exception):  # optional; without it no build imports it either
        import bitsandbytes  # noqa: F401
    return process_resident_bytes()


def host_excess_bytes(hardware: JsonDict, device_type: str) -> float:
    """What this process (on CPU, before its model is built) holds beyond the bench process that
    measured `hardware` held at the same point: a plan's peak memory on CPU adds it. 0 on a GPU,
    for calibrations that did not record it, or where it holds less."""
    recorded = hardware.get(HOST_BASELINE_KEY)
    now = resident_bytes_before_model() if device_type == "cpu" and recorded else None
    return max(0.0, float(now - recorded)) if now is not None and recorded else 0.0


class PeakMemory:
    """Context manager; `.peak_bytes` after exit."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.peak_bytes = 0
        # CUDA only (None elsewhere): the allocator's reserved peak, the device's used bytes and the
        # bytes used outside the allocator, at exit.
        self.peak_reserved_bytes: int | None = None
        self.device_used_bytes: int | None = None
        self.non_torch_bytes: int | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            import torch

            # Each probe starts from an empty cache so that its reserved peak is its own shape's,
            # not what an earlier, larger probe left cached (a run's growth over many shapes is its
            # own figure: train records the same fields).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)  # this process's device, named
            return self
        _trim_heap()
        if _reset_high_water_mark():
            return self

        self._process = psutil.Process()
        self._stop = threading.Event()
        self.peak_bytes = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self._read_cuda()
            return
        if self._thread is None:
            self.peak_bytes = _high_water_mark() or 0
            return
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def _read_cuda(self) -> None:
        import torch

        self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        self.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
        free, total = torch.cuda.mem_get_info(self.device)
        self.device_used_bytes = int(total - free)
        # Read together with the used bytes: what the allocator holds now, not at its peak.
        self.non_torch_bytes = max(0, self.device_used_bytes - int(torch.cuda.memory_reserved(self.device)))

    @property
    def device_peak_bytes(self) -> int:
        """What the device held at the highest point: reserved + outside the allocator on CUDA, the
        peak RSS on CPU."""
        if self.peak_reserved_bytes is None or self.non_torch_bytes is None:
            return self.peak_bytes
        return self.peak_reserved_bytes + self.non_torch_bytes

    def record(self) -> dict[str, int]:
        """The fields a measurement row (and a run's actual figures) keep beside peak_memory_bytes:
        on CUDA only (calibration.memory_fit.CUDA_MEMORY_FIELDS)."""
        fields = {"peak_reserved_bytes": self.peak_reserved_bytes, "device_used_bytes": self.device_used_bytes, "non_torch_bytes": self.non_torch_bytes}
        return {name: value for name, value in fields.items() if value is not None}
