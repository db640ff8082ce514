"""Which machine to rent, before renting any: `train --dry-run --consider h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie`.

Each machine named (a device key of calibration.datasheets, a number of GPUs, and for several an
interconnect word of calibration.topology) becomes one row of the comparison, from the best source
there is, in this order:

- **measured here**: a calibration (stored, bundled or a path) of this device and process count
  (and interconnect, where recorded);
- **measured by someone**: the same, shared on the hub (`--use-calibration hub:ORG/NAME`) or
  bundled with benchtrain (measured on a real H100 by its makers);
- **predicted**: a 1-process calibration of this device, with the collectives of N processes
  measured by another calibration over this interconnect, or priced from its links' figures
  (train.recipes.options.predicted_option);
- **translated**: a calibration of another GPU of the same vendor, translated by the datasheets'
  ratios (calibration.translate), then predicted for N processes as above;
- **not plannable**: no calibration of this vendor's GPUs (or only CPU ones), or a plan that does
  not fit: said why.

The time and cost of each row are a bracket (the plan's low bound to the upper end the deadline is
judged at); a row not measured says what would settle it: the `bench run` on that machine and what
it costs at the given price. Computation only: train.compare_command prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration.datasheets import DeviceSheet, known_keys, sheet_for
from calibration.model import Calibration
from calibration.store import is_bundled
from calibration.topology import parse_interconnect, recorded_interconnect
from calibration.translate import describe_translation, translate
from common.durations import format_duration
from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.planning.prices import run_cost
from train.recipes.compare import Comparison, Consideration, Row, plan_row, rank_by
from train.recipes.options import Option, collectives_sources, predicted_option

if TYPE_CHECKING:
    from train.recipes.run_plan import PlanContext
    from train.workload.method import MethodConfig

VENDORS = {"nvidia": "NVIDIA", "amd": "AMD"}


@dataclass(frozen=True)
class Machine:
    """One machine to consider: `processes` GPUs of the datasheet `sheet`, linked by `interconnect`."""

    text: str  # as written: h100:2:nvlink
    sheet: DeviceSheet
    processes: int
    interconnect: str | None  # a calibration.topology word; None for one GPU
    interconnect_assumed: bool = False  # not written: the card's own link (NVLink where it has one, else PCIe)

    @property
    def label(self) -> str:
        link = f" over {self.interconnect}{' (assumed)' if self.interconnect_assumed else ''}" if self.processes > 1 else ""
        return f"{self.processes}×{self.sheet.name}{link}"


def parse_machines(text: str) -> list[Machine]:
    """`h100:1,h100:2:nvlink,a100-40gb:4:pcie` (DEVICE[:GPUS[:INTERCONNECT]]); one line for anything else."""
    machines = []
    for part in (item.strip() for item in text.split(",")):
        if not part:
            continue
        fields = part.split(":", 2)
        sheet = sheet_for(fields[0])
        if sheet is None:
            raise BenchtrainError(f"--consider {part!r}: no datasheet for {fields[0]!r}; one of {known_keys()}")
        try:
            processes = int(fields[1]) if len(fields) > 1 else 1
        except ValueError:
            raise BenchtrainError(f"--consider {part!r}: the number of GPUs must be a whole number (h100:2:nvlink)") from None
        if processes < 1:
            raise BenchtrainError(f"--consider {part!r}: at least one GPU")
        word, assumed = (fields[2], False) if len(fields) > 2 else (default_link(sheet), True)
        if processes > 1:
            placed = parse_interconnect(word, "--consider").placed(processes)
            word = placed.word
            if placed.kind == "pcie":  # a card linked by PCIe is the PCIe card where one exists (a100-40gb → A100 40GB PCIe)
                sheet = sheet_for(f"{sheet.key}-pcie") or sheet
        machines.append(Machine(part, sheet, processes, word if processes > 1 else None, assumed and processes > 1))
    if not machines:
        raise BenchtrainError("--consider names no machine: DEVICE[:GPUS[:INTERCONNECT]],… e.g. h100:1,h100:2:nvlink,a100-40gb:4:pcie")
    return machines


def default_link(sheet: DeviceSheet) -> str:
    """The link a card has of its own: NVLink where its datasheet lists it, else PCIe."""
    return "nvlink" if sheet.nvlink_bandwidth else "pcie"


@dataclass(frozen=True)
class Sourced:
    """A machine and the option that plans it (None: not plannable, `problem` says why)."""

    machine: Machine
    kind: str  # measured here, measured by someone, predicted, translated, not plannable
    option: Option | None = None
    rests_on: str = ""
    problem: str | None = None


def device_key(cal: Calibration) -> str | None:
    """The datasheet key of the GPU a calibration measured (or was translated to); None for a CPU."""
    if cal.hardware.get("device_type") != "cuda":
        return None
    sheet = sheet_for(str(cal.hardware.get("name", "")))
    return sheet.key if sheet is not None else None


def is_shared(cal: Calibration) -> bool:
    """Measured by someone else: shared on the hub, or bundled with benchtrain (measured by its makers)."""
    return ((cal.data.get("source") or {}).get("kind")) == "hub" or (cal.path is not None and is_bundled(cal.path))


def source_machine(machine: Machine, calibrations: list[Calibration], sharding: str, sources: list[JsonDict]) -> Sourced:
    """The best source for one machine (the module's docstring), local calibrations before shared ones."""
    here = [cal for cal in calibrations if device_key(cal) == machine.sheet.key]
    here.sort(key=is_shared)  # measured here first
    for cal in here:
        if cal.world_size != machine.processes:
            continue
        recorded = recorded_interconnect(cal.hardware, machine.processes) if machine.processes > 1 else None
        if machine.processes > 1 and recorded is not None and machine.interconnect and recorded.family != family(machine.interconnect):
            continue
        kind = "measured by someone" if is_shared(cal) else "measured here"
        return Sourced(machine, kind, measured_option(cal, machine, sharding), f"{cal.provenance} ({cal.id})")
    singles = [cal for cal in here if cal.world_size == 1]
    if singles and machine.processes > 1:
        return predicted(machine, singles[0], sharding, sources, "predicted")
    return translated(machine, calibrations, sharding, sources)


def family(word: str) -> str:
    return parse_interconnect(word).family


def measured_option(cal: Calibration, machine: Machine, sharding: str) -> Option:
    return Option(cal, cal.world_size, cal.sharding if cal.world_size > 1 else "none", interconnect=machine.interconnect)


def predicted(machine: Machine, cal: Calibration, sharding: str, sources: list[JsonDict], kind: str, rests_on: str = "") -> Sourced:
    """N processes of `cal`'s device over the machine's interconnect (train.recipes.options)."""
    try:
        option = predicted_option(cal, machine.processes, sharding, machine.interconnect or "pcie", sources)
    except BenchtrainError as error:
        return Sourced(machine, "not plannable", problem=str(error))
    what = rests_on or f"{cal.provenance} ({cal.id})"
    return Sourced(machine, kind, option, f"{what}; collectives: {option.collectives_source}")


def translated(machine: Machine, calibrations: list[Calibration], sharding: str, sources: list[JsonDict]) -> Sourced:
    """A calibration of the same vendor's GPU nearest in FLOP/s, translated (calibration.translate)."""
    gpus = [cal for cal in calibrations if cal.world_size == 1 and device_key(cal) is not None]
    same_vendor = [cal for cal in gpus if sheet_for(cal.hardware["name"]).vendor == machine.sheet.vendor]  # type: ignore[union-attr]
    if not same_vendor:
        why = "only CPU calibrations" if not gpus else f"no calibration of any {VENDORS.get(machine.sheet.vendor, machine.sheet.vendor)} GPU"
        return Sourced(machine, "not plannable", problem=f"no source: {why}; run `bench run` on a GPU of this vendor")

    def distance(cal: Calibration) -> tuple[float, bool]:
        source = sheet_for(cal.hardware["name"])
        return abs(math.log(source.bf16_dense_flops / machine.sheet.bf16_dense_flops)), is_shared(cal)  # type: ignore[union-attr]

    cal = min(same_vendor, key=distance)
    try:
        data = translate(cal.data, machine.sheet, machine.processes)
    except BenchtrainError as error:
        return Sourced(machine, "not plannable", problem=str(error))
    target = Calibration(data, None)
    rests_on = f"{cal.provenance} ({cal.id}), {describe_translation(data['translation'])}"
    if machine.processes == 1:
        return Sourced(machine, "translated", measured_option(target, machine, sharding), rests_on)
    return predicted(machine, target, sharding, sources, "translated", rests_on)


def settle_command(machine: Machine, model: str, method: MethodConfig, budget_seconds: float) -> str:
    """The `bench run` that would measure this machine instead."""
    lora = " --lora" if method.is_lora else ""
    launch = f"accelerate launch --num_processes {machine.processes} -m " if machine.processes > 1 else ""
    link = f" --interconnect {machine.interconnect}" if machine.interconnect else ""
    return f"{launch}bench run --gpu {machine.sheet.key} --model {model}{lora}{link} --budget {format_duration(budget_seconds)}"


def settle_budget(cal: Calibration) -> float:
    """What the bench that made a calibration was given (its `search.budget_seconds`), else 4 minutes."""
    budget = (cal.data.get("search") or {}).get("budget_seconds")
    return float(budget) if isinstance(budget, (int, float)) and budget > 0 else 240.0


# -- the table -------------------------------------------------------------------------------


def bracket(row: Row) -> tuple[float, float] | None:
    """(low, upper) seconds of a planned row: its plan's low bound and the upper end its deadline is judged at."""
    if row.plan is None:
        return None
    chosen = row.plan.chosen
    return chosen.total_seconds_low, chosen.total_seconds_promised


def cost_bracket(row: Row) -> tuple[float, float] | None:
    seconds = bracket(row)
    if seconds is None or row.price_per_hour is None:
        return None
    low, high = (run_cost(value, row.price_per_hour, row.processes) for value in seconds)
    return (low or 0.0), (high or 0.0)


def rank_at_upper_end(rows: list[Row], by_cost: bool) -> list[Row]:
    """Rows that meet the deadline at their upper end, cheapest at that end first (fastest without
    prices); then the others, closest first; then those with no plan. The first is recommended."""

    def upper(row: Row) -> tuple[float, float]:
        costs, seconds = cost_bracket(row), bracket(row)
        assert seconds is not None
        return ((costs[1] if costs else 0.0) if by_cost else 0.0), seconds[1]

    return rank_by(rows, upper, lambda row: upper(row)[1])


def could_overtake(rows: list[Row], available_seconds: float, by_cost: bool) -> list[Row]:
    """Rows that might beat the recommended one within their brackets: at their low end they meet
    the deadline and cost less (or, without prices, finish sooner) than it does at its upper end."""
    best = next((row for row in rows if row.recommended), None)
    if best is None:
        return []
    best_cost, best_seconds = cost_bracket(best), bracket(best)
    assert best_seconds is not None
    found = []
    for row in rows:
        seconds, costs = bracket(row), cost_bracket(row)
        if row is best or seconds is None or seconds[0] > available_seconds:
            continue
        if (costs[0] < best_cost[1]) if (by_cost and costs and best_cost) else seconds[0] < best_seconds[1]:
            found.append(row)
    return found


def consider(
    context: PlanContext, method: MethodConfig, calibrations: list[Calibration], here: JsonDict, profile: JsonDict, machines: list[Machine]
) -> Comparison:
    """One planned row per machine (`source_machine`), ranked at the upper ends of their brackets
    (`rank_at_upper_end`), with what would settle each row that was not measured."""
    config, spec = context.config, context.spec
    if config.plan.fit_deadline:
        raise BenchtrainError("--fit-deadline cuts each plan's steps, so the rows would not train the same run: consider machines without it")
    sources = collectives_sources(calibrations)
    rows = [machine_row(context, method, source_machine(machine, calibrations, config.step.sharding, sources), here) for machine in machines]
    by_cost = all(row.price_per_hour is not None for row in rows if row.plan is not None) and any(row.plan is not None for row in rows)
    available = config.run_deadline.seconds_left(context.elapsed_seconds)
    ranked = rank_at_upper_end(rows, by_cost)
    for row in could_overtake(ranked, available, by_cost):
        row.consider.could_overtake = True  # type: ignore[union-attr]
    notes = [] if by_cost else ["no --price-per-hour: rows are ranked by time; pass h100=2.5,… to rank by cost"]
    notes.append("each row's time and cost run from its plan's low bound to the upper end; the deadline and the price are judged at the upper end")
    deadline, ranked_by = config.run_deadline, "cost" if by_cost else "time"
    return Comparison(ranked, spec.name, method.describe(), config.plan.priority, deadline.deadline_seconds, available, ranked_by, profile, notes)


def machine_row(context: PlanContext, method: MethodConfig, sourced: Sourced, here: JsonDict) -> Row:
    """The row of one machine: planned as a comparison plans a calibration (train.recipes.compare),
    or without a plan and why; with the bench run that would settle it unless it was measured."""
    machine = sourced.machine
    if sourced.option is None:
        row = Row(None, {"name": machine.sheet.name, "device_type": "cuda", "memory_bytes": machine.sheet.memory_bytes})
        row.problem = sourced.problem
    else:
        row = plan_row(context, method, sourced.option, here)
    kind = "not plannable" if row.plan is None else sourced.kind
    row.consider = Consideration(machine.label, machine.processes, kind, sourced.rests_on or (sourced.problem or ""))
    row.consider.cost_low, row.consider.cost_upper = cost_bracket(row) or (None, None)
    if sourced.kind not in ("measured here", "measured by someone"):
        budget = settle_budget(sourced.option.calibration) if sourced.option is not None else 240.0
        row.consider.settle = settle_command(machine, context.spec.name, method, budget)
        row.consider.settle_seconds = budget
        row.consider.settle_cost = run_cost(budget, row.price_per_hour if row.price_per_hour is not None else price_of(context, machine), machine.processes)
    return row


def price_of(context: PlanContext, machine: Machine) -> float | None:
    """The --price-per-hour of a machine no plan was made for (None where none is given)."""
    hardware = {"name": machine.sheet.device_name, "peak_flops_entry": machine.sheet.peak_entry, "device_type": "cuda"}
    try:
        return context.config.plan.prices.for_device("", hardware)
    except BenchtrainError:
        return None
