"""The contract between `bench` and `train`: calibration schema, fitted models and store (plain data
and math: no torch here).

    >>> from benchtrain import calibration
    >>> from benchtrain.calibration.step_config import StepConfig
    >>> calibration.load("latest").predict(StepConfig(micro_batch_size=4, num_workers=2, grad_accum=2, seq_len=512)).tokens_per_second
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchtrain.calibration.hub import read_calibration
from benchtrain.calibration.model import Calibration, Prediction
from benchtrain.calibration.store import Preferences, resolve_calibration

__all__ = ["Calibration", "Prediction", "load"]


def load(
    reference: str | Path = "latest",
    on_skip: Callable[[str], None] | None = None,
    preferences: Preferences = (),
    on_passed_over: Callable[[Path], None] | None = None,
) -> Calibration:
    """Load `latest`, a calibration id, a path to a calibration JSON, or one shared on the hub (`hub:ORG/NAME/ID`);
    the callbacks as calibration.store.resolve_calibration takes them."""
    path = resolve_calibration(str(reference), on_skip, preferences, on_passed_over)
    return Calibration(read_calibration(path), path)
