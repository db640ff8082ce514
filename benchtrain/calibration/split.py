"""How a training step's time splits: compute-bound kernels, memory-bound kernels, exposed host time.
The methods and why: docs/design.md#step-split"""

from __future__ import annotations

from typing import Any

from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.fit import (
    DATA_TERMS,
    HOST_TERM,
    device_terms,
    overlapped,
    throughput_features,
    throughput_terms,
)
from benchtrain.calibration.fit_tools import is_number
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict

SPLIT_FIELDS = ("compute_seconds", "memory_seconds", "host_seconds")
METHODS = ("profiler", "flops")
# Assumption, not measured: the share of the dense bf16 peak a step's matmuls reach (docs/design.md#step-split).
MATMUL_EFFICIENCY = 0.6
SPLIT_PROBES = 2


def step_parts(parameters: JsonDict, config: StepConfig) -> tuple[float, float, float]:
    """(device kernels, optimizer step, exposed host) seconds of one micro-step by the fit's terms: the host's fixed
    cost only where the device does not hide it (the `overlap` form), the data terms always."""
    features = throughput_features(config)
    parts = {
        term: float(features[index]) * float(parameters.get(term, 0.0)) for index, term in enumerate(throughput_terms())
    }
    device = sum(parts[term] for term in device_terms())
    power = float(parameters.get("overlap_power", 1.0))
    exposed = max(0.0, float(overlapped(parts[HOST_TERM], device, power)) - device)
    host = exposed + sum(parts[term] for term in (*DATA_TERMS, "per_worker"))
    return device, parts["optimizer_step"], host


def split_rows(rows: list[JsonDict]) -> list[JsonDict]:
    """The probes whose split is recorded: the ok probe with the most tokens per micro-step and the largest of a smaller
    size (the sizes plans choose). Among equals, the plainest step: fewest accumulation, workers, switches."""
    ok = [row for row in rows if row.get("status") == "ok" and (row.get("step_seconds") or 0) > 0]

    def size(row: JsonDict) -> int:
        return int(row["micro_batch_size"]) * int(row["seq_len"])

    def key(row: JsonDict) -> tuple[int, ...]:
        plainest = (-int(row.get(dimension.name, 0)) for dimension in switches())
        return size(row), -int(row.get("grad_accum", 1)), -int(row.get("num_workers", 0)), *plainest

    chosen: list[JsonDict] = []
    while ok and len(chosen) < SPLIT_PROBES:
        largest = max(ok, key=key)
        chosen.append(largest)
        ok = [row for row in ok if size(row) < size(largest)]
    return chosen


def flops_split(fit: JsonDict, row: JsonDict) -> JsonDict:
    """The "flops" split of a measured probe, scaled to its measured step."""
    config = StepConfig.from_row(row)
    device, optimizer, host = step_parts(fit["parameters"], config)
    step = float(row["step_seconds"])
    modelled = (device + optimizer + host) * config.grad_accum
    scale = step / modelled if modelled > 0 else 0.0
    compute = device * config.grad_accum * scale if modelled > 0 else step
    memory = optimizer * config.grad_accum * scale
    mfu = row.get("mfu")
    if is_number(mfu) and mfu > 0:
        matmul = min(compute, mfu * step / MATMUL_EFFICIENCY)
        compute, memory = matmul, memory + compute - matmul
    return {
        **config.to_row(),
        "compute_seconds": compute,
        "memory_seconds": memory,
        "host_seconds": host * config.grad_accum * scale,
        "method": "flops",
    }


def usable_record(entry: Any) -> bool:
    """A `step_split` record the translation can use: three non-negative numbers and a method."""
    if not isinstance(entry, dict) or entry.get("method") not in METHODS:
        return False
    values = [entry.get(name) for name in SPLIT_FIELDS]
    numbers = [float(value) for value in values if is_number(value) and value >= 0]
    return len(numbers) == len(SPLIT_FIELDS) and sum(numbers) > 0


def step_splits(data: JsonDict) -> list[JsonDict]:
    """The calibration's recorded split (bench.step_split), else the "flops" split of the probes bench would record."""
    recorded = [entry for entry in data.get("step_split") or [] if usable_record(entry)]
    if recorded:
        return recorded
    fit = data.get("fit")
    if not fit:
        return []
    return [flops_split(fit, row) for row in split_rows(data.get("measurements") or [])]
