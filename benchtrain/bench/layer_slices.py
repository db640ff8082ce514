"""`bench run --layers auto|K1,K2[,…]`: calibrate a model on slices of its real architecture.
The method and why: docs/design.md#bench-layer-slices
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from benchtrain.bench.calibrate import CHECKPOINT_BYTES_PER_TRAINABLE, after_probes_seconds, plan_probes
from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.outlook import AUTO_PROBES, outlook, total_seconds
from benchtrain.bench.record import assess_noise, fit_with_drift_choice
from benchtrain.bench.space import Shape, shape_of
from benchtrain.bench.variant_measurement import BenchRequest, Carry, ProgressBar, describe_task, measure_variant
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT, fit_eval
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.slices import DepthLine, SliceFit, derive_full_rows, derive_step_split, slice_error
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import discard_unfinished, unfinished_paths
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError, DoesNotFitError, MeasurementError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.memory_check import describe_gpus_needed, gpus_needed, memory_need, meta_model
from benchtrain.train.step.engine import process_layout
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.train.workload.method import MethodConfig, method_record
from benchtrain.train.workload.model import ModelSpec, make_config, model_record, model_shape

# Layer counts to measure slices at: sorted, each once (`--layers 2,4,6`).
Depths = tuple[int, ...]

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
AUTO_LADDERS = ((2, 4, 6), (1, 2, 3), (1, 2))
SLICE_MEMORY_SHARE = 0.8
# Config values that make one block differ from another (beyond per-layer lists with mixed values).
NON_UNIFORM_KEYS = {
    "first_k_dense_replace": lambda value: bool(value),  # DeepSeek: dense layers first, then MoE
    "mlp_only_layers": lambda value: bool(value),  # Qwen MoE: some layers dense
    "decoder_sparse_step": lambda value: isinstance(value, int) and value > 1,  # MoE every n-th layer
    "moe_layer_freq": lambda value: isinstance(value, int) and value > 1,
    "interleave_moe_layer_step": lambda value: isinstance(value, int) and value > 1,  # Llama 4
}


def parse_layers(text: str | None) -> str | Depths | None:
    """`auto`, two or more distinct positive depths (sorted), or None without --layers."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        depths = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise BenchtrainError(f"--layers takes auto or a list of layer counts such as 2,4,6, got {text!r}") from None
    if len(depths) < 2 or depths[0] < 1:
        raise BenchtrainError(
            f"--layers needs two or more distinct positive layer counts (a line needs two points), got {text!r}"
        )
    return depths


def layer_key(config_dict: JsonDict) -> str:
    return next((key for key in LAYER_KEYS if key in config_dict), "num_hidden_layers")


def full_layers(spec: ModelSpec) -> int:
    return int(make_config(spec).num_hidden_layers)


def non_uniform_reason(spec: ModelSpec) -> str | None:
    """Why slices of this architecture would not measure its layers (None: its blocks are alike)."""
    config = make_config(spec).to_dict()
    layers = full_layers(spec)
    for key, value in sorted(config.items()):
        if isinstance(value, list) and len(value) == layers and len({repr(entry) for entry in value}) > 1:
            kinds = ", ".join(sorted({str(entry) for entry in value})[:3])
            return f"its layers differ ({key}: {kinds})"
        test = NON_UNIFORM_KEYS.get(key)
        if test is not None and test(value):
            return f"its layers differ ({key} = {value})"
    return None


def slice_spec(spec: ModelSpec, layers: int) -> ModelSpec:
    """The model cut to `layers` decoder layers (every per-layer list too), with random weights: speed and memory do not depend on their values."""
    total = full_layers(spec)
    config = {
        key: value[:layers] if isinstance(value, list) and len(value) == total else value
        for key, value in spec.config_dict.items()
    }
    config[layer_key(spec.config_dict)] = layers
    return replace(spec, config_dict=config, load_weights=False)


def static_bytes(spec: ModelSpec, method: MethodConfig, hardware: JsonDict, layout: tuple[int, str]) -> float:
    """What one process keeps before activations (exact, from the `meta` device)."""
    world_size, sharding = layout
    return memory_need(spec, method, hardware["device_type"]).per_process_bytes(
        sharding, world_size, hardware["device_type"]
    )


def auto_depths(
    spec: ModelSpec,
    method: MethodConfig,
    hardware: JsonDict,
    layout: tuple[int, str],
    affordable: Callable[[tuple[int, ...]], bool] = lambda ladder: True,
) -> tuple[int, ...] | None:
    """The first ladder of AUTO_LADDERS whose deepest slice fits the device and whose depths the budget
    pays a minimum viable fit at (`affordable`), else the first that fits; None: no slice fits."""
    layers = full_layers(spec)
    limit = SLICE_MEMORY_SHARE * float(hardware["memory_bytes"])
    fitting = [
        ladder
        for ladder in AUTO_LADDERS
        if ladder[-1] < layers and static_bytes(slice_spec(spec, ladder[-1]), method, hardware, layout) <= limit
    ]
    return next((ladder for ladder in fitting if affordable(ladder)), fitting[0] if fitting else None)


def whole_model_affordable(
    request: BenchRequest, spec: ModelSpec, method: MethodConfig, budget: float | str | None
) -> bool:
    """The whole model fits the device and the budget buys AUTO_PROBES probes of it (or the whole
    grid), at the prices bench works out before building anything."""
    try:
        task, need, _ = describe_task(request, spec, method, budget)
    except DoesNotFitError:
        return False
    if not isinstance(budget, (int, float)):
        return True  # no budget (the whole grid) or --budget auto (priced for AUTO_PROBES probes)
    planner, _ = plan_probes(task, spec, method, need, request.options)
    view = outlook(planner, budget, 0.0, after_probes_seconds(task, planner))
    return len(view.planned) >= min(AUTO_PROBES, view.grid_probes)


def choose_depths(
    request: BenchRequest,
    spec: ModelSpec,
    method: MethodConfig,
    asked: str | tuple[int, ...],
    budget: float | str | None,
) -> tuple[tuple[int, ...] | None, str]:
    """(the depths to measure, or None for the whole model; the rule that chose, in words)."""
    layers = full_layers(spec)
    reason = non_uniform_reason(spec)
    if reason is not None:
        say(f"--layers: {spec.name} cannot be measured on slices: {reason}; measuring the whole model")
        return None, f"whole model: {reason}"
    if asked != "auto":
        assert isinstance(asked, tuple)
        if asked[-1] > layers:
            raise BenchtrainError(f"--layers {','.join(map(str, asked))}: {spec.name} has {layers} layers")
        return asked, "asked (--layers)"
    if layers <= AUTO_LADDERS[-1][-1] or whole_model_affordable(request, spec, method, budget):
        return None, "whole model: it fits the device and the budget buys a usable fit of it"

    def affordable(ladder: tuple[int, ...]) -> bool:
        return (
            not isinstance(budget, (int, float))
            or sum(price_ladder(request, spec, method, ladder, budget).values()) <= budget
        )

    layout = process_layout(request.options, method)
    depths = auto_depths(spec, method, detect_hardware(), (layout.world_size, layout.sharding), affordable)
    if depths is None:
        raise DoesNotFitError(
            f"--layers auto: not even a {AUTO_LADDERS[-1][-1]}-layer slice of {spec.name} fits this device with room for activations; "
            "use --lora, --quantize 4bit, or a device with more memory"
        )
    ladders = ", ".join("/".join(map(str, ladder)) for ladder in AUTO_LADDERS)
    return (
        depths,
        f"auto: {'/'.join(map(str, depths))}, the first of {ladders} whose deepest slice fits and whose minimum the budget pays",
    )


def price_ladder(
    request: BenchRequest, spec: ModelSpec, method: MethodConfig, depths: tuple[int, ...], budget: float | str | None
) -> dict[int, float]:
    """Each depth's minimum (`price_depths`) from the planner bench would probe it with, before anything is built."""
    planners = {}
    for index, depth in enumerate(depths):
        task, need, _ = describe_task(request, slice_spec(spec, depth), method, budget)
        planner, prices = plan_probes(task, slice_spec(spec, depth), method, need, request.options)
        task = replace(task, prices=prices, one_off_timings=index == len(depths) - 1)
        planners[depth] = (planner, 0.0, after_probes_seconds(task, planner))
    return price_depths(planners)


def measure_layers(
    request: BenchRequest,
    spec: ModelSpec,
    method: MethodConfig,
    budget: float | str | None,
    asked: str | Depths,
    progress: ProgressBar,
) -> JsonDict | None:
    """`bench run --layers`: the whole model, or each depth in turn and their combination (rank 0's record; None on the other processes)."""
    started = time.monotonic()
    depths, rule = choose_depths(request, spec, method, asked, budget)
    if depths is None:
        return measure_variant(request, spec, method, budget, progress)
    layers = full_layers(spec)
    say(f"measuring {spec.name} on slices of {', '.join(map(str, depths))} of its {layers} layers ({rule})")
    prices = price_ladder(request, spec, method, depths, budget) if isinstance(budget, (int, float)) else None
    if prices is not None:
        refuse_if_unaffordable(prices, budget, spec.name, time.monotonic() - started)
    records: dict[int, JsonDict | None] = {}
    carry = Carry()
    for index, depth in enumerate(depths):
        share = budget
        if prices is not None and isinstance(budget, (int, float)):
            share = depth_share(max(0.0, budget - (time.monotonic() - started)), prices, depths[index:])
        say(f"slice {index + 1} of {len(depths)}: {depth} of {spec.name}'s {layers} layers")
        carry.one_off = index == len(depths) - 1
        records[depth] = record = measure_variant(request, slice_spec(spec, depth), method, share, progress, carry)
        # `--loss auto` compared the losses at the first depth: the others run the one it chose.
        chosen = ((record or {}).get("loss_choice") or {}).get("chosen")
        if chosen:
            request = replace(request, options=replace(request.options, loss=chosen))
    measured = {depth: record for depth, record in records.items() if record is not None}
    if len(measured) < len(depths):
        return None  # the other processes: rank 0 combines
    return whole_model_record(measured, spec, method, rule)


def whole_model_record(records: dict[int, JsonDict], spec: ModelSpec, method: MethodConfig, rule: str) -> JsonDict:
    """The depths' records combined into the whole model's calibration; shallower depths' kept rows
    are discarded (the combined record names the deepest's, removed when it is stored)."""
    deepest = records[max(records)]
    hardware = deepest["hardware"]
    distributed = deepest.get("distributed") or {}
    layout = (int(distributed.get("world_size", 1)), str(distributed.get("sharding", "none")))
    meta = meta_model(spec, method)
    shape = model_shape(meta)
    layers = full_layers(spec)
    counts = {
        key: value
        for key, value in method_record(method, meta).items()
        if key in ("trainable_parameters", "total_parameters", "lora")
    }
    need = memory_need(spec, method, hardware["device_type"])
    whole = WholeModel(
        layers=layers,
        layer_key=layer_key(spec.config_dict),
        model=model_record(spec, shape),
        training={**counts, "flops_terms": shape.flops_terms(method.is_lora)},
        static_bytes={depth: static_bytes(slice_spec(spec, depth), method, hardware, layout) for depth in records}
        | {layers: static_bytes(spec, method, hardware, layout)},
        gpus_needed=gpus_needed(need, Hardware.from_record(hardware)),
        rule=rule,
        checkpoint_bytes=need.trainable_parameters * CHECKPOINT_BYTES_PER_TRAINABLE,
    )
    record = combine_slices(records, whole)
    for depth in sorted(records)[:-1]:
        discard_unfinished(unfinished_paths(records[depth]))
    many = describe_gpus_needed(need, Hardware.from_record(hardware))
    if many:
        say(f"the whole model does not fit one {hardware['name']}: {many}")
    return record


# One-off costs that do not grow with depth (counts, rates, flags, the one compiled block): measured at
# the depths that timed them; per shape, weighted by the shapes each compiled.
KEPT_OVERHEADS = {
    "warmup_steps",
    "disk_write_bytes_per_second",
    "checkpoint_extrapolated",
    "compile_cached_seconds_per_shape",
}
PER_SHAPE_OVERHEADS = {"compile_seconds_per_shape": "compile_shapes_measured"}


@dataclass(frozen=True)
class WholeModel:
    """What the slices stand for: the whole model's record and its exact fixed bytes."""

    layers: int
    layer_key: str
    model: JsonDict  # the calibration's `model` section
    training: JsonDict  # trainable/total parameters and FLOPs terms of the whole model
    static_bytes: dict[int, float]  # before activations, per process, at each slice depth and at `layers`
    gpus_needed: int | None  # devices like the bench's the whole model needs (FSDP); None: no count holds it
    rule: str  # how the depths were chosen
    checkpoint_bytes: int = 0  # what the whole model's checkpoint holds (bench.calibrate.AfterProbePrices)


def combine_slices(records: dict[int, JsonDict], whole: WholeModel) -> JsonDict:
    """One calibration of the whole model from each depth's record (`records[K]`, K layers)."""
    depths = sorted(records)
    deepest = records[depths[-1]]
    fitted = derive_full_rows(
        {depth: smoothed_rows(records[depth]) for depth in depths}, whole.layers, whole.static_bytes
    )
    if len(fitted.rows) < MIN_ROWS_FOR_FIT:
        raise MeasurementError(
            f"only {len(fitted.rows)} configurations were measured at two slice depths or more; a fit of the whole model needs "
            f"{MIN_ROWS_FOR_FIT}: raise --budget or narrow the grid (--batch-sizes, --seq-lens)"
        )
    record = {key: value for key, value in deepest.items() if key not in ("noise", "left_out_configs")}
    record.update(
        model=whole.model, training={**deepest["training"], **whole.training}, measurements=fitted.rows, history=[]
    )
    record["fit"] = fit_with_drift_choice(fitted.rows, None, record, [])
    eval_rows = derive_eval_rows(records, whole.layers)
    record["eval"] = {"measurements": eval_rows, "fit": fit_eval(eval_rows)}
    record["overheads"] = derive_overheads(records, whole.layers, whole.checkpoint_bytes)
    record["search"] = {
        **deepest["search"],
        "slice_depths": {str(depth): depth_summary(records[depth]) for depth in depths},
    }
    record["slices"] = slices_section(fitted, depths, whole)
    # The deepest slice's split is not the whole model's (its head weighs more): lines in depth, or
    # none (the whole model's FLOP-count split then stands).
    record["step_split"] = derive_step_split(
        {depth: records[depth].get("step_split") or [] for depth in depths}, whole.layers
    )
    if not record["step_split"]:
        del record["step_split"]
    record["warnings"] = list(
        dict.fromkeys(warning for depth in depths for warning in records[depth].get("warnings", []))
    )
    noise = assess_noise(record)
    if noise:
        record["noise"] = noise
        record["warnings"].append(noise["message"])
    record["left_out_configs"] = deepest.get("left_out_configs", [])
    return record


def smoothed_rows(record: JsonDict) -> list[JsonDict]:
    """A depth's ok rows with their step time as that depth's (robust) fit predicts it, the measured
    median kept as `step_seconds_measured`: one disturbed probe would otherwise bend a line through
    two or three depths. Memory stays measured (it is exact to a fraction of a percent)."""
    model = Calibration(record).throughput
    rows = []
    for row in record["measurements"]:
        if row.get("status") == "ok" and row.get("step_seconds"):
            fitted = model.micro_step_seconds(StepConfig.from_row(row)) * row["grad_accum"]
            row = {**row, "step_seconds": fitted, "step_seconds_measured": row["step_seconds"]}
        rows.append(row)
    return rows


def depth_summary(record: JsonDict) -> JsonDict:
    """What one depth's bench measured and how well its own fit held out."""
    rows = record["measurements"]
    fit = record.get("fit") or {}
    return {
        "probes": len(rows),
        "ok": sum(1 for row in rows if row["status"] == "ok"),
        "held_out_median_pct": (fit.get("held_out_error") or {}).get("median_abs_pct"),
        "benchmark_seconds": (record.get("overheads") or {}).get("benchmark_seconds"),
        "budget_seconds": (record.get("search") or {}).get("budget_seconds"),
    }


def slices_section(fitted: SliceFit, depths: list[int], whole: WholeModel) -> JsonDict:
    per_layer = [entry["per_layer_seconds"] for entry in fitted.per_config]
    activations = [
        entry["per_layer_activation_bytes"] for entry in fitted.per_config if "per_layer_activation_bytes" in entry
    ]
    fixed = [entry["fixed_seconds"] for entry in fitted.per_config]
    section: JsonDict = {
        "depths": depths,
        "full_layers": whole.layers,
        "layer_key": whole.layer_key,
        "rule": whole.rule,
        "per_layer": {
            "seconds": statistics.median(per_layer),
            "activation_bytes": statistics.median(activations) if activations else None,
            "fixed_seconds": statistics.median(fixed),
        },
        "per_config": fitted.per_config,
        "held_out": {
            "time": {**fitted.held_out_time.to_json(), "signed_relative": fitted.held_out_time.signed_relative},
            "memory": {**fitted.held_out_memory.to_json(), "signed_relative": fitted.held_out_memory.signed_relative},
        },
        "static_bytes": {str(depth): whole.static_bytes[depth] for depth in sorted(whole.static_bytes)},
        "gpus_needed": whole.gpus_needed,
    }
    time = section["held_out"]["time"]
    section["held_out_error_pct"] = time["median_abs_pct"]
    section["bound_widening"] = {"time": slice_error(section, "time"), "memory": slice_error(section, "memory")}
    return section


def derive_eval_rows(records: dict[int, JsonDict], layers: int) -> list[JsonDict]:
    """Forward-only batches at full depth, one per (batch, length) evaluated at two depths or more."""
    found: dict[tuple[int, int], dict[int, float]] = {}
    for depth, record in records.items():
        for row in (record.get("eval") or {}).get("measurements") or []:
            if row.get("status") == "ok" and row.get("batch_seconds"):
                found.setdefault((row["micro_batch_size"], row["seq_len"]), {})[depth] = float(row["batch_seconds"])
    rows = []
    for (batch, length), seconds in sorted(found.items()):
        if len(seconds) < 2:
            continue
        line = DepthLine.fit(list(seconds), list(seconds.values()))
        value = max(line.at(layers), max(seconds.values()))
        rows.append(
            {
                "micro_batch_size": batch,
                "seq_len": length,
                "status": "ok",
                "batch_seconds": value,
                "tokens_per_second": batch * length / value,
            }
        )
    return rows


def derive_overheads(records: dict[int, JsonDict], layers: int, checkpoint_bytes: int = 0) -> dict[str, float]:
    """The one-off costs at full depth: lines in depth where every depth measured them (model
    build, warm-up), the depth-free ones as measured (KEPT_OVERHEADS, PER_SHAPE_OVERHEADS), the
    whole model's checkpoint written at the measured disk speed, and the whole bench's seconds."""
    depths = sorted(records)
    found = {depth: records[depth].get("overheads") or {} for depth in depths}
    overheads: JsonDict = {}
    for name in dict.fromkeys(key for depth in depths for key in found[depth]):
        values = {depth: found[depth][name] for depth in depths if isinstance(found[depth].get(name), (int, float))}
        if name in PER_SHAPE_OVERHEADS or name in PER_SHAPE_OVERHEADS.values():
            continue
        if name in KEPT_OVERHEADS or len(values) < len(depths):
            overheads[name] = next((found[depth][name] for depth in depths if name in found[depth]), None)
        else:
            overheads[name] = max(0.0, DepthLine.fit(depths, list(values.values())).at(layers))
    for name, count in PER_SHAPE_OVERHEADS.items():
        weights = {
            depth: float(found[depth].get(count) or 0)
            for depth in depths
            if isinstance(found[depth].get(name), (int, float))
        }
        if weights:
            total = sum(weights.values())
            mean = (
                sum(weights[d] * found[d][name] for d in weights) / total
                if total
                else max(found[d][name] for d in weights)
            )
            overheads.update({name: mean, count: int(total)})
    rate = overheads.get("disk_write_bytes_per_second")
    if checkpoint_bytes:
        overheads["checkpoint_bytes"] = checkpoint_bytes
    if rate and overheads.get("checkpoint_bytes"):
        overheads["checkpoint_save_seconds"] = round(overheads["checkpoint_bytes"] / rate, 4)
        overheads["checkpoint_bytes"] = round(overheads["checkpoint_bytes"])
    overheads["benchmark_seconds"] = round(sum(float(found[d].get("benchmark_seconds") or 0.0) for d in depths), 2)
    return overheads


def price_depths(planners: dict[int, tuple[ProbePlanner, float, float]]) -> dict[int, float]:
    """Each depth's seconds for its minimum viable fit, all included, the shapes compiled at the
    depths before it carried; `planners[K] = (planner, seconds before its probes (imports, build),
    seconds after them (evaluation, timings))`."""
    compiled: set[Shape] = set()
    prices = {}
    for depth in sorted(planners):
        planner, before, after = planners[depth]
        trial = copy.deepcopy(planner)
        trial.seen_shapes |= compiled
        chosen = trial.preview(None, stop_when_viable=True)
        compiled |= {shape_of(config) for config, _ in chosen}
        prices[depth] = total_seconds(sum(price for _, price in chosen), before, after)
    return prices


def depth_share(left: float, prices: dict[int, float], depths: tuple[int, ...]) -> float:
    """The next depth's (`depths[0]`) seconds of the `left` the remaining `depths` share: its
    minimum and its part of the rest (the last depth takes all that is left)."""
    if len(depths) == 1:
        return left
    needed = sum(prices[depth] for depth in depths)
    return min(left, prices[depths[0]] * max(1.0, left / needed) if needed > 0 else left / len(depths))


def refuse_if_unaffordable(prices: dict[int, float], budget: float | str | None, name: str, spent: float = 0.0) -> None:
    """One line, before anything is built, when the budget cannot pay for a minimum viable fit at every depth after the `spent` seconds (pricing them)."""
    needed = sum(prices.values()) + spent
    if isinstance(budget, (int, float)) and budget < needed:
        depths = ", ".join(map(str, sorted(prices)))
        raise BenchtrainError(
            f"--budget {format_duration(budget)} cannot pay for a minimum calibration at each of the slice depths {depths} of {name}: "
            f"they need ≈ {format_duration(needed)}; use --budget {format_duration(math.ceil(needed))} or more, or fewer depths (--layers)"
        )
