"""The configuration of one training step, one object throughout: the four sizes as fields and the
switches on as names (calibration.dimensions.DIMENSIONS); stored as a measurement row."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from benchtrain.calibration.dimensions import DIMENSIONS, switches

# A combination of switches, the names of those on: what a step keeps apart in time and memory
# (a probe planner's and a planner's "mode": checkpointing off, on).
Mode = tuple[str, ...]


@dataclass(frozen=True, order=True)
class StepConfig:
    micro_batch_size: int
    num_workers: int
    grad_accum: int
    seq_len: int
    switches: Mode = ()  # the switch dimensions on, in the table's order

    def __post_init__(self) -> None:
        object.__setattr__(self, "switches", tuple(name for name in DIMENSIONS if name in self.switches))

    def value(self, name: str) -> int:
        """A dimension's value: a size, or a switch as 0/1."""
        dimension = DIMENSIONS[name]
        return int(name in self.switches) if dimension.switch else int(getattr(self, name))

    def on(self, name: str) -> bool:
        return name in self.switches

    def switched(self, **values: bool) -> StepConfig:
        """The same step with these switches set."""
        on = {name for name in self.switches if name not in values} | {name for name, value in values.items() if value}
        return dataclasses.replace(self, switches=tuple(on))

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the step recomputes activations in backward (a Trainer's fields and bench's cost prior read it)."""
        return self.on("gradient_checkpointing")

    def to_row(self) -> dict[str, int]:
        """The measurement row's columns, every dimension of the table (switches as 0/1)."""
        return {name: self.value(name) for name in DIMENSIONS}

    @classmethod
    def from_row(cls, row: Mapping[str, float | str]) -> StepConfig:
        """From a measurement row (or anything with its columns: numbers, or their text); a switch absent (a row from before it) is off."""
        return cls(
            micro_batch_size=int(row["micro_batch_size"]),
            num_workers=int(row["num_workers"]),
            grad_accum=int(row["grad_accum"]),
            seq_len=int(row["seq_len"]),
            switches=tuple(dimension.name for dimension in switches() if _is_on(row.get(dimension.name, 0))),
        )

    @property
    def label(self) -> str:
        """How bench's lines name it: B8/W2/A1/S512 (/ckpt with checkpointing)."""
        text = f"B{self.micro_batch_size}/W{self.num_workers}/A{self.grad_accum}/S{self.seq_len}"
        return text + "".join(DIMENSIONS[name].label for name in self.switches)

    @property
    def phrase(self) -> str:
        """How plans name it: "batch 8 × accum 2, 0 workers, max length 512" (", gradient checkpointing")."""
        text = f"batch {self.micro_batch_size} × accum {self.grad_accum}, {self.num_workers} workers, max length {self.seq_len}"
        return text + "".join(DIMENSIONS[name].phrase for name in self.switches)

    def with_shape(self, rows: int, length: int) -> StepConfig:
        """The same step on a batch of `rows` sequences padded (or packed) to `length` tokens."""
        return dataclasses.replace(self, micro_batch_size=rows, seq_len=length)


def holds_as_much(config: StepConfig, other: StepConfig) -> bool:
    """`config` keeps at least the memory `other` kept: as large a batch at as long a sequence, a leaner switch (checkpointing) on only where `other`'s is,
    every other switch the same. An out-of-memory `other` rules `config` out."""
    if config.micro_batch_size < other.micro_batch_size or config.seq_len < other.seq_len:
        return False
    for dimension in switches():
        mine, theirs = config.on(dimension.name), other.on(dimension.name)
        if (mine and not theirs) if dimension.leaner else mine != theirs:
            return False
    return True


def _is_on(value: float | str | None) -> bool:
    """A switch's column: a number (0/1, or a bool), or its text."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "1.0", "true", "on", "yes")
    return bool(value)
