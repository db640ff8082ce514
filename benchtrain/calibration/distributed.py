"""The processes a calibration's probes ran in (its `distributed` record: `accelerate launch --num_processes N`): how
many, over which backend, the model spread how, and the collectives they timed. Typed once where a record is read, so
that its readers (a comparison pricing predicted rows, train.recipes.machines) name fields, not keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchtrain.common.json_types import JsonDict


@dataclass(frozen=True)
class Distributed:
    """One `distributed` record; a calibration of one process has none and reads as the defaults."""

    world_size: int = 1
    sharding: str = "none"  # none | ddp | fsdp
    backend: str | None = None  # nccl | gloo; None: one process
    # The collectives timed among the processes, by kind: {kind: {"measurements": rows, "fit": CommModel JSON}}
    # (calibration.comm.CommModel); {}: none timed.
    collectives: dict[str, JsonDict] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: JsonDict | None) -> Distributed:
        """A stored record; one holding only the all-reduce's fit (`comm`, `all_reduce`: a DDP calibration of before
        FSDP) reads as that one collective."""
        record = record or {}
        collectives: dict[str, JsonDict] = {}
        if record.get("collectives"):
            collectives = dict(record["collectives"])
        elif record.get("comm"):
            collectives = {"all_reduce": {"measurements": record.get("all_reduce", []), "fit": record["comm"]}}
        backend = record.get("backend")
        return cls(
            world_size=int(record.get("world_size", 1)),
            sharding=str(record.get("sharding", "none")),
            backend=str(backend) if backend is not None else None,
            collectives=collectives,
        )
