"""Datasheet figures of the GPUs people rent, each with where it comes from.

One table, read by the peak-FLOP/s lookup (train.step.hardware.peak_flops: MFU) and by the
translation of a calibration to a device nobody measured (calibration.translate). These are the
vendors' numbers, not measurements: a translated plan says so and carries a bracket.

Conventions, the same for every row:
- `bf16_dense_flops`: the bf16 tensor-core peak WITHOUT 2:4 sparsity. NVIDIA's datasheets print
  the sparse figure with an asterisk ("1,979*" for the H100 SXM); the dense one is half of it.
- `memory_bytes`: the datasheet's GB in decimal bytes (80 GB = 80e9). The memory torch reports is
  a few percent more (an H100 80GB HBM3: 85.0e9 bytes), so a plan checked against this figure is
  on the safe side.
- `memory_bandwidth`, `peer_link_bandwidth`, `pcie_bandwidth`: bytes/s as the vendor quotes them;
  link figures are the bidirectional totals per GPU that NVIDIA and AMD print (NVLink 4: 900 GB/s
  = 450 GB/s each way; PCIe Gen5 x16: 128 GB/s = 64 GB/s each way).
- `words`: whole words of a device name (or a CLI key) that pick the row, as torch names devices
  ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"); the first row whose words all appear wins,
  so the more specific rows come first ("h100 pcie" before "h100"; "l4" is not "l40").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TB = 1e12
GB = 1e9

H100_SOURCE = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ (bf16 printed with sparsity, halved)"
H200_SOURCE = "NVIDIA H200 Tensor Core GPU product page, https://www.nvidia.com/en-us/data-center/h200/ (bf16 printed with sparsity, halved)"
A100_80_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (80GB), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
A100_40_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (40GB, 2020), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet.pdf"
)

Links = tuple[str | None, float | None, int]  # (peer link, its bytes/s per GPU, PCIe generation)
NVLINK_3: Links = ("NVLink 3", 600 * GB, 4)
NVLINK_4: Links = ("NVLink 4", 900 * GB, 5)
NVLINK_5: Links = ("NVLink 5", 1800 * GB, 5)
# Bridges carry the NVLink generation of their card (NCCL prices a link by it: calibration.topology).
H100_BRIDGE: Links = ("NVLink 4 bridge", 600 * GB, 5)
H200_BRIDGE: Links = ("NVLink 4 bridge", 900 * GB, 5)
A100_BRIDGE: Links = ("NVLink 3 bridge", 600 * GB, 4)
NO_LINK_GEN4: Links = (None, None, 4)


@dataclass(frozen=True)
class DeviceSheet:
    """One device's datasheet figures and where they come from."""

    key: str  # the CLI key: `--consider h100:1,a100-40gb:4`
    name: str  # what the figures describe: "H100 SXM", "A100 40GB PCIe"
    device_name: str  # the name torch.cuda.get_device_name reports (as best known)
    peak_entry: str  # the hardware record's `peak_flops_entry` (train.step.hardware): "A100" for every A100
    vendor: str  # "nvidia" | "amd": a calibration is never translated across vendors
    bf16_dense_flops: float  # FLOP/s
    memory_bytes: int
    memory_kind: str
    memory_bandwidth: float  # bytes/s
    peer_link: str | None  # "NVLink 4", "NVLink 4 bridge", "Infinity Fabric"; None: PCIe only
    peer_link_bandwidth: float | None  # bytes/s per GPU, bidirectional
    pcie_generation: int
    pcie_bandwidth: float  # bytes/s, x16, bidirectional
    multiprocessors: int | None  # the whole GPU's SMs (a MIG slice has a share); None: no MIG
    words: tuple[str, ...]
    sources: tuple[str, ...]

    @property
    def nvlink_bandwidth(self) -> float | None:
        """Bytes/s over NVLink per GPU (bidirectional), None where the card has none."""
        return self.peer_link_bandwidth if self.peer_link and self.peer_link.startswith("NVLink") else None

    @property
    def nvlink_generation(self) -> str | None:
        """The NVLink generation ("NVLink 3", "NVLink 4", "NVLink 5"; a bridge's too); None without NVLink."""
        return " ".join(self.peer_link.split()[:2]) if self.nvlink_bandwidth and self.peer_link else None


def _sheet(
    identity: tuple[str, str, str, str],
    figures: tuple[float, float, str, float],
    links: Links,
    words: tuple[str, ...],
    sources: tuple[str, ...],
    multiprocessors: int | None = None,
    vendor: str = "nvidia",
) -> DeviceSheet:
    """A row from (key, name, device name, peak entry), (bf16 FLOP/s, memory, its kind, bandwidth), (peer link, its bandwidth, PCIe generation)."""
    key, name, device_name, peak_entry = identity
    flops, memory, kind, bandwidth = figures
    link, link_bandwidth, pcie = links
    return DeviceSheet(
        key=key,
        name=name,
        device_name=device_name,
        peak_entry=peak_entry,
        vendor=vendor,
        bf16_dense_flops=flops,
        memory_bytes=int(memory),
        memory_kind=kind,
        memory_bandwidth=bandwidth,
        peer_link=link,
        peer_link_bandwidth=link_bandwidth,
        pcie_generation=pcie,
        pcie_bandwidth={4: 64 * GB, 5: 128 * GB}[pcie],
        multiprocessors=multiprocessors,
        words=words,
        sources=sources,
    )


L40S_SOURCE = "NVIDIA L40S product page, https://www.nvidia.com/en-us/data-center/l40s/"
L40_SOURCE = "NVIDIA L40 product page, https://www.nvidia.com/en-us/data-center/l40/"
L4_SOURCE = "NVIDIA L4 product page, https://www.nvidia.com/en-us/data-center/l4/ (bf16 printed with sparsity, halved)"
GH200_SOURCE = "NVIDIA GH200 Grace Hopper Superchip, https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/ (bf16 printed with sparsity, halved)"
B200_SOURCE = (
    "NVIDIA HGX platform, https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 8 GPUs, 1.4 TB HBM3e, 64 TB/s; "
    "per GPU = total / 8; bf16 printed with sparsity, halved)"
)
A10G_SOURCES = (
    "AWS EC2 G5 instances, https://aws.amazon.com/ec2/instance-types/g5/",
    "A10 vs A10G, https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ (the bf16 peak is derived: see the table)",
)
RTX_4090_SOURCE = (
    "NVIDIA Ada GPU architecture whitepaper, https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf "
    "(RTX 4090: 165.2 TFLOP/s bf16 with fp32 accumulate)"
)
MI300X_SOURCE = "AMD Instinct MI300X accelerator, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
# fmt: off
SHEETS: tuple[DeviceSheet, ...] = (
    # Hopper. H100 SXM5: 1,979 TFLOP/s bf16 sparse, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; the PCIe card: 1,513 sparse,
    # 2 TB/s, NVLink bridge 600 GB/s; H100 NVL (94 GB): 1,671 sparse, 3.9 TB/s, bridge 600 GB/s. All PCIe Gen5.
    _sheet(("h100-pcie", "H100 PCIe", "NVIDIA H100 PCIe", "H100 PCIe"), (756e12, 80 * GB, "HBM2e", 2.0 * TB),
           H100_BRIDGE, ("h100", "pcie"), (H100_SOURCE,), 114),
    _sheet(("h100-nvl", "H100 NVL", "NVIDIA H100 NVL", "H100 NVL"), (835e12, 94 * GB, "HBM3", 3.9 * TB), H100_BRIDGE, ("h100", "nvl"), (H100_SOURCE,), 132),
    _sheet(("h100", "H100 SXM", "NVIDIA H100 80GB HBM3", "H100 SXM"), (989e12, 80 * GB, "HBM3", 3.35 * TB), NVLINK_4, ("h100",), (H100_SOURCE,), 132),
    # GH200's GPU, the 96 GB HBM3 version (the 144 GB HBM3e one has 4.9 TB/s): 1,979 sparse, 4 TB/s, NVLink 900 GB/s.
    _sheet(("gh200", "GH200", "NVIDIA GH200 480GB", "GH200"), (989e12, 96 * GB, "HBM3", 4.0 * TB), NVLINK_4, ("gh200",), (GH200_SOURCE,), 132),
    # H200 NVL: 1,671 sparse, 141 GB at 4.8 TB/s, NVLink bridge 900 GB/s; H200 SXM: 1,979 sparse, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _sheet(("h200-nvl", "H200 NVL", "NVIDIA H200 NVL", "H200 NVL"), (835e12, 141 * GB, "HBM3e", 4.8 * TB), H200_BRIDGE, ("h200", "nvl"), (H200_SOURCE,), 132),
    _sheet(("h200", "H200 SXM", "NVIDIA H200", "H200"), (989e12, 141 * GB, "HBM3e", 4.8 * TB), NVLINK_4, ("h200",), (H200_SOURCE,), 132),
    # Blackwell, HGX B200 (1,000 W): 4,500 TFLOP/s bf16 sparse per GPU, 180 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s.
    _sheet(("b200", "B200", "NVIDIA B200", "B200"), (2250e12, 180 * GB, "HBM3e", 8.0 * TB), NVLINK_5, ("b200",), (B200_SOURCE,), 148),
    # Ampere A100: 312 TFLOP/s bf16 dense on every form factor (the PCIe cards, at 250-300 W, sustain less); 40 GB HBM2 at
    # 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (SXM) or 1,935 GB/s (PCIe); NVLink 600 GB/s (SXM; PCIe cards: a bridge between
    # two); PCIe Gen4. A bare "A100" is the 40GB SXM: the smaller memory and bandwidth, so a plan that holds there holds on the 80GB.
    _sheet(("a100-80gb-pcie", "A100 80GB PCIe", "NVIDIA A100 80GB PCIe", "A100"), (312e12, 80 * GB, "HBM2e", 1935 * GB),
           A100_BRIDGE, ("a100", "80gb", "pcie"), (A100_80_SOURCE,), 108),
    _sheet(("a100-40gb-pcie", "A100 40GB PCIe", "NVIDIA A100-PCIE-40GB", "A100"), (312e12, 40 * GB, "HBM2", 1555 * GB),
           A100_BRIDGE, ("a100", "pcie"), (A100_40_SOURCE,), 108),
    _sheet(("a100-80gb", "A100 80GB SXM", "NVIDIA A100-SXM4-80GB", "A100"), (312e12, 80 * GB, "HBM2e", 2039 * GB),
           NVLINK_3, ("a100", "80gb"), (A100_80_SOURCE,), 108),
    _sheet(("a100-40gb", "A100 40GB SXM", "NVIDIA A100-SXM4-40GB", "A100"), (312e12, 40 * GB, "HBM2", 1555 * GB), NVLINK_3, ("a100",), (A100_40_SOURCE,), 108),
    # Ada, PCIe Gen4 cards without NVLink. L40S: 733 sparse (362.05 dense), 48 GB GDDR6 at 864 GB/s; L40: 362.1 sparse;
    # L4: 242 sparse, 24 GB GDDR6 at 300 GB/s; RTX 4090: 165.2 dense bf16 with fp32 accumulate, 24 GB GDDR6X at 1,008 GB/s.
    _sheet(("l40s", "L40S", "NVIDIA L40S", "L40S"), (362e12, 48 * GB, "GDDR6", 864 * GB), NO_LINK_GEN4, ("l40s",), (L40S_SOURCE,)),
    _sheet(("l40", "L40", "NVIDIA L40", "L40"), (181e12, 48 * GB, "GDDR6", 864 * GB), NO_LINK_GEN4, ("l40",), (L40_SOURCE,)),
    # A10G (AWS G5 only): NVIDIA publishes no datasheet. 24 GB GDDR6 at 600 GB/s (384-bit at 12.5 Gbps, as the A10's); the
    # bf16 peak is derived: 80 SMs x 1.71 GHz x 512 dense FLOP/clock/SM (GA10x tensor cores) = 70 TFLOP/s.
    _sheet(("a10g", "A10G", "NVIDIA A10G", "A10G"), (70e12, 24 * GB, "GDDR6", 600 * GB), NO_LINK_GEN4, ("a10g",), A10G_SOURCES),
    _sheet(("l4", "L4", "NVIDIA L4", "L4"), (121e12, 24 * GB, "GDDR6", 300 * GB), NO_LINK_GEN4, ("l4",), (L4_SOURCE,)),
    _sheet(("4090", "RTX 4090", "NVIDIA GeForce RTX 4090", "RTX 4090"), (165e12, 24 * GB, "GDDR6X", 1008 * GB), NO_LINK_GEN4, ("4090",), (RTX_4090_SOURCE,)),
    # AMD MI300X: 1,307.4 TFLOP/s bf16 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 128 GB/s, PCIe Gen5.
    _sheet(("mi300x", "MI300X", "AMD Instinct MI300X", "MI300X"), (1307e12, 192 * GB, "HBM3", 5.3 * TB),
           ("Infinity Fabric", 896 * GB, 5), ("mi300x",), (MI300X_SOURCE,), vendor="amd"),
)
# fmt: on
SHEETS_BY_KEY = {sheet.key: sheet for sheet in SHEETS}
# CLI spellings beside the keys (the words of a key already find its row).
ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "a100": "a100-40gb", "rtx-4090": "4090", "rtx4090": "4090"}


def words_of(text: str) -> set[str]:
    """The whole words of a device name or key, lower case: "NVIDIA A100-SXM4-40GB" → {nvidia, a100, sxm4, 40gb}."""
    return set(re.split(r"[^a-z0-9]+", text.lower())) - {""}


def sheet_for(text: str) -> DeviceSheet | None:
    """The datasheet row of a CLI key (`h100`, `h100-pcie`, `a100-40gb`, `4090`) or a device name
    as torch reports it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"); None for a device the
    table does not hold (CPUs, an RTX A6000)."""
    key = text.strip().lower()
    key = ALIASES.get(key, key)
    if key in SHEETS_BY_KEY:
        return SHEETS_BY_KEY[key]
    words = words_of(text)
    return next((sheet for sheet in SHEETS if all(word in words for word in sheet.words)), None)


def known_keys() -> str:
    """The keys, for an error message."""
    return ", ".join(sheet.key for sheet in SHEETS)
