"""What we are running on: device type, name, count, memory, software versions, peak FLOP/s."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import psutil

from benchtrain.calibration.datasheets import sheet_for
from benchtrain.calibration.hardware import Hardware
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict


class PeakFlops(NamedTuple):
    entry: str  # the datasheet table's entry (a MIG slice says its share)
    flops: float  # dense bf16 FLOP/s


def peak_flops(device_name: str, multiprocessors: int | None = None) -> PeakFlops | None:
    """A device's dense bf16 peak from the datasheet table (calibration.datasheets), or None (CPUs,
    unknown GPUs); a MIG slice gets its multiprocessors' share."""
    sheet = sheet_for(device_name)
    if sheet is None:
        return None
    full = sheet.multiprocessors
    if full and multiprocessors and multiprocessors < full:
        return PeakFlops(
            f"{sheet.peak_entry} MIG {multiprocessors}/{full} SMs", sheet.bf16_dense_flops * multiprocessors / full
        )
    return PeakFlops(sheet.peak_entry, sheet.bf16_dense_flops)


def detect_hardware() -> JsonDict:
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
            **detect_interconnect(),
        }

    return {
        "device_type": "cpu",
        "name": _cpu_name(),
        "count": 1,
        "memory_bytes": int(psutil.virtual_memory().total),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "peak_flops_entry": None,
        "peak_bf16_flops": None,
        "interconnect": "loopback",  # gloo between processes of this host (calibration.topology)
    }


def this_device() -> Hardware:
    """`detect_hardware`'s record, typed as calibrations' are (calibration.hardware)."""
    return Hardware.from_record(detect_hardware())


class NvLinks(NamedTuple):
    """GPU `index`'s NVLinks as NVML or nvidia-smi see them."""

    active: int  # links up
    switched: bool  # any of them to an NVSwitch
    peers: int | None  # the other GPUs they reach (None: not seen)
    gpus: int | None  # the GPUs of the node (None: not seen)


@functools.cache
def detect_interconnect(index: int = 0) -> JsonDict:
    """{"interconnect": pcie | nvlink | nvswitch | None, "nvlinks": active links or None} of GPU
    `index`, from NVML where importable, else nvidia-smi (the rule: docs/design.md#hardware)."""
    found = _nvml_links(index) or _smi_links(index)
    if found is None:
        return {"interconnect": None, "nvlinks": None}
    partial = found.peers is not None and found.gpus is not None and found.peers < found.gpus - 1
    word = (
        "pcie" if found.active == 0 or (partial and not found.switched) else "nvswitch" if found.switched else "nvlink"
    )
    return {"interconnect": word, "nvlinks": found.active}


def _bus(pci_info: object) -> str:
    """A PCI address as NVML gives it (bytes or str) without its domain: "18:00.0"."""
    bus = getattr(pci_info, "busId", b"")
    text = bus.decode() if isinstance(bus, bytes) else str(bus)
    return ":".join(text.strip().lower().split(":")[-2:])


def _nvml_links(index: int) -> NvLinks | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError: no driver, no library
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        active, switched = 0, False
        remote_type = getattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        remote_pci = getattr(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo", None)
        switch = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        remotes: set[str] = set()
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                active += 1
                switched = switched or (remote_type is not None and remote_type(handle, link) == switch)
                if remote_pci is not None:
                    remotes.add(_bus(remote_pci(handle, link)))
            except pynvml.NVMLError:  # past the device's links, or a GPU without NVLink
                continue
        return NvLinks(active, switched, *_nvml_peers(pynvml, index, remotes if remote_pci is not None else None))
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_peers(pynvml: ModuleType, index: int, remotes: set[str] | None) -> tuple[int | None, int | None]:
    """(the node's other GPUs an NVLink of GPU `index` reaches, the node's GPUs), or Nones."""
    count = getattr(pynvml, "nvmlDeviceGetCount", None)
    pci = getattr(pynvml, "nvmlDeviceGetPciInfo", None)
    if remotes is None or count is None or pci is None:
        return None, None
    gpus = int(count())
    others = {_bus(pci(pynvml.nvmlDeviceGetHandleByIndex(other))) for other in range(gpus) if other != index}
    return len(others & remotes), gpus


def _smi_links(index: int) -> NvLinks | None:
    """GPU `index`'s active links from `nvidia-smi nvlink -s` and their peers from `nvidia-smi topo -m`
    (NV# in its row); None without nvidia-smi, which cannot tell an NVSwitch."""
    output = _nvidia_smi("nvlink", "-s", "-i", str(index))
    if output is None:
        return None
    active = len(re.findall(r"Link \d+:\s*[\d.]+\s*GB/s", output))
    return NvLinks(active, False, *_smi_peers(_nvidia_smi("topo", "-m"), index))


def _smi_peers(matrix: str | None, index: int) -> tuple[int | None, int | None]:
    """(the GPUs row `index` of `nvidia-smi topo -m` reaches by NVLink, the GPUs in it), or Nones."""
    lines = (matrix or "").splitlines()
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"] and "X" not in line.split()), None)
    row = next((line.split() for line in lines if line.split()[:1] == [f"GPU{index}"] and "X" in line.split()), None)
    if header is None or row is None:
        return None, None
    gpus = sum(1 for cell in header if re.fullmatch(r"GPU\d+", cell))
    return sum(1 for cell in row[1 : gpus + 1] if re.fullmatch(r"NV\d+", cell)), gpus


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def detect_software() -> JsonDict:
    import accelerate
    import torch
    import transformers

    try:
        benchtrain_version = metadata.version("benchtrain")
    except metadata.PackageNotFoundError:
        benchtrain_version = "unknown"
    return {
        "benchtrain": benchtrain_version,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "platform": platform.platform(),
        # expandable_segments changes fragmentation: a plan says when the run's differ.
        "allocator_conf": allocator_conf(),
    }


ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_conf() -> str | None:
    """PyTorch's allocator settings from the environment, e.g. "expandable_segments:True"; None: the defaults."""
    return next((os.environ[name] for name in ALLOCATOR_VARIABLES if os.environ.get(name)), None)


def device_label(hardware: JsonDict) -> str:
    """Short name for ids: `cpu`, `h100`, `a100`…"""
    if hardware["device_type"] == "cpu":
        return "cpu"
    entry = hardware.get("peak_flops_entry")
    return (
        (entry or hardware["name"]).lower().replace("nvidia", "").split()[0] if (entry or hardware["name"]) else "gpu"
    )


def requested_mismatch(requested: str | None, hardware: JsonDict) -> str | None:
    """A warning when `--gpu NAME` does not name the detected device, else None."""
    if not requested:
        return None
    wanted = requested.lower().replace("-", " ").replace("_", " ").strip()
    if wanted == "cpu":
        matches = hardware["device_type"] == "cpu"
    else:
        name = hardware["name"].lower()
        matches = hardware["device_type"] == "cuda" and all(part in name for part in wanted.split())
    detected = f"{hardware['name']} ({hardware['device_type']})"
    return (
        None
        if matches
        else f"--gpu {requested} was asked for but the detected device is {detected}; this calibration describes the detected device"
    )


def require_requested_device(requested: str | None) -> None:
    """`--gpu NAME` (other than cpu) where torch sees no usable CUDA: one line saying what torch
    sees and the install that fixes it, instead of benchmarking the CPU under a GPU's name."""
    if not requested or requested.strip().lower() == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        return
    raise BenchtrainError(
        f"--gpu {requested}: {cuda_diagnosis(torch.__version__, torch.version.cuda, driver_version(), driver_cuda_version())}"
    )


def cuda_diagnosis(torch_version: str, build_cuda: str | None, driver: str | None, driver_cuda: str | None) -> str:
    """What torch sees when torch.cuda.is_available() is False, and the fix, in one line."""
    release = torch_version.split("+")[0]
    build = (
        f"torch {torch_version} is built for CUDA {build_cuda}"
        if build_cuda
        else f"torch {torch_version} is a CPU-only build"
    )
    if driver is None and driver_cuda is None:
        seen = f"{build}, no NVIDIA driver found (nvidia-smi, libcuda), torch.cuda.is_available() is False"
        install = "" if build_cuda else ", then a CUDA build of torch"
        return f"{seen}: no GPU is usable here (install the NVIDIA driver{install}), or measure this CPU with --gpu cpu"
    supports = f" supporting CUDA {driver_cuda}" if driver_cuda else ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    seen = f"{build}, NVIDIA driver {driver or 'found'}{supports}, torch.cuda.is_available() is False{hidden}"
    if build_cuda and driver_cuda and _version_tuple(build_cuda) <= _version_tuple(driver_cuda):
        fix = (
            "make the GPU visible (CUDA_VISIBLE_DEVICES)"
            if hidden
            else "torch's CUDA and the driver's agree: nvidia-smi should say why the GPU is unusable"
        )
        return f"{seen}: {fix}, or measure this CPU with --gpu cpu"
    wheel = f"cu{driver_cuda.replace('.', '')}" if driver_cuda else "cuXYZ"
    target = f"CUDA {driver_cuda} or older" if driver_cuda else "the driver's CUDA (nvidia-smi shows it)"
    return (
        f"{seen}: install torch {release} built for {target} "
        f"(pip install --force-reinstall torch=={release} --index-url https://download.pytorch.org/whl/{wheel}), "
        "or update the NVIDIA driver; --gpu cpu measures this CPU"
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def driver_version() -> str | None:
    """The NVIDIA driver's version, from the kernel module or nvidia-smi; None without one."""
    try:
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    output = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return output.splitlines()[0].strip() if output else None


def driver_cuda_version() -> str | None:
    """The newest CUDA the driver supports ("12.4"): libcuda's cuDriverGetVersion, else nvidia-smi's header."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    match = re.search(r"CUDA Version:\s*([\d.]+)", _nvidia_smi() or "")
    return match.group(1) if match else None


def _nvidia_smi(*arguments: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None
