"""The configuration of one training step: what bench probes, what the fit's features describe,
and what the planner chooses. Calibration files hold it as the columns of a measurement row."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

# The row columns, in the order of the fields (the search space's axes follow it).
DIMENSIONS = ("micro_batch_size", "num_workers", "grad_accum", "seq_len", "gradient_checkpointing")


@dataclass(frozen=True, order=True)
class StepConfig:
    micro_batch_size: int
    num_workers: int
    grad_accum: int
    seq_len: int
    gradient_checkpointing: bool = False

    def to_row(self) -> dict[str, int]:
        """The measurement row's columns (checkpointing as 0/1, as calibration files write it)."""
        return {name: int(getattr(self, name)) for name in DIMENSIONS}

    @classmethod
    def from_row(cls, row: Mapping[str, float | str]) -> StepConfig:
        """From a measurement row (or anything with its columns: numbers, or their text); checkpointing
        absent is off."""
        return cls(
            micro_batch_size=int(row["micro_batch_size"]),
            num_workers=int(row["num_workers"]),
            grad_accum=int(row["grad_accum"]),
            seq_len=int(row["seq_len"]),
            gradient_checkpointing=bool(row.get("gradient_checkpointing", 0)),
        )

    @property
    def label(self) -> str:
        """How bench's lines name it: B8/W2/A1/S512 (/ckpt with checkpointing)."""
        text = f"B{self.micro_batch_size}/W{self.num_workers}/A{self.grad_accum}/S{self.seq_len}"
        return text + ("/ckpt" if self.gradient_checkpointing else "")

    @property
    def phrase(self) -> str:
        """How plans name it: "batch 8 × accum 2, 0 workers, max length 512" (", gradient checkpointing")."""
        checkpointing = ", gradient checkpointing" if self.gradient_checkpointing else ""
        return f"batch {self.micro_batch_size} × accum {self.grad_accum}, {self.num_workers} workers, max length {self.seq_len}{checkpointing}"

    def with_shape(self, rows: int, length: int) -> StepConfig:
        """The same step on a batch of `rows` sequences padded (or packed) to `length` tokens."""
        return dataclasses.replace(self, micro_batch_size=rows, seq_len=length)
