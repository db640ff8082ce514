"""Peak memory of a probe: the CUDA allocator's peak on GPU, the process's peak RSS on CPU.

On CPU, RSS is sampled by a background thread; freed heap is handed back to the OS first
(glibc `malloc_trim`) so one probe's peak does not inflate the next one's.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

SAMPLE_SECONDS = 0.002


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Context manager; `.peak_bytes` after exit."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return self
        import psutil

        _trim_heap()
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

            self.peak_bytes = int(torch.cuda.max_memory_allocated())
            return
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
