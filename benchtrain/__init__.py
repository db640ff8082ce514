"""benchtrain: measure your training step, plan it to a deadline, train, report.

The commands are `bench`, `train` and `report` (also `python -m benchtrain.bench|train|reports`).
Inside your own Trainer:

    from benchtrain import DeadlineCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[DeadlineCallback(deadline="11h30m")])
    trainer.train()

`calibrate(trainer, budget="3m")` measures that Trainer's own step across batch, accumulation, workers and
checkpointing and stores a calibration (the Trainer left as found). `fit_to_deadline(trainer, deadline="11h30m")`
plans that Trainer's arguments to the deadline from a calibration and its data's real lengths, sets them and attaches
the callback. `trainer_arguments` turns a benchtrain plan (`train --dry-run --for-trainer`) into the
TrainingArguments fields it maps to. Bad arguments raise `BenchtrainError`, one line.

Everything benchtrain installs lives under this one name (benchtrain.bench, benchtrain.train,
benchtrain.calibration, benchtrain.reports, benchtrain.common, benchtrain.trainer), so a user's own
train.py or common.py never stands in for ours.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.planning.trainer_fields import TrainerFields
    from benchtrain.train.planning.trainer_fields import trainer_fields as trainer_arguments
    from benchtrain.trainer.calibrate import calibrate
    from benchtrain.trainer.callback import DeadlineCallback
    from benchtrain.trainer.fit import TrainerPlan, fit_to_deadline

__all__ = [
    "BenchtrainError",
    "DeadlineCallback",
    "TrainerFields",
    "TrainerPlan",
    "calibrate",
    "fit_to_deadline",
    "trainer_arguments",
]

# Each public name and where it lives, imported on first use: `python -m benchtrain.train --help`
# imports this package first, and must not pay for transformers (the callback's) to print its help.
_PUBLIC = {
    "BenchtrainError": ("benchtrain.common.errors", "BenchtrainError"),
    "DeadlineCallback": ("benchtrain.trainer.callback", "DeadlineCallback"),
    "TrainerFields": ("benchtrain.train.planning.trainer_fields", "TrainerFields"),
    "TrainerPlan": ("benchtrain.trainer.fit", "TrainerPlan"),
    "calibrate": ("benchtrain.trainer.calibrate", "calibrate"),
    "fit_to_deadline": ("benchtrain.trainer.fit", "fit_to_deadline"),
    "trainer_arguments": ("benchtrain.train.planning.trainer_fields", "trainer_fields"),
}


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'benchtrain' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
