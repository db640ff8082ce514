"""Peak memory of a probe or a run: the CUDA allocator's peak on GPU, the process's peak RSS on CPU.
Design: docs/design.md#peak-memory"""

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

from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    import torch

SAMPLE_SECONDS = 0.01
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
CPU_MMAP_THRESHOLD_BYTES = 8 * 2**20  # docs/design.md#peak-memory: 128 KiB halved small steps' speed
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def physical_cpu_memory() -> bool:
    """Every allocation of CPU_MMAP_THRESHOLD_BYTES or more mapped on its own and unmapped when freed (glibc); False off glibc."""
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


# On CPU a process's peak is its resident set, which also holds what the process loaded before any model (libraries, records, tokenizer arrays): bench records
# its own before it builds the model, and `train` adds what its process holds beyond that (train.recipes.run_plan).
HOST_BASELINE_KEY = "process_rss_before_model_bytes"


def process_resident_bytes() -> int | None:
    """This process's resident set now (None where psutil cannot read it)."""
    try:
        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def resident_bytes_before_model() -> int | None:
    """This process's resident set with the libraries a model build loads imported first (peft, torch's compiler stack, bitsandbytes): bench and `train` measure
    it at different points, and their difference must be what the process holds, not import order."""
    # bitsandbytes warns on import, on some CPUs, that an optional package of faster kernels is missing.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import peft  # noqa: F401
    import torch._dynamo  # noqa: F401

    with contextlib.suppress(Exception):  # optional; without it no build imports it either
        import bitsandbytes  # noqa: F401
    return process_resident_bytes()


def host_excess_bytes(hardware: JsonDict, device_type: str) -> float:
    """What this process (on CPU, before its model is built) holds beyond the bench process that
    measured `hardware` at the same point, which a plan's CPU peak adds; 0 on a GPU or unrecorded."""
    recorded = hardware.get(HOST_BASELINE_KEY)
    now = resident_bytes_before_model() if device_type == "cpu" and recorded else None
    return max(0.0, float(now - recorded)) if now is not None and recorded else 0.0


class PeakMemory:
    """Context manager; `.peak_bytes` after exit."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.peak_bytes = 0
        # CUDA only (None elsewhere): the allocator's reserved peak, the device's used bytes and the bytes used outside the allocator, at exit.
        self.peak_reserved_bytes: int | None = None
        self.device_used_bytes: int | None = None
        self.non_torch_bytes: int | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            import torch

            # From an empty cache, so the reserved peak is this probe's, not what a larger one left cached.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)  # this process's device, named
            return self
        with contextlib.suppress(OSError, AttributeError):  # freed heap back to the OS: not this probe's peak
            ctypes.CDLL("libc.so.6").malloc_trim(0)
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
            import torch

            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used_bytes = int(total - free)
            # Read together with the used bytes: what the allocator holds now, not at its peak.
            self.non_torch_bytes = max(0, self.device_used_bytes - int(torch.cuda.memory_reserved(self.device)))
            return
        if self._thread is None:
            self.peak_bytes = _high_water_mark() or 0
            return
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def record(self) -> dict[str, int]:
        """The fields a measurement row (and a run's actual figures) keep beside peak_memory_bytes: on CUDA only (calibration.memory_fit.CUDA_MEMORY_FIELDS)."""
        fields = {
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "non_torch_bytes": self.non_torch_bytes,
        }
        return {name: value for name, value in fields.items() if value is not None}
