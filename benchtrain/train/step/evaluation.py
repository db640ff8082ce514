"""Evaluation: held-out loss and perplexity on a fixed set of batches. Design: docs/design.md#evaluation"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from benchtrain.common.durations import parse_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.compile import eager_region
from benchtrain.train.step.step import without_packed_sequence_check
from benchtrain.train.workload.batching import (
    IGNORE_INDEX,
    BatchLayout,
    DataView,
    MicroBatch,
    PackedBatches,
    PaddedBatches,
    epoch_batches,
    make_loader,
    shard,
    to_device,
)
from benchtrain.train.workload.tokens import TokenizedData

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


@dataclass(frozen=True)
class EvalSchedule:
    """When to evaluate besides the end: every N optimizer steps, or every so many seconds."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def due(self, step: int, seconds_since_last: float) -> bool:
        if self.every_steps:
            return step % self.every_steps == 0
        return self.every_seconds is not None and seconds_since_last >= self.every_seconds

    def count(self, steps: int, train_seconds: float) -> int:
        """Evaluations in a run of `steps` steps lasting `train_seconds`, the final one included."""
        if self.every_steps:
            return steps // self.every_steps + 1
        if self.every_seconds:
            return math.floor(train_seconds / self.every_seconds) + 1
        return 1


_STEPS = re.compile(r"^(\d+)\s*(steps?)?$")


def parse_eval_every(text: str | None) -> EvalSchedule:
    """`500steps` / `500` (optimizer steps) or a duration (`10m`); None: at the end only."""
    if text is None:
        return EvalSchedule()
    match = _STEPS.match(str(text).strip().lower())
    if match:
        steps = int(match.group(1))
        if steps < 1:
            raise BenchtrainError(f"--eval-every must be positive, got {text!r}")
        return EvalSchedule(every_steps=steps)
    return EvalSchedule(every_seconds=parse_duration(text, "--eval-every"))


class EvalSplit(NamedTuple):
    train: TokenizedData
    held_out: TokenizedData  # the eval set


def split_eval(data: TokenizedData, fraction: float, seed: int) -> EvalSplit:
    """(train, eval): a deterministic `fraction` of the samples held out, at least one each side."""
    count = len(data)
    if not 0 < fraction < 1:
        raise BenchtrainError(f"--eval-split must be a fraction between 0 and 1, got {fraction}")
    held = min(count - 1, max(1, round(count * fraction)))
    if count < 2:
        raise BenchtrainError("--eval-split needs at least 2 samples")
    order = np.random.default_rng(seed + 7919).permutation(count)
    eval_index, train_index = np.sort(order[:held]), np.sort(order[held:])
    return EvalSplit(data.subset(train_index), data.subset(eval_index))


def eval_batches(data: DataView, micro_batch_size: int, max_length: int, seed: int) -> Sequence[MicroBatch]:
    """The eval set's fixed batches (as planned for training, epoch 0)."""
    return epoch_batches(data, micro_batch_size, max_length, seed, 0)


def evaluate_loss(
    accelerator: Accelerator,
    model: torch.nn.Module,
    data: TokenizedData,
    layout: BatchLayout,
    pad_id: int,
    compiled: bool = False,
) -> dict[str, float]:
    """Mean loss per target token over the eval set (batched as `layout` says), its perplexity, and
    the seconds it took; a compiled model evaluates eagerly, as bench measured it."""
    import torch

    started = time.perf_counter()
    batches = shard(
        eval_batches(data, layout.micro_batch_size, layout.max_length, layout.seed),
        accelerator.process_index,
        accelerator.num_processes,
    )
    dataset = (
        PackedBatches(data, batches, layout.max_length)
        if data.packing
        else PaddedBatches(data, batches, layout.max_length, pad_id)
    )
    loader = make_loader(dataset, 0, accelerator.device.type == "cuda")
    device = accelerator.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad(), accelerator.autocast(), eager_region(compiled), without_packed_sequence_check():
        for batch in loader:
            batch = to_device(batch, device)
            # Right-padded rows under causal attention need no mask (see train.step.step).
            outputs = model(input_ids=batch["input_ids"], labels=batch["labels"])
            # The model's loss is the mean over its shifted target tokens: weight it by their count.
            count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
            loss_sum += outputs.loss.double() * count
            tokens += count
    model.train(was_training)
    if accelerator.num_processes > 1:
        loss_sum, tokens = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(tokens, "sum")
    mean = float(loss_sum / tokens.clamp(min=1))
    return {
        "eval_loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "eval_tokens": int(tokens),
        "seconds": time.perf_counter() - started,
    }
