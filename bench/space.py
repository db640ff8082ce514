"""The benchmark's search space: which probes, in which order, and which an OOM rules out."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace

from calibration.step_config import DIMENSIONS, StepConfig
from common.errors import BenchtrainError


@dataclass(frozen=True)
class SearchSpace:
    batch_sizes: tuple[int, ...]
    workers: tuple[int, ...]
    accums: tuple[int, ...]
    seq_lens: tuple[int, ...]
    checkpointing: tuple[int, ...] = (0,)

    def values(self) -> tuple[tuple[int, ...], ...]:
        return (self.batch_sizes, self.workers, self.accums, self.seq_lens, self.checkpointing)

    @property
    def size(self) -> int:
        return math.prod(len(axis) for axis in self.values())

    def all_configs(self) -> list[StepConfig]:
        return list(configurations(self.values()))

    def as_dict(self) -> dict[str, list[int]]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "workers": list(self.workers),
            "accums": list(self.accums),
            "seq_lens": list(self.seq_lens),
            "checkpointing": list(self.checkpointing),
        }


@functools.lru_cache(maxsize=64)
def configurations(values: tuple[tuple[int, ...], ...]) -> tuple[StepConfig, ...]:
    """Every configuration of a space's axes, built once per space: the probe planner asks for them
    for every candidate it weighs (≈ 85,000 times in a simulated 5-minute bench, 60% of its time)."""
    return tuple(StepConfig.from_row(dict(zip(DIMENSIONS, combo, strict=True))) for combo in itertools.product(*values))


def default_space(device_type: str, memory_bytes: float) -> SearchSpace:
    """Small on CPU; on a GPU, larger batches and sequences (more with more memory)."""
    if device_type == "cpu":
        # 48 configurations: a 150 s budget covers them on a busy 2-core machine.
        return SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256))
    big = memory_bytes >= 60 * 2**30
    return SearchSpace(
        (1, 2, 4, 8, 16) if big else (1, 2, 4, 8),
        (0, 4),
        (1, 4),
        (512, 1024, 2048) if big else (256, 512, 1024),
    )


def within_positions(space: SearchSpace, max_positions: int, asked: bool) -> SearchSpace:
    """The sequence lengths the model's position table holds, known before the model is built:
    lengths asked for (`asked`) beyond it are a one-line error; default ones beyond it (a big
    GPU's 2048 for gpt2's 1024 positions) are left out, the table's own size probed instead."""
    too_long = [length for length in space.seq_lens if length > max_positions]
    if not too_long:
        return space
    if asked:
        raise BenchtrainError(f"--seq-lens {too_long} exceed the model's {max_positions} positions")
    return replace(space, seq_lens=tuple(sorted({length for length in space.seq_lens if length < max_positions} | {max_positions})))


# One dimension's values in a search (batch sizes, workers, …): sorted, each once.
Choices = tuple[int, ...]


def parse_int_list(text: str, option: str, minimum: int = 1) -> Choices:
    """`1,2,4` as a sorted tuple of unique integers ≥ minimum, or a one-line error."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise BenchtrainError(f"{option}: {part!r} is not an integer (write e.g. {option} 1,2,4)") from None
        if value < minimum:
            kind = "non-negative" if minimum == 0 else "positive"
            raise BenchtrainError(f"{option}: values must be {kind} integers, got {value}")
        values.append(value)
    if not values:
        raise BenchtrainError(f"{option} needs at least one value")
    return tuple(sorted(set(values)))


def ruled_out_by(config: StepConfig, oom_configs: list[StepConfig]) -> StepConfig | None:
    """The OOM probe that makes `config` pointless: as large a batch at as long a sequence, keeping
    at least as many activations (checkpointing off needs more memory than on)."""
    for oom in oom_configs:
        keeps_as_much = config.gradient_checkpointing <= oom.gradient_checkpointing
        if config.micro_batch_size >= oom.micro_batch_size and config.seq_len >= oom.seq_len and keeps_as_much:
            return oom
    return None


def parse_switch_list(text: str, option: str) -> Choices:
    """`off,on` (or 0,1, false,true) as a sorted tuple of 0/1, or a one-line error."""
    words = {"off": 0, "0": 0, "false": 0, "no": 0, "on": 1, "1": 1, "true": 1, "yes": 1}
    values = []
    for part in str(text).split(","):
        key = part.strip().lower()
        if key not in words:
            raise BenchtrainError(f"{option}: {part.strip()!r} is not on or off (write e.g. {option} off,on)")
        values.append(words[key])
    return tuple(sorted(set(values)))
