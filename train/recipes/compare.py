"""Which machine to rent: one plan per calibration, the cheapest that meets the deadline first.

`train --dry-run --use-calibration A,B,C` (or `all`) plans the same run once per calibration,
each for the device that calibration measured (train.recipes.plan_setup.plan_device: its memory, peak
FLOP/s, compile and loss) and the processes it measured, with `--priority` choosing inside each
row as it does for one calibration. Each row costs its estimate × the price of its device ×
its processes (train.planning.prices.run_cost). The recommended row meets the deadline at the lowest cost,
ties by time; without prices, the fastest that meets it.

Rows for N processes that no calibration measured are *predicted*: a 1-process calibration's step
plus the collectives another calibration measured among N processes of the same device (any
model: collectives only move bytes), priced as `train` prices them (train.planning.comm.price_traffic).
Their upper bound widens by the largest error such predictions showed (PREDICTION_ERROR).

Computation only: rows and their ranking; train.compare_command prints them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.durations import format_duration
from common.errors import BenchtrainError, DoesNotFitError
from train.planning.deadline import Deadline
from train.recipes.plan_setup import Placement, PlanContext, fit_setup, plan_device, plan_fitted, plan_json, planned_compute, same_device

# The largest |error| of a multi-process step predicted from a 1-process calibration plus
# collectives timed on idle processes (docs/benchmarks.md, "Multi-process": cpu-vm, gloo, 2
# processes; every measured step was slower than predicted). No GPU (NCCL) figure exists yet.
PREDICTION_ERROR = {"ddp": 0.412, "fsdp": 1.063}
PREDICTION_SOURCE = "docs/benchmarks.md: +41% (DDP) and +106% (FSDP) at most, cpu-vm gloo; not yet measured on GPUs"


@dataclass(frozen=True)
class Option:
    """One row to plan: a calibration, with its own processes (measured) or N processes predicted
    from collectives that calibration `collectives_from` measured."""

    calibration: Any
    world_size: int
    sharding: str
    collectives: dict[str, dict[str, Any]] | None = None
    collectives_from: str | None = None

    @property
    def predicted(self) -> bool:
        return self.collectives is not None


@dataclass
class Row:
    option: Option
    device: dict[str, Any]
    price_per_hour: float | None = None
    placement: Placement | None = None
    plan: Any = None  # train.planning.planner.Plan, or None when this calibration cannot plan the run
    communication: dict[str, Any] = field(default_factory=dict)
    compute: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # why there is no plan (the model does not fit this device, …)
    warnings: list[str] = field(default_factory=list)
    recommended: bool = False

    @property
    def calibration_id(self) -> str:
        return self.option.calibration.id

    @property
    def reference(self) -> str:
        """How --use-calibration names it: a bundled one by its name, a stored one by its id, else its path."""
        from calibration.store import calibrations_dir, is_bundled

        path = self.option.calibration.path
        if path is None or is_bundled(path):
            return path.stem if path is not None else self.calibration_id
        return self.calibration_id if Path(path).resolve().parent == calibrations_dir().resolve() else str(path)

    @property
    def processes(self) -> int:
        return self.option.world_size

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

    def to_json(self) -> dict[str, Any]:
        cal = self.option.calibration
        if self.plan is not None and self.placement is not None:
            data = plan_json(cal, self.plan, self.placement, self.communication, self.compute)
        else:
            data = {"calibration_id": cal.id, "calibration_path": str(cal.path) if cal.path else None, "world_size": self.processes, "plan": None}
        data.update(
            {
                "reference": self.reference,
                "device": self.device["name"],
                "device_type": self.device["device_type"],
                "memory_bytes": self.device["memory_bytes"],
                "sharding": self.option.sharding,
                "source": "predicted" if self.option.predicted else "measured",
                "collectives_from": self.option.collectives_from,
                "prediction_error": PREDICTION_ERROR[self.option.sharding] if self.option.predicted else 0.0,
                "price_per_hour": self.price_per_hour,
                "cost": self.cost,
                "meets_deadline": self.meets_deadline,
                "memory_headroom": self.memory_headroom,
                "problem": self.problem,
                "warnings": self.warnings,
                "recommended": self.recommended,
            }
        )
        return data


@dataclass
class Comparison:
    rows: list[Row]  # ranked: the recommended row first
    model: str
    method: str
    priority: str
    deadline_seconds: float
    available_seconds: float
    ranked_by: str  # cost | time
    profile: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].recommended else None

    def to_json(self) -> dict[str, Any]:
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
            "prediction_error_source": PREDICTION_SOURCE,
            "notes": self.notes,
            "rows": [row.to_json() for row in self.rows],
        }


# -- which calibrations ----------------------------------------------------------------------


def measured_identity(data: dict[str, Any]) -> tuple[str | None, str]:
    """(model fingerprint, method) of a calibration: what must agree within a comparison (a preset
    and a hub model of the same architecture share a fingerprint, train.workload.model)."""
    return (data.get("model") or {}).get("fingerprint"), (data.get("training") or {}).get("method", "full")


def select_calibrations(reference: str, spec: Any, method: Any, on_skip: Any = None) -> list[Any]:
    """The calibrations a comparison names: `all` (every stored calibration of this model and
    method, newest first, then the bundled ones) or ids/paths separated by commas (each once)."""
    import calibration as calibration_api
    from calibration.model import Calibration
    from calibration.schema import read_calibration_file
    from calibration.store import bundled_calibrations, list_calibrations

    if reference.strip() == "all":
        mine = (spec.fingerprint, method.method)
        stored = [(path, data) for path, data, _ in list_calibrations() if data is not None]
        stored += [(path, read_calibration_file(path)) for path in bundled_calibrations().values()]
        found = []
        for path, data in stored:
            if measured_identity(data) != mine:
                continue
            try:
                found.append(Calibration(data, path))
            except BenchtrainError as error:  # no fitted model: said, and left out
                if on_skip is not None:
                    on_skip(f"skipped {path}: {error}")
        if not found:
            raise BenchtrainError(
                f"--use-calibration all: no stored or bundled calibration of {spec.name} ({method.describe()}); "
                f"run `bench run --model {spec.name}{' --lora' if method.is_lora else ''}` on each device to compare"
            )
        chosen = found
    else:
        names = [part.strip() for part in reference.split(",") if part.strip()]
        if not names:
            raise BenchtrainError(f"--use-calibration {reference!r} names no calibration: A,B,C (ids or paths) or all")
        chosen = [calibration_api.load(name, on_skip=on_skip) for name in names]
    unique: dict[str, Any] = {}
    for cal in chosen:
        unique.setdefault(cal.id, cal)
    check_one_model_and_method(list(unique.values()))
    return list(unique.values())


def check_one_model_and_method(calibrations: list[Any]) -> None:
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


def collectives_sources(calibrations: list[Any]) -> list[dict[str, Any]]:
    """Calibrations of several processes whose collectives can price predicted rows: those in the
    comparison and every stored one (of any model), newest first, as raw data."""
    from calibration.store import list_calibrations

    seen, sources = set(), []
    candidates = [cal.data for cal in calibrations] + [data for _, data, _ in list_calibrations() if data is not None]
    for data in sorted(candidates, key=lambda data: data.get("created_at", ""), reverse=True):
        if data["id"] in seen or int((data.get("distributed") or {}).get("world_size", 1)) < 2:
            continue
        seen.add(data["id"])
        sources.append(data)
    return sources


def options_for(calibrations: list[Any], sharding: str, sources: list[dict[str, Any]]) -> list[Option]:
    """A row for each calibration as measured; and for each 1-process one, a predicted row per
    process count another calibration measured collectives for on the same device (the newest),
    unless a calibration in the comparison measured that device, count and sharding itself."""
    from train.planning.comm import COLLECTIVES, stored_collectives

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
            wanted = {kind: collectives[kind] for kind in COLLECTIVES[sharding]}
            predicted[processes] = Option(cal, processes, sharding, wanted, data["id"])
        options += [predicted[count] for count in sorted(predicted)]
    return options


# -- one row ---------------------------------------------------------------------------------


def plan_row(context: PlanContext, method: Any, option: Option, here: dict[str, Any]) -> Row:
    """The plan of one option, made as a single-calibration dry run makes it (train.recipes.plan_setup:
    fit_setup, plan_fitted), or why it cannot be made (a model too big for the device, no
    configuration in memory)."""
    from train.planning.comm import price_traffic

    cal, layout = option.calibration, (option.world_size, option.sharding)
    if not cal.ok_rows():
        row = Row(option, plan_device(context.config, cal, here, context.spec).hardware)
        row.problem = f"calibration {cal.id} has no successful probes"
        return row
    try:
        setup = fit_setup(context.config, cal, context.spec, method, layout, here)
    except DoesNotFitError as error:
        row = Row(option, plan_device(context.config, cal, here, context.spec).hardware)
        row.problem = str(error)
        return row
    row = Row(option, setup.device.hardware)
    row.price_per_hour, row.warnings = setup.price_per_hour, list(setup.warnings)
    communicate = None
    if option.predicted and option.collectives is not None:
        collectives = option.collectives

        def communicate(traffic: Any) -> tuple[float, float, dict[str, Any], float]:
            return (*price_traffic(collectives, traffic, option.world_size, cal.world_size, option.collectives_from), PREDICTION_ERROR[option.sharding])

    try:
        placed = plan_fitted(setup, context, layout, communicate)
    except BenchtrainError as error:
        row.problem = str(error)
        return row
    row.placement, row.communication, row.plan = placed.placement, placed.communication, placed.plan
    row.compute = planned_compute(context.spec, method, row.plan.chosen, setup.device.hardware)
    row.warnings += row.plan.warnings
    return row


# -- the comparison --------------------------------------------------------------------------


def rank(rows: list[Row], by_cost: bool) -> list[Row]:
    """Rows that meet the deadline by cost (or time without prices), ties by time; then those that
    do not, closest first; then those with no plan. The first that meets it is recommended."""
    planned = [row for row in rows if row.plan is not None]
    meeting = sorted((row for row in planned if row.meets_deadline), key=lambda row: (row.cost if by_cost else 0.0, row.plan.chosen.total_seconds))
    missing = sorted((row for row in planned if not row.meets_deadline), key=lambda row: row.plan.chosen.total_seconds_promised)
    ranked = meeting + missing + [row for row in rows if row.plan is None]
    for row in ranked:
        row.recommended = False
    if meeting:
        meeting[0].recommended = True
    return ranked


def compare(
    context: PlanContext, method: Any, calibrations: list[Any], here: dict[str, Any], profile: dict[str, Any], sources: list[dict[str, Any]] | None = None
) -> Comparison:
    """Every option planned and ranked, each on the same `context` (the command, the model, the
    data as profiled, the time spent). `sources`: calibrations whose collectives may price
    predicted rows (default: those of the comparison and the store)."""
    config, spec = context.config, context.spec
    if config.fit_deadline:
        raise BenchtrainError("--fit-deadline cuts each plan's steps, so the rows would not train the same run: compare without it")
    sharding = config.step_options.sharding
    options = options_for(calibrations, sharding, collectives_sources(calibrations) if sources is None else sources)
    rows = [plan_row(context, method, option, here) for option in options]
    by_cost = all(row.price_per_hour is not None for row in rows)
    notes = []
    if not by_cost:
        notes.append("no --price-per-hour: rows are ranked by time; pass h100=2.5,… to rank by cost")
    if any(option.predicted for option in options):
        notes.append(
            "predicted rows: a 1-process calibration plus collectives measured among N processes of the same device by another "
            f"calibration; not measured as N-process steps, so their upper bound is widened ({PREDICTION_SOURCE})"
        )
    deadline = config.run_deadline
    ranked_by = "cost" if by_cost else "time"
    available = deadline.seconds_left(context.elapsed_seconds)
    return Comparison(rank(rows, by_cost), spec.name, method.describe(), config.priority, deadline.deadline_seconds, available, ranked_by, profile, notes)


def no_row_meets_the_deadline(comparison: Comparison, margin: float) -> str:
    """One line: the closest row, what it needs, and what would fit (a later deadline, fewer
    epochs or steps: train.planning.planner.deadline_options)."""
    from train.planning.planner import deadline_options

    planned = [row for row in comparison.rows if row.plan is not None]
    if not planned:
        problems = "; ".join(f"{row.reference}: {row.problem}" for row in comparison.rows)
        return f"no calibration could plan this run: {problems}"
    closest = planned[0]
    plan = closest.plan
    spent = plan.deadline.budget_seconds - plan.available_seconds
    needed = Deadline.deadline_holding(plan.chosen.total_seconds_promised + spent, margin)
    needed = math.ceil(needed / 60) * 60 if needed > 600 else math.ceil(needed)  # a deadline one would write
    return (
        f"no calibration's plan meets the {format_duration(comparison.deadline_seconds)} deadline: the closest, {closest.reference} "
        f"({closest.device['name']} × {closest.processes}), needs up to {format_duration(plan.chosen.total_seconds_promised)} of the "
        f"{format_duration(max(0.0, plan.available_seconds))} usable; options: --deadline {format_duration(needed)}, {deadline_options(plan)}"
    )
