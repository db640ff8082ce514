"""A plan in seconds from a random sample of the records: the token total's estimate and interval,
and `SampledData`, the sample standing for the whole set. docs/design.md#a-plan-from-a-sample"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from benchtrain.train.workload.tokens import TokenizedData

SAMPLE_START = 4096
TARGET_HALF_WIDTH = 0.01  # the token total's 95% interval, relative
Z_95 = 1.959964
SAMPLE_SEED = 20261124


@dataclass(frozen=True)
class TotalEstimate:
    """The token total estimated from `sampled` of `records` records, and its 95% half-width."""

    records: int
    sampled: int
    total_tokens: float
    half_width: float

    @property
    def relative_half_width(self) -> float:
        return self.half_width / self.total_tokens if self.total_tokens else 0.0

    def error_of(self, exact_tokens: int) -> float:
        """(exact − estimated) / estimated: positive when the data held more tokens than the sample said."""
        return (exact_tokens - self.total_tokens) / self.total_tokens if self.total_tokens else 0.0

    def describe(self) -> str:
        if self.total_tokens >= 1e6:
            total, half = f"{self.total_tokens / 1e6:,.1f}M", f"{self.half_width / 1e6:,.1f}M"
        else:
            total, half = f"{self.total_tokens:,.0f}", f"{self.half_width:,.0f}"
        return f"lengths from {self.sampled:,} of {self.records:,} records: {total} ± {half} tokens (95% interval)"


def estimate_total(lengths: np.ndarray, records: int) -> TotalEstimate:
    count = len(lengths)
    mean = float(np.mean(lengths)) if count else 0.0
    spread = float(np.std(lengths, ddof=1)) if count > 1 else 0.0
    correction = math.sqrt(max(0.0, (records - count) / (records - 1))) if records > 1 else 0.0
    return TotalEstimate(
        records, count, mean * records, Z_95 * records * spread / math.sqrt(max(1, count)) * correction
    )


def sample_size_for(lengths: np.ndarray, records: int, target: float = TARGET_HALF_WIDTH) -> int:
    """Records to sample so the total's 95% interval is within ±target (from a first sample's spread)."""
    mean = float(np.mean(lengths))
    if mean <= 0 or len(lengths) < 2:
        return records
    variation = float(np.std(lengths, ddof=1)) / mean
    infinite = (Z_95 * variation / target) ** 2
    return min(records, math.ceil(infinite / (1 + (infinite - 1) / records)))


def sample_indices(records: int, count: int) -> np.ndarray:
    """The first `count` of one fixed random order of the records, sorted: a larger sample holds a smaller one."""
    order = np.random.default_rng(SAMPLE_SEED).permutation(records)
    return np.sort(order[:count])


@dataclass(frozen=True, eq=False)
class SampledData:
    """The planner's view of `records` records from a tokenized sample: record i has the length and loss of sample document `stand_in[i]`."""

    sample: TokenizedData
    stand_in: np.ndarray
    estimate: TotalEstimate

    @classmethod
    def expand(cls, sample: TokenizedData, records: int, estimate: TotalEstimate) -> SampledData:
        count = len(sample)
        rng = np.random.default_rng(SAMPLE_SEED + 1)
        stand_in = np.concatenate(
            [np.repeat(np.arange(count), records // count), rng.choice(count, records % count, replace=False)]
        )
        return cls(sample, stand_in.astype(np.int64), estimate)

    @property
    def format(self) -> str:
        return self.sample.format

    @property
    def source(self) -> str:
        return self.sample.source

    @property
    def loss_on(self) -> str:
        return self.sample.loss_on

    @property
    def packing(self) -> bool:
        return self.sample.packing

    def __len__(self) -> int:
        return len(self.stand_in)

    @cached_property
    def lengths(self) -> np.ndarray:
        return self.sample.lengths[self.stand_in]

    @property
    def stream_length(self) -> int:
        return int(self.lengths.sum())

    def subset(self, indices: np.ndarray) -> SampledData:
        return replace(self, stand_in=self.stand_in[np.asarray(indices, dtype=np.int64)])

    def real_tokens(self, max_length: int) -> int:
        if self.packing:
            return self.stream_length
        return int(self.sample.real_tokens_per_document(max_length)[self.stand_in].sum())
