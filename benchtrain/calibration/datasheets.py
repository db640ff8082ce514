"""Datasheet figures of the GPUs people rent, each with where it comes from (the vendors' numbers,
not measurements), and published cross-GPU measurements the translation is checked against.
Conventions of the table: docs/design.md#datasheets"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

TB = 1e12
GB = 1e9

H100_SOURCE = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ (bf16 printed with sparsity, halved)"
H200_SOURCE = "NVIDIA H200 Tensor Core GPU product page, https://www.nvidia.com/en-us/data-center/h200/ (bf16 printed with sparsity, halved)"
A100_80_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (80GB), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
A100_40_SOURCE = "NVIDIA A100 Tensor Core GPU datasheet (40GB, 2020), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet.pdf"

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
    architecture: str  # the GPU generation, what published comparisons are kept by (generation_shift)
    # The name SkyPilot and dstack rent it by (train --emit): a PCIe or NVL card rents as its family, and the run
    # script checks the device it got (rented_together).
    launch_name: str
    vendor: str  # "nvidia" | "amd": a calibration is never translated across vendors
    bf16_dense_flops: float  # FLOP/s
    memory_bytes: int
    memory_kind: str
    memory_bandwidth: float  # bytes/s
    peer_link: str | None  # "NVLink 4", "NVLink 4 bridge", "Infinity Fabric"; None: PCIe only
    peer_link_bandwidth: float | None  # bytes/s per GPU, bidirectional
    pcie_generation: int
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
    identity: tuple[str, str, str, str, str, str],
    figures: tuple[float, float, str, float],
    links: Links,
    words: tuple[str, ...],
    sources: tuple[str, ...],
    multiprocessors: int | None = None,
    vendor: str = "nvidia",
) -> DeviceSheet:
    """A row from (key, name, device name, peak entry, architecture, launch name), (bf16 FLOP/s, memory, its kind, bandwidth),
    (peer link, its bandwidth, PCIe generation)."""
    flops, memory, kind, bandwidth = figures
    link, link_bandwidth, pcie = links
    return DeviceSheet(
        *identity,
        vendor,
        flops,
        int(memory),
        kind,
        bandwidth,
        link,
        link_bandwidth,
        pcie,
        multiprocessors,
        words,
        sources,
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
MI300X_SOURCE = (
    "AMD Instinct MI300X accelerator, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
)
# fmt: off
SHEETS: tuple[DeviceSheet, ...] = (
    # Hopper. H100 SXM5: 1,979 TFLOP/s bf16 sparse, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; the PCIe card: 1,513 sparse,
    # 2 TB/s, NVLink bridge 600 GB/s; H100 NVL (94 GB): 1,671 sparse, 3.9 TB/s, bridge 600 GB/s. All PCIe Gen5.
    _sheet(("h100-pcie", "H100 PCIe", "NVIDIA H100 PCIe", "H100 PCIe", "hopper", "H100"), (756e12, 80 * GB, "HBM2e", 2.0 * TB),
           H100_BRIDGE, ("h100", "pcie"), (H100_SOURCE,), 114),
    _sheet(("h100-nvl", "H100 NVL", "NVIDIA H100 NVL", "H100 NVL", "hopper", "H100"), (835e12, 94 * GB, "HBM3", 3.9 * TB),
           H100_BRIDGE, ("h100", "nvl"), (H100_SOURCE,), 132),
    _sheet(("h100", "H100 SXM", "NVIDIA H100 80GB HBM3", "H100 SXM", "hopper", "H100"), (989e12, 80 * GB, "HBM3", 3.35 * TB),
           NVLINK_4, ("h100",), (H100_SOURCE,), 132),
    # GH200's GPU, the 96 GB HBM3 version (the 144 GB HBM3e one has 4.9 TB/s): 1,979 sparse, 4 TB/s, NVLink 900 GB/s.
    _sheet(("gh200", "GH200", "NVIDIA GH200 480GB", "GH200", "hopper", "GH200"), (989e12, 96 * GB, "HBM3", 4.0 * TB),
           NVLINK_4, ("gh200",), (GH200_SOURCE,), 132),
    # H200 NVL: 1,671 sparse, 141 GB at 4.8 TB/s, NVLink bridge 900 GB/s; H200 SXM: 1,979 sparse, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _sheet(("h200-nvl", "H200 NVL", "NVIDIA H200 NVL", "H200 NVL", "hopper", "H200"), (835e12, 141 * GB, "HBM3e", 4.8 * TB),
           H200_BRIDGE, ("h200", "nvl"), (H200_SOURCE,), 132),
    _sheet(("h200", "H200 SXM", "NVIDIA H200", "H200", "hopper", "H200"), (989e12, 141 * GB, "HBM3e", 4.8 * TB), NVLINK_4, ("h200",), (H200_SOURCE,), 132),
    # Blackwell, HGX B200 (1,000 W): 4,500 TFLOP/s bf16 sparse per GPU, 180 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s.
    _sheet(("b200", "B200", "NVIDIA B200", "B200", "blackwell", "B200"), (2250e12, 180 * GB, "HBM3e", 8.0 * TB), NVLINK_5, ("b200",), (B200_SOURCE,), 148),
    # Ampere A100: 312 TFLOP/s bf16 dense on every form factor (the PCIe cards, at 250-300 W, sustain less); 40 GB HBM2 at
    # 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (SXM) or 1,935 GB/s (PCIe); NVLink 600 GB/s (SXM; PCIe cards: a bridge between
    # two); PCIe Gen4. A bare "A100" is the 40GB SXM: the smaller memory and bandwidth, so a plan that holds there holds on the 80GB.
    _sheet(("a100-80gb-pcie", "A100 80GB PCIe", "NVIDIA A100 80GB PCIe", "A100", "ampere", "A100-80GB"), (312e12, 80 * GB, "HBM2e", 1935 * GB),
           A100_BRIDGE, ("a100", "80gb", "pcie"), (A100_80_SOURCE,), 108),
    _sheet(("a100-40gb-pcie", "A100 40GB PCIe", "NVIDIA A100-PCIE-40GB", "A100", "ampere", "A100"), (312e12, 40 * GB, "HBM2", 1555 * GB),
           A100_BRIDGE, ("a100", "pcie"), (A100_40_SOURCE,), 108),
    _sheet(("a100-80gb", "A100 80GB SXM", "NVIDIA A100-SXM4-80GB", "A100", "ampere", "A100-80GB"), (312e12, 80 * GB, "HBM2e", 2039 * GB),
           NVLINK_3, ("a100", "80gb"), (A100_80_SOURCE,), 108),
    _sheet(("a100-40gb", "A100 40GB SXM", "NVIDIA A100-SXM4-40GB", "A100", "ampere", "A100"), (312e12, 40 * GB, "HBM2", 1555 * GB),
           NVLINK_3, ("a100",), (A100_40_SOURCE,), 108),
    # Ada, PCIe Gen4 cards without NVLink. L40S: 733 sparse (362.05 dense), 48 GB GDDR6 at 864 GB/s; L40: 362.1 sparse;
    # L4: 242 sparse, 24 GB GDDR6 at 300 GB/s; RTX 4090: 165.2 dense bf16 with fp32 accumulate, 24 GB GDDR6X at 1,008 GB/s.
    _sheet(("l40s", "L40S", "NVIDIA L40S", "L40S", "ada", "L40S"), (362e12, 48 * GB, "GDDR6", 864 * GB), NO_LINK_GEN4, ("l40s",), (L40S_SOURCE,)),
    _sheet(("l40", "L40", "NVIDIA L40", "L40", "ada", "L40"), (181e12, 48 * GB, "GDDR6", 864 * GB), NO_LINK_GEN4, ("l40",), (L40_SOURCE,)),
    # A10G (AWS G5 only): NVIDIA publishes no datasheet. 24 GB GDDR6 at 600 GB/s (384-bit at 12.5 Gbps, as the A10's); the
    # bf16 peak is derived: 80 SMs x 1.71 GHz x 512 dense FLOP/clock/SM (GA10x tensor cores) = 70 TFLOP/s.
    _sheet(("a10g", "A10G", "NVIDIA A10G", "A10G", "ampere", "A10G"), (70e12, 24 * GB, "GDDR6", 600 * GB), NO_LINK_GEN4, ("a10g",), A10G_SOURCES),
    _sheet(("l4", "L4", "NVIDIA L4", "L4", "ada", "L4"), (121e12, 24 * GB, "GDDR6", 300 * GB), NO_LINK_GEN4, ("l4",), (L4_SOURCE,)),
    _sheet(("4090", "RTX 4090", "NVIDIA GeForce RTX 4090", "RTX 4090", "ada", "RTX4090"), (165e12, 24 * GB, "GDDR6X", 1008 * GB),
           NO_LINK_GEN4, ("4090",), (RTX_4090_SOURCE,)),
    # AMD MI300X: 1,307.4 TFLOP/s bf16 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 128 GB/s, PCIe Gen5.
    _sheet(("mi300x", "MI300X", "AMD Instinct MI300X", "MI300X", "cdna3", "MI300X"), (1307e12, 192 * GB, "HBM3", 5.3 * TB),
           ("Infinity Fabric", 896 * GB, 5), ("mi300x",), (MI300X_SOURCE,), vendor="amd"),
)
# fmt: on
SHEETS_BY_KEY = {sheet.key: sheet for sheet in SHEETS}
# CLI spellings beside the keys (the words of a key already find its row).
ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "a100": "a100-40gb", "rtx-4090": "4090", "rtx4090": "4090"}


def sheet_for(text: str) -> DeviceSheet | None:
    """The datasheet row of a CLI key (`h100`, `a100-40gb`) or a device name as torch reports it ("NVIDIA A100-SXM4-40GB");
    None for a device the table does not hold (CPUs, an RTX A6000)."""
    key = text.strip().lower()
    key = ALIASES.get(key, key)
    if key in SHEETS_BY_KEY:
        return SHEETS_BY_KEY[key]
    words = set(re.split(r"[^a-z0-9]+", text.lower())) - {""}  # "NVIDIA A100-SXM4-40GB" → {nvidia, a100, sxm4, 40gb}
    return next((sheet for sheet in SHEETS if all(word in words for word in sheet.words)), None)


def rented_together(launch_name: str) -> tuple[str, ...]:
    """The keys of the cards the engines rent under `launch_name`, the one the bare name means first (`sheet_for`:
    "H100" is the SXM), then the table's order: the devices a node may get when it asks for that name."""
    family = [sheet.key for sheet in SHEETS if sheet.launch_name == launch_name]
    meant = sheet_for(launch_name)
    first = [meant.key] if meant is not None and meant.key in family else []
    return tuple(dict.fromkeys([*first, *family]))


def known_keys() -> str:
    """The keys, for an error message."""
    return ", ".join(sheet.key for sheet in SHEETS)


# -- published cross-GPU measurements the translation's bracket is checked against --------------


@dataclass(frozen=True)
class PublishedPair:
    """One training step measured on two GPUs with the same model, sequence length, micro-batch,
    accumulation, activation checkpointing and GPU count: tokens per second per GPU on each."""

    model: str
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    checkpointing: bool
    slower_tokens_per_second: float  # per GPU, on `slower`
    faster_tokens_per_second: float  # per GPU, on `faster`

    @property
    def speedup(self) -> float:
        return self.faster_tokens_per_second / self.slower_tokens_per_second


@dataclass(frozen=True)
class PublishedComparison:
    """Pairs from one source, between two datasheet rows (keys), on `gpus` GPUs each."""

    source: str
    slower: str
    faster: str
    gpus: int
    setup: str
    pairs: tuple[PublishedPair, ...]


LLM_FOUNDRY_SOURCE = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c), tables 'H100 80GB BF16' and "
    "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)': Throughput (T/s/GPU) of MPT models, every row whose model, "
    "sequence length, GPU count, micro-batch, accumulation and checkpointing are the same on both"
)
# fmt: off
PUBLISHED_COMPARISONS: tuple[PublishedComparison, ...] = (
    # Ampere to Hopper, SXM, 8 GPUs in one node, FSDP FULL_SHARD, amp_bf16, flash attention. Speed-ups 1.81x-2.84x:
    # lowest at 32k-65k tokens (attention-bound), highest at 512-1024 tokens of the 760m model (the A100's MFU fell to 45%).
    PublishedComparison(LLM_FOUNDRY_SOURCE, "a100-80gb", "h100", 8, "FSDP full shard, amp_bf16, MPT (flash attention)", tuple(
        PublishedPair(model, seq_len, micro, accum, checkpointing, a100, h100)
        for model, seq_len, micro, accum, checkpointing, a100, h100 in (
            ("mpt-30b", 8192, 1, 21, True, 574, 1384), ("mpt-30b", 4096, 1, 21, True, 814, 1802), ("mpt-30b", 2048, 3, 21, True, 916, 2002),
            ("mpt-30b", 1024, 6, 21, True, 946, 2084), ("mpt-13b", 32768, 1, 3, True, 1016, 1976), ("mpt-13b", 16384, 3, 3, True, 1431, 2985),
            ("mpt-13b", 4096, 10, 3, True, 2060, 4717), ("mpt-13b", 1024, 40, 3, True, 2330, 5502), ("mpt-7b", 65536, 1, 2, True, 1013, 1956),
            ("mpt-7b", 32768, 2, 2, True, 1672, 3318), ("mpt-7b", 8192, 8, 2, True, 3206, 6935), ("mpt-7b", 4096, 16, 2, True, 3684, 8611),
            ("mpt-7b", 1024, 64, 2, True, 4357, 10203), ("mpt-3b", 65536, 1, 2, True, 1767, 3262), ("mpt-3b", 32768, 3, 6, True, 3029, 5873),
            ("mpt-3b", 16384, 1, 6, False, 5529, 11152), ("mpt-3b", 8192, 3, 6, False, 7695, 16578), ("mpt-3b", 4096, 5, 6, False, 9457, 20964),
            ("mpt-3b", 1024, 20, 6, False, 11580, 27046), ("mpt-3b", 512, 40, 6, False, 12127, 27965), ("mpt-1b", 65536, 1, 2, True, 3044, 5506),
            ("mpt-1b", 32768, 1, 4, False, 6275, 12025), ("mpt-1b", 16384, 2, 4, False, 9956, 19649), ("mpt-1b", 8192, 3, 4, False, 13814, 29157),
            ("mpt-1b", 4096, 7, 4, False, 17807, 38535), ("mpt-1b", 1024, 18, 4, False, 22112, 48910), ("mpt-1b", 512, 56, 4, False, 23148, 52275),
            ("mpt-760m", 32768, 1, 2, False, 8802, 16291), ("mpt-760m", 16384, 3, 2, False, 14274, 27815), ("mpt-760m", 8192, 6, 2, False, 20933, 41825),
            ("mpt-760m", 4096, 12, 2, False, 27351, 55459), ("mpt-760m", 2048, 24, 2, False, 32434, 63147), ("mpt-760m", 1024, 48, 2, False, 29765, 78581),
            ("mpt-760m", 512, 96, 2, False, 29446, 83749),
        )
    )),
)
# fmt: on


@dataclass(frozen=True)
class GenerationShift:
    """The median published speed-up over the datasheets' FLOP/s ratio between two generations, and its source."""

    attained_share: float
    source: str


def generation_shift(slower: str, faster: str) -> GenerationShift | None:
    """The published shift from generation `slower` to `faster` (DeviceSheet.architecture); None where none was published."""
    for comparison in PUBLISHED_COMPARISONS:
        if (SHEETS_BY_KEY[comparison.slower].architecture, SHEETS_BY_KEY[comparison.faster].architecture) == (
            slower,
            faster,
        ):
            speedup = statistics.median(pair.speedup for pair in comparison.pairs)
            flops = (
                SHEETS_BY_KEY[comparison.faster].bf16_dense_flops / SHEETS_BY_KEY[comparison.slower].bf16_dense_flops
            )
            return GenerationShift(speedup / flops, comparison.source)
    return None
