"""How the processes of a job are linked (`--interconnect` words: nvlink, pcie, ib, 2x8:nvlink+ib, …),
and what their collectives cost from the links' figures, as NCCL's ring algorithm moves bytes.
The model and why: docs/design.md#interconnects-and-collectives"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import NamedTuple

from benchtrain.calibration.comm import CommModel
from benchtrain.calibration.datasheets import sheet_for
from benchtrain.calibration.hardware import Hardware
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict

NETWORKS = ("infiniband", "ethernet")
ALIASES = {
    "nvlink": "nvlink", "nvl": "nvlink", "nvswitch": "nvswitch", "pcie": "pcie", "pci": "pcie", "ib": "infiniband", "infiniband": "infiniband",
    "ethernet": "ethernet", "eth": "ethernet", "loopback": "loopback", "gloo": "loopback",
}  # fmt: skip
# NVSwitch is NVLink through switches: the same per-GPU links and figures, so a calibration of one serves the other.
FAMILY = {"nvswitch": "nvlink"}

# Assumption, not a measurement: backward (twice forward) is 2/3 of a step's compute; collectives hide behind at most that.
BACKWARD_SHARE = 2 / 3

_LAYOUT = re.compile(r"^(\d+)x(\d+):(.+)$")


@dataclass(frozen=True)
class Interconnect:
    """`kind` links the GPUs of one node, `network` the nodes (None: one node); `nodes`, `gpus_per_node` None: see `placed`."""

    kind: str
    network: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None

    @property
    def word(self) -> str:
        """The canonical word (what hardware records store and what matching compares)."""
        links = f"{self.kind}+{self.network}" if self.network and self.network != self.kind else self.kind
        if self.nodes is not None and self.gpus_per_node is not None and (self.nodes > 1 or self.network):
            return f"{self.nodes}x{self.gpus_per_node}:{links}"
        return links

    @property
    def family(self) -> str:
        """The word with NVSwitch read as NVLink: what matching compares."""
        return Interconnect(FAMILY.get(self.kind, self.kind), self.network, self.nodes, self.gpus_per_node).word

    def placed(self, processes: int) -> Interconnect:
        """The layout for `processes`: one node, or one per process for a bare network; a written layout must hold that many."""
        if self.nodes is not None and self.gpus_per_node is not None:
            if self.nodes * self.gpus_per_node != processes:
                raise BenchtrainError(
                    f"interconnect {self.word} holds {self.nodes * self.gpus_per_node} processes, not {processes}"
                )
            return self
        if self.kind in NETWORKS:
            return Interconnect(self.kind, self.kind, processes, 1)
        return Interconnect(self.kind, None, 1, processes)


def canonical(word: str, flag: str = "--interconnect") -> str:
    kind = ALIASES.get(word.strip().lower())
    if kind is None:
        raise BenchtrainError(
            f"{flag} {word!r}: not an interconnect; one of nvlink, nvswitch, pcie, ib, ethernet, loopback, or NxG:nvlink+ib"
        )
    return kind


def parse_interconnect(text: str, flag: str = "--interconnect") -> Interconnect:
    """`nvlink`, `pcie`, `ib`, `2x8:nvlink+ib`, … (the module's docstring); one line for anything else."""
    cleaned = text.strip().lower()
    layout = _LAYOUT.match(cleaned)
    nodes: int | None = None
    gpus: int | None = None
    if layout:
        nodes, gpus, cleaned = int(layout.group(1)), int(layout.group(2)), layout.group(3)
        if nodes < 1 or gpus < 1:
            raise BenchtrainError(f"{flag} {text!r}: nodes and GPUs per node must be positive (2x8:nvlink+ib)")
    parts = cleaned.split("+")
    if len(parts) > 2 or not all(parts):
        raise BenchtrainError(
            f"{flag} {text!r}: one link inside a node and one between nodes at most, e.g. 2x8:nvlink+ib"
        )
    kind = canonical(parts[0], flag)
    network = canonical(parts[1], flag) if len(parts) == 2 else None
    if network is not None and network not in NETWORKS:
        raise BenchtrainError(f"{flag} {text!r}: nodes are linked by ib or ethernet, not {network}")
    if kind == "loopback" and (network or (nodes or 1) > 1):
        raise BenchtrainError(f"{flag} {text!r}: loopback is one host")
    if network is None and kind in NETWORKS:
        network = kind
    if network is not None and kind not in NETWORKS and layout is None:
        raise BenchtrainError(f"{flag} {text!r}: say how many nodes of how many GPUs, e.g. 2x8:{kind}+{parts[1]}")
    if layout and nodes and nodes > 1 and network is None:
        raise BenchtrainError(
            f"{flag} {text!r}: {nodes} nodes need a network between them, e.g. {nodes}x{gpus}:{kind}+ib"
        )
    return Interconnect(kind, network, nodes, gpus)


def recorded_interconnect(hardware: Hardware, processes: int | None = None) -> Interconnect | None:
    """The interconnect a hardware record names (placed for `processes` where given); None where it names none, one this
    version cannot read, or a layout that does not hold `processes`. A CPU's record that names none is loopback (gloo)."""
    return _read_interconnect(
        hardware.interconnect or ("loopback" if hardware.device_type == "cpu" else None), processes
    )


def _read_interconnect(word: str | None, processes: int | None = None) -> Interconnect | None:
    if not word:
        return None
    try:
        link = parse_interconnect(str(word))
        return link.placed(processes) if processes else link
    except BenchtrainError:
        return None


def same_interconnect(measured: str | None, wanted: str | None) -> bool:
    """Whether collectives measured over `measured` price a run over `wanted` (words; either unknown: the same)."""
    one, other = _read_interconnect(measured), _read_interconnect(wanted)
    return one is None or other is None or one.family == other.family


# -- the links' figures -------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One GPU's link: bandwidth per direction, latency per ring step, NCCL's base latency per collective, and sources."""

    kind: str
    bandwidth_bytes_per_second: float
    hop_latency_seconds: float
    base_latency_seconds: float
    source: str

    def to_json(self) -> JsonDict:
        return asdict(self)


# NCCL's own tuning model (ring, Simple protocol): baseLatencies and hwLatencies per ring step (docs/design.md#link-figures).
NCCL = "NVIDIA/nccl src/graph/tuning.cc (5067397) ring/simple"
BASE_LATENCY = 14.0e-6
HOP_LATENCY = {"nvlink": 3.4e-6, "nvswitch": 3.4e-6, "pcie": 5.7e-6, "infiniband": 14.0e-6, "ethernet": 14.0e-6}

# Per-GPU bandwidth each way as NCCL's topology model prices a link, not the datasheet's rate (docs/design.md#link-figures).
NCCL_TOPOLOGY = "NVIDIA/nccl src/graph/topo.h, topo.cc (5067397)"
NCCL_NVLINK_BANDWIDTH = {"NVLink 3": 20.0e9, "NVLink 4": 20.6e9, "NVLink 5": 40.1e9}
# bidirectional per link (datasheets: 600/12, 900/18, 1800/18)
NVLINK_LINK_RATE = {
    "NVLink 3": 50e9,
    "NVLink 4": 50e9,
    "NVLink 5": 100e9,
}
NCCL_PCIE_BANDWIDTH = {3: 12e9, 4: 24e9, 5: 48e9}  # x16
NETWORK_BANDWIDTH = {
    "infiniband": (50e9, "InfiniBand NDR 400 Gb/s per GPU port (NVIDIA ConnectX-7 datasheet)"),
    "ethernet": (12.5e9, "100 Gb Ethernet per GPU (IEEE 802.3ba)"),
}
# A device the table does not hold, over PCIe: Gen4 x16, the slower of the two generations GPUs use (said in the source).
ASSUMED_PCIE_GENERATION = 4


def link_figures(kind: str, device_name: str) -> Link:
    """NCCL's figures for a `kind` link on `device_name` (above); one line where there are none."""
    sheet = sheet_for(device_name)
    if kind in ("nvlink", "nvswitch"):
        nvlink = sheet.nvlink_generation if sheet is not None else None
        if sheet is None or nvlink is None or sheet.nvlink_bandwidth is None:
            raise BenchtrainError(
                f"no NVLink figure for {device_name} (no NVLink, or not in calibration.datasheets): use pcie, or measure it"
            )
        links = round(sheet.nvlink_bandwidth / NVLINK_LINK_RATE[nvlink])
        bandwidth = links * NCCL_NVLINK_BANDWIDTH[nvlink]
        source = (
            f"{sheet.name} {sheet.peer_link}: {links} links × {NCCL_NVLINK_BANDWIDTH[nvlink] / 1e9:g} GB/s, NCCL's figure per link "
            f"({NCCL_TOPOLOGY}; links from {sheet.nvlink_bandwidth / 1e9:.0f} GB/s, {'; '.join(sheet.sources)})"
        )
        return Link(kind, bandwidth, HOP_LATENCY[kind], BASE_LATENCY, f"{source}; latency {NCCL}")
    if kind == "pcie":
        generation = sheet.pcie_generation if sheet is not None else ASSUMED_PCIE_GENERATION
        assumed = f", assumed ({device_name} is not in calibration.datasheets)" if sheet is None else ""
        source = f"PCIe Gen{generation} x16{assumed}: {NCCL_PCIE_BANDWIDTH[generation] / 1e9:g} GB/s, NCCL's figure ({NCCL_TOPOLOGY})"
        return Link(kind, NCCL_PCIE_BANDWIDTH[generation], HOP_LATENCY[kind], BASE_LATENCY, f"{source}; latency {NCCL}")
    if kind in NETWORK_BANDWIDTH:
        bandwidth, source = NETWORK_BANDWIDTH[kind]
        return Link(kind, bandwidth, HOP_LATENCY[kind], BASE_LATENCY, f"{source}; latency {NCCL}")
    raise BenchtrainError(
        f"{kind} has no datasheet figure: measure it (`torchrun --nproc_per_node 2 -m benchtrain.bench run --gpu cpu` stores the collectives of this host)"
    )


# -- collectives from links ---------------------------------------------------------------------


def ring_model(kind: str, processes: int, link: Link, backend: str = "nccl") -> CommModel:
    """A ring collective as a line: (n−1)/n of the bytes per direction, 2× for an all-reduce."""
    n = processes
    passes = 2 if kind == "all_reduce" else 1
    latency = link.base_latency_seconds + passes * (n - 1) * link.hop_latency_seconds
    return CommModel(n, backend, latency, passes * (n - 1) / n / link.bandwidth_bytes_per_second)


def hierarchical_model(
    kind: str, nodes: int, gpus_per_node: int, intra: Link, inter: Link, backend: str = "nccl"
) -> CommModel:
    """Across nodes, hierarchically (docs/design.md#interconnects-and-collectives); NCCL's base latency once."""
    g, m = gpus_per_node, nodes
    passes = 2 if kind == "all_reduce" else 1  # an all-reduce's two phases, inside the node and between nodes alike
    latency = intra.base_latency_seconds + passes * (
        (g - 1) * intra.hop_latency_seconds + (m - 1) * inter.hop_latency_seconds
    )
    per_byte = passes * (
        (g - 1) / g / intra.bandwidth_bytes_per_second + (m - 1) / m / g / inter.bandwidth_bytes_per_second
    )
    return CommModel(m * g, backend, latency, per_byte)


def collective_model(
    kind: str, interconnect: Interconnect, intra: Link, inter: Link | None = None, backend: str = "nccl"
) -> CommModel:
    """One collective (all_reduce, all_gather, reduce_scatter) over a placed interconnect."""
    nodes, gpus = interconnect.nodes or 1, interconnect.gpus_per_node or 1
    if nodes == 1:
        return ring_model(kind, gpus, intra, backend)
    if inter is None:
        raise BenchtrainError(f"interconnect {interconnect.word}: no figure for the network between nodes")
    if gpus == 1:
        return ring_model(kind, nodes, inter, backend)
    return hierarchical_model(kind, nodes, gpus, intra, inter, backend)


def analytic_collectives(
    interconnect: Interconnect | str,
    processes: int,
    device_name: str,
    kinds: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter"),
) -> dict[str, JsonDict]:
    """{kind: {"fit": CommModel JSON, "source": "analytic", "interconnect": word, "links": [...]}}: the shape stored
    collectives have (calibration.distributed.Distributed.collectives), so train.planning.comm.price_traffic prices them."""
    placed = (parse_interconnect(interconnect) if isinstance(interconnect, str) else interconnect).placed(processes)
    intra = link_figures(placed.kind, device_name)
    inter = link_figures(placed.network, device_name) if placed.network else None
    links = [intra.to_json()] + ([inter.to_json()] if inter is not None and placed.network != placed.kind else [])
    return {
        kind: {
            "fit": collective_model(kind, placed, intra, inter).to_json(),
            "source": "analytic",
            "interconnect": placed.word,
            "links": links,
        }
        for kind in kinds
    }


# -- overlap with backward ------------------------------------------------------------------------


class OverlapBracket(NamedTuple):
    """Seconds of collectives a step shows: with full overlap (`low`) and with none (`high`)."""

    low: float
    high: float


def overlap_bracket(comm_seconds: float, compute_seconds: float) -> OverlapBracket:
    """(exposed with full overlap, with none) of `comm_seconds` of collectives beside `compute_seconds` of a step: full
    overlap hides them behind backward (BACKWARD_SHARE of the compute)."""
    return OverlapBracket(max(0.0, comm_seconds - BACKWARD_SHARE * compute_seconds), comm_seconds)


def bracket_estimate(low: float, high: float) -> float:
    """The estimate inside an overlap bracket: its midpoint (why: docs/design.md#interconnects-and-collectives); the upper
    bound, and the deadline, take none."""
    return (low + high) / 2
