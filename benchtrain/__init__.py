"""benchtrain inside your own Trainer: `from benchtrain import DeadlineCallback`.

    from benchtrain import DeadlineCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[DeadlineCallback(deadline="11h30m")])
    trainer.train()

`trainer_arguments` turns a benchtrain plan (`train --dry-run --for-trainer`) into the
TrainingArguments fields it maps to. Bad arguments raise `BenchtrainError`, one line.
"""

from __future__ import annotations

from benchtrain.callback import DeadlineCallback
from common.errors import BenchtrainError
from train.planning.trainer_fields import TrainerFields
from train.planning.trainer_fields import trainer_fields as trainer_arguments

__all__ = ["BenchtrainError", "DeadlineCallback", "TrainerFields", "trainer_arguments"]
