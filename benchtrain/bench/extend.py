"""`bench run --extend ID`: a stored calibration measured further (new sequence lengths, or another dimension's values) with
the step, device and probe timing it measured, stored as a new calibration whose `extends` names it; the old file is left
as it was. Why a new file and how train asks for one: docs/design.md#measuring-what-a-plan-lacks"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.bench.calibrate import BenchRun, BenchTask, plan_probes, probe_payload
from benchtrain.bench.disturbed import measurements_of
from benchtrain.bench.probe import Workload
from benchtrain.bench.probe_tasks import probe_coordinator
from benchtrain.bench.record import fit_record
from benchtrain.bench.runner import Budget, run_grid
from benchtrain.bench.space import SearchSpace
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration.dimensions import DIMENSIONS
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import new_id
from benchtrain.calibration.training import Training
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.heap import frozen_heap
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.memory_check import check_fits
from benchtrain.train.step.engine import StepOptions, process_layout
from benchtrain.train.step.hardware import detect_hardware, detect_software, device_label
from benchtrain.train.step.runtime import job_world_size
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, resolve_model

if TYPE_CHECKING:
    from benchtrain.common.progress import Bar

# Shown of the probes the budget buys, before the rest are counted.
PROBES_NAMED = 6


@dataclass(frozen=True)
class ExtensionSource:
    """The calibration to extend, as read, and the model its probes trained."""

    data: JsonDict
    spec: ModelSpec


def extension_source(path: Path, model: str | None) -> ExtensionSource:
    """The calibration to extend and its model, or one line on why it cannot be extended here: measured on another device,
    by several processes, on layer slices, of several setups, of a user's Trainer, or translated."""
    data = read_calibration_file(path)
    name = data["id"]
    refusals = (
        (
            data.get("variants"),
            "measured several setups (--quantize/--optimizer lists): extend one `bench run` per setup",
        ),
        (data.get("slices"), "was measured on layer slices: `bench run --layers` measures it again"),
        ((data.get("distributed") or {}).get("world_size", 1) > 1, "was measured by several processes"),
        (data.get("translation"), "was translated from another device, not measured"),
        (
            (data.get("training") or {}).get("trainer"),
            "timed a user's Trainer step: `benchtrain.calibrate` measures it",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise BenchtrainError(f"bench run --extend {name}: the calibration {why}")
    if job_world_size() > 1:
        raise BenchtrainError(
            f"bench run --extend {name}: extends a calibration of one process; run it without `accelerate launch`"
        )
    here = Hardware.from_record(detect_hardware())
    if not Hardware.from_record(data["hardware"]).same_device(here):
        raise BenchtrainError(
            f"bench run --extend {name}: it was measured on {data['hardware']['name']}, this is {here.name}: extend it on that device"
        )
    spec = resolve_model(model or data["model"]["name"])
    if spec.fingerprint != data["model"].get("fingerprint"):
        raise BenchtrainError(
            f"bench run --extend {name}: it measured model {data['model']['name']}, not {spec.name}: pass --model as `bench run` had it"
        )
    return ExtensionSource(data, spec)


def measured_method(training: Training) -> MethodConfig:
    """What the calibration's probes trained, as the method to train again (LoRA's settings as recorded)."""
    lora = training.record.get("lora") or {}
    targets = lora.get("targets")
    return MethodConfig(
        method=training.method,
        lora_rank=int(lora.get("rank") or 16),
        lora_alpha=float(lora["alpha"]) if lora.get("alpha") is not None else None,
        lora_dropout=float(lora.get("dropout") or 0.0),
        lora_targets=tuple(targets) if targets else None,
        quantize=training.quantization,
        optimizer=training.optimizer,
    )


def measured_options(training: Training) -> StepOptions:
    """How the calibration's step ran: compiled or eager, its loss."""
    return StepOptions(compile="on" if training.compiled else "off", loss=training.loss or "auto")


def extension_space(source: JsonDict, asked: dict[str, tuple[int, ...]]) -> SearchSpace:
    """The values to probe: those asked for, and for each dimension not asked for the values the calibration measured."""
    ok = [row for row in source["measurements"] if row.get("status") == "ok"]
    measured = {
        dimension.axis: tuple(sorted({int(row.get(name, 0)) for row in ok})) for name, dimension in DIMENSIONS.items()
    }
    return SearchSpace(**(measured | asked))


def extend(
    source: JsonDict,
    spec: ModelSpec,
    asked: dict[str, tuple[int, ...]],
    budget_seconds: float | None,
    progress: Callable[[int, float | None], Bar | None],
) -> JsonDict:
    """The probes the budget pays for, chosen by bench's probe planner among `asked` as it knows the calibration's own
    probes (their prices and what the fit already learned from them), then every row fitted again as a new record."""
    started = time.monotonic()
    training = Training.from_record(source.get("training"))
    method, options = measured_method(training), measured_options(training)
    hardware = detect_hardware()
    space = extension_space(source, asked)
    # The probes timed as the calibration's were (steps, warm-up, seconds each).
    recorded = (source.get("search") or {}).get("settings")
    settings = ProbeSettings(**recorded) if recorded else ProbeSettings.for_device(hardware["device_type"])
    layout = process_layout(options, method)
    need = check_fits(spec, method, Hardware.from_record(hardware), layout.sharding, layout.world_size)
    task = BenchTask(
        space=space,
        settings=settings,
        hardware=hardware,
        software=detect_software(),
        model=source["model"],
        training=source.get("training") or {},
        device_label=device_label(hardware),
        compiled=training.compiled,
    )
    planner, _ = plan_probes(task, spec, method, need, options)
    for row in source["measurements"]:
        planner.record(row)  # its prices, memory and what the fit knows: only the new values are candidates
    build = float((source.get("overheads") or {}).get("model_build_seconds", 0.0))
    left = None if budget_seconds is None else budget_seconds - build
    planned = planner.preview(left)
    if not planned:
        cheapest = min((planner.price(config) for config in planner.candidates()), default=0.0)
        raise BenchtrainError(
            f"bench run --extend {source['id']}: --budget {format_duration(budget_seconds or 0.0)} cannot pay for one probe "
            f"(the model build ≈ {format_duration(build)} and the cheapest probe ≈ {format_duration(cheapest)}): "
            f"use --budget {format_duration(max(1.0, build + cheapest) * 1.5)}"
        )
    named = ", ".join(config.label for config, _ in planned[:PROBES_NAMED])
    more = f" and {len(planned) - PROBES_NAMED} more" if len(planned) > PROBES_NAMED else ""
    say(
        f"extending calibration {source['id']}: {len(planned)} probes ({named}{more}) ≈ {format_duration(sum(p for _, p in planned) + build)} "
        f"with the model build, of {len(planner.candidates())} new configurations"
        + (f", within {format_duration(budget_seconds)}" if budget_seconds else "")
    )
    workload = Workload(spec, None, method, options)
    coordinator = probe_coordinator(workload, hardware.get("peak_bf16_flops"))
    budget = Budget(budget_seconds, started)
    run = BenchRun(task, coordinator, planner, budget)

    def probe(config: StepConfig, remaining: float | None) -> JsonDict:
        return coordinator.run("probe", probe_payload(run, config, remaining))

    bar = progress(len(planned), budget_seconds)
    with frozen_heap():
        try:
            result = run_grid(space, probe, budget, bar, reference_every=None, planner=planner)
        finally:
            if bar is not None:
                bar.close()
            coordinator.finish()
            workload.release()
    return extended_record(
        source, result.rows, space, budget_seconds, result.stopped_by_budget, time.monotonic() - started
    )


def extended_record(
    source: JsonDict,
    rows: list[JsonDict],
    space: SearchSpace,
    budget_seconds: float | None,
    stopped_by_budget: bool,
    seconds: float,
    created: datetime | None = None,
) -> JsonDict:
    """`source` (untouched) with `rows` added and fitted again, under a new id whose `extends` names it. Past runs
    measured the old fit's predictions: their correction does not carry over (as `bench refit`)."""
    ok = [row for row in rows if row.get("status") == "ok"]
    if not ok:
        raise BenchtrainError(
            f"bench run --extend {source['id']}: no new probe succeeded ({len(rows)} tried): nothing stored"
        )
    created = created or datetime.now(timezone.utc)
    record = copy.deepcopy(source)
    record["id"] = new_id(device_label(record["hardware"]), record["model"]["name"], created)
    record["created_at"] = created.isoformat(timespec="seconds")
    record["extends"] = source["id"]
    record.pop("refit_of", None)
    record["measurements"] = [*record["measurements"], *after_positions(record["measurements"], rows, source["id"])]
    search = record.setdefault("search", {})
    search["extensions"] = [
        *search.get("extensions", []),
        {
            "of": source["id"],
            "space": space.as_dict(),
            "budget_seconds": budget_seconds,
            "probes": len(rows),
            "ok": len(ok),
            "stopped_by_budget": stopped_by_budget,
            "seconds": round(seconds, 3),
            "created_at": record["created_at"],
        },
    ]
    record["warnings"] = [warning for warning in record.get("warnings", []) if not warning.startswith("held-out error")]
    if sum(1 for row in record["measurements"] if row.get("status") == "ok") >= MIN_ROWS_FOR_FIT:
        fit_record(record, (record.get("process_check") or {}).get("measurements") or [])
    record["history"] = []
    return record


def after_positions(earlier: list[JsonDict], rows: list[JsonDict], source_id: str) -> list[JsonDict]:
    """`rows` (copies) marked as extending `source_id`, their positions in the benchmark's sequence after `earlier`'s: a
    drift correction interpolates by position, and these were measured after every one of those."""
    positions = [
        int(m.get("position", index)) for index, row in enumerate(earlier) for m in [row, *measurements_of(row)]
    ]
    after = 1 + max(positions, default=-1)
    added = []
    for row in copy.deepcopy(rows):
        for measurement in {id(m): m for m in [row, *measurements_of(row)]}.values():
            if "position" in measurement:
                measurement["position"] = after + int(measurement["position"])
        added.append({**row, "extends": source_id})
    return added
