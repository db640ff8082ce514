"""Which machine to rent: one plan per calibration, the cheapest that meets the deadline first.

`train --dry-run --use-calibration A,B,C` (or `all`) plans the same run once per calibration,
each for the device that calibration measured (train.recipes.choice.fit_variant: its memory, peak
FLOP/s, compile and loss) and the processes it measured, with `--priority` choosing inside each
row as it does for one calibration. Each row costs its estimate × the price of its device ×
its processes (train.planning.prices.run_cost). The recommended row meets the deadline at the lowest cost,
ties by time; without prices, the fastest that meets it.

Rows for N processes that no calibration measured are *predicted*: a 1-process calibration's step
plus the collectives another calibration measured among N processes of the same device and
interconnect (any model: collectives only move bytes), or, where none did, collectives priced from
the interconnect's link figures (calibration.topology; train.recipes.options), priced as `train`
prices them (train.planning.comm.price_traffic). Their time is bracketed between the collectives
hidden behind backward as far as they can be and not at all (train.planning.planner.exposed_floor):
the estimate takes the midpoint, the upper bound (and the deadline) none hidden.

Computation only: rows and their ranking; train.compare_command prints them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import calibration as calibration_api
from calibration.hub import hub_reference, is_hub_reference, parse_reference, shared_calibrations
from calibration.model import Calibration
from calibration.schema import read_calibration_file
from calibration.store import bundled_calibrations, calibrations_dir, is_bundled, list_calibrations
from calibration.topology import parse_interconnect
from common.durations import format_duration
from common.errors import BenchtrainError, DoesNotFitError
from common.json_types import JsonDict
from train.planning.comm import Traffic, price_traffic
from train.planning.deadline import Deadline
from train.planning.planner import deadline_options
from train.recipes.choice import fit_variant, plan_hardware
from train.recipes.options import Option, collectives_sources, options_for
from train.recipes.run_plan import PlanContext, RunPlan, plan_run, planned_compute
from train.step.engine import ProcessLayout, check_sharding

if TYPE_CHECKING:
    from train.planning.types import Plan
    from train.workload.method import MethodConfig
    from train.workload.model import ModelSpec

COMMUNICATION_BRACKET = (
    "collectives between full overlap with backward (2/3 of the step's compute, an assumption) and none; estimate at the midpoint, "
    "upper bound and deadline at none (calibration.topology)"
)


@dataclass
class Row:
    option: Option | None  # None: a machine considered with no calibration to plan it from (`problem` says why)
    device: JsonDict
    price_per_hour: float | None = None
    run_plan: RunPlan | None = None  # the plan whole: its device, processes and variant (`plan` is its planner answer)
    plan: Plan | None = None  # None when this calibration cannot plan the run
    communication: JsonDict = field(default_factory=dict)
    compute: JsonDict = field(default_factory=dict)
    problem: str | None = None  # why there is no plan (the model does not fit this device, …)
    warnings: list[str] = field(default_factory=list)
    recommended: bool = False
    consider: Consideration | None = None  # a row of `--consider` (train.recipes.consider)

    @property
    def calibration_id(self) -> str:
        return self.option.calibration.id if self.option is not None else "–"

    @property
    def reference(self) -> str:
        """How --use-calibration names it: a bundled one by its name, a stored one by its id, else its path."""
        if self.option is None:
            return "–"
        shared = hub_reference(self.option.calibration.data)  # hub:ORG/NAME/ID, not its file in the cache
        if shared is not None:
            return shared
        path = self.option.calibration.path
        if path is None or is_bundled(path):
            return path.stem if path is not None else self.calibration_id
        return self.calibration_id if Path(path).resolve().parent == calibrations_dir().resolve() else str(path)

    @property
    def processes(self) -> int:
        return self.option.world_size if self.option is not None else self.consider.processes if self.consider else 1

    @property
    def cost(self) -> float | None:
        return self.plan.cost if self.plan is not None else None

    @property
    def meets_deadline(self) -> bool:
        return self.plan is not None and self.plan.meets_deadline

    @property
    def memory_headroom(self) -> float | None:
        """Share of the device's memory left at the predicted peak."""
        peak = self.plan.chosen.peak_memory_bytes if self.plan is not None else None
        return None if peak is None else 1 - peak / float(self.device["memory_bytes"])

    def to_json(self) -> JsonDict:
        if self.option is None:
            bare = {"world_size": self.processes, "plan": None, "device": self.device["name"], "problem": self.problem, "recommended": False}
            return {**bare, **self.considered()}
        cal = self.option.calibration
        if self.plan is not None and self.run_plan is not None:
            data = self.run_plan.to_json(self.compute)
        else:
            data = {"calibration_id": cal.id, "calibration_path": str(cal.path) if cal.path else None, "world_size": self.processes, "plan": None}
        data.update(
            {
                "reference": self.reference,
                "provenance": cal.provenance,  # whose measurement: measured here, hub:ORG/NAME (by USER), bundled
                "device": self.device["name"],
                "device_type": self.device["device_type"],
                "memory_bytes": self.device["memory_bytes"],
                "sharding": self.option.sharding,
                "source": "predicted" if self.option.predicted else "measured",
                "collectives_from": self.option.collectives_from,
                "collectives_source": self.option.collectives_source,
                "interconnect": self.option.interconnect or self.device.get("interconnect"),
                "comm_overlap": self.option.predicted,
                "price_per_hour": self.price_per_hour,
                "cost": self.cost,
                "meets_deadline": self.meets_deadline,
                "memory_headroom": self.memory_headroom,
                "problem": self.problem,
                "warnings": self.warnings,
                "recommended": self.recommended,
                **self.considered(),
            }
        )
        return data

    def considered(self) -> JsonDict:
        return self.consider.to_json() if self.consider is not None else {}


@dataclass
class Consideration:
    """What a `--consider` row adds (train.recipes.consider): the machine, where its figures come
    from, and for a row nobody measured, the bench run that would settle it."""

    machine: str  # 2×H100 SXM nvlink
    processes: int
    kind: str  # measured here | measured by someone | predicted | translated | not plannable
    rests_on: str = ""
    settle: str | None = None
    settle_seconds: float = 0.0
    settle_cost: float | None = None
    could_overtake: bool = False
    cost_low: float | None = None  # the cost at the time bracket's ends (train.recipes.consider.cost_bracket)
    cost_upper: float | None = None

    def to_json(self) -> JsonDict:
        return {
            "machine": self.machine,
            "kind": self.kind,
            "rests_on": self.rests_on,
            "settle": self.settle,
            "settle_seconds": self.settle_seconds,
            "settle_cost": self.settle_cost,
            "could_overtake": self.could_overtake,
            "cost_low": self.cost_low,
            "cost_upper": self.cost_upper,
        }


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


# -- which calibrations ----------------------------------------------------------------------


def measured_identity(data: JsonDict) -> tuple[str | None, str]:
    """(model fingerprint, method) of a calibration: what must agree within a comparison (a preset
    and a hub model of the same architecture share a fingerprint, train.workload.model)."""
    return (data.get("model") or {}).get("fingerprint"), (data.get("training") or {}).get("method", "full")


def select_calibrations(reference: str, spec: ModelSpec, method: MethodConfig, on_skip: Callable[[str], None] | None = None) -> list[Calibration]:
    """The calibrations a comparison names, separated by commas (each once): `all` (every stored
    calibration of this model and method, newest first, then the bundled ones), `hub:ORG/NAME`
    (those of this model and method shared in that hub repository: calibration.hub), ids, paths
    or `hub:ORG/NAME/ID`."""
    names = [part.strip() for part in reference.split(",") if part.strip()]
    if not names:
        raise BenchtrainError(f"--use-calibration {reference!r} names no calibration: A,B,C (ids, paths or hub:ORG/NAME[/ID]) or all")
    chosen: list[Calibration] = []
    for name in names:
        if name == "all":
            stored = [(path, data) for path, data, _ in list_calibrations() if data is not None]
            stored += [(path, read_calibration_file(path)) for path in bundled_calibrations().values()]
            chosen += of_this_run(stored, spec, method, on_skip)
        elif is_hub_reference(name) and parse_reference(name).calibration_id is None:
            shared = of_this_run(shared_calibrations(name, on_skip), spec, method, on_skip)
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


def of_this_run(entries: Sequence[tuple[Path, JsonDict]], spec: ModelSpec, method: MethodConfig, on_skip: Callable[[str], None] | None) -> list[Calibration]:
    """The calibrations (path, data) of this model and method; one without a fitted model is said
    and left out."""
    found = []
    for path, data in entries:
        if measured_identity(data) != (spec.fingerprint, method.method):
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
        if other.model.get("fingerprint") != first.model.get("fingerprint"):
            raise BenchtrainError(
                f"calibrations of different models in one comparison: {first.id} measured {first.model.get('name')}, "
                f"{other.id} measured {other.model.get('name')}; compare calibrations of one model"
            )
        if other.training.get("method", "full") != first.training.get("method", "full"):
            raise BenchtrainError(
                f"calibrations of different methods in one comparison: {first.id} measured {first.training.get('method', 'full')}, "
                f"{other.id} measured {other.training.get('method', 'full')}; compare calibrations of one method"
            )


# -- one row ---------------------------------------------------------------------------------


def plan_row(context: PlanContext, method: MethodConfig, option: Option, here: JsonDict) -> Row:
    """The plan of one option, made as a single-calibration dry run makes it (train.recipes.choice.fit_variant,
    train.recipes.run_plan.plan_run), or why it cannot be made (a model too big for the device, no
    configuration in memory)."""
    cal, layout = option.calibration, ProcessLayout(option.world_size, option.sharding)
    try:  # a row of N processes is sharded as asked even when this command runs one
        check_sharding(method, layout.sharding)
    except BenchtrainError as error:
        row = Row(option, plan_hardware(context.config, cal, here))
        row.problem = str(error)
        return row
    if not cal.ok_rows():
        row = Row(option, plan_hardware(context.config, cal, here))
        row.problem = f"calibration {cal.id} has no successful probes"
        return row
    try:
        setup = fit_variant(context.config, cal, context.spec, method, layout, here)
    except DoesNotFitError as error:
        row = Row(option, plan_hardware(context.config, cal, here))
        row.problem = str(error)
        return row
    if option.interconnect is not None:  # the machine's links, which the calibration's device record may not name
        setup = replace(setup, hardware={**setup.hardware, "interconnect": parse_interconnect(option.interconnect).kind})
    row = Row(option, setup.hardware)
    row.price_per_hour, row.warnings = setup.price_per_hour, list(setup.warnings)
    communicate = None
    if option.predicted and option.collectives is not None:
        collectives = option.collectives

        def communicate(traffic: Traffic) -> tuple[float, float, JsonDict]:
            per_step, per_micro_step, record = price_traffic(collectives, traffic, option.world_size, cal.world_size, option.collectives_from)
            return per_step, per_micro_step, {**record, "overlap": "bracketed", "interconnect": option.interconnect}

    try:
        placed = plan_run(setup, context, communicate)
    except BenchtrainError as error:
        row.problem = str(error)
        return row
    row.run_plan, row.communication, row.plan = placed, placed.communication, placed.plan
    row.compute = planned_compute(context.spec, placed, row.plan.chosen)
    row.warnings += row.plan.warnings
    return row


# -- the comparison --------------------------------------------------------------------------


def rank(rows: list[Row], by_cost: bool) -> list[Row]:
    """Rows that meet the deadline by cost (or time without prices), ties by time; then those that
    do not, closest first; then those with no plan. The first that meets it is recommended."""
    return rank_by(rows, lambda row: (row.cost if by_cost else 0.0, plan_of(row).chosen.total_seconds), lambda row: plan_of(row).chosen.total_seconds_promised)


def plan_of(row: Row) -> Plan:
    """The plan of a row that has one (rank_by's keys see only those)."""
    assert row.plan is not None
    return row.plan


def rank_by(rows: list[Row], meeting_key: Callable[[Row], Any], missing_key: Callable[[Row], Any]) -> list[Row]:
    """Rows that meet the deadline ordered by `meeting_key`, then those that do not by
    `missing_key`, then those with no plan; the first that meets it is recommended."""
    planned = [row for row in rows if row.plan is not None]
    meeting = sorted((row for row in planned if row.meets_deadline), key=meeting_key)
    missing = sorted((row for row in planned if not row.meets_deadline), key=missing_key)
    ranked = meeting + missing + [row for row in rows if row.plan is None]
    for row in ranked:
        row.recommended = False
    if meeting:
        meeting[0].recommended = True
    return ranked


def compare(
    context: PlanContext,
    method: MethodConfig,
    calibrations: list[Calibration],
    here: JsonDict,
    profile: JsonDict,
    sources: list[JsonDict] | None = None,
    options: list[Option] | None = None,
) -> Comparison:
    """Every option planned and ranked, each on the same `context` (the command, the model, the
    data as profiled, the time spent). `sources`: calibrations whose collectives may price
    predicted rows (default: those of the comparison and the store). `options`: the rows to plan
    (e.g. from predicted_option), instead of options_for's."""
    config, spec = context.config, context.spec
    if config.plan.fit_deadline:
        raise BenchtrainError("--fit-deadline cuts each plan's steps, so the rows would not train the same run: compare without it")
    sharding = config.step.sharding
    if options is None:
        options = options_for(calibrations, sharding, collectives_sources(calibrations) if sources is None else sources)
    rows = [plan_row(context, method, option, here) for option in options]
    by_cost = all(row.price_per_hour is not None for row in rows)
    notes = []
    if not by_cost:
        notes.append("no --price-per-hour: rows are ranked by time; pass h100=2.5,… to rank by cost")
    if any(option.predicted for option in options):
        notes.append(
            "predicted rows: a 1-process calibration plus collectives measured among N processes of the same device and interconnect "
            f"by another calibration, or priced from the interconnect's link figures; not measured as N-process steps: {COMMUNICATION_BRACKET}"
        )
    deadline = config.run_deadline
    ranked_by = "cost" if by_cost else "time"
    available = deadline.seconds_left(context.elapsed_seconds)
    return Comparison(rank(rows, by_cost), spec.name, method.describe(), config.plan.priority, deadline.deadline_seconds, available, ranked_by, profile, notes)


def no_row_meets_the_deadline(comparison: Comparison, margin: float) -> str:
    """One line: the closest row, what it needs, and what would fit (a later deadline, fewer
    epochs or steps: train.planning.planner.deadline_options)."""
    planned = [row for row in comparison.rows if row.plan is not None]
    if not planned:
        problems = "; ".join(f"{row.reference}: {row.problem}" for row in comparison.rows)
        return f"no calibration could plan this run: {problems}"
    closest = planned[0]
    plan = plan_of(closest)
    spent = plan.deadline.budget_seconds - plan.available_seconds
    needed = Deadline.deadline_holding(plan.chosen.total_seconds_promised + spent, margin)
    needed = math.ceil(needed / 60) * 60 if needed > 600 else math.ceil(needed)  # a deadline one would write
    return (
        f"no calibration's plan meets the {format_duration(comparison.deadline_seconds)} deadline: the closest, {closest.reference} "
        f"({closest.device['name']} × {closest.processes}), needs up to {format_duration(plan.chosen.total_seconds_promised)} of the "
        f"{format_duration(max(0.0, plan.available_seconds))} usable; options: --deadline {format_duration(needed)}, {deadline_options(plan)}"
    )
