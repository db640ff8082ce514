"""Which machine to rent: the same run planned once per row (a calibration of `--use-calibration A,B,C|all`, or a
machine of `--consider`), ranked, the recommended row first. Computation only: train.compare_command prints the
rows. The sources and the ranking: docs/design.md#which-machine-to-rent."""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import benchtrain.calibration as calibration_api
from benchtrain.calibration.datasheets import DeviceSheet, known_keys, sheet_for
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.hub import hub_reference, is_hub_reference, parse_reference, shared_calibrations
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import ListedCalibration, read_calibration_file
from benchtrain.calibration.setup import measured_setup
from benchtrain.calibration.store import bundled_calibrations, calibrations_dir, is_bundled, list_calibrations
from benchtrain.calibration.topology import (
    analytic_collectives,
    parse_interconnect,
    recorded_interconnect,
    same_interconnect,
)
from benchtrain.calibration.translate import describe_translation, translate
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import COLLECTIVES, CommPlan, Traffic, price_traffic
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import deadline_options
from benchtrain.train.planning.prices import run_cost
from benchtrain.train.recipes.choice import fit_variant, plan_hardware
from benchtrain.train.recipes.run_plan import PlanContext, RunPlan, plan_run, planned_compute
from benchtrain.train.step.engine import ProcessLayout, check_sharding

if TYPE_CHECKING:
    from benchtrain.train.planning.types import Plan
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import ModelSpec

COMMUNICATION_BRACKET = (
    "collectives between full overlap with backward (2/3 of the step's compute, an assumption) and none; estimate at the midpoint, "
    "upper bound and deadline at none (calibration.topology)"
)
NO_PRICES = "no --price-per-hour: rows are ranked by time; pass h100=2.5,… to rank by cost"
MEASURED = ("measured here", "measured by someone")  # indexed by is_shared
VENDORS = {"nvidia": "NVIDIA", "amd": "AMD"}
SETTLE_SECONDS = 240.0  # a bench run's budget where the calibration a row rests on does not say its own


# -- machines ---------------------------------------------------------------------------------


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
        link = (
            f" over {self.interconnect}{' (assumed)' if self.interconnect_assumed else ''}"
            if self.processes > 1
            else ""
        )
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
            raise BenchtrainError(
                f"--consider {part!r}: the number of GPUs must be a whole number (h100:2:nvlink)"
            ) from None
        if processes < 1:
            raise BenchtrainError(f"--consider {part!r}: at least one GPU")
        # Not written: the card's own link, NVLink where its datasheet lists it, else PCIe.
        word, assumed = (
            (fields[2], False) if len(fields) > 2 else ("nvlink" if sheet.nvlink_bandwidth else "pcie", True)
        )
        if processes > 1:
            placed = parse_interconnect(word, "--consider").placed(processes)
            word = placed.word
            # a card linked by PCIe is the PCIe card where one exists (a100-40gb → A100 40GB PCIe)
            if placed.kind == "pcie":
                sheet = sheet_for(f"{sheet.key}-pcie") or sheet
        machines.append(Machine(part, sheet, processes, word if processes > 1 else None, assumed and processes > 1))
    if not machines:
        raise BenchtrainError(
            "--consider names no machine: DEVICE[:GPUS[:INTERCONNECT]],… e.g. h100:1,h100:2:nvlink,a100-40gb:4:pcie"
        )
    return machines


# -- sources: what a row is planned from --------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """What plans a row: a calibration with its own processes (measured), or N processes predicted from the collectives
    the calibration `collectives_from` measured or (None) priced from the links of `interconnect`."""

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


@dataclass(frozen=True)
class Source:
    """Where a row's figures come from: the option that plans it (None: not plannable, `problem` says why), its kind,
    whose measurement it rests on; for `--consider`, the machine."""

    option: Option | None
    kind: str  # measured here | measured by someone | predicted | translated | not plannable
    rests_on: str = ""
    problem: str | None = None
    machine: Machine | None = None


def device_key(cal: Calibration) -> str | None:
    """The datasheet key of the GPU a calibration measured (or was translated to); None for a CPU."""
    if cal.hardware.device_type != "cuda":
        return None
    sheet = sheet_for(cal.hardware.name)
    return sheet.key if sheet is not None else None


def is_shared(cal: Calibration) -> bool:
    """Measured by someone else: shared on the hub, or bundled with benchtrain (measured by its makers)."""
    return cal.from_hub or (cal.path is not None and is_bundled(cal.path))


def measured_by(cal: Calibration) -> str:
    return f"{cal.provenance} ({cal.id})"


def collectives_sources(calibrations: list[Calibration]) -> list[Calibration]:
    """Calibrations of several processes whose collectives can price predicted rows (the comparison's and every stored one
    that loads: one without a fitted model is no calibration to read), newest first."""
    seen, sources = set(), []
    candidates = calibrations + [cal for cal in map(stored_calibration, list_calibrations()) if cal is not None]
    for cal in sorted(candidates, key=lambda cal: cal.created_at, reverse=True):
        if cal.id in seen or cal.world_size < 2:
            continue
        seen.add(cal.id)
        sources.append(cal)
    return sources


def stored_calibration(entry: ListedCalibration) -> Calibration | None:
    """A stored calibration as loaded; None where it could not be read or holds no fitted model."""
    if entry.data is None:
        return None
    try:
        return Calibration(entry.data, entry.path)
    except BenchtrainError:
        return None


def options_for(calibrations: list[Calibration], sharding: str, sources: list[Calibration]) -> list[Option]:
    """A row for each calibration as measured; for each 1-process one, a predicted row per process count whose collectives
    another calibration measured on its device and interconnect, unless the comparison measured that count itself."""
    options = [as_measured(cal) for cal in calibrations]
    measured = {(cal.hardware.name, cal.world_size, cal.sharding) for cal in calibrations}
    for cal in calibrations:
        if cal.world_size != 1:
            continue
        predicted: dict[int, Option] = {}
        for source in sources:
            processes = source.world_size
            if processes in predicted or (cal.hardware.name, processes, sharding) in measured:
                continue
            link = source.hardware.interconnect
            wanted = measured_collectives(source, cal, processes, sharding)
            if wanted is not None and same_interconnect(link, cal.hardware.interconnect):
                predicted[processes] = Option(cal, processes, sharding, wanted, source.id, link)
        options += [predicted[count] for count in sorted(predicted)]
    return options


def measured_collectives(
    source: Calibration, cal: Calibration, processes: int, sharding: str
) -> dict[str, JsonDict] | None:
    """The collectives `sharding` needs, as `source` measured them among `processes` of `cal`'s device; None where it did not."""
    collectives, kinds = source.distributed.collectives, COLLECTIVES[sharding]
    if source.world_size != processes or not cal.hardware.same_device(source.hardware):
        return None
    return {kind: collectives[kind] for kind in kinds} if all(kind in collectives for kind in kinds) else None


def as_measured(cal: Calibration, interconnect: str | None = None) -> Option:
    """A calibration planned as it measured: its own processes and sharding."""
    return Option(cal, cal.world_size, cal.sharding if cal.world_size > 1 else "none", interconnect=interconnect)


def option_source(option: Option) -> Source:
    """A row of a comparison of calibrations: measured (here or by someone) or predicted."""
    cal = option.calibration
    kind = "predicted" if option.predicted else MEASURED[is_shared(cal)]
    return Source(option, kind, measured_by(cal))


def predicted_option(
    cal: Calibration, processes: int, sharding: str, interconnect: str, sources: list[Calibration]
) -> Option:
    """A row for `processes` of the 1-process `cal`'s device linked by `interconnect` (nvlink, pcie, 2x8:nvlink+ib, …), its
    collectives from the first of `sources` that measured them there, else from the links' figures. One line for a bad
    interconnect or layout, a link with no figures for this device, or a calibration of several processes."""
    placed = parse_interconnect(interconnect).placed(processes)
    if processes == 1:
        return Option(cal, 1, "none", interconnect=placed.word)
    if cal.world_size != 1:
        raise BenchtrainError(
            f"calibration {cal.id} measured {cal.world_size} processes: it plans those, not {processes} over {placed.word}"
        )
    for source in sources:
        recorded = recorded_interconnect(source.hardware, processes)
        wanted = measured_collectives(source, cal, processes, sharding)
        if wanted is not None and recorded is not None and recorded.family == placed.family:
            return Option(cal, processes, sharding, wanted, source.id, placed.word)
    return Option(
        cal,
        processes,
        sharding,
        analytic_collectives(placed, processes, cal.hardware.name, COLLECTIVES[sharding]),
        None,
        placed.word,
    )


def machine_source(
    machine: Machine, calibrations: list[Calibration], sharding: str, sources: list[Calibration]
) -> Source:
    """The best source for one machine (the module's docstring), local calibrations before shared ones."""
    # measured here first
    here = sorted((cal for cal in calibrations if device_key(cal) == machine.sheet.key), key=is_shared)
    for cal in here:
        if cal.world_size != machine.processes:
            continue
        recorded = recorded_interconnect(cal.hardware, machine.processes) if machine.processes > 1 else None
        if (
            machine.processes > 1
            and recorded is not None
            and machine.interconnect
            and recorded.family != parse_interconnect(machine.interconnect).family
        ):
            continue
        return Source(
            as_measured(cal, machine.interconnect), MEASURED[is_shared(cal)], measured_by(cal), machine=machine
        )
    singles = [cal for cal in here if cal.world_size == 1]
    if singles and machine.processes > 1:
        return predicted(machine, singles[0], sharding, sources, "predicted", measured_by(singles[0]))
    return translated(machine, calibrations, sharding, sources)


def predicted(
    machine: Machine, cal: Calibration, sharding: str, sources: list[Calibration], kind: str, rests_on: str
) -> Source:
    """N processes of `cal`'s device over the machine's interconnect (`predicted_option`)."""
    try:
        option = predicted_option(cal, machine.processes, sharding, machine.interconnect or "pcie", sources)
    except BenchtrainError as error:
        return Source(None, "not plannable", problem=str(error), machine=machine)
    return Source(option, kind, f"{rests_on}; collectives: {option.collectives_source}", machine=machine)


def translated(machine: Machine, calibrations: list[Calibration], sharding: str, sources: list[Calibration]) -> Source:
    """A calibration of the same vendor's GPU nearest in FLOP/s, translated (calibration.translate)."""
    gpus = [cal for cal in calibrations if cal.world_size == 1 and device_key(cal) is not None]
    same_vendor = [cal for cal in gpus if sheet_for(cal.hardware.name).vendor == machine.sheet.vendor]  # type: ignore[union-attr]
    if not same_vendor:
        why = (
            "only CPU calibrations"
            if not gpus
            else f"no calibration of any {VENDORS.get(machine.sheet.vendor, machine.sheet.vendor)} GPU"
        )
        return Source(
            None, "not plannable", problem=f"no source: {why}; run `bench run` on a GPU of this vendor", machine=machine
        )

    def distance(cal: Calibration) -> tuple[float, bool]:
        source = sheet_for(cal.hardware.name)
        return abs(math.log(source.bf16_dense_flops / machine.sheet.bf16_dense_flops)), is_shared(cal)  # type: ignore[union-attr]

    cal = min(same_vendor, key=distance)
    try:
        data = translate(cal.data, machine.sheet, machine.processes)
    except BenchtrainError as error:
        return Source(None, "not plannable", problem=str(error), machine=machine)
    target = Calibration(data, None)
    rests_on = f"{measured_by(cal)}, {describe_translation(data['translation'])}"
    if machine.processes == 1:
        return Source(as_measured(target, machine.interconnect), "translated", rests_on, machine=machine)
    return predicted(machine, target, sharding, sources, "translated", rests_on)


# -- which calibrations ----------------------------------------------------------------------


def select_calibrations(
    reference: str, spec: ModelSpec, method: MethodConfig, on_skip: Callable[[str], None] | None = None
) -> list[Calibration]:
    """The calibrations a comparison names (each once): `all` (the stored ones of this model and method, newest first, then
    the bundled ones), `hub:ORG/NAME` (those that hub repository shares), ids, paths or `hub:ORG/NAME/ID`."""
    names = [part.strip() for part in reference.split(",") if part.strip()]
    if not names:
        raise BenchtrainError(
            f"--use-calibration {reference!r} names no calibration: A,B,C (ids, paths or hub:ORG/NAME[/ID]) or all"
        )
    chosen: list[Calibration] = []
    for name in names:
        if name == "all":
            stored = [(path, data) for path, data, _ in list_calibrations() if data is not None]
            stored += [(path, read_calibration_file(path)) for path in bundled_calibrations().values()]
            chosen += of_this_run(stored, spec, method, on_skip)
        elif is_hub_reference(name) and parse_reference(name).calibration_id is None:
            pulled = [(path, data) for path, data, _ in shared_calibrations(name, on_skip) if data is not None]
            shared = of_this_run(pulled, spec, method, on_skip)
            if not shared and on_skip is not None:
                on_skip(f"{name}: none of its calibrations measured {spec.name} ({method.describe()})")
            chosen += shared
        else:
            chosen.append(calibration_api.load(name, on_skip=on_skip))
    if not chosen:
        what = "no stored or bundled calibration of" if names == ["all"] else "none of these calibrations measured"
        raise BenchtrainError(
            f"--use-calibration {reference}: {what} {spec.name} ({method.describe()}); "
            f"run `bench run --model {spec.name}{' --lora' if method.is_lora else ''}` on each device to compare"
        )
    unique: dict[str, Calibration] = {}
    for cal in chosen:
        unique.setdefault(cal.id, cal)
    check_one_model_and_method(list(unique.values()))
    return list(unique.values())


def of_this_run(
    entries: Sequence[tuple[Path, JsonDict]],
    spec: ModelSpec,
    method: MethodConfig,
    on_skip: Callable[[str], None] | None,
) -> list[Calibration]:
    """The calibrations (path, data) of this model's fingerprint and method; one without a fitted model is said and left out."""
    found = []
    for path, data in entries:
        measured = measured_setup(data)
        if (measured.model_fingerprint, measured.method) != (spec.fingerprint, method.method):
            continue
        try:
            found.append(Calibration(data, path))
        except BenchtrainError as error:
            if on_skip is not None:
                on_skip(f"skipped {path}: {error}")
    return found


def check_one_model_and_method(calibrations: list[Calibration]) -> None:
    """A comparison is of one model and one method: anything else would compare different runs."""
    first = calibrations[0]
    for other in calibrations[1:]:
        if other.setup.model_fingerprint != first.setup.model_fingerprint:
            raise BenchtrainError(
                f"calibrations of different models in one comparison: {first.id} measured {first.setup.model_name}, "
                f"{other.id} measured {other.setup.model_name}; compare calibrations of one model"
            )
        if other.training.method != first.training.method:
            raise BenchtrainError(
                f"calibrations of different methods in one comparison: {first.id} measured {first.training.method}, "
                f"{other.id} measured {other.training.method}; compare calibrations of one method"
            )


# -- one row ---------------------------------------------------------------------------------


class Bracket(NamedTuple):
    """A row's seconds (or dollars) from its plan's low bound to the upper end its deadline is judged at."""

    low: float
    upper: float


@dataclass
class Row:
    source: Source
    device: Hardware
    price_per_hour: float | None = None
    run_plan: RunPlan | None = None  # None when this source cannot plan the run
    compute: JsonDict = field(default_factory=dict)
    problem: str | None = None  # why there is no plan (the model does not fit this device, …)
    warnings: list[str] = field(default_factory=list)
    recommended: bool = False
    could_overtake: bool = (
        False  # at the upper end: cheaper (or sooner) at its low end than the recommended row at its upper end
    )
    # A row nobody measured: the `bench` arguments that would measure it (empty: measured).
    settle_arguments: tuple[str, ...] = ()
    settle_seconds: float = 0.0
    settle_cost: float | None = None

    @property
    def kind(self) -> str:
        """The source's kind, or "not plannable" where it made no plan (a source can plan and still not fit)."""
        return "not plannable" if self.run_plan is None else self.source.kind

    @property
    def rests_on(self) -> str:
        """Whose measurement the row rests on, or why it has none (the source's problem); "" where neither is known."""
        return self.source.rests_on or (self.source.problem or "")

    @property
    def calibration_id(self) -> str:
        """The id of the calibration that plans the row; "–" for a machine nothing can plan."""
        option = self.source.option
        return option.calibration.id if option is not None else "–"

    @property
    def reference(self) -> str:
        """How --use-calibration names it: a bundled one by its name, a stored one by its id, else its path."""
        option = self.source.option
        if option is None:
            return "–"
        shared = hub_reference(option.calibration.data)  # hub:ORG/NAME/ID, not its file in the cache
        if shared is not None:
            return shared
        path = option.calibration.path
        if path is None or is_bundled(path):
            return path.stem if path is not None else self.calibration_id
        return self.calibration_id if Path(path).resolve().parent == calibrations_dir().resolve() else str(path)

    @property
    def settle(self) -> str | None:
        """The bench run that would measure the row, as a person types it (several processes through accelerate);
        None: it was measured."""
        if not self.settle_arguments:
            return None
        machine = self.source.machine
        processes = machine.processes if machine is not None else 1
        launch = f"accelerate launch --num_processes {processes} -m benchtrain." if processes > 1 else ""
        return f"{launch}bench {shlex.join(self.settle_arguments)}"

    @property
    def processes(self) -> int:
        """The processes the row plans: its option's, else its machine's (a machine nothing can plan), else one."""
        option, machine = self.source.option, self.source.machine
        return option.world_size if option is not None else machine.processes if machine is not None else 1

    @property
    def bracket(self) -> Bracket | None:
        """The planned run's seconds from its low bound to its promised upper end; None without a plan."""
        if self.run_plan is None:
            return None
        chosen = self.run_plan.plan.chosen
        return Bracket(chosen.total_seconds_low, chosen.total_seconds_promised)

    @property
    def cost_bracket(self) -> Bracket | None:
        """`bracket` in dollars at the row's price for its processes; None without a plan or a price."""
        seconds = self.bracket
        if seconds is None or self.price_per_hour is None:
            return None
        low, high = (run_cost(value, self.price_per_hour, self.processes) for value in seconds)
        return Bracket(low or 0.0, high or 0.0)

    @property
    def memory_headroom(self) -> float | None:
        """Share of the device's memory left at the predicted peak; None without a plan or a predicted peak."""
        peak = self.run_plan.plan.chosen.peak_memory_bytes if self.run_plan is not None else None
        return None if peak is None else 1 - peak / float(self.device.memory_bytes)

    def to_json(self) -> JsonDict:
        option = self.source.option
        if option is None:
            bare = {
                "world_size": self.processes,
                "plan": None,
                "device": self.device.name,
                "problem": self.problem,
                "recommended": False,
            }
            return {**bare, **self.machine_json()}
        cal = option.calibration
        plan = self.run_plan.plan if self.run_plan is not None else None
        if self.run_plan is not None:
            data = self.run_plan.to_json(self.compute)
        else:
            data = {
                "calibration_id": cal.id,
                "calibration_path": str(cal.path) if cal.path else None,
                "world_size": self.processes,
                "plan": None,
            }
        data.update(
            {
                "reference": self.reference,
                "provenance": cal.provenance,  # whose measurement: measured here, hub:ORG/NAME (by USER), bundled
                "device": self.device.name,
                "device_type": self.device.device_type,
                "memory_bytes": self.device.memory_bytes,
                "sharding": option.sharding,
                "source": "predicted" if option.predicted else "measured",
                "collectives_from": option.collectives_from,
                "collectives_source": option.collectives_source,
                "interconnect": option.interconnect or self.device.interconnect,
                "comm_overlap": option.predicted,
                "price_per_hour": self.price_per_hour,
                "cost": plan.cost if plan is not None else None,
                "meets_deadline": plan is not None and plan.meets_deadline,
                "memory_headroom": self.memory_headroom,
                "problem": self.problem,
                "warnings": self.warnings,
                "recommended": self.recommended,
                **self.machine_json(),
            }
        )
        return data

    def machine_json(self) -> JsonDict:
        """What a row of `--consider` adds: the machine, where its figures come from, what would settle it."""
        machine = self.source.machine
        if machine is None:
            return {}
        low, upper = self.cost_bracket or (None, None)
        return {
            "machine": machine.label,
            "kind": self.kind,
            "rests_on": self.rests_on,
            "settle": self.settle,
            "settle_seconds": self.settle_seconds,
            "settle_cost": self.settle_cost,
            "could_overtake": self.could_overtake,
            "cost_low": low,
            "cost_upper": upper,
        }


def plan_row(context: PlanContext, method: MethodConfig, source: Source, here: Hardware) -> Row:
    """The plan of one source, made as a single-calibration dry run makes it, or why it cannot be made."""
    option = source.option
    if option is None:
        machine = source.machine
        assert machine is not None  # a calibration's row always has an option
        hardware = Hardware("cuda", machine.sheet.name, 1, machine.sheet.memory_bytes)
        return Row(source, hardware, problem=source.problem)
    cal, layout = option.calibration, ProcessLayout(option.world_size, option.sharding)
    problem = None if cal.ok_rows() else f"calibration {cal.id} has no successful probes"
    try:  # a row of N processes is sharded as asked even when this command runs one
        check_sharding(method, layout.sharding)
    except BenchtrainError as error:
        problem = str(error)
    if problem is None:
        try:
            setup = fit_variant(context.config, cal, context.spec, method, layout, here)
        except DoesNotFitError as error:  # any other error (a price missing, …) is the command's
            problem = str(error)
    if problem is not None:
        return Row(source, plan_hardware(context.config, cal, here), problem=problem)
    if option.interconnect is not None:  # the machine's links, which the calibration's device record may not name
        setup = replace(
            setup, hardware=replace(setup.hardware, interconnect=parse_interconnect(option.interconnect).kind)
        )
    row = Row(source, setup.hardware, setup.price_per_hour, warnings=list(setup.warnings))
    communicate = None
    if option.predicted and option.collectives is not None:
        collectives = option.collectives

        def communicate(traffic: Traffic) -> CommPlan:
            priced = price_traffic(collectives, traffic, option.world_size, cal.world_size, option.collectives_from)
            return priced._replace(
                record={**priced.record, "overlap": "bracketed", "interconnect": option.interconnect}
            )

    try:
        placed = plan_run(setup, context, communicate)
    except BenchtrainError as error:
        row.problem = str(error)
        return row
    row.run_plan = placed
    row.compute = planned_compute(context.spec, setup, placed.plan.chosen)
    row.warnings += placed.plan.warnings
    return row


def calibration_row(run: RunPlan) -> Row:
    """A single calibration's dry run as the row it is: that plan on the processes and interconnect the calibration recorded."""
    fitted = run.fitted
    processes = fitted.step.world_size
    recorded = recorded_interconnect(fitted.cal.hardware, processes) if processes > 1 else None
    option = Option(fitted.cal, processes, fitted.step.sharding, interconnect=recorded.word if recorded else None)
    return Row(option_source(option), fitted.hardware, fitted.price_per_hour, run_plan=run)


def add_settle(row: Row, context: PlanContext, method: MethodConfig) -> None:
    """The `bench run` that would measure a machine's row nobody measured, and what it costs."""
    machine, option = row.source.machine, row.source.option
    if machine is None or row.source.kind in MEASURED:
        return
    budget = option.calibration.budget_seconds if option is not None else None
    row.settle_seconds = budget or SETTLE_SECONDS
    lora = ("--lora",) if method.is_lora else ()
    link = ("--interconnect", machine.interconnect) if machine.interconnect else ()
    model = ("--model", context.config.model)  # as the user gave it: a local folder, a hub id@REV
    budget_option = ("--budget", format_duration(row.settle_seconds))
    row.settle_arguments = ("run", "--gpu", machine.sheet.key, *model, *lora, *link, *budget_option)
    price = row.price_per_hour
    if price is None:  # no plan was made for it: the --price-per-hour of its device, where one is given
        hardware = Hardware("cuda", machine.sheet.device_name, 1, machine.sheet.memory_bytes, machine.sheet.peak_entry)
        try:
            price = context.config.plan.prices.for_device("", hardware)
        except BenchtrainError:
            price = None
    row.settle_cost = run_cost(row.settle_seconds, price, machine.processes)


# -- the ranking -----------------------------------------------------------------------------


@dataclass
class Comparison:
    rows: list[Row]  # ranked: the recommended row first
    model: str
    method: str
    priority: str
    deadline_seconds: float
    available_seconds: float
    ranked_by: str  # cost | time
    profile: JsonDict
    notes: list[str] = field(default_factory=list)
    at_upper_end: bool = False  # judged at the upper end of each row's bracket (machines), not its estimate

    @property
    def recommended(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].recommended else None

    def to_json(self) -> JsonDict:
        best = self.recommended
        return {
            "kind": "comparison",
            "model": self.model,
            "method": self.method,
            "priority": self.priority,
            "deadline_seconds": self.deadline_seconds,
            "available_seconds": self.available_seconds,
            "ranked_by": self.ranked_by,
            "recommended": best.calibration_id if best else None,
            "recommended_world_size": best.processes if best else None,
            "profile": self.profile,
            "communication_bracket": COMMUNICATION_BRACKET,
            "notes": self.notes,
            "rows": [row.to_json() for row in self.rows],
        }


def plan_of(row: Row) -> Plan:
    assert row.run_plan is not None
    return row.run_plan.plan


def rank(rows: list[Row], by_cost: bool, at_upper_end: bool) -> list[Row]:
    """The rows in the order docs/design.md#which-machine-to-rent gives, judged at their estimates or `at_upper_end`."""

    def judged(row: Row) -> tuple[float, float]:
        chosen = plan_of(row).chosen
        if at_upper_end:
            return ((row.cost_bracket or Bracket(0.0, 0.0)).upper if by_cost else 0.0), chosen.total_seconds_promised
        return ((plan_of(row).cost or 0.0) if by_cost else 0.0), chosen.total_seconds

    planned = [row for row in rows if row.run_plan is not None]
    meeting = sorted((row for row in planned if plan_of(row).meets_deadline), key=judged)
    missing = sorted(
        (row for row in planned if not plan_of(row).meets_deadline),
        key=lambda row: plan_of(row).chosen.total_seconds_promised,
    )
    ranked = meeting + missing + [row for row in rows if row.run_plan is None]
    for row in ranked:
        row.recommended = bool(meeting) and row is meeting[0]
    return ranked


def could_overtake(rows: list[Row], available_seconds: float, by_cost: bool) -> list[Row]:
    """Rows that at their low end meet the deadline and cost less (without prices: finish sooner) than the recommended at its upper end."""
    best = next((row for row in rows if row.recommended), None)
    if best is None or best.bracket is None:
        return []
    best_cost, best_seconds = best.cost_bracket, best.bracket
    found = []
    for row in rows:
        seconds, costs = row.bracket, row.cost_bracket
        if row is best or seconds is None or seconds.low > available_seconds:
            continue
        if (costs.low < best_cost.upper) if (by_cost and costs and best_cost) else seconds.low < best_seconds.upper:
            found.append(row)
    return found


def compare(
    context: PlanContext,
    method: MethodConfig,
    calibrations: list[Calibration],
    here: Hardware,
    profile: JsonDict,
    sources: list[Calibration] | None = None,
) -> Comparison:
    """A row per calibration and per process count predicted from it, ranked at their estimates. `sources`: calibrations
    whose collectives may price predicted rows (default: collectives_sources)."""
    options = options_for(
        calibrations, context.config.step.sharding, collectives_sources(calibrations) if sources is None else sources
    )
    return comparison(context, method, [option_source(option) for option in options], here, profile, at_upper_end=False)


def consider(
    context: PlanContext,
    method: MethodConfig,
    calibrations: list[Calibration],
    here: Hardware,
    profile: JsonDict,
    machines: list[Machine],
) -> Comparison:
    """A row per machine from its best source, ranked at the upper ends of their brackets, with what would settle each."""
    sources, sharding = collectives_sources(calibrations), context.config.step.sharding
    return comparison(
        context,
        method,
        [machine_source(machine, calibrations, sharding, sources) for machine in machines],
        here,
        profile,
        at_upper_end=True,
    )


def comparison(
    context: PlanContext,
    method: MethodConfig,
    sources: list[Source],
    here: Hardware,
    profile: JsonDict,
    at_upper_end: bool,
) -> Comparison:
    """Every source planned on the same `context` and ranked."""
    config = context.config
    if config.plan.fit_deadline:
        again = "consider machines" if at_upper_end else "compare"
        raise BenchtrainError(
            f"--fit-deadline cuts each plan's steps, so the rows would not train the same run: {again} without it"
        )
    rows = [plan_row(context, method, source, here) for source in sources]
    for row in rows:
        add_settle(row, context, method)
    by_cost = all(row.price_per_hour is not None for row in rows if row.run_plan is not None) and any(
        row.run_plan is not None for row in rows
    )
    available = config.run_deadline.seconds_left(context.elapsed_seconds)
    ranked = rank(rows, by_cost, at_upper_end)
    for row in could_overtake(ranked, available, by_cost) if at_upper_end else []:
        row.could_overtake = True
    notes = [] if by_cost else [NO_PRICES]
    if at_upper_end:
        notes.append(
            "each row's time and cost run from its plan's low bound to the upper end; the deadline and the price are judged at the upper end"
        )
    elif any(source.kind == "predicted" for source in sources):
        notes.append(
            "predicted rows: a 1-process calibration plus collectives measured among N processes of the same device and interconnect "
            f"by another calibration, or priced from the interconnect's link figures; not measured as N-process steps: {COMMUNICATION_BRACKET}"
        )
    deadline = config.run_deadline
    ranked_by = "cost" if by_cost else "time"
    return Comparison(
        ranked,
        context.spec.name,
        method.describe(),
        config.plan.priority,
        deadline.deadline_seconds,
        available,
        ranked_by,
        profile,
        notes,
        at_upper_end,
    )


def no_row_meets_the_deadline(comparison: Comparison, margin: float) -> str:
    """One line: the closest row, what it needs, and what would fit (a later deadline, fewer epochs or steps)."""
    planned = [row for row in comparison.rows if row.run_plan is not None]
    if not planned:
        problems = "; ".join(f"{row.reference}: {row.problem}" for row in comparison.rows)
        return f"no calibration could plan this run: {problems}"
    closest = planned[0]
    plan = plan_of(closest)
    spent = plan.request.deadline.budget_seconds - plan.available_seconds
    needed = Deadline.deadline_holding(plan.chosen.total_seconds_promised + spent, margin)
    needed = math.ceil(needed / 60) * 60 if needed > 600 else math.ceil(needed)  # a deadline one would write
    return (
        f"no calibration's plan meets the {format_duration(comparison.deadline_seconds)} deadline: the closest, {closest.reference} "
        f"({closest.device.name} × {closest.processes}), needs up to {format_duration(plan.chosen.total_seconds_promised)} of the "
        f"{format_duration(max(0.0, plan.available_seconds))} usable; options: --deadline {format_duration(needed)}, {deadline_options(plan)}"
    )
