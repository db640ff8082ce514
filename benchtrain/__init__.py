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

__all__ = ["BenchtrainError", "DeadlineCallback"]
