"""Micro-batches (packed, padded or synthetic) planned deterministically from (seed, epoch), and the
DataLoader that delivers them whole, for probes and training alike. docs/design.md#micro-batches"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, NotRequired, Protocol, TypedDict, cast, overload

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader, Dataset

from benchtrain.train.workload.sampling import SampledData
from benchtrain.train.workload.tokens import Lengths, TokenizedData

# One micro-batch: its samples' indices (an int array when planned from lengths), or its packed rows.
MicroBatch = Sequence[int] | np.ndarray

# What the planner reads of data: the exact store, or a sample standing for the whole set.
DataView = TokenizedData | SampledData


class Batch(TypedDict):
    """One micro-batch as the step takes it: token ids and labels (IGNORE_INDEX where no loss), rows by length;
    `target_tokens`, the labels that carry loss, counted on the host by the DataLoader worker (to_device drops it)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    target_tokens: NotRequired[int]


IGNORE_INDEX = -100
# Length grouping sorts within windows of this many batches: similar lengths, still shuffled.
GROUP_WINDOW_BATCHES = 32


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that carry loss in a host batch (counted in the DataLoader workers, off the step)."""
    return int((labels != IGNORE_INDEX).sum())


def to_device(batch: Mapping[str, object], device: torch.device | str) -> Batch:
    """The batch's tensors on `device`, copied without blocking (from pinned memory on CUDA); host-side counts (`target_tokens`) are dropped."""
    # Every tensor the batch holds moves (a test's batch may hold more than Batch names).
    return cast(
        Batch, {key: value.to(device, non_blocking=True) for key, value in batch.items() if hasattr(value, "to")}
    )


class BatchSizes(NamedTuple):
    """Each batch's rows and the length its rows are padded to, one array each (no object per
    batch: a packed epoch of a billion tokens has millions of batches)."""

    rows: np.ndarray
    lengths: np.ndarray


class BatchShape(NamedTuple):
    """A micro-batch's rows and the length they are padded to: a key of the planner's shape counts
    (a NamedTuple, so it equals and hashes as the plain (rows, length) pair)."""

    rows: int
    length: int


def _padded_layout(
    lengths: Lengths,
    micro_batch_size: int,
    max_length: int,
    seed: int,
    epoch: int,
    window_batches: int = GROUP_WINDOW_BATCHES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample order, where each batch starts in it, the order batches run in): a shuffled order, sorted (longest
    first) inside windows of `window_batches` batches, cut into batches, and the batches shuffled (a window of one
    batch groups nothing: a Trainer's random batches)."""
    count = len(lengths)
    rng = np.random.default_rng(seed * 1_000_003 + epoch)
    order = rng.permutation(count)
    clipped = np.minimum(np.asarray(lengths), max_length)
    window = micro_batch_size * window_batches
    window_of = np.arange(count) // window
    order = order[np.lexsort((-clipped[order], window_of))]
    # A new batch starts every micro_batch_size places inside each window.
    starts = np.flatnonzero(np.arange(count) % window % micro_batch_size == 0)
    return order, starts, rng.permutation(len(starts))


def plan_padded_batches(
    lengths: Lengths, micro_batch_size: int, max_length: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Length-grouped batches of sample indices (_padded_layout), in the order they run."""
    if len(lengths) == 0:
        return []
    order, starts, batch_order = _padded_layout(lengths, micro_batch_size, max_length, seed, epoch)
    batches = np.split(order, starts[1:])
    return [batches[i] for i in batch_order]


def padded_epoch_shape_counts(
    lengths: Lengths,
    micro_batch_size: int,
    max_length: int,
    seed: int,
    epoch: int,
    batch_count: int | None = None,
    bucket: int | None = None,
    window_batches: int = GROUP_WINDOW_BATCHES,
) -> dict[BatchShape, int]:
    """batch_shape_counts of plan_padded_batches(...)[:batch_count] without building the batches (one process plans
    600,000 samples in seconds): each batch's rows and longest sample from the sorted order, taken in the order the
    batches run."""
    if len(lengths) == 0:
        return {}
    order, starts, batch_order = _padded_layout(lengths, micro_batch_size, max_length, seed, epoch, window_batches)
    clipped = np.minimum(np.asarray(lengths), max_length)[order]
    sizes = np.diff(np.append(starts, len(order)))
    longest = np.maximum.reduceat(clipped, starts)
    chosen = batch_order[:batch_count] if batch_count is not None else batch_order
    return _shape_counts(BatchSizes(sizes[chosen], _padded_widths(longest[chosen], max_length, bucket)), max_length)


def _shape_counts(sizes: BatchSizes, max_length: int) -> dict[BatchShape, int]:
    # One integer per (rows, length): np.unique on a 1-D key, not on pairs.
    keys, counts = np.unique(sizes.rows.astype(np.int64) * (max_length + 1) + sizes.lengths, return_counts=True)
    return {
        BatchShape(int(key // (max_length + 1)), int(key % (max_length + 1))): int(count)
        for key, count in zip(keys, counts, strict=True)
    }


def padded_width(longest: int, max_length: int, bucket: int | None = None) -> int:
    """The width a batch is padded to: its longest sample, or with `bucket` (compiled steps) the
    next multiple of `bucket`, so that a run meets few distinct shapes; never past max_length."""
    longest = min(longest, max_length)
    return min(max_length, -(-longest // bucket) * bucket) if bucket else longest


def _padded_widths(longest: np.ndarray, max_length: int, bucket: int | None) -> np.ndarray:
    """padded_width of each batch's longest sample (at most max_length already)."""
    return np.minimum(max_length, -(-longest // bucket) * bucket) if bucket else longest


def packed_row_count(total_tokens: int, max_length: int) -> int:
    return max(1, -(-total_tokens // max_length))


class PackedPlan(Sequence[list[int]]):
    """An epoch's packed batches, lazily: one shuffled array of row numbers (int32 where it fits),
    cut into micro-batches when read, so a corpus of a billion tokens holds no Python object per row."""

    def __init__(self, order: np.ndarray, micro_batch_size: int, first: int = 0, count: int | None = None) -> None:
        self.order, self.micro_batch_size, self.first = order, micro_batch_size, first
        self.batches = -(-len(order) // micro_batch_size) - first if count is None else count

    def __len__(self) -> int:
        return self.batches

    @overload
    def __getitem__(self, index: int) -> list[int]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[list[int]]: ...

    def __getitem__(self, index: int | slice) -> list[int] | Sequence[list[int]]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.batches)
            if step == 1:
                return PackedPlan(self.order, self.micro_batch_size, self.first + start, max(0, stop - start))
            return [self[i] for i in range(start, stop, step)]
        if not -self.batches <= index < self.batches:
            raise IndexError(index)
        batch = self.first + (index % self.batches)
        return self.order[batch * self.micro_batch_size : (batch + 1) * self.micro_batch_size].tolist()


def plan_packed_batches(row_count: int, micro_batch_size: int, seed: int, epoch: int) -> PackedPlan:
    dtype = np.int32 if row_count < 2**31 else np.int64
    order = np.random.default_rng(seed * 1_000_003 + epoch).permutation(row_count).astype(dtype)
    return PackedPlan(order, micro_batch_size)


def packed_epoch_shape_counts(
    row_count: int, micro_batch_size: int, length: int, batch_count: int
) -> dict[BatchShape, int]:
    """batch_shape_counts of one process's first `batch_count` batches, without the batches:
    every batch is full but the epoch's last (which the shuffle leaves last)."""
    total = -(-row_count // micro_batch_size)
    last = row_count - (total - 1) * micro_batch_size
    counts = {BatchShape(micro_batch_size, length): min(batch_count, total - 1)}
    if batch_count >= total:
        counts[BatchShape(last, length)] = counts.get(BatchShape(last, length), 0) + 1
    return {shape: count for shape, count in counts.items() if count}


class MicroBatches(Protocol):
    """Item i: micro-batch i as the step takes it (PaddedBatches, PackedBatches, SyntheticBatches)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Batch: ...


class PaddedBatches:
    """Item i: micro-batch i of `batches`, padded to its longest sample (at most max_length). The
    samples are sliced out of the memory-mapped store in the worker that collates the batch."""

    def __init__(
        self,
        data: TokenizedData,
        batches: Sequence[MicroBatch],
        max_length: int,
        pad_id: int,
        bucket: int | None = None,
    ) -> None:
        self.data, self.batches, self.max_length, self.pad_id, self.bucket = (
            data,
            list(batches),
            max_length,
            pad_id,
            bucket,
        )

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        import torch

        data = self.data
        rows = [data.sample(i)[: self.max_length] for i in self.batches[index]]
        width = padded_width(max(len(row) for row in rows), self.max_length, self.bucket)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for r, (row, sample_index) in enumerate(zip(rows, self.batches[index], strict=True)):
            ids = torch.as_tensor(np.asarray(row, dtype=np.int64))
            input_ids[r, : len(row)] = ids
            labels[r, : len(row)] = ids
            # prompt + completion data: no loss on the prompt.
            labels[r, : min(data.prompt_length(sample_index), len(row))] = IGNORE_INDEX
            mask = data.mask(sample_index)
            if mask is not None:
                # chat data: loss on the assistant's turns only.
                labels[r, : len(row)][~torch.as_tensor(mask[: len(row)])] = IGNORE_INDEX
        # Right padding, no attention mask: under causal attention no real token sees a pad, and
        # pads carry no loss (train.step.step), so the mask would only cost a host sync and SDPA's fast path.
        return {"input_ids": input_ids, "labels": labels, "target_tokens": count_targets(labels)}


class PackedBatches:
    """Item i: the rows of micro-batch i cut from the data's token stream (its documents back to
    back, wrapping around at its end), read by position from the store."""

    def __init__(self, data: TokenizedData, batches: Sequence[MicroBatch], max_length: int) -> None:
        self.data, self.batches, self.max_length = data, list(batches), max_length
        self.stream_length = data.stream_length

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        import torch

        length = self.max_length
        rows = np.asarray(self.batches[index], dtype=np.int64)
        positions = (rows[:, None] * length + np.arange(length)[None, :]).ravel() % self.stream_length
        ids = torch.as_tensor(self.data.stream_take(positions).astype(np.int64)).view(-1, length)
        return {"input_ids": ids, "labels": ids.clone(), "target_tokens": ids.numel()}


class SyntheticBatches:
    """Item i: random token ids of shape (micro_batch_size, seq_len), the same for the same i."""

    def __init__(self, count: int, micro_batch_size: int, seq_len: int, vocab_size: int) -> None:
        self.count, self.micro_batch_size, self.seq_len, self.vocab_size = count, micro_batch_size, seq_len, vocab_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Batch:
        import torch

        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab_size, (self.micro_batch_size, self.seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids.clone(), "target_tokens": ids.numel()}


def make_loader(dataset: MicroBatches, num_workers: int, pin_memory: bool, start: int = 0) -> DataLoader[Batch]:
    """A real DataLoader over whole micro-batches, starting at batch `start` (for --resume)."""
    from torch.utils.data import DataLoader, Subset

    # torch reads a map-style dataset through __len__ and __getitem__ alone: ours need not subclass
    # its Dataset (which would import torch wherever batches are planned).
    items = cast("Dataset[Batch]", dataset)
    if start:
        items = Subset(items, range(start, len(dataset)))
    return DataLoader(
        items,
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers else None,
        worker_init_fn=leave_stop_signals_to_the_main_process if num_workers else None,
    )


def leave_stop_signals_to_the_main_process(_worker_id: int) -> None:
    """A worker ignores Ctrl-C: the main process finishes the step and saves its checkpoint (docs/design.md#micro-batches)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def shard(batches: Sequence[MicroBatch], rank: int, world_size: int) -> list[MicroBatch]:
    """This process's share of an epoch's batches: every world_size-th one, the leftover samples dealt out
    so that every process runs as many steps (how: docs/design.md#micro-batches)."""
    if world_size <= 1:
        return batches  # type: ignore[return-value]  # a list, or a PackedPlan (lazy)
    whole = len(batches) - len(batches) % world_size
    leftover = [sample for batch in batches[whole:] for sample in batch]
    if not leftover:
        return list(batches[rank:whole:world_size])
    if len(leftover) >= world_size:
        return [*batches[rank:whole:world_size], list(leftover[rank::world_size])]
    tail = [sample for batch in batches[whole - world_size : whole] for sample in batch] + leftover
    if whole < world_size or len(tail) < 2 * world_size:
        return list(batches[rank:whole:world_size])
    rounds = 2 * world_size
    return [
        *batches[rank : whole - world_size : world_size],
        list(tail[rank::rounds]),
        list(tail[world_size + rank :: rounds]),
    ]


def epoch_batches(
    data: DataView, micro_batch_size: int, max_length: int, seed: int, epoch: int
) -> Sequence[MicroBatch]:
    """The exact micro-batches training will run in `epoch` (indices of samples, or packed rows)."""
    if data.packing:
        rows = packed_row_count(data.stream_length, max_length)
        return plan_packed_batches(rows, micro_batch_size, seed, epoch)
    return plan_padded_batches(data.lengths, micro_batch_size, max_length, seed, epoch)


@dataclass(frozen=True)
class BatchLayout:
    """What cuts data into micro-batches besides the epoch: the same three give the same batches (epoch_batches), in training and in evaluation alike."""

    micro_batch_size: int
    max_length: int
    seed: int


def run_batches(
    data: DataView, layout: BatchLayout, epoch: int, epochs: float, world_size: int = 1, rank: int = 0
) -> list[MicroBatch]:
    """This process's micro-batches for `epoch`; a fractional last epoch runs its first part."""
    batches = epoch_batches(data, layout.micro_batch_size, layout.max_length, layout.seed, epoch)
    return shard(batches[: epoch_share(len(batches), epoch, epochs)], rank, world_size)


def epoch_share(batch_count: int, epoch: int, epochs: float) -> int:
    """How many of an epoch's batches run: all, or in a fractional last epoch its first part."""
    whole = math.ceil(epochs)
    if epochs < whole and epoch == whole - 1:
        return max(1, round(batch_count * (epochs - (whole - 1))))
    return batch_count


def padded_batch_count(count: int, micro_batch_size: int) -> int:
    """Batches of padded data in an epoch: each window of GROUP_WINDOW_BATCHES batches is cut every micro_batch_size samples."""
    window = micro_batch_size * GROUP_WINDOW_BATCHES
    return (count // window) * GROUP_WINDOW_BATCHES + -(-(count % window) // micro_batch_size)


def batch_rows_and_lengths(
    data: DataView, batches: Sequence[MicroBatch], max_length: int, bucket: int | None = None
) -> BatchSizes:
    if not len(batches):
        return BatchSizes(np.zeros(0, np.int64), np.zeros(0, np.int64))
    if not data.packing:
        clipped = np.minimum(np.asarray(data.lengths), max_length)
        sizes = np.fromiter((len(batch) for batch in batches), dtype=np.int64, count=len(batches))
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        longest = np.maximum.reduceat(clipped[np.concatenate(batches)], starts)
        return BatchSizes(sizes, _padded_widths(longest, max_length, bucket))
    if isinstance(batches, PackedPlan):
        rows = np.full(len(batches), batches.micro_batch_size, dtype=np.int64)
        rows[-1] = len(batches[len(batches) - 1])
    else:
        rows = np.fromiter((len(batch) for batch in batches), dtype=np.int64, count=len(batches))
    return BatchSizes(rows, np.full(len(rows), max_length, dtype=np.int64))


def batch_shapes(
    data: DataView, batches: Sequence[MicroBatch], max_length: int, bucket: int | None = None
) -> list[BatchShape]:
    return [
        BatchShape(int(rows), int(length))
        for rows, length in zip(*batch_rows_and_lengths(data, batches, max_length, bucket), strict=True)
    ]


def batch_shape_counts(
    data: DataView, batches: Sequence[MicroBatch], max_length: int, bucket: int | None = None
) -> dict[BatchShape, int]:
    """How many batches have each (rows, padded length), without a Python object per batch."""
    return _shape_counts(batch_rows_and_lengths(data, batches, max_length, bucket), max_length)
