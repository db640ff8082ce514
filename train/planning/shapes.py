"""The batch shapes a configuration runs: how many micro-batches of each (rows, length) one
process runs in an epoch, and one pass over the eval set. The calibration prices each shape, so
the planner's step time is the sum over these counts (train.planning.planner.evaluate).
"""

from __future__ import annotations

from collections import Counter

from calibration.model import Calibration
from train.planning.types import PlanRequest
from train.step.evaluation import eval_batches
from train.workload.batching import (
    BatchLayout,
    BatchShape,
    DataView,
    batch_shapes,
    epoch_share,
    packed_epoch_shape_counts,
    packed_row_count,
    packed_shapes,
    padded_batch_count,
    padded_epoch_shape_counts,
    padded_shape_counts,
    run_batches,
)

ShapeCache = dict[tuple[int, int, int], Counter[BatchShape]]


def shape_counts(data: DataView, request: PlanRequest, micro: int, length: int, epoch: int, cache: ShapeCache | None) -> Counter[BatchShape]:
    """How many micro-batches of each (rows, length) one process runs in `epoch` (cached: the
    batches do not depend on accumulation or workers)."""
    key = (micro, length, epoch)
    if cache is not None and key in cache:
        return cache[key]
    if request.world_size == 1:
        # One process: the shapes straight from the batch layout, without building the batches.
        if data.packing:
            rows = packed_row_count(data.stream_length, length)
            counts = Counter(packed_epoch_shape_counts(rows, micro, length, epoch_share(-(-rows // micro), epoch, request.epochs)))
        else:
            total = padded_batch_count(len(data.lengths), micro)
            taken = epoch_share(total, epoch, request.epochs)
            counts = Counter(padded_epoch_shape_counts(data.lengths, micro, length, request.seed, epoch, taken, request.shape_bucket))
        if cache is not None:
            cache[key] = counts
        return counts
    # Each process runs every world_size-th batch (rank 0 stands for all of them).
    batches = run_batches(data, BatchLayout(micro, length, request.seed), epoch, request.epochs, request.world_size)
    if data.packing:
        counts = Counter(packed_shapes(batches, length))
    else:
        counts = Counter(padded_shape_counts(data.lengths, batches, length, request.shape_bucket))
    if cache is not None:
        cache[key] = counts
    return counts


def eval_pass_seconds(calibration: Calibration, eval_data: DataView, micro: int, length: int, seed: int) -> float:
    """One pass over the eval set's fixed batches, from bench's forward-only eval measurements."""
    total = 0.0
    for shape in batch_shapes(eval_data, eval_batches(eval_data, micro, length, seed), length):
        seconds = calibration.eval_batch_seconds(shape.rows, shape.length)
        if seconds is None:
            return 0.0
        total += seconds
    return total
