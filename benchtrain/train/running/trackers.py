"""Experiment trackers through accelerate's tracking API: `--report-to tensorboard,wandb,...`.
What is logged, where: docs/design.md#trackers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    from accelerate import Accelerator

# --report-to names: each is also the module that must import and the pip extra that installs it.
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


def parse_report_to(text: str | None) -> tuple[str, ...]:
    """`none` (default) or a comma list of tracker names, each installed, or a one-line error."""
    names = tuple(dict.fromkeys(part.strip().lower() for part in (text or "none").split(",") if part.strip()))
    if names in ((), ("none",)):
        return ()
    for name in names:
        if name not in TRACKERS:
            raise BenchtrainError(
                f"--report-to {name}: unknown tracker; use none or a comma list of {', '.join(TRACKERS)}"
            )
        if importlib.util.find_spec(name) is None:
            raise BenchtrainError(
                f"--report-to {name}: the {name} package is not installed: pip install 'benchtrain[{name}]'"
            )
    return names


def flat_config(record: JsonDict) -> dict[str, bool | int | float | str]:
    """The plan and estimate as scalars (TensorBoard's hparams take nothing nested)."""
    config: dict[str, bool | int | float | str] = {}
    for section in ("plan", "estimate"):
        values = dict(record.get(section) or {})
        values.update(values.pop("configuration", None) or {})  # the step configuration's columns, each a scalar
        for key, value in values.items():
            if isinstance(value, (bool, int, float, str)):
                config[f"{section}/{key}"] = value
            elif value is not None:
                config[f"{section}/{key}"] = str(value)
    config["run_id"] = record.get("run_id", "")
    config["calibration_id"] = record.get("calibration_id", "")
    return config


def start(accelerator: Accelerator, names: tuple[str, ...], run_dir: Path, record: JsonDict) -> None:
    if not names:
        return
    # W&B writes where it is told: inside the run folder (TensorBoard: the accelerator's project_dir).
    where = {"wandb": {"dir": str(run_dir)}} if "wandb" in names else {}
    accelerator.init_trackers("benchtrain", config=flat_config(record), init_kwargs=where)
    estimate = record.get("estimate") or {}
    log(
        accelerator,
        {
            f"estimate/{key}": value
            for key, value in estimate.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        },
        0,
    )


def log(accelerator: Accelerator, values: dict[str, float | None], step: int) -> None:
    """The values known at `step` to every tracker (None: not known, left out)."""
    if getattr(accelerator, "trackers", None):
        accelerator.log({key: value for key, value in values.items() if value is not None}, step=step)


def finish(accelerator: Accelerator) -> None:
    """Close every tracker (not `accelerator.end_training`, which also tears the process group down: see train.step.runtime.finish_together)."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        tracker.finish()
