"""The benchmark's search space: which probes, in which order, and which an OOM rules out."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from benchtrain.calibration.dimensions import DIMENSIONS, switches
from benchtrain.calibration.step_config import Mode, StepConfig, holds_as_much
from benchtrain.common.errors import BenchtrainError

# One dimension's values in a search (batch sizes, workers, …): sorted, each once.
Choices = tuple[int, ...]


@dataclass(frozen=True, init=False)
class SearchSpace:
    """The values bench measures of each dimension of calibration.dimensions.DIMENSIONS, by its
    axis name (batch_sizes, workers, accums, seq_lens, checkpointing, …): given positionally in the
    table's order or by name; a switch not given is measured off only."""

    axes: tuple[tuple[str, Choices], ...]

    def __init__(self, *values: Choices, **named: Choices) -> None:
        given = dict(zip((dimension.axis for dimension in DIMENSIONS.values()), values, strict=False)) | named
        unknown = set(given) - {dimension.axis for dimension in DIMENSIONS.values()}
        missing = [
            dimension.axis for dimension in DIMENSIONS.values() if not dimension.switch and dimension.axis not in given
        ]
        if unknown or missing:
            raise TypeError(f"search space axes unknown {sorted(unknown)} or missing {missing}")
        axes = tuple((dimension.axis, tuple(given.get(dimension.axis, (0,)))) for dimension in DIMENSIONS.values())
        object.__setattr__(self, "axes", axes)

    def axis(self, name: str) -> Choices:
        return dict(self.axes)[name]

    def with_axes(self, **named: Choices) -> SearchSpace:
        return SearchSpace(**(dict(self.axes) | named))

    def values(self) -> tuple[Choices, ...]:
        return tuple(values for _, values in self.axes)

    def modes(self) -> list[Mode]:
        """Every combination of the switches measured (each a tuple of the switches on)."""
        measured = [
            [(dimension.name,) if value else () for value in self.axis(dimension.axis)] for dimension in switches()
        ]
        return sorted({sum(combo, ()) for combo in itertools.product(*measured)})

    @property
    def size(self) -> int:
        return math.prod(len(axis) for axis in self.values())

    def all_configs(self) -> list[StepConfig]:
        return list(configurations(self.values()))

    def as_dict(self) -> dict[str, list[int]]:
        return {axis: list(values) for axis, values in self.axes}


@functools.lru_cache(maxsize=64)
def configurations(values: tuple[tuple[int, ...], ...]) -> tuple[StepConfig, ...]:
    """Every configuration of a space's axes, built once per space: the probe planner asks for them
    for every candidate it weighs (≈ 85,000 times in a simulated 5-minute bench, 60% of its time)."""
    return tuple(StepConfig.from_row(dict(zip(DIMENSIONS, combo, strict=True))) for combo in itertools.product(*values))


# What a compiled step compiles once: rows, length, the switches on (checkpointing changes the graph).
Shape = tuple[int, int, Mode]


def shape_of(config: StepConfig) -> Shape:
    return (config.micro_batch_size, config.seq_len, config.switches)


def mode_words(mode: Mode) -> str:
    """A combination of switches in words: "gradient checkpointing on"."""
    return ", ".join(
        f"{dimension.name.replace('_', ' ')} {'on' if dimension.name in mode else 'off'}" for dimension in switches()
    )


def default_space(device_type: str, memory_bytes: float) -> SearchSpace:
    """Small on CPU; on a GPU, larger batches and sequences (more with more memory)."""
    if device_type == "cpu":
        # 48 configurations: a 150 s budget covers them on a busy 2-core machine.
        return SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256))
    big = memory_bytes >= 60 * 2**30
    return SearchSpace(
        (1, 2, 4, 8, 16) if big else (1, 2, 4, 8), (0, 4), (1, 4), (512, 1024, 2048) if big else (256, 512, 1024)
    )


def within_positions(space: SearchSpace, max_positions: int, asked: bool) -> SearchSpace:
    """The sequence lengths the model's position table holds, known before the model is built:
    lengths asked for (`asked`) beyond it are a one-line error; default ones beyond it (a big
    GPU's 2048 for gpt2's 1024 positions) are left out, the table's own size probed instead."""
    too_long = [length for length in space.axis("seq_lens") if length > max_positions]
    if not too_long:
        return space
    if asked:
        raise BenchtrainError(f"--seq-lens {too_long} exceed the model's {max_positions} positions")
    return space.with_axes(
        seq_lens=tuple(
            sorted({length for length in space.axis("seq_lens") if length < max_positions} | {max_positions})
        )
    )


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
    """The OOM probe that makes `config` pointless: one it keeps at least as much memory as (calibration.step_config.holds_as_much)."""
    return next((oom for oom in oom_configs if holds_as_much(config, oom)), None)


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
