"""A user's Trainer's data as the planner reads it: each sample's token length as their Trainer feeds it (cut at
their `max_length` where they set one, as TRL's SFTTrainer truncates), and the tokens its loss is on (their
`labels` column where it has one, else a completion or assistant mask, else every token)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.batching import IGNORE_INDEX
from benchtrain.train.workload.tokens import TokenizedData

# A format whose samples keep their borders (padded, never packed): the planner prices a Trainer's batches so.
UNPACKED_FORMAT = "prompt_completion"
LOSS_MASKS = ("completion_mask", "assistant_masks")  # TRL's columns that say which tokens carry loss


@dataclass(frozen=True)
class TrainerData:
    """The lengths the planner reads (train.workload.tokens.TokenizedData, lengths only: it reads no token) of
    the Trainer's training set and evaluation set (None: it has none), and the length it truncates at."""

    train: TokenizedData
    eval: TokenizedData | None
    max_length: int  # the longest sample as fed: their max_length where it cuts, else the longest sample

    @property
    def sample_count(self) -> int:
        return len(self.train)


def trainer_data(trainer: Any) -> TrainerData:
    """The Trainer's training and evaluation sets read once (their `input_ids`), cut at its args' `max_length`."""
    limit = getattr(trainer.args, "max_length", None)
    limit = int(limit) if isinstance(limit, int) and limit > 0 else None
    if trainer.train_dataset is None:
        raise BenchtrainError("fit_to_deadline: the Trainer has no train_dataset to plan for")
    train = lengths_view(trainer.train_dataset, limit, "train_dataset")
    evaluation = trainer.eval_dataset
    sets = list(evaluation.values()) if isinstance(evaluation, dict) else [evaluation] if evaluation is not None else []
    eval_view = concatenated([lengths_view(dataset, limit, "eval_dataset") for dataset in sets])
    longest = int(train.lengths.max())
    return TrainerData(train, eval_view, longest)


def lengths_view(dataset: Any, limit: int | None, name: str) -> TokenizedData:
    """One dataset's sample lengths (cut at `limit`) and loss tokens, as the planner's data view."""
    if not hasattr(dataset, "__len__"):
        raise BenchtrainError(
            f"fit_to_deadline: the Trainer's {name} has no length (an iterable dataset): planning needs every sample's "
            "length; give a map-style dataset (datasets.Dataset), or set max_steps and use DeadlineCallback alone"
        )
    if len(dataset) == 0:
        raise BenchtrainError(f"fit_to_deadline: the Trainer's {name} is empty")
    columns = set(getattr(dataset, "column_names", None) or ())
    if columns and "input_ids" not in columns:
        raise BenchtrainError(
            f"fit_to_deadline: the Trainer's {name} has no input_ids column (it has {', '.join(sorted(columns))}): "
            "tokenize it first (TRL's SFTTrainer does in its __init__)"
        )
    if columns:
        ids = dataset["input_ids"]
        loss = next((column for column in ("labels", *LOSS_MASKS) if column in columns), None)
        marks = dataset[loss] if loss else None
    else:
        items = [row if isinstance(row, dict) else {} for row in (dataset[index] for index in range(len(dataset)))]
        if not all("input_ids" in item for item in items):
            raise BenchtrainError(f"fit_to_deadline: the Trainer's {name} yields samples without input_ids")
        ids = [item["input_ids"] for item in items]
        loss = next((column for column in ("labels", *LOSS_MASKS) if all(column in item for item in items)), None)
        marks = [item[loss] for item in items] if loss else None
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(dataset))
    if limit is not None:
        lengths = np.minimum(lengths, limit)
    targets = lengths.copy() if marks is None else loss_tokens(marks, loss == "labels", lengths)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    return TokenizedData(
        np.zeros(0, np.int32),
        offsets,
        UNPACKED_FORMAT,
        f"the Trainer's {name}",
        "the Trainer's labels",
        targets=targets,
    )


def loss_tokens(marks: Iterable[Any], are_labels: bool, lengths: np.ndarray) -> np.ndarray:
    """Per sample, the tokens within its (cut) length that carry loss: labels other than IGNORE_INDEX, or a mask's 1s."""
    counts = []
    for row, length in zip(marks, lengths, strict=True):
        values = np.asarray(row)[: int(length)]
        counts.append(int((values != IGNORE_INDEX).sum()) if are_labels else int((values != 0).sum()))
    return np.asarray(counts, dtype=np.int64)


def concatenated(views: list[TokenizedData]) -> TokenizedData | None:
    """Several evaluation sets (a Trainer's dict of them) as one: each is evaluated in turn."""
    if not views:
        return None
    if len(views) == 1:
        return views[0]
    lengths = np.concatenate([view.lengths for view in views])
    targets = np.concatenate([view.targets for view in views if view.targets is not None])
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    return TokenizedData(
        np.zeros(0, np.int32), offsets, UNPACKED_FORMAT, "the Trainer's eval_dataset", views[0].loss_on, targets=targets
    )
