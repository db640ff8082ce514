"""The rows a comparison plans (train.recipes.compare): each calibration as measured, and
predicted rows of N processes from a 1-process calibration — the collectives another calibration
measured among N processes of the same device and interconnect, or those priced from the
interconnect's link figures (calibration.topology)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration.store import list_calibrations
from calibration.topology import analytic_collectives, parse_interconnect, recorded_interconnect, same_interconnect
from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.planning.comm import COLLECTIVES, stored_collectives
from train.recipes.choice import same_device

if TYPE_CHECKING:
    from calibration.model import Calibration


@dataclass(frozen=True)
class Option:
    """One row to plan: a calibration, with its own processes (measured) or N processes predicted
    from collectives that calibration `collectives_from` measured, or (`collectives_from` None)
    priced from the links of `interconnect` (calibration.topology.analytic_collectives)."""

    calibration: Calibration
    world_size: int
    sharding: str
    collectives: dict[str, JsonDict] | None = None
    collectives_from: str | None = None
    interconnect: str | None = None  # calibration.topology's word, where known

    @property
    def predicted(self) -> bool:
        return self.collectives is not None

    @property
    def collectives_source(self) -> str | None:
        """ "the collectives of ID" or "nvlink link figures (not measured)"; None for a measured row."""
        if self.collectives is None:
            return None
        if self.collectives_from is not None:
            return f"the collectives of {self.collectives_from}"
        return f"{self.interconnect} link figures (not measured)"


def collectives_sources(calibrations: list[Calibration]) -> list[JsonDict]:
    """Calibrations of several processes whose collectives can price predicted rows: those in the
    comparison and every stored one (of any model), newest first, as raw data."""
    seen, sources = set(), []
    candidates = [cal.data for cal in calibrations] + [data for _, data, _ in list_calibrations() if data is not None]
    for data in sorted(candidates, key=lambda data: data.get("created_at", ""), reverse=True):
        if data["id"] in seen or int((data.get("distributed") or {}).get("world_size", 1)) < 2:
            continue
        seen.add(data["id"])
        sources.append(data)
    return sources


def options_for(calibrations: list[Calibration], sharding: str, sources: list[JsonDict]) -> list[Option]:
    """A row for each calibration as measured; and for each 1-process one, a predicted row per
    process count another calibration measured collectives for on the same device and
    interconnect (the newest; an interconnect not recorded matches any), unless a calibration in
    the comparison measured that device, count and sharding itself."""
    options = [Option(cal, cal.world_size, cal.sharding if cal.world_size > 1 else "none") for cal in calibrations]
    measured = {(cal.hardware["name"], cal.world_size, cal.sharding) for cal in calibrations}
    for cal in calibrations:
        if cal.world_size != 1:
            continue
        predicted: dict[int, Option] = {}
        for data in sources:
            processes = int(data["distributed"]["world_size"])
            collectives = stored_collectives(data.get("distributed"))
            if processes in predicted or (cal.hardware["name"], processes, sharding) in measured:
                continue
            if not same_device(data["hardware"], cal.hardware) or not all(kind in collectives for kind in COLLECTIVES[sharding]):
                continue
            link = data["hardware"].get("interconnect")
            if not same_interconnect(link, cal.hardware.get("interconnect")):
                continue
            wanted = {kind: collectives[kind] for kind in COLLECTIVES[sharding]}
            predicted[processes] = Option(cal, processes, sharding, wanted, data["id"], link)
        options += [predicted[count] for count in sorted(predicted)]
    return options


def predicted_option(cal: Calibration, processes: int, sharding: str, interconnect: str, sources: list[JsonDict]) -> Option:
    """A row for `processes` of `cal`'s device linked by `interconnect` (a calibration.topology
    word: nvlink, pcie, 2x8:nvlink+ib, …), from the 1-process calibration `cal`: the collectives
    the first of `sources` (collectives_sources: newest first) measured among as many processes of
    this device over this interconnect (recorded, not assumed), else priced from the links'
    figures. One line (BenchtrainError) for a word that is not an interconnect, a layout that does
    not hold `processes`, a link with no figure for this device (loopback: only measured), or a
    calibration of several processes (it plans its own)."""
    placed = parse_interconnect(interconnect).placed(processes)
    if processes == 1:
        return Option(cal, 1, "none", interconnect=placed.word)
    if cal.world_size != 1:
        raise BenchtrainError(f"calibration {cal.id} measured {cal.world_size} processes: it plans those, not {processes} over {placed.word}")
    kinds = COLLECTIVES[sharding]
    for data in sources:
        recorded = recorded_interconnect(data["hardware"], processes)
        collectives = stored_collectives(data.get("distributed"))
        if int((data.get("distributed") or {}).get("world_size", 1)) != processes or not same_device(data["hardware"], cal.hardware):
            continue
        if recorded is not None and recorded.family == placed.family and all(kind in collectives for kind in kinds):
            return Option(cal, processes, sharding, {kind: collectives[kind] for kind in kinds}, data["id"], placed.word)
    return Option(cal, processes, sharding, analytic_collectives(placed, processes, cal.hardware["name"], kinds), None, placed.word)
