"""What we are running on: device type, name, count, memory, software versions, peak FLOP/s."""

from __future__ import annotations

import os
import platform
import re
from typing import Any

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' datasheets, and
# for the GPUs that can be split into MIG slices, the whole GPU's streaming multiprocessors: a
# slice has a share of them, and that share of the peak.
# Patterns are whole words of the device name ("L4" is not "L40"); the first entry that matches wins.
PEAK_BF16_DENSE_FLOPS: list[tuple[tuple[str, ...], str, float, int | None]] = [
    (("h100", "pcie"), "H100 PCIe", 756e12, 114),
    (("h100", "nvl"), "H100 NVL", 835e12, 132),
    (("h100",), "H100 SXM", 989e12, 132),
    (("gh200",), "GH200", 989e12, 132),
    (("h200", "nvl"), "H200 NVL", 835e12, 132),
    (("h200",), "H200", 989e12, 132),
    (("b200",), "B200", 2250e12, 148),
    (("a100",), "A100", 312e12, 108),
    (("l40s",), "L40S", 362e12, None),
    (("l40",), "L40", 181e12, None),
    (("a10g",), "A10G", 70e12, None),
    (("l4",), "L4", 121e12, None),
    (("4090",), "RTX 4090", 165e12, None),
    (("mi300x",), "MI300X", 1307e12, None),
]


def peak_flops(device_name: str, multiprocessors: int | None = None) -> tuple[str, float] | None:
    """(table entry, dense bf16 FLOP/s) for a device name, or None (CPUs, unknown GPUs). A device
    with fewer multiprocessors than its whole GPU (a MIG slice) gets their share of the peak."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for patterns, label, flops, full_multiprocessors in PEAK_BF16_DENSE_FLOPS:
        if not all(pattern in words for pattern in patterns):
            continue
        if full_multiprocessors and multiprocessors and multiprocessors < full_multiprocessors:
            share = multiprocessors / full_multiprocessors
            return f"{label} MIG {multiprocessors}/{full_multiprocessors} SMs", flops * share
        return label, flops
    return None


def detect_hardware() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        peak = peak_flops(name, properties.multi_processor_count)
        return {
            "device_type": "cuda",
            "name": name,
            "count": torch.cuda.device_count(),
            "memory_bytes": int(properties.total_memory),
            "compute_capability": f"{properties.major}.{properties.minor}",
            "multiprocessors": properties.multi_processor_count,
            "cuda_version": torch.version.cuda,
            "peak_flops_entry": peak[0] if peak else None,
            "peak_bf16_flops": peak[1] if peak else None,
            "cpu_cores": os.cpu_count(),
        }
    import psutil

    return {
        "device_type": "cpu",
        "name": _cpu_name(),
        "count": 1,
        "memory_bytes": int(psutil.virtual_memory().total),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "peak_flops_entry": None,
        "peak_bf16_flops": None,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def detect_software() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import accelerate
    import torch
    import transformers

    try:
        benchtrain_version = version("benchtrain")
    except PackageNotFoundError:
        benchtrain_version = "unknown"

    return {
        "benchtrain": benchtrain_version,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "platform": platform.platform(),
    }


def device_label(hardware: dict[str, Any]) -> str:
    """Short name for ids: `cpu`, `h100`, `a100`…"""
    if hardware["device_type"] == "cpu":
        return "cpu"
    entry = hardware.get("peak_flops_entry")
    return (entry or hardware["name"]).lower().replace("nvidia", "").split()[0] if (entry or hardware["name"]) else "gpu"


def requested_mismatch(requested: str | None, hardware: dict[str, Any]) -> str | None:
    """A warning when `--gpu NAME` does not name the detected device, else None."""
    if not requested:
        return None
    wanted = requested.lower().replace("-", " ").replace("_", " ").strip()
    if wanted == "cpu":
        matches = hardware["device_type"] == "cpu"
    else:
        name = hardware["name"].lower()
        matches = hardware["device_type"] == "cuda" and all(part in name for part in wanted.split())
    if matches:
        return None
    return (
        f"--gpu {requested} was asked for but the detected device is {hardware['name']} "
        f"({hardware['device_type']}); this calibration describes the detected device"
    )
