"""A calibration measured on one GPU, translated to another from datasheet figures: said to be
translated and bracketed, never passed off as measured.
The model and why: docs/design.md#translation-to-another-gpu"""

from __future__ import annotations

import copy
from typing import NamedTuple

from benchtrain.calibration.datasheets import DeviceSheet, generation_shift, known_keys, sheet_for
from benchtrain.calibration.fit import EVAL_TERMS, device_terms, throughput_model_from_json
from benchtrain.calibration.split import step_parts, step_splits
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.common.json_types import JsonDict

# Assumption, not measured: how much the host part may run slower or faster beside the target (docs/design.md#translation-to-another-gpu).
HOST_WIDENING = 0.25
STEP_FIELDS = ("step_seconds", "step_seconds_mean", "step_seconds_median", "step_seconds_min", "step_seconds_max")
GIB = 2**30


def source_sheet(data: JsonDict) -> DeviceSheet:
    """The datasheet row of the device a calibration measured, or a one-line refusal (translated, a CPU, a MIG slice, unknown)."""
    hardware = data.get("hardware") or {}
    name = str(hardware.get("name", "?"))
    if hardware.get("translated"):  # its bracket would be lost, not compounded
        raise BenchtrainError(
            f"calibration {data.get('id')} is itself translated from {hardware.get('translated_from')}: translate the measured one"
        )
    if hardware.get("device_type") != "cuda":
        raise BenchtrainError(
            f"calibration {data.get('id')} measured {name} ({hardware.get('device_type')}): a CPU calibration is never translated "
            "to a GPU (nor a GPU's to a CPU); run `bench run` on the GPU"
        )
    if "MIG" in str(hardware.get("peak_flops_entry") or ""):
        raise BenchtrainError(
            f"calibration {data.get('id')} measured a MIG slice of {name}: its share of the memory bandwidth is in no datasheet"
        )
    sheet = sheet_for(name)
    if sheet is None:
        raise BenchtrainError(
            f"calibration {data.get('id')} measured {name}, which the datasheet table lacks ({known_keys()}): it cannot be translated"
        )
    return sheet


def translate(data: JsonDict, target: DeviceSheet, world_size: int = 1) -> JsonDict:
    """The calibration as measured on `target`: hardware the target's (`translated: True`), id `<id>~<target key>`, the fit and the measurements at the central
    estimate, and a `translation` record (the same device: an identity record, the data unchanged). With one process of the target a model whose fixed memory
    exceeds it is refused here (with several, sharding may fit it)."""
    if world_size < 1:
        raise BenchtrainError(f"a translation needs at least one process, got {world_size}")
    source = source_sheet(data)
    if source.vendor != target.vendor:
        raise BenchtrainError(
            f"calibration {data.get('id')} measured {source.name} ({source.vendor}): never translated to {target.name} ({target.vendor}), "
            "another vendor's kernels; run `bench run` there"
        )
    record = translation_record(data, source, target)
    translated = copy.deepcopy(data)
    translated["translation"] = record
    if record["identity"]:
        return translated
    if world_size == 1:
        check_fixed_memory(data, target)
    for entry in (translated, *(translated.get("variants") or [])):
        scale_entry(entry, record["device_factor"], source.bf16_dense_flops / target.bf16_dense_flops)
        keep_oom_rows_that_hold(entry, float(data["hardware"]["memory_bytes"]), target)
    translated["hardware"] = target_hardware(data["hardware"], target, world_size)
    translated["id"] = f"{data['id']}~{target.key}"
    return translated


def translation_record(data: JsonDict, source: DeviceSheet, target: DeviceSheet) -> JsonDict:
    """Ratios (target ÷ source), the split they were weighed by, the central device factor, and at the split's probes
    the step's central factor, host share and bracket [low, high] (time on the target ÷ time measured)."""
    identity = source.key == target.key
    flops_ratio = target.bf16_dense_flops / source.bf16_dense_flops
    bandwidth_ratio = target.memory_bandwidth / source.memory_bandwidth
    attained_ratio, attained_from = attained_flops_ratio(source, target)
    splits = step_splits(data)
    compute = sum(float(entry["compute_seconds"]) for entry in splits)
    memory = sum(float(entry["memory_seconds"]) for entry in splits)
    device_factor = (
        (compute / attained_ratio + memory / bandwidth_ratio) / (compute + memory)
        if compute + memory > 0
        else 1 / attained_ratio
    )
    record: JsonDict = {
        "identity": identity,
        "from_device": data["hardware"]["name"],
        "from_sheet": source.name,
        "to_device": target.name,
        "to_key": target.key,
        "flops_ratio": flops_ratio,
        "bandwidth_ratio": bandwidth_ratio,
        "attained_flops_ratio": attained_ratio,
        "attained_from": attained_from,
        "device_factor": 1.0 if identity else device_factor,
        "host_widening": 0.0 if identity else HOST_WIDENING,
        "split_method": splits[0]["method"] if splits else None,
        "compute_share": compute / (compute + memory) if compute + memory > 0 else None,
        "sources": list(dict.fromkeys((*source.sources, *target.sources, *([attained_from] if attained_from else [])))),
    }
    record.update(summary_at(data, splits, record))
    return record


def summary_at(data: JsonDict, splits: list[JsonDict], record: JsonDict) -> JsonDict:
    """The step's central factor, host share and bracket at the split's probes, by the fit's terms there."""
    if record["identity"]:
        return {"central_factor": 1.0, "host_share": None, "bracket": [1.0, 1.0]}
    if not splits or not data.get("fit"):  # nothing says where the time goes: all of it is the device's
        ratios = device_time_factors(record)
        return {"central_factor": record["device_factor"], "host_share": None, "bracket": [min(ratios), max(ratios)]}
    parameters = data["fit"]["parameters"]
    device = host = 0.0
    for entry in splits:
        config = StepConfig.from_row(entry)
        kernels, optimizer, exposed = step_parts(parameters, config)
        device += (kernels + optimizer) * config.grad_accum
        host += exposed * config.grad_accum
    total = device + host
    central = (device * record["device_factor"] + host) / total
    low, high = bracket_around(device * record["device_factor"] / total, host / total, record)
    return {"central_factor": central, "host_share": host / total, "bracket": [low * central, high * central]}


class Bracket(NamedTuple):
    """Factors around a central estimate: it may be `low` to `high` times itself."""

    low: float
    high: float


class BoundWidths(NamedTuple):
    """Relative widths of a step time's bounds: central / (1 + lower) to central × (1 + upper)."""

    lower: float
    upper: float


def bracket_around(device_share: float, host_share: float, record: JsonDict) -> Bracket:
    """(low, high) factors around a central estimate of these device (at the central factor) and host shares."""
    factor = float(record["device_factor"])
    ratios = device_time_factors(record)
    slow, fast = max(ratios), min(ratios)
    widening = float(record["host_widening"])
    total = device_share + host_share
    low = (device_share * fast / factor + host_share * (1 - widening)) / total
    high = (device_share * slow / factor + host_share * (1 + widening)) / total
    return Bracket(low, high)


def device_time_factors(record: JsonDict) -> tuple[float, ...]:
    """What the device's time may be multiplied by: the datasheets' FLOP/s ratio, their bandwidth ratio, or the attained one."""
    attained = float(record.get("attained_flops_ratio") or record["flops_ratio"])
    return 1 / record["flops_ratio"], 1 / record["bandwidth_ratio"], 1 / attained


def attained_flops_ratio(source: DeviceSheet, target: DeviceSheet) -> tuple[float, str | None]:
    """The FLOP/s ratio (target ÷ source) the central estimate scales compute by, and its source: the datasheets', times
    the share published runs attained (generation_shift); the datasheets' alone, and None, where none was published."""
    datasheet = target.bf16_dense_flops / source.bf16_dense_flops
    generations = source.architecture, target.architecture
    forward, backward = generation_shift(*generations), generation_shift(*reversed(generations))
    if forward is not None:
        return datasheet * forward.attained_share, forward.source
    if backward is not None:
        return datasheet / backward.attained_share, backward.source
    return datasheet, None


def bracket_for(parameters: JsonDict, config: StepConfig, record: JsonDict) -> Bracket:
    """(low, high) factors around a translated calibration's central estimate at `config`, by its fit's device and host terms there; (1, 1) for the identity."""
    if record.get("identity"):
        return Bracket(1.0, 1.0)
    try:
        device, optimizer, host = step_parts(parameters, config)
        return bracket_around(device + optimizer, host, record) if device + optimizer + host > 0 else Bracket(1.0, 1.0)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise BenchtrainError(
            f"a translated calibration's translation record is damaged ({error!r}): translate it again"
        ) from None


def widened_bounds(measured: float, record: JsonDict | None, parameters: JsonDict, config: StepConfig) -> BoundWidths:
    """(lower, upper) widths at `config`: the measured bound, times a translation's bracket ends (None: as measured)."""
    if record is None:
        return BoundWidths(measured, measured)
    low, high = bracket_for(parameters, config, record)
    return BoundWidths((1 + measured) / low - 1, (1 + measured) * high - 1)


def check_fixed_memory(data: JsonDict, target: DeviceSheet) -> None:
    """Refuse a target that cannot hold the memory fit's static part and the bytes outside the allocator."""
    statics = []
    for entry in (data, *(data.get("variants") or [])):  # each setup measured (a 4-bit base holds less)
        memory = (entry.get("fit") or {}).get("memory") or {}
        statics.append(
            float((memory.get("parameters") or {}).get("static", 0.0)) + float(memory.get("non_torch_bytes") or 0.0)
        )
    static = min(statics)
    if static > target.memory_bytes:
        raise DoesNotFitError(
            f"calibration {data.get('id')}: the model's fixed memory, {static / GIB:.1f} GiB measured on {data['hardware']['name']}, "
            f"does not fit the {target.name}'s {target.memory_bytes / GIB:.0f} GiB: a device with more memory, LoRA, or several "
            "processes sharded with FSDP"
        )


def scale_entry(entry: JsonDict, device_factor: float, peak_ratio: float) -> None:
    """The fit's device terms and the eval fit's token terms × the central factor; each measured step as the fit moved."""
    fit = entry.get("fit")
    if not fit:
        return
    before = throughput_model_from_json(fit)
    # The optimizer step is elementwise (AdamW reads and writes every parameter's state): memory-bound, a device term.
    fit["parameters"] = {
        term: value * device_factor if term in (*device_terms(), "optimizer_step") else value
        for term, value in fit["parameters"].items()
    }
    after = throughput_model_from_json(fit)
    evaluation = (entry.get("eval") or {}).get("fit")
    if evaluation and isinstance(evaluation.get("parameters"), dict):
        evaluation["parameters"] = {
            term: value * device_factor if term in EVAL_TERMS[1:] else value
            for term, value in evaluation["parameters"].items()
        }
    factors = []
    for row in entry.get("measurements") or []:
        if row.get("status") != "ok" or not row.get("step_seconds"):
            continue
        config = StepConfig.from_row(row)
        factors.append(after.micro_step_seconds(config) / before.micro_step_seconds(config))
        scale_row(row, factors[-1], peak_ratio)
    held_out = fit.get("held_out_predicted_tokens_per_second")
    if isinstance(held_out, list) and len(held_out) == len(factors):  # one per fitted row, in order (calibration.fit)
        fit["held_out_predicted_tokens_per_second"] = [
            rate / factor for rate, factor in zip(held_out, factors, strict=True)
        ]


def scale_row(row: JsonDict, factor: float, peak_ratio: float) -> None:
    """A measured row as the target would show it: step times × factor, rate ÷ factor, MFU against the target's peak."""
    for name in STEP_FIELDS:
        if isinstance(row.get(name), (int, float)):
            row[name] *= factor
    for name in ("tokens_per_second", "tflops"):
        if isinstance(row.get(name), (int, float)):
            row[name] /= factor
    if isinstance(row.get("mfu"), (int, float)):
        row["mfu"] = row["mfu"] * peak_ratio / factor
    row["translated_factor"] = factor


def keep_oom_rows_that_hold(entry: JsonDict, source_memory: float, target: DeviceSheet) -> None:
    """Out-of-memory probes, on a target with more memory, kept as skipped with why (the memory model judges there)."""
    if target.memory_bytes <= source_memory:
        return
    for row in entry.get("measurements") or []:
        if row.get("status") == "oom":
            row["status"] = "skipped"
            row["error"] = (
                f"out of memory on the {source_memory / GIB:.0f} GiB device measured; the {target.name} has more (the memory model judges it)"
            )


def target_hardware(hardware: JsonDict, target: DeviceSheet, world_size: int) -> JsonDict:
    """The hardware record of the target, from its datasheet, marked translated."""
    record = {
        key: value
        for key, value in hardware.items()
        if key not in ("compute_capability", "cuda_version", "multiprocessors")
    }
    record.update(
        name=target.device_name,
        count=max(world_size, int(hardware.get("count", 1))),
        memory_bytes=target.memory_bytes,
        peak_flops_entry=target.peak_entry,
        peak_bf16_flops=target.bf16_dense_flops,
        vendor=target.vendor,
        translated=True,
        translated_from=hardware["name"],
    )
    if target.multiprocessors:
        record["multiprocessors"] = target.multiprocessors
    return record


def describe_translation(record: JsonDict) -> str:
    """One line for a plan or a table row: what the figures rest on."""
    low, high = record["bracket"]
    return (
        f"translated from {record['from_device']} to the {record['to_device']} by datasheet ratios (FLOP/s ×{record['flops_ratio']:.2f}, "
        f"bandwidth ×{record['bandwidth_ratio']:.2f}; split: {record.get('split_method') or 'none'}): step ×{record['central_factor']:.2f}, "
        f"bracket ×{low:.2f}–×{high:.2f}; not measured: `bench run` on the {record['to_device']} would settle it"
    )
