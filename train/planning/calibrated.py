"""What the calibration lets a plan weigh: the micro batch sizes and accumulations that make the
effective batch, the gradient checkpointing modes it measured; and what its own noise says about
any plan made from it, out loud."""

from __future__ import annotations

from calibration.model import Calibration
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


def checkpointing_modes(calibration: Calibration, requested: str) -> list[bool]:
    """Gradient checkpointing modes to plan with: those the calibration measured, as asked."""
    measured = [bool(value) for value in calibration.measured_values("gradient_checkpointing")]
    wanted = {"auto": measured, "on": [True], "off": [False]}[requested]
    modes = [mode for mode in wanted if mode in measured]
    if not modes:
        raise BenchtrainError(
            f"--gradient-checkpointing {requested}: calibration {calibration.id} did not measure it; "
            f"run `bench run --checkpointing off,on`, or use --gradient-checkpointing auto"
        )
    return modes


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
