"""What the calibration lets a plan weigh: the micro batch sizes and accumulations that make the
effective batch, the switches (gradient checkpointing) it measured; and what its own noise says about
any plan made from it, out loud."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from calibration.dimensions import switches
from calibration.model import Calibration
from calibration.step_config import Mode
from common.errors import BenchtrainError


def batch_sizes_for(calibration: Calibration, effective_batch: int, world_size: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs that keep samples per optimizer step = effective_batch."""
    calibrated = calibration.measured_values("micro_batch_size")
    pairs = []
    for micro in range(1, calibrated[-1] + 1):
        per_step = micro * world_size
        if effective_batch % per_step == 0 and micro >= calibrated[0]:
            pairs.append((micro, effective_batch // per_step))
    return pairs


def switch_modes(calibration: Calibration, requested: Mapping[str, str]) -> list[Mode]:
    """The combinations of switches (calibration.dimensions) to plan with: each switch's values the
    calibration measured, as asked (auto, on or off; absent: auto)."""
    choices = []
    for dimension in switches():
        measured = [bool(value) for value in calibration.measured_values(dimension.name)] or [False]
        asked = requested.get(dimension.name, "auto")
        values = [value for value in {"auto": measured, "on": [True], "off": [False]}[asked] if value in measured]
        if not values:
            raise BenchtrainError(
                f"{dimension.plan_flag} {asked}: calibration {calibration.id} did not measure it; "
                f"run `bench run {dimension.flag} off,on`, or use {dimension.plan_flag} auto"
            )
        choices.append([(dimension.name,) if value else () for value in values])
    return [sum(combo, ()) for combo in itertools.product(*choices)]


def noise_warnings(calibration: Calibration) -> list[str]:
    """What the calibration's own error says about this plan, out loud."""
    warnings = []
    noise = calibration.data.get("noise") or {}
    if noise.get("message"):
        warnings.append(f"calibration {calibration.id}: {noise['message']}")
    if calibration.too_noisy_to_bound:
        warnings.append(
            f"the calibration's 90th-percentile error ({calibration.relative_bound:.0%}) is too large to promise a finish time: the deadline "
            "is checked against the central estimate, not an upper bound; the deadline guard still stops the run in time if it is slower"
        )
    return warnings
