"""The contract between `bench` and `train`: calibration schema, fitted models and store.

Plain data and math: no torch here.

    >>> import calibration
    >>> cal = calibration.load("latest")
    >>> from calibration.step_config import StepConfig
    >>> cal.predict(StepConfig(micro_batch_size=4, num_workers=2, grad_accum=2, seq_len=512)).tokens_per_second
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from calibration.hub import read_calibration
from calibration.model import Calibration, Prediction
from calibration.schema import SCHEMA_VERSION
from calibration.store import resolve_calibration
from common.errors import BenchtrainError, CalibrationFileError
from common.json_types import JsonDict

__all__ = [
    "SCHEMA_VERSION",
    "BenchtrainError",
    "Calibration",
    "CalibrationFileError",
    "Prediction",
    "load",
]


def load(
    reference: str | Path = "latest",
    on_skip: Callable[[str], None] | None = None,
    preferences: Sequence[Callable[[JsonDict], bool]] = (),
    on_passed_over: Callable[[Path], None] | None = None,
) -> Calibration:
    """Load `latest`, a calibration id, a path to a calibration JSON, or one shared on the hub
    (`hub:ORG/NAME/ID`; calibration.hub: it says where it came from); `on_skip` hears about
    newer calibration files that `latest` had to skip because they cannot be read. `preferences`:
    for `latest`, the newest calibration the first of them accepts (then the next), else the newest;
    `on_passed_over` hears of the newest one when a preference chose another."""
    path = resolve_calibration(str(reference), on_skip, preferences, on_passed_over)
    return Calibration(read_calibration(path), path)
