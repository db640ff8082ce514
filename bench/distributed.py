"""`bench run` under several processes: rank 0 decides every probe and broadcasts it, all ranks run
it together, and the rows combine into one (the worst status, the slowest step, the largest peak).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DONE = "done"
STATUS_RANK = {"ok": 0, "skipped": 1, "error": 2, "oom": 3}


def combine_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One probe as seen by all ranks: the worst status; the slowest step; the largest peak."""
    worst = max(rows, key=lambda row: STATUS_RANK.get(row.get("status", "ok"), 2))
    if worst.get("status") != "ok":
        return dict(worst)
    slowest = max(rows, key=lambda row: row.get("step_seconds", row.get("batch_seconds", 0.0)))
    combined = dict(slowest)
    peaks = [row.get("peak_memory_bytes") or 0 for row in rows]
    combined["peak_memory_bytes"] = max(peaks)
    combined["ranks"] = len(rows)
    return combined


class Coordinator:
    """Runs named tasks on every rank at once, as rank 0 decides."""

    def __init__(self, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
        import torch.distributed as dist

        self.handlers = handlers
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.failed = False  # a task failed on rank 0: the ranks may no longer be in step

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def run(self, task: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: run `task` on every rank and return the combined row."""
        if not self.distributed:
            return self.handlers[task](payload)
        try:
            self._broadcast((task, payload))
            return self._execute(task, payload)
        except BaseException:
            self.failed = True
            raise

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts until it says done."""
        while True:
            task, payload = self._broadcast(None)
            if task == DONE:
                return
            self._execute(task, payload)

    def finish(self) -> None:
        # After a failed task no collective is sent: the process group may be what failed (a
        # timed-out collective), or the others are still in the task's; its error is the one to
        # tell, and the launcher ends the others once rank 0 leaves.
        if self.distributed and self.leads and not self.failed:
            self._broadcast((DONE, {}))

    def _execute(self, task: str, payload: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        row = self.handlers[task](payload)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, row)
        return combine_rows(gathered) if "status" in row else row

    @staticmethod
    def _broadcast(message: Any) -> Any:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]
