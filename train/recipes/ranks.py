"""What the processes of a multi-process `train` decide once, on rank 0, for all of them, and the check that
every rank trains what rank 0 trains. Why: docs/design.md#decided-on-rank-0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from common.errors import BenchtrainError
from train.step.runtime import job_world_size

T = TypeVar("T")


def _join_process_group() -> Any:
    """torch.distributed, joined to the launcher's process group (accelerate's PartialState, once per process)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState(cpu=not torch.cuda.is_available())
    return dist


def from_rank0(value: T) -> T:
    """`value` as rank 0 has it, on every rank (one process: `value`)."""
    if job_world_size() == 1:
        return value
    dist = _join_process_group()
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_decides(decide: Callable[[], T], adopt: Callable[[T], T] = lambda value: value) -> T:
    """`decide()` on every rank (each joins its collectives), then rank 0's outcome on all: its value (through `adopt` on the
    others, to put their own clocks back in), or its BenchtrainError raised on every rank, so no rank is left waiting."""
    if job_world_size() == 1:
        return decide()
    try:
        outcome: tuple[Any, BenchtrainError | None] = (decide(), None)
    except BenchtrainError as refusal:
        outcome = (None, refusal)
    value, refused = from_rank0(outcome)
    if refused is not None:
        raise refused
    dist = _join_process_group()
    return value if dist.get_rank() == 0 else adopt(value)


def check_same_training(training: dict[str, Any]) -> None:
    """Every rank trains what rank 0 trains (`training_summary`): else one line on every rank before any step, not a hang."""
    if job_world_size() == 1:
        return
    dist = _join_process_group()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, training)
    lead = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        differing = [key for key in sorted(set(lead) | set(theirs)) if lead.get(key) != theirs.get(key)]
        if differing:
            key = differing[0]
            raise BenchtrainError(
                f"the processes disagree on what to train: rank {rank}'s {key} is {theirs.get(key)!r}, rank 0's {lead.get(key)!r} "
                f"({', '.join(differing)} differ); every rank must plan from rank 0's plan (report this as a bug)"
            )


# What every rank must train alike, as run.json's plan section holds it (calibration.run_file.RunFile writes it).
COMPARED_PLAN_KEYS = ("configuration", "world_size", "epochs", "optimizer_steps", "step_limit", "total_steps", "learning_rate")


def training_summary(record_plan: dict[str, Any], run_id: str) -> dict[str, Any]:
    """What `check_same_training` compares: run.json's plan section's COMPARED_PLAN_KEYS, and the run."""
    return {**{key: record_plan.get(key) for key in COMPARED_PLAN_KEYS}, "run_id": run_id}
