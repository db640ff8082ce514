"""NCCL's own device memory per GPU: what a process of an N-GPU job holds that a 1-process
calibration never measured (no communicator existed), outside torch's allocator.

A calibration measured with N processes holds it in its measured peak (the bytes outside the
allocator, calibration.memory_fit); one measured with one process does not, and an N-process plan
from it adds `communicator_bytes` (train.recipes.run_plan). Figures from NCCL's source
(NVIDIA/nccl at 5067397, v2.30; the same since 2.21.5), an estimate, not a measurement:

- connection buffers (src/init.cc `computeBuffSizes`): per channel and peer, one buffer per
  protocol: Simple NCCL_BUFFSIZE 4 MiB, LL128 120 × 640 × 8 steps × 8 B, LL 8 × 512 × 8 × 16 B;
  each GPU of a ring receives from one neighbour and sends to the other (two peers);
- channels: 16, as an 8×H800 NVLink job's log shows ("16 coll channels … 16 p2p channels per peer",
  NVIDIA/nccl#892); fewer over PCIe, so an upper estimate there;
- NVLink SHARP (NVLS) on an NVSwitch of compute capability 9.0 and up (src/transport/nvls.cc
  `ncclNvlsBufferSetup`): 16 channels (NVLS_NCHANNELS_SM90) × 2 × NCCL_NVLS_CHUNKSIZE 128 KiB × 8
  steps per GPU of the node, bound on every GPU: 256 MiB at 8 GPUs. NCCL before 2.21.5 bound more:
  1 GiB per GPU on 8×H100 under 2.19.3 ("NVLS Bind mem … size 1073741824", NVIDIA/nccl-tests#216),
  2.25 GiB (nvlsTotalSize 2415919104, NVIDIA/nccl#1410), which is why people set
  NCCL_NVLS_ENABLE=0 to avoid running out of memory (NVIDIA/NeMo-Framework-Launcher#127).
"""

from __future__ import annotations

from common.json_types import JsonDict

MIB = 2**20
SIMPLE_BUFFER_BYTES = 4 * MIB  # DEFAULT_BUFFSIZE
LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD × NCCL_LL128_MAX_NTHREADS × NCCL_STEPS × 8 B
LL_BUFFER_BYTES = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD × NCCL_LL_MAX_NTHREADS × NCCL_STEPS × 16 B
CONNECTION_BYTES = SIMPLE_BUFFER_BYTES + LL128_BUFFER_BYTES + LL_BUFFER_BYTES
CHANNELS = 16
RING_PEERS = 2
NVLS_CHANNELS = 16  # NVLS_NCHANNELS_SM90
NVLS_BYTES_PER_GPU_OF_NODE = NVLS_CHANNELS * 2 * 128 * 1024 * 8  # × 2 × NCCL_NVLS_CHUNKSIZE × NCCL_STEPS
NVLS_MIN_COMPUTE_CAPABILITY = 9.0
SOURCE = (
    "NCCL's connection buffers (16 channels × 2 ring peers × 9.2 MiB, src/init.cc) and NVLS on an NVSwitch "
    "(32 MiB × GPUs, src/transport/nvls.cc; 1 GiB under NCCL 2.19, nccl-tests#216): an estimate"
)


def nvls_binds(hardware: JsonDict) -> bool:
    """Whether NCCL binds NVLS memory on this device: an NVSwitch (or links not recorded: the larger
    figure) under a GPU of compute capability 9.0 or later."""
    if hardware.get("interconnect") not in ("nvswitch", None):
        return False
    try:
        return float(hardware.get("compute_capability") or 0.0) >= NVLS_MIN_COMPUTE_CAPABILITY
    except ValueError:
        return False


def communicator_bytes(hardware: JsonDict, processes: int) -> float:
    """NCCL's device memory on each GPU of a `processes`-GPU job on `hardware` (a CUDA device; its
    recorded interconnect and compute capability); 0 for one process or another device type."""
    if processes < 2 or hardware.get("device_type") != "cuda":
        return 0.0
    buffers = CHANNELS * RING_PEERS * CONNECTION_BYTES
    nvls = NVLS_BYTES_PER_GPU_OF_NODE * processes if nvls_binds(hardware) else 0
    return float(buffers + nvls)
